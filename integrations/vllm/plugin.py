"""vLLM plugin hook: registers kvbridge's connectors in vLLM's ``KVConnectorFactory``.

Installed as the entry point ``kvbridge = kvbridge.integrations.vllm.plugin:register``
of group ``vllm.general_plugins``, which vLLM loads in every process it starts
(API server, engine core, workers). Registration is lazy (module path and class
name only), so importing kvbridge costs nothing until a kvbridge connector is
configured, and idempotent (vLLM may call plugins more than once per process).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MODULE = "kvbridge.integrations.vllm.connector"


def register() -> None:
    """Make ``{"kv_connector": "KVBridgeNixlConnector", ...}`` work with no module path."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector API: nothing to register
        logger.debug("kvbridge: vLLM KVConnectorFactory not found; no connectors registered")
        return
    from kvbridge.integrations.vllm.connector_names import CONNECTOR_NAMES

    for name in CONNECTOR_NAMES:
        if name in KVConnectorFactory._registry:  # idempotent: vLLM refuses duplicates
            continue
        KVConnectorFactory.register_connector(name, MODULE, name)
