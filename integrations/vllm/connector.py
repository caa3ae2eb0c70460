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

The adapter is split by concept. This module holds the connector classes vLLM
loads by name (:class:`KVBridgeConnectorBase` and the named subclasses: they
must stay importable from here, vLLM configs name them as strings), builds the
kvbridge half for the process's role, and owns the scheduler side: requests,
block lists, the step, finished requests, handshake metadata. It re-exports
what others import from here, and may not touch what these own:

* :mod:`kvbridge.integrations.vllm.description` -- the engine translation
  (:class:`EngineDescription`: groups, format, topology, connector config);
* :mod:`kvbridge.integrations.vllm.request_view` -- transfer params and block hashes;
* :mod:`kvbridge.integrations.vllm.worker_side` -- tensors and the worker hooks
  (:class:`~kvbridge.integrations.vllm.worker_side.WorkerSide`, a base of
  :class:`KVBridgeConnectorBase`);
* :mod:`kvbridge.integrations.vllm.messages` -- step metadata and handshake bytes;
* :mod:`kvbridge.integrations.vllm.stats` -- transfer stats and Prometheus metrics;
* :mod:`kvbridge.integrations.vllm.layout` -- groups -> regions, tensor views.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbridge.connectors import (
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerStep,
    TransferMode,
    WorkerConnector,
)
from kvbridge.integrations.vllm.description import (
    CONNECTOR_KEY,
    PARAMS_CONNECTORS,
    SAME_PROCESS_CONNECTORS,
    EngineDescription,
    _resolve,
)
from kvbridge.integrations.vllm.description import _group_info as _group_info  # tests
from kvbridge.integrations.vllm.layout import AdapterConfigError, required_layout
from kvbridge.integrations.vllm.messages import KVBridgeHandshake, KVBridgeVllmMetadata
from kvbridge.integrations.vllm.request_view import (
    PARAMS_KEY,
    _HashChain,
    identity_of,
    parse_transfer_params,
    wrap_transfer_params,
)
from kvbridge.integrations.vllm.stats import (
    ALL_REFUSED,
    KVBridgePromMetrics,
    KVBridgeStats,
    refusal_deltas,
)
from kvbridge.integrations.vllm.worker_side import WorkerSide
from kvbridge.layouts import rank_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: vLLM's null block: the block pool's first block, never allocated, which a request's
#: block table names where it holds no block (a sliding window's dropped positions:
#: a consumer allocates them so for the prefix it will not attend, and a producer's
#: table names them so once the request finished). Never moved nor verified.
VLLM_NULL_BLOCK_ID = 0

__all__ = [  # the classes vLLM loads by name, and what others import from here
    "CONNECTOR_KEY",
    "PARAMS_KEY",
    "SAME_PROCESS_CONNECTORS",
    "EngineDescription",
    "KVBridgeConnector",
    "KVBridgeConnectorBase",
    "KVBridgeHandshake",
    "KVBridgeMooncakeStoreConnector",
    "KVBridgeNixlConnector",
    "KVBridgeOffloadingConnector",
    "KVBridgePromMetrics",
    "KVBridgeStats",
    "KVBridgeVllmMetadata",
    "parse_transfer_params",
    "wrap_transfer_params",
]

logger = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------- the connector


class KVBridgeConnectorBase(WorkerSide, SupportsHMA):
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
                                   resolved.extra, null_block_id=VLLM_NULL_BLOCK_ID)
            self._scheduler = resolved.plugin.create_scheduler(ctx)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            rank = self._desc.topology.with_rank(tp_rank=get_tp_group().rank_in_group,
                                                 pp_rank=get_pp_group().rank_in_group)
            ctx = ConnectorContext(spec, self._desc.topology, resolved.config, num_blocks,
                                   resolved.extra, rank=rank, worker_index=rank_index(rank),
                                   null_block_id=VLLM_NULL_BLOCK_ID)
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
        self._refusals_reported: dict[str, int | float] = {}  # scheduler's, as last reported
        self._counts_refusals = resolved.plugin.name in PARAMS_CONNECTORS
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
                                                   *identity_of(request))
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
            lora=chain.lora,
            features=chain.features,
            embeds=chain.embeds,
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

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Workers: their transfers (``WorkerSide``). The scheduler (vLLM asks it every
        step too, and adds it to the workers' report): the refusal counters that grew
        since its last report, which become ``vllm:kvbridge_refused_params*``."""
        if self._scheduler is None:
            return super().get_kv_connector_stats()
        if not self._counts_refusals:
            return None
        now = self._scheduler.get_stats()
        grown = refusal_deltas(now, self._refusals_reported)
        if not grown:
            return None
        self._refusals_reported = {k: v for k, v in now.items() if k.startswith(ALL_REFUSED)}
        data = KVBridgeStats().data
        data["refused"] = grown
        return KVBridgeStats.packed(data)

    def take_events(self) -> Iterable[Any]:
        # kvbridge's own KV events go out on kvbridge's publisher, not vLLM's.
        if self._scheduler is not None:
            self._scheduler.take_events()
        return ()

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
