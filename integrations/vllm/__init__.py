"""kvbridge inside vLLM (v1 connector API): adapter, plugin hook, test harness.

Nothing here imports vLLM at module import time except the adapter modules
that vLLM itself loads (``connector`` with ``worker_side``, ``messages`` and
``stats``, which it imports, the plugin's ``register``, and ``tiering``, which vLLM's
secondary-tier factory loads by module path), so the harness and
the tiny-model builder work in any environment.
"""
