"""kvbridge inside vLLM (v1 connector API): adapter, plugin hook, test harness.

Nothing here imports vLLM at module import time except the adapter modules
that vLLM itself loads (``connector`` with ``worker_side``, ``messages`` and
``stats``, which it imports, and the plugin's ``register``), so the harness and
the tiny-model builder work in any environment.
"""
