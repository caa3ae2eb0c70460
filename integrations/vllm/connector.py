"""kvbridge connectors as vLLM v1 KV connectors (``KVConnectorBase_V1``).

Use by name once the plugin is installed (entry point ``vllm.general_plugins``,
see :mod:`kvbridge.integrations.vllm.plugin`)::

    --kv-transfer-config '{"kv_connector": "KVBridgeNixlConnector", "kv_role": "kv_producer"}'

or by module path, with no plugin::

    --kv-transfer-config '{"kv_connector": "KVBridgeNixlConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm.connector", "kv_role": ...}'

``kv_connector_extra_config`` goes to the kvbridge connector unchanged (its
plugin validates it: a bad key fails at start-up naming it), except
``kvbridge_connector``, which :class:`KVBridgeConnector` reads to pick any
registered kvbridge connector by name or ``module:Class``.

What is translated, and where (nothing of vLLM goes below this package):

* the engine: ``KVCacheConfig`` groups -> kvbridge regions
  (:func:`kvbridge.integrations.vllm.layout.build_spec`), parallel sizes ->
  :class:`ParallelTopology`, ``kv_transfer_config`` -> :class:`ConnectorConfig`;
* requests: a vLLM ``Request`` -> an immutable :class:`ConnectorRequest` per
  hook call (chained block hashes kept incrementally per request);
  ``kv_transfer_params["kvbridge"]`` <-> :class:`TransferParams`;
* blocks: ``KVCacheBlocks.get_block_ids()`` / ``block_ids`` per group ->
  ``BlockIds`` (region ``r`` = group ``group_of_region[r]``);
* each step: ``SchedulerOutput`` -> :class:`SchedulerStep` (block lists are
  tracked here: vLLM sends only new block ids for running requests);
* tensors: vLLM's per-layer KV tensors -> views in kvbridge's memory model,
  checked against the spec at start-up;
* worker results: ``get_finished`` / ``get_transfer_results`` /
  ``get_block_ids_with_load_errors`` / stats, back into vLLM's types.

Hybrid KV cache manager: these connectors implement ``SupportsHMA``
(``request_finished_all_groups``), so vLLM's default (HMA on) is accepted;
with ``--disable-hybrid-kv-cache-manager`` vLLM calls ``request_finished``,
which is served the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbridge.connectors import (
    ConnectorConfig,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorRequest,
    KVCaches,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerStep,
    TransferMode,
    TransferParams,
    TransferParamsError,
    UnknownConnectorError,
    WorkerConnector,
)
from kvbridge.connectors import registry as kvb_registry
from kvbridge.connectors.metadata_wire import MetadataWireError, decode_metadata, encode_metadata
from kvbridge.integrations.vllm.layout import (
    REQUIRED_LAYOUT,
    AdapterConfigError,
    AdapterSpec,
    GroupInfo,
    GroupKind,
    VllmFormat,
    build_spec,
    kvbridge_dtype,
    kvbridge_view,
    required_layout,
)
from kvbridge.layouts import ParallelTopology, hash_block, rank_index, root_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Key of kvbridge's TransferParams inside vLLM's ``kv_transfer_params``.
PARAMS_KEY = "kvbridge"
#: Adapter-only key of ``kv_connector_extra_config``.
CONNECTOR_KEY = "kvbridge_connector"

#: Where kvbridge's own connectors live, for installs whose entry points are missing.
FALLBACK_PATHS = {
    "nixl": "kvbridge.connectors.nixl:NixlPlugin",
    "shared_storage": "kvbridge.connectors.shared_storage:SharedStoragePlugin",
}


#: kvbridge connectors whose two halves share memory: one process, unless the
#: offloading connector's CPU slots are file-backed (``shm_dir``).
SAME_PROCESS_CONNECTORS = frozenset({"offloading"})


# --------------------------------------------------------------------------- messages


@dataclass
class KVBridgeVllmMetadata(KVConnectorMetadata):
    """The kvbridge connector's per-step metadata, carried through vLLM to the workers.

    vLLM moves this object between its processes with pickle, so it holds only
    ``wire``: msgpack bytes of ``[kvbridge metadata (connectors.metadata_wire), new_ids]``.
    ``new_ids``: kvbridge request id -> vLLM request id, for requests first seen
    this step whose kvbridge id differs (push-mode producers use the router's
    ``producer_request_id``, which the consumer names in its registration;
    vLLM's own ids carry a random suffix no router can know).
    """

    wire: bytes

    @classmethod
    def pack(cls, inner: ConnectorMetadata, new_ids: Mapping[str, str]) -> KVBridgeVllmMetadata:
        return cls(msgpack.packb([encode_metadata(inner), dict(new_ids)], use_bin_type=True))

    def unpack(self) -> tuple[ConnectorMetadata, dict[str, str]]:
        """The kvbridge metadata and ``new_ids``; raises :class:`MetadataWireError` when bad."""
        try:
            raw = msgpack.unpackb(self.wire, raw=False)
        except (msgpack.UnpackException, ValueError) as exc:
            raise MetadataWireError("connector_metadata", f"not valid msgpack: {exc}") from None
        if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], bytes):
            raise MetadataWireError("connector_metadata", "expected [metadata bytes, new_ids]")
        new_ids = raw[1]
        if not isinstance(new_ids, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in new_ids.items()):
            raise MetadataWireError("connector_metadata.new_ids", "expected a map of str to str")
        return decode_metadata(raw[0]), new_ids


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """A worker's opaque handshake bytes (e.g. its NIXL agent document)."""

    blob: bytes


_STAT_LISTS = ("transfer_duration", "bytes_transferred", "num_descriptors")


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Per-transfer samples and cumulative counters, worker -> vLLM's stats logger.

    ``data``: ``transfer_duration`` (s), ``bytes_transferred``,
    ``num_descriptors`` (lists, one entry per finished transfer since the
    last report) and ``failed`` (count of failed transfers in those).

    A worker's report crosses vLLM's (pickling) channel as ``wire`` only: msgpack
    bytes of ``data``, with ``data`` empty (:meth:`packed`). Every method opens
    ``wire`` into ``data`` first, validating it.
    """

    data: dict[str, Any] = field(default_factory=lambda: {
        "transfer_duration": [], "bytes_transferred": [], "num_descriptors": [], "failed": 0})
    wire: bytes = b""

    @classmethod
    def packed(cls, data: Mapping[str, Any]) -> KVBridgeStats:
        return cls(data={}, wire=msgpack.packb(dict(data), use_bin_type=True))

    def _open(self) -> dict[str, Any]:
        if self.wire:
            wire, self.wire = self.wire, b""
            try:
                raw = msgpack.unpackb(wire, raw=False)
            except (msgpack.UnpackException, ValueError) as exc:
                raise MetadataWireError("kv_connector_stats", f"not valid msgpack: {exc}") from None
            if not isinstance(raw, dict):
                raise MetadataWireError("kv_connector_stats", "expected a map")
            for key in _STAT_LISTS:
                values = raw.get(key, [])
                if not isinstance(values, list) or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                    raise MetadataWireError(f"kv_connector_stats.{key}", "expected a number list")
            failed = raw.get("failed", 0)
            if not isinstance(failed, int) or isinstance(failed, bool):
                raise MetadataWireError("kv_connector_stats.failed", "expected an int")
            self.data = raw
        return self.data

    def to_dict(self) -> dict[str, Any]:
        return self._open()

    def reset(self) -> None:
        self.data = KVBridgeStats().data
        self.wire = b""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data = self._open()
        theirs = other._open() if isinstance(other, KVBridgeStats) else other.data
        for key in _STAT_LISTS:
            data.setdefault(key, []).extend(theirs.get(key, []))
        data["failed"] = data.get("failed", 0) + theirs.get("failed", 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self._open()
        durations = sorted(data.get("transfer_duration", []))
        nbytes = data.get("bytes_transferred", [])
        count = len(durations)
        return {
            "num_transfers": count,
            "num_failed": data.get("failed", 0),
            "median_xfer_time_ms": round(1e3 * durations[count // 2], 3) if count else 0.0,
            "total_mb": round(sum(nbytes) / 2**20, 3),
        }

    def is_empty(self) -> bool:
        data = self._open()
        return not data.get("transfer_duration") and not data.get("failed")


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbridge_xfer_time_seconds`` / ``_bytes_transferred`` / ``_num_descriptors``
    histograms and ``vllm:kvbridge_num_failed_transfers``, like vLLM's NIXL ones."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from prometheus_client import Counter, Histogram

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        time_buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
        self.xfer_time = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_xfer_time_seconds",
            documentation="Duration of kvbridge KV transfers (one per request and rank).",
            buckets=time_buckets, labelnames=labelnames))
        self.xfer_bytes = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_bytes_transferred",
            documentation="Bytes moved per kvbridge KV transfer.",
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames))
        self.xfer_descs = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_num_descriptors",
            documentation="Descriptors per kvbridge KV transfer.",
            buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000], labelnames=labelnames))
        self.failed = per_engine(metric_types[Counter](
            name="vllm:kvbridge_num_failed_transfers",
            documentation="Failed kvbridge KV transfers.", labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for metric, key in ((self.xfer_time, "transfer_duration"),
                            (self.xfer_bytes, "bytes_transferred"),
                            (self.xfer_descs, "num_descriptors")):
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
        failed = transfer_stats_data.get("failed", 0)
        if failed:
            self.failed[engine_idx].inc(failed)


# --------------------------------------------------------------------------- engine translation


def _group_info(index: int, group: Any, total_kv_heads: int, cache_dtype: str) -> GroupInfo:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    type_name = type(spec).__name__
    if isinstance(spec, MLAAttentionSpec):
        kind = GroupKind.MLA
    elif isinstance(spec, SlidingWindowSpec):
        kind = GroupKind.SLIDING_WINDOW
    elif isinstance(spec, FullAttentionSpec):
        kind = GroupKind.FULL
    else:
        kind = GroupKind.UNSUPPORTED
    if kind is GroupKind.UNSUPPORTED:
        return GroupInfo(index, kind, type_name, tuple(group.layer_names), 1, 1, 1, "float32")
    if not getattr(group, "enable_kv_transfer", True):
        # vLLM 0.33: an ephemeral replica group vLLM rebuilds from its source after a load.
        raise AdapterConfigError(f"kv_cache_config.kv_cache_groups[{index}]",
                                 f"{type_name} group has enable_kv_transfer=False (a replica "
                                 f"vLLM rebuilds after loads); kvbridge's adapter transfers "
                                 f"every group and does not skip one yet")
    where = f"kv_cache_config.kv_cache_groups[{index}]"
    packed = [f"{name}={getattr(spec, name)!r}" for name, plain in (
        ("num_head_slots", None), ("state_content_bytes", None), ("tokens_per_state", 1))
        if getattr(spec, name, plain) != plain]
    if packed:
        raise AdapterConfigError(where, f"{type_name} has a packed page ({', '.join(packed)}): "
                                        f"not plain K/V cells kvbridge can describe")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in ("NONE", "FP8_PER_TENSOR"):
        raise AdapterConfigError("kv_cache_dtype", f"{type_name} uses KV quantization {quant} "
                                                   f"(scales or packed values in the cache), "
                                                   f"which kvbridge does not describe; use "
                                                   f"'auto' or a plain fp8 kv_cache_dtype")
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    if kind is GroupKind.MLA:
        # MLAAttentionSpec: one latent (kv_lora_rank + rope) per token, no V (head_size_v 0).
        head_size_v = spec.head_size if head_size_v in (0, None) else head_size_v
    if head_size_v not in (None, spec.head_size):
        raise AdapterConfigError(f"kv_cache_config.kv_cache_groups[{index}]",
                                 f"K head size {spec.head_size} != V head size {head_size_v}; "
                                 f"kvbridge regions have one head_dim")
    heads = 1 if kind is GroupKind.MLA else total_kv_heads
    return GroupInfo(index, kind, type_name, tuple(group.layer_names), int(spec.block_size),
                     int(heads), int(spec.head_size),
                     kvbridge_dtype(str(spec.dtype), cache_dtype),
                     int(getattr(spec, "page_size_bytes", 0) or 0))


def _vllm_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmFormat:
    """The format vLLM resolved: platform, ``kv_cache_layout`` (the engine core resolves it
    before the connector exists; it may have dropped kvbridge's request), cache dtype."""
    from vllm.platforms import current_platform

    layout = (getattr(kv_cache_config, "kv_cache_layout", None)
              or getattr(vllm_config.cache_config, "kv_cache_layout", None))
    if layout is None:
        # Not resolved yet (an older vLLM, or a profiling run): what vLLM will use for
        # kvbridge's request; register_kv_caches checks the tensors' strides against it.
        layout = required_layout(vllm_config.cache_config.block_size,
                                 bool(getattr(vllm_config.model_config, "use_mla", False))
                                 ) or REQUIRED_LAYOUT
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend_name = getattr(backend, "name", None) or (str(backend) if backend else "auto")
    return VllmFormat(device=str(current_platform.device_type), kv_cache_layout=str(layout),
                      cache_dtype=str(vllm_config.cache_config.cache_dtype or "auto"),
                      attn_backend=backend_name)


@dataclass(frozen=True)
class EngineDescription:
    """Everything the adapter derives from vLLM's configuration, once, at start-up."""

    adapter: AdapterSpec
    topology: ParallelTopology
    config: ConnectorConfig
    num_blocks: int

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  connector: str) -> EngineDescription:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        parallel = vllm_config.parallel_config
        dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
        if pcp > 1:
            raise AdapterConfigError("prefill_context_parallel_size",
                                     f"{pcp} > 1 is not supported by kvbridge's vLLM adapter; "
                                     f"use 1")
        interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
        if dcp > 1 and interleave != 1:
            raise AdapterConfigError(
                "cp_kv_cache_interleave_size",
                f"{interleave} places runs of {interleave} tokens on each DCP rank; kvbridge's "
                f"token sharding is token t on DCP rank t % dcp_size (interleave 1): use 1")
        from vllm.platforms import current_platform

        if (current_platform.device_type != "cpu"
                and str(getattr(transfer, "kv_buffer_device", "")) == "cpu"):
            raise AdapterConfigError(
                "kv_buffer_device",
                "'cpu' stages KV in a host buffer; kvbridge's connectors register the "
                "device KV cache itself: leave kv_buffer_device at the device (e.g. 'cuda')")
        try:
            topology = ParallelTopology(tp_size=int(parallel.tensor_parallel_size),
                                        pp_size=int(parallel.pipeline_parallel_size),
                                        dcp_size=dcp)
        except Exception as exc:
            raise AdapterConfigError("tensor_parallel_size", str(exc)) from None
        model_config = vllm_config.model_config
        total_kv_heads = int(model_config.get_total_num_kv_heads())
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        groups = [_group_info(i, g, total_kv_heads, cache_dtype)
                  for i, g in enumerate(kv_cache_config.kv_cache_groups)]
        fmt = _vllm_format(vllm_config, kv_cache_config)
        adapter = build_spec(str(model_config.model), groups, fmt,
                             int(parallel.tensor_parallel_size))
        try:
            adapter.spec.validate_topology(topology)
        except Exception as exc:
            raise AdapterConfigError("tensor_parallel_size", str(exc)) from None
        extra = dict(transfer.kv_connector_extra_config or {})
        extra.pop(CONNECTOR_KEY, None)
        config = ConnectorConfig.from_dict({
            "kv_connector": connector,
            "kv_role": transfer.kv_role,
            "engine_id": transfer.engine_id,
            "kv_connector_extra_config": extra,
        })
        return cls(adapter, topology, config, int(kv_cache_config.num_blocks))


def _configure_logging() -> None:
    """``KVBRIDGE_LOG_LEVEL`` (e.g. INFO, DEBUG) shows kvbridge's own log lines in vLLM's
    output; without it only warnings and errors appear (Python's last-resort handler)."""
    import os

    level = os.environ.get("KVBRIDGE_LOG_LEVEL")
    root = logging.getLogger("kvbridge")
    if not level or root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("(kvbridge pid=%(process)d) %(levelname)s "
                                           "%(asctime)s [%(name)s] %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())


def _resolve(config: ConnectorConfig) -> Any:
    try:
        return kvb_registry.resolve(config)
    except UnknownConnectorError:
        fallback = FALLBACK_PATHS.get(config.connector)
        if fallback is None:
            raise
        return kvb_registry.resolve(ConnectorConfig(fallback, config.role, config.engine_id,
                                                    config.extra, config.load_failure_policy))


def parse_transfer_params(raw: Mapping[str, Any] | None) -> tuple[TransferParams | None, bool]:
    """``(params, remote_decode)`` from a request's ``kv_transfer_params``.

    Malformed kvbridge params are logged and ignored (the request recomputes):
    raising here would stop the engine for one bad request.
    """
    if not raw:
        return None, False
    remote_decode = bool(raw.get("do_remote_decode"))
    data = raw.get(PARAMS_KEY)
    if data is None:
        return None, remote_decode
    try:
        return TransferParams.from_dict(data), remote_decode
    except TransferParamsError as exc:
        logger.warning("kvbridge: ignoring malformed kv_transfer_params: %s", exc)
        return None, remote_decode


def wrap_transfer_params(params: TransferParams) -> dict[str, Any]:
    """What a producer returns to the router: vLLM's PD flags plus kvbridge's record."""
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: params.to_dict()}


class _HashChain:
    """Chained block hashes of one request, extended as its tokens grow."""

    __slots__ = ("hashes", "salt")

    def __init__(self, num_regions: int, salt: str | None) -> None:
        self.hashes: list[list[bytes]] = [[] for _ in range(num_regions)]
        self.salt = salt

    def update(self, token_ids: list[int], block_tokens: list[int]) -> tuple[tuple[bytes, ...], ...]:
        extra = (self.salt,) if self.salt else ()
        out = []
        for r, size in enumerate(block_tokens):
            chain = self.hashes[r]
            parent = chain[-1] if chain else root_hash()
            for start in range(len(chain) * size, len(token_ids) - size + 1, size):
                parent = hash_block(parent, token_ids[start:start + size], extra)
                chain.append(parent)
            out.append(tuple(chain))
        return tuple(out)


# --------------------------------------------------------------------------- the connector


class KVBridgeConnectorBase(KVConnectorBase_V1, SupportsHMA):
    """Adapter base: one kvbridge connector (by name) behind vLLM's connector interface."""

    #: kvbridge connector name (registry name or ``module:Class``); None: read extra config.
    KVBRIDGE_CONNECTOR: ClassVar[str | None] = None

    # ------------------------------------------------------------------ vLLM API (0.32/0.33)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC (HND) for head-split models, as vLLM's NixlConnector asks: a head's slice
        of a block is one run, so heterogeneous TP moves whole runs; LBNHC where the
        block size may be split into kernel blocks; None for MLA (see
        :func:`kvbridge.integrations.vllm.layout.required_layout`). vLLM may drop the
        request (a backend that cannot run it); the adapter then describes the layout
        vLLM resolved, or refuses it at start-up naming it."""
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None:
            return None
        block_size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
        return required_layout(block_size, bool(getattr(model_config, "use_mla", False)))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Push mode writes each layer from ``save_kv_layer``, which a CUDA graph replay
        would skip: it needs PIECEWISE graphs. Pull mode does nothing per layer."""
        return str((extra_config or {}).get("mode", "pull")).lower() == "push"

    @property
    def supports_sleep_mode(self) -> bool:
        """Declined: kvbridge keeps the KV cache registered with its transport (NIXL
        registrations, peers' descriptors) for the engine's life; vLLM's sleep mode
        frees and re-allocates that memory under them. Say so instead of corrupting."""
        return False

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """kvbridge loads every region it describes, and regions are vLLM's KV cache groups
        (sliding-window groups included: the producer's whole block list moves)."""
        return tuple(sorted(set(self._desc.adapter.group_of_region)))

    def has_pending_push_work(self) -> bool:
        """True while a push-mode producer holds a finished request whose KV it still has
        to write to a consumer (the engine must keep stepping to drive the writes)."""
        return bool(self._held_push)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing to do: kvbridge's offloading connector copies a step's stores inside
        ``wait_for_save`` (the same step), so no save is in flight when vLLM preempts a
        request and reuses its blocks; the NIXL connectors read only held blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _configure_logging()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        name = self.KVBRIDGE_CONNECTOR or (transfer.kv_connector_extra_config or {}).get(
            CONNECTOR_KEY)
        if not name:
            raise AdapterConfigError(f"kv_connector_extra_config.{CONNECTOR_KEY}",
                                     "missing: name the kvbridge connector to run (e.g. 'nixl')")
        self._desc = EngineDescription.from_vllm(vllm_config, kv_cache_config, str(name))
        resolved = _resolve(self._desc.config)
        backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
        if (resolved.plugin.name in SAME_PROCESS_CONNECTORS and backend != "uni"
                and getattr(resolved.extra, "shm_dir", None) is None):
            raise AdapterConfigError(
                "distributed_executor_backend",
                f"kvbridge connector {resolved.plugin.name!r} shares its CPU tier between the "
                f"scheduler and the worker; with vLLM's worker in another process "
                f"({backend!r} executor) set kv_connector_extra_config.shm_dir (e.g. "
                f"'/dev/shm'), or run with --distributed-executor-backend uni")
        spec = self._desc.adapter.spec
        num_blocks = tuple(self._desc.num_blocks for _ in spec.regions)
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        if role == KVConnectorRole.SCHEDULER:
            ctx = ConnectorContext(spec, self._desc.topology, resolved.config, num_blocks,
                                   resolved.extra)
            self._scheduler = resolved.plugin.create_scheduler(ctx)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            rank = self._desc.topology.with_rank(tp_rank=get_tp_group().rank_in_group,
                                                 pp_rank=get_pp_group().rank_in_group)
            ctx = ConnectorContext(spec, self._desc.topology, resolved.config, num_blocks,
                                   resolved.extra, rank=rank, worker_index=rank_index(rank))
            self._worker = resolved.plugin.create_worker(ctx)
        self._block_tokens = [spec.regions[r].tokens_per_key(self._desc.topology.dcp_size)
                              for r in range(len(spec.regions))]
        # scheduler-side request tracking (single-threaded, like vLLM's scheduler)
        self._requests: dict[str, Request] = {}
        self._chains: dict[str, _HashChain] = {}
        self._blocks: dict[str, list[list[int]]] = {}
        self._local_computed: dict[str, int] = {}
        self._step_id = 0
        # kvbridge id <-> vLLM id, only where they differ (see KVBridgeVllmMetadata)
        self._to_vllm: dict[str, str] = {}
        self._to_kvb: dict[str, str] = {}
        self._new_ids: dict[str, str] = {}
        self._held_push: set[str] = set()  # push producer: finished, KV still to write
        # worker-side state
        self._views: dict[str, torch.Tensor] = {}
        self._records_seen: Any = None
        logger.info("kvbridge: %s (%s) for vLLM engine %s, role %s, %d region(s), format %s",
                    type(self).__name__, resolved.config.connector, resolved.config.engine_id,
                    resolved.config.role.value, len(spec.regions),
                    dict(spec.engine_format))

    # ------------------------------------------------------------------ helpers

    @property
    def kvbridge_scheduler(self) -> SchedulerConnector:
        if self._scheduler is None:
            raise RuntimeError("kvbridge: scheduler hook called on a worker-role connector")
        return self._scheduler

    @property
    def kvbridge_worker(self) -> WorkerConnector:
        if self._worker is None:
            raise RuntimeError("kvbridge: worker hook called on a scheduler-role connector")
        return self._worker

    def _view(self, request: Request, num_computed: int | None = None) -> ConnectorRequest:
        rid = request.request_id
        params, remote_decode = parse_transfer_params(request.kv_transfer_params)
        kvb_id = rid
        if params is not None and remote_decode and params.mode is TransferMode.PUSH:
            kvb_id = params.producer_request_id
            if self._to_kvb.get(rid) != kvb_id:
                self._to_kvb[rid] = kvb_id
                self._to_vllm[kvb_id] = rid
                self._new_ids[kvb_id] = rid
        chain = self._chains.get(rid)
        if chain is None:
            chain = self._chains[rid] = _HashChain(len(self._block_tokens),
                                                   getattr(request, "cache_salt", None))
        tokens = list(request.all_token_ids)
        return ConnectorRequest(
            request_id=kvb_id,
            token_ids=tuple(tokens),
            num_prompt_tokens=int(request.num_prompt_tokens),
            block_hashes=chain.update(tokens, self._block_tokens),
            num_computed_tokens=int(request.num_computed_tokens if num_computed is None
                                    else num_computed),
            transfer_params=params,
            remote_decode=remote_decode,
            cache_salt=chain.salt,
        )

    def _region_blocks(self, per_group: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
        groups = [tuple(g) for g in per_group]
        return tuple(groups[g] if g < len(groups) else ()
                     for g in self._desc.adapter.group_of_region)

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._chains.pop(rid, None)
        self._blocks.pop(rid, None)
        self._local_computed.pop(rid, None)
        self._new_ids.pop(self._to_kvb.get(rid, rid), None)

    def _kvb_ids(self, vllm_ids: Iterable[str] | None) -> frozenset[str]:
        return frozenset(self._to_kvb.get(i, i) for i in vllm_ids or ())

    def _vllm_ids(self, kvb_ids: Iterable[str]) -> set[str]:
        return {self._to_vllm.get(i, i) for i in kvb_ids}

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        self._local_computed[request.request_id] = num_computed_tokens
        view = self._view(request, num_computed_tokens)
        return self.kvbridge_scheduler.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        ids = blocks.get_block_ids()
        self._blocks[rid] = [list(g) for g in ids]
        view = self._view(request, self._local_computed.get(rid, request.num_computed_tokens))
        self.kvbridge_scheduler.update_state_after_alloc(view, self._region_blocks(ids),
                                                         num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled: list[ScheduledRequest] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            self._blocks[rid] = [list(g) for g in new.block_ids]
            request = self._requests.get(rid)
            if request is None:
                continue
            scheduled.append(ScheduledRequest(
                self._view(request, new.num_computed_tokens),
                self._region_blocks(new.block_ids), int(new.num_computed_tokens),
                int(counts.get(rid, 0)), True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            if resumed or rid not in self._blocks:
                self._blocks[rid] = [list(g) for g in (new_ids or ())]
            elif new_ids is not None:
                for group, extra in zip(self._blocks[rid], new_ids, strict=False):
                    group.extend(extra)
            request = self._requests.get(rid)
            if request is None:
                continue
            computed = int(cached.num_computed_tokens[i])
            scheduled.append(ScheduledRequest(
                self._view(request, computed), self._region_blocks(self._blocks[rid]),
                computed, int(counts.get(rid, 0)), resumed))
        self._step_id += 1
        step = SchedulerStep(
            step_id=self._step_id, scheduled=tuple(scheduled),
            finished_request_ids=self._kvb_ids(scheduler_output.finished_req_ids),
            preempted_request_ids=self._kvb_ids(scheduler_output.preempted_req_ids))
        new_ids, self._new_ids = self._new_ids, {}
        return KVBridgeVllmMetadata.pack(self.kvbridge_scheduler.build_connector_meta(step),
                                         new_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sent = self._kvb_ids(connector_output.finished_sending)
        out = ConnectorOutput(
            finished_sending=sent,
            finished_recving=self._kvb_ids(connector_output.finished_recving),
            failed_recving=self._kvb_ids(getattr(connector_output, "failed_recving", None)),
            # vLLM's block ids are pool ids shared by every KV cache group (hybrid models):
            # a bad block is bad in whichever region holds it
            invalid_block_ids=frozenset(
                (r, b) for b in connector_output.invalid_block_ids or ()
                for r in range(len(self._desc.adapter.spec.regions))),
        )
        self.kvbridge_scheduler.update_connector_output(out)
        for kvb_id in sent:  # a held request is done for good once sent
            self._held_push.discard(kvb_id)
            vllm_id = self._to_vllm.pop(kvb_id, None)
            if vllm_id is not None:
                self._to_kvb.pop(vllm_id, None)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        view = self._view(request)
        try:
            delay, params = self.kvbridge_scheduler.request_finished(
                view, self._region_blocks(block_ids))
        finally:
            self._forget(rid)
        if delay and view.transfer_params is not None \
                and view.transfer_params.mode is TransferMode.PUSH:
            self._held_push.add(view.request_id)
        return delay, (wrap_transfer_params(params) if params is not None else None)

    def request_finished(self, request: Request, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        # --disable-hybrid-kv-cache-manager: one group, a flat list.
        return self.request_finished_all_groups(request, (block_ids,))

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        per_worker: dict[int, bytes] = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            if isinstance(meta, KVBridgeHandshake):
                rank = self._desc.topology.with_rank(tp_rank=tp_rank, pp_rank=pp_rank)
                per_worker[rank_index(rank)] = meta.blob
        if self._scheduler is not None:
            self._scheduler.set_handshake_metadata(per_worker)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata],
                                    ) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def take_events(self) -> Iterable[Any]:
        # kvbridge's own KV events go out on kvbridge's publisher, not vLLM's.
        if self._scheduler is not None:
            self._scheduler.take_events()
        return ()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.kvbridge_worker
        shapes = worker.ctx.rank_shapes()
        names = {lid: name for name, lid in self._desc.adapter.layer_ids.items()}
        unknown = sorted(set(kv_caches) - set(self._desc.adapter.layer_ids))
        if unknown:
            raise AdapterConfigError("kv_cache_config", f"KV tensors for layers not in any KV "
                                                        f"cache group: {unknown[:3]}")
        layers: dict[int, torch.Tensor] = {}
        num_blocks: list[int] = []
        for shape in shapes:
            count = self._desc.num_blocks
            for lid in shape.layer_ids:
                name = names[lid]
                if name not in kv_caches:
                    raise AdapterConfigError(
                        "pipeline_parallel_size",
                        f"layer {name} belongs to this pipeline stage in kvbridge's split "
                        f"({self._desc.topology.pp_size} stages) but vLLM gave this rank no "
                        f"KV tensor for it")
                tensor = kv_caches[name]
                count = int(tensor.shape[0])
                if count != self._desc.num_blocks and count % self._desc.num_blocks == 0:
                    count = self._desc.num_blocks  # kernel blocks, regrouped by kvbridge_view
                view = kvbridge_view(tensor, shape.region, shape.tensor_shape(count), name,
                                     self._desc.adapter.fmt.kv_cache_layout,
                                     manager_blocks=self._desc.num_blocks)
                self._views[name] = view
                layers[lid] = view
            num_blocks.append(count)
        if len(layers) != len(kv_caches):
            raise AdapterConfigError("pipeline_parallel_size",
                                     f"vLLM gave {len(kv_caches)} KV tensors, kvbridge's "
                                     f"pipeline split expects {len(layers)} on this rank")
        worker.register_kv_caches(KVCaches(shapes, tuple(num_blocks), layers))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        blob = self._worker.get_handshake_metadata()
        return KVBridgeHandshake(blob) if blob else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVBridgeVllmMetadata)
        inner, new_ids = connector_metadata.unpack()
        for kvb_id, vllm_id in new_ids.items():
            self._to_vllm[kvb_id] = vllm_id
            self._to_kvb[vllm_id] = kvb_id
        worker = self.kvbridge_worker
        worker.bind_connector_metadata(inner)
        # vLLM 0.32 calls start_load_kv *after* the forward unless the step has
        # synchronous loads; kvbridge's contract calls it before any layer is
        # computed (a push producer learns the step's writes there, before
        # save_kv_layer). Starting here keeps kvbridge's order on every path.
        worker.start_load_kv()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Already done in :meth:`bind_connector_metadata` (see there)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        lid = self._desc.adapter.layer_id(layer_name)
        if lid is not None:
            self.kvbridge_worker.wait_for_layer_load(lid)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        lid = self._desc.adapter.layer_id(layer_name)
        view = self._views.get(layer_name)
        if lid is not None and view is not None:
            self.kvbridge_worker.save_kv_layer(lid, view)

    def wait_for_save(self) -> None:
        self.kvbridge_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str],
                     ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.kvbridge_worker
        sending, recving = worker.get_finished(self._kvb_ids(finished_req_ids))
        failed = worker.get_failed_recving()
        results = KVConnectorTransferResults(
            finished_sending=self._vllm_ids(sending),
            finished_recving=self._vllm_ids(set(recving) | set(failed)),
            failed_recving=self._vllm_ids(failed))
        for kvb_id in sending:
            vllm_id = self._to_vllm.pop(kvb_id, None)
            if vllm_id is not None:
                self._to_kvb.pop(vllm_id, None)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.get_block_ids_with_load_errors()
        if len(self._desc.adapter.spec.regions) > 1:
            # vLLM's block ids are unique only within a KV cache group, and its scheduler
            # raises on block-level errors of a model with several groups (hybrid): the
            # failed request is in failed_recving, which recomputes it whole
            return set()
        return {block_id for _region, block_id in errors}

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        worker = self._worker
        records_of = getattr(worker, "records", None)
        if records_of is None:
            return None
        records = records_of()
        start = 0
        if self._records_seen is not None:
            for index in range(len(records) - 1, -1, -1):
                if records[index] is self._records_seen:
                    start = index + 1
                    break
        new = records[start:]
        if not new:
            return None
        self._records_seen = new[-1]
        data = KVBridgeStats().data
        for record in new:
            if not record.ok:
                data["failed"] += 1
                continue
            data["transfer_duration"].append(float(record.duration_s))
            data["bytes_transferred"].append(int(record.nbytes))
            data["num_descriptors"].append(int(record.num_descs))
        return KVBridgeStats.packed(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


class KVBridgeConnector(KVBridgeConnectorBase):
    """Any kvbridge connector: ``kv_connector_extra_config.kvbridge_connector`` names it."""


class KVBridgeNixlConnector(KVBridgeConnectorBase):
    """kvbridge's NIXL prefill/decode connector (``mode`` pull or push in the extra config)."""

    KVBRIDGE_CONNECTOR = "nixl"
    _cache_hit_source = CacheHitSource.P2P


class KVBridgeMooncakeStoreConnector(KVBridgeConnectorBase):
    """kvbridge's Mooncake store connector."""

    KVBRIDGE_CONNECTOR = "mooncake_store"


class KVBridgeOffloadingConnector(KVBridgeConnectorBase):
    """kvbridge's tiered offloading connector (runs on vLLM's CPU platform too)."""

    KVBRIDGE_CONNECTOR = "offloading"
    _cache_hit_source = CacheHitSource.HOST
