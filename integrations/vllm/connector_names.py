"""Names under which kvbridge's connectors appear in vLLM (no vLLM import here)."""

from __future__ import annotations

#: vLLM connector names; each is also the class name in ``kvbridge.integrations.vllm.connector``.
CONNECTOR_NAMES = (
    "KVBridgeConnector",
    "KVBridgeNixlConnector",
    "KVBridgeMooncakeStoreConnector",
    "KVBridgeOffloadingConnector",
)
