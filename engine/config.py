"""The settings of one reference engine (:class:`EngineConfig`), validated on construction.

Owns: the fields, their defaults and the checks that need nothing but the config
itself (counts >= 1, the spec fits the topology). May not touch: the host (see
:mod:`kvbridge.engine.host_memory` for whether this machine can hold the KV cache,
:mod:`kvbridge.engine.devices` for whether it has the device),
the block pools or any connector; building an engine is :mod:`kvbridge.engine.core`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connectors import ConfigError, ConnectorConfig
from kvbridge.engine.devices import parse_device
from kvbridge.layouts import KVCacheSpec, ParallelTopology
from kvbridge.layouts.kv_memory import guard_from_env


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one reference engine. ``num_blocks`` is per region (every rank)."""

    spec: KVCacheSpec
    topology: ParallelTopology = field(default_factory=ParallelTopology)
    num_blocks: int = 256
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    connector: ConnectorConfig | None = None
    enable_prefix_caching: bool = True
    verify_loads: bool = True
    remote_kv_timeout_s: float = 60.0
    engine_id: str | None = None
    record_hooks: bool = False
    #: emit the block pools' KV events (medium GPU), as vLLM's ``enable_kv_cache_events``;
    #: connector events are always collected
    enable_kv_cache_events: bool = False
    #: hand each allocation's blocks out in ascending id order (True), or in the free
    #: queue's order as vLLM does (False). The blocks chosen are the same either way
    #: (least recently freed first); only their order in the request differs. Sorted,
    #: a request's blocks form contiguous runs, so a NIXL transfer merges them
    #: (measured 4096 x 16 KiB: ~2x the bandwidth); vLLM's order, after a request
    #: freed its blocks tail first, runs downwards and nothing merges.
    sorted_allocation: bool = True
    #: where each rank's KV cache lives: ``cpu``, ``cuda`` (rank r on ``cuda:(r mod n)``)
    #: or ``cuda:N`` (:mod:`kvbridge.engine.devices`)
    device: str = "cpu"
    #: give host-memory KV the host-access guard (:mod:`kvbridge.layouts.kv_memory`): it
    #: then refuses what device KV refuses, so CPU runs catch host reads of device KV;
    #: default from ``KVBRIDGE_KV_HOST_GUARD``
    kv_host_guard: bool = field(default_factory=guard_from_env)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        if self.num_blocks < 1:
            raise ConfigError("num_blocks", f"expected >= 1, got {self.num_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", "expected >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "expected >= 1")
        self.spec.validate_topology(self.topology)
