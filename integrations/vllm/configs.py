"""The ``kv_transfer_config`` of vLLM servers under test: vLLM's own NixlConnector,
kvbridge's NIXL connector, and a producer/consumer pair of server specs.

Shared by the vLLM tests (``tests/integrations/vllm``) and the side-by-side
benchmark (:mod:`kvbridge.tools.bench.vllm_pd`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.integrations.vllm import harness as h


def builtin_nixl_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def kvbridge_nixl_config(role: str, *, module_path: bool = False,
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"kv_connector": "KVBridgeNixlConnector", "kv_role": role,
                              "kv_connector_extra_config": dict(extra or {})}
    if module_path:
        config["kv_connector_module_path"] = "kvbridge.integrations.vllm.connector"
    return config


def pair_specs(model: str, name: str, producer_config: Mapping[str, Any],
               consumer_config: Mapping[str, Any],
               builtin_side_channel: bool = False) -> tuple[h.ServerSpec, h.ServerSpec]:
    """Producer pinned to core 0, consumer to core 1, fresh ports for everything."""
    def env() -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())} if builtin_side_channel else {}
    return (h.ServerSpec(f"{name}-producer", model, h.free_port(), core=0,
                         kv_transfer_config=producer_config, env=env()),
            h.ServerSpec(f"{name}-consumer", model, h.free_port(), core=1,
                         kv_transfer_config=consumer_config, env=env()))
