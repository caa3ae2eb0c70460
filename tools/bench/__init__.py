"""Every benchmark of kvbridge: the ``kvbridge bench`` suite and one module per subject.

The suite is :mod:`.suite` (its paths in :mod:`.paths`, the one row shape and the
shared figures in :mod:`.rows`, tables and the plot in :mod:`.render`); the
measuring code is :mod:`.nixl`, :mod:`.nixl_cost`, :mod:`.nixl_scale` (with the
peer process of :mod:`.nixl_peer`), :mod:`.mooncake`, :mod:`.mooncake_client`,
:mod:`.offload`, :mod:`.offload_copy`, :mod:`.events`, :mod:`.auth` and
:mod:`.digests`; beside real vLLM (run in its venv) :mod:`.vllm_pd`, :mod:`.vllm_fs`
and :mod:`.vllm_tiering`. Each measures kvbridge against the raw library doing the same
bytes in the same run.
"""
