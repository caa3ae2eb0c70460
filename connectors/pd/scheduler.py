"""Scheduler half of the PD connector: decides who loads, holds, pushes; serves the handshake.

Consumer (``kv_consumer``): a request that carries ``TransferParams`` asks for
``min(params.num_tokens, request tokens) - computed`` tokens, loaded
asynchronously, once the params are checked against the request
(``TransferParams.check_request``: sizes bounded by its prompt; then
:class:`~kvbridge.connectors.sealing.ParamsCheck`: sealed by their producer,
for this prompt, a hold not loaded before; refused ones are counted per
reason and the request recomputes); once blocks are allocated a
:class:`LoadOrder` goes to the workers. Zero tokens (a full local prefix hit) or an abort before the
request was ever allocated still sends a :class:`ReleaseOrder`, so the
producer frees at once instead of waiting for its lease to run out.

Producer (``kv_producer``): a finished ``remote_decode`` request is held
(``delay_free``) and a :class:`HoldOrder` starts its lease on every rank;
``request_finished`` returns the pull ``TransferParams`` the router forwards,
sealed (:class:`~kvbridge.connectors.sealing.Sealer`).
In push mode every scheduled step of such a request is a :class:`PushOrder`
(the workers write each layer as it completes in the prompt's last step).

The engine's handshake side channel (one ZMQ ROUTER for all ranks) is started
in :meth:`PdScheduler.set_handshake_metadata`, when the ranks' transport agent
metadata is known, and stopped in :meth:`shutdown`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbridge.connectors.api import (
    BlockIds,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    SchedulerStep,
    block_range,
)
from kvbridge.connectors.errors import TransferParamsError
from kvbridge.connectors.params import TransferMode, TransferParams
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.sealing import (
    ParamsCheck,
    Sealer,
    chain_links,
    prompt_chain,
    record_digest,
)
from kvbridge.handshake import (
    CompatHeader,
    HandshakeServer,
    MetadataStore,
    decode_agent,
)
from kvbridge.handshake import TransferMode as WireMode

logger = logging.getLogger(__name__)

#: Params refused against their request, counted per field (``refused_params`` counts
#: every refusal, these the bounds checks': see ``TransferParams.check_request``).
REFUSAL_COUNTERS = {"num_tokens": "refused_params_num_tokens",
                    "block_ids": "refused_params_block_ids",
                    "block_id": "refused_params_block_id",
                    # unsealed, or a seal that does not verify (sealing.ParamsCheck)
                    "seal": "refused_params_seal",
                    # sealed for other tokens than this request's prompt
                    "prompt_chain": "refused_params_prompt",
                    # a hold this engine already loaded for another request
                    "hold_id": "refused_params_replay"}


def _refusal_counter(field_name: str) -> str:
    """``transfer_params.block_ids[0][3]`` -> the counter of one out-of-range id;
    ``transfer_params.block_ids[0]`` -> of a list too long (or too many lists)."""
    name = field_name.removeprefix("transfer_params.")
    if name.startswith("block_ids"):
        return REFUSAL_COUNTERS["block_id" if name.count("[") == 2 else "block_ids"]
    if name.startswith("seal"):
        return REFUSAL_COUNTERS["seal"]
    return REFUSAL_COUNTERS.get(name, REFUSAL_COUNTERS["num_tokens"])


@dataclass(frozen=True)
class LoadOrder:
    """Consumer: load block indices ``start[r]..`` of every region from the producer.

    ``consumer_block_ids[r][k]`` receives ``producer_block_ids[r][k]`` (pull);
    in push mode ``producer_block_ids`` is empty (the producer knows its own).
    ``error`` set: the order is refused up front (the worker fails it at once).
    """

    request_id: str
    params: TransferParams
    consumer_block_ids: BlockIds
    producer_block_ids: BlockIds
    start: tuple[int, ...]
    error: str | None = None
    #: the sealed params' digest the producer checks (``sealing.record_digest``)
    record: bytes = b""
    #: push: this request's prompt chain, which the producer compares with its own
    chain: bytes = b""


@dataclass(frozen=True)
class ReleaseOrder:
    """Consumer: tell the producer it can free ``params``' blocks (nothing will be read)."""

    request_id: str
    params: TransferParams
    record: bytes = b""  # as in LoadOrder: a release names the sealed record too


@dataclass(frozen=True)
class HoldOrder:
    """Producer: hold ``request_id``'s blocks under a lease until the consumers are done;
    ``record``: the digest of the params sealed for it (empty in push mode)."""

    request_id: str
    block_ids: BlockIds
    push: bool
    record: bytes = b""


@dataclass(frozen=True)
class PushOrder:
    """Producer (push): this step computes tokens up to ``end`` of ``request_id``;
    ``final``: the prompt is complete after this step (its layers can be written)."""

    request_id: str
    params: TransferParams
    block_ids: BlockIds
    end: int
    final: bool
    #: the prompt chain a consumer's register must name (``sealing.prompt_chain``)
    chain: bytes = b""


@dataclass
class PdMetadata(ConnectorMetadata):
    """The per-step orders (read-only for the workers).

    ``cancels``: consumer requests finished (aborted) while loading; push loads
    ask the producer to stop. ``drops``: producer push requests that finished
    without a hold (aborted before the prompt was complete).
    """

    step_id: int = 0
    loads: tuple[LoadOrder, ...] = ()
    releases: tuple[ReleaseOrder, ...] = ()
    holds: tuple[HoldOrder, ...] = ()
    pushes: tuple[PushOrder, ...] = ()
    heartbeats: tuple[TransferParams, ...] = ()
    cancels: tuple[str, ...] = ()
    drops: tuple[str, ...] = ()


@dataclass
class _SchedState:
    loads: list[LoadOrder] = field(default_factory=list)
    releases: list[ReleaseOrder] = field(default_factory=list)
    holds: list[HoldOrder] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)


class PdScheduler(SchedulerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings = ctx.extra if isinstance(ctx.extra, PdSettings) else PdSettings()
        self.settings = settings
        self.header = CompatHeader.from_spec(ctx.spec, WireMode(settings.mode.value))
        self._pending = _SchedState()
        self._waiting: dict[str, TransferParams] = {}  # consumer: matched, not allocated yet
        self._handled: set[str] = set()  # consumer: load or release ordered
        self._last_heartbeat = time.monotonic()
        self._store: MetadataStore | None = None
        self._server: HandshakeServer | None = None
        self._stats: dict[str, int] = {"loads_ordered": 0, "releases_ordered": 0,
                                       "holds_ordered": 0, "refused_params": 0, "blocks_ordered": 0,
                                       "finished_sending": 0, "finished_recving": 0,
                                       "failed_recving": 0,
                                       **dict.fromkeys(REFUSAL_COUNTERS.values(), 0)}
        #: the field of the last refused params (``transfer_params.block_ids[0]``), or None
        self.last_refused_field: str | None = None
        auth = settings.cluster_auth()
        secret = auth.secret if auth is not None else None
        self._sealer = Sealer(secret)  # producer: seals the params it returns
        self._check = ParamsCheck(secret)  # consumer: loads only sealed params of its prompt
        self._push_chains: dict[str, bytes] = {}  # producer, push: each request's chain

    # ------------------------------------------------------------------ handshake

    def set_handshake_metadata(self, per_worker: Mapping[int, bytes]) -> None:
        auth = self.settings.cluster_auth()
        store = MetadataStore(self.ctx.engine_id, self.ctx.spec, self.ctx.topology,
                              WireMode(self.settings.mode.value), auth=auth)
        for _index, blob in sorted(per_worker.items()):
            store.publish(decode_agent(blob))
        server = HandshakeServer(store, self.settings.host, self.settings.port,
                                 insecure_no_auth=self.settings.serves_strangers)
        server.start()
        self._store, self._server = store, server
        logger.info("pd: engine %s (%s, %s) side channel on %s (%s)", self.ctx.engine_id,
                    self.ctx.role.value, self.settings.mode.value, server.address,
                    f"cluster secret {auth.secret.fingerprint}" if auth else
                    "no cluster secret: unauthenticated")

    def endpoint(self) -> tuple[str, int] | None:
        if self._server is None:
            return None
        return self.settings.public_host, self._server.port

    # ------------------------------------------------------------------ consumer

    def _usable(self, request: ConnectorRequest) -> TransferParams | None:
        params = request.transfer_params
        if params is None or not self.ctx.role.is_consumer or request.remote_decode:
            return None
        if request.request_id in self._handled:
            return None
        if params.mode is not self.settings.mode or (
                params.spec_fingerprint is not None
                and params.spec_fingerprint != self.ctx.spec.fingerprint()):
            self._stats["refused_params"] += 1
            logger.warning("pd: request %s: transfer params of mode %s / fingerprint %s do "
                           "not pair with this engine (%s / %s); recomputing",
                           request.request_id, params.mode.value, params.spec_fingerprint,
                           self.settings.mode.value, self.ctx.spec.fingerprint())
            self._handled.add(request.request_id)
            return None
        try:
            self._check_bounds(request, params)
            self._check.check(request.request_id, request.token_ids, request.cache_salt,
                              params, self._links(request), request.extra_keys)
        except TransferParamsError as exc:
            self._refuse(request, exc)
            return None
        return params

    def _check_bounds(self, request: ConnectorRequest, params: TransferParams) -> None:
        """The params against the request they came with, before anything is allocated,
        ordered or looked up on their say (their block ids are the producer's: its
        blocks hold ``tokens_per_key`` at the producer's DCP size)."""
        if params.mode is TransferMode.PULL:
            params.check_regions(len(self.ctx.spec.regions))
        dcp = params.producer_topology.dcp_size
        params.check_request(request.num_prompt_tokens,
                             [region.tokens_per_key(dcp) for region in self.ctx.spec.regions])

    def _links(self, request: ConnectorRequest) -> tuple[bytes, ...]:
        """The request's block hashes that are prompt-chain links (none: computed)."""
        return tuple(chain_links(request.block_hashes,
                                 [self.ctx.block_tokens(r)
                                  for r in range(len(self.ctx.spec.regions))]))

    def _chain(self, request: ConnectorRequest, num_tokens: int) -> bytes:
        return prompt_chain(request.token_ids, num_tokens, request.cache_salt,
                            self._links(request), request.extra_keys)

    def _refuse(self, request: ConnectorRequest, exc: TransferParamsError) -> None:
        """Refused params: the request recomputes locally; counted, one log line."""
        self._handled.add(request.request_id)
        self._stats["refused_params"] += 1
        self._stats[_refusal_counter(exc.field)] += 1
        self.last_refused_field = exc.field
        logger.warning("pd: request %s: refused transfer params (%s: %s); recomputing",
                       request.request_id, exc.field, exc.reason)

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._usable(request)
        if params is None:
            return 0, False
        self._waiting[request.request_id] = params
        total = min(params.num_tokens, request.num_tokens)
        ext = total - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        params = self._waiting.pop(request.request_id, None)
        if params is None:
            return
        self._handled.add(request.request_id)
        self._check.used(request.request_id, params)
        if num_external_tokens <= 0:
            self._release(request.request_id, params)
            return
        record = record_digest(params) if params.seal is not None else b""
        start_token = request.num_computed_tokens
        end_token = start_token + num_external_tokens
        consumer: list[tuple[int, ...]] = []
        producer: list[tuple[int, ...]] = []
        starts: list[int] = []
        error = None
        null = self.ctx.null_block_id
        for r in range(len(self.ctx.spec.regions)):
            span = block_range(self.ctx.block_tokens(r), start_token, end_token)
            ids = block_ids[r] if r < len(block_ids) else ()
            if len(ids) < span.stop:
                error = error or f"region {r}: {len(span)} blocks to load but " \
                                 f"{len(ids[span.start:span.stop])} allocated"
            # positions the engine gave no block (a sliding window's prefix it will not
            # attend) are not loaded: the load starts at the region's first real block
            first = span.start
            while null is not None and first < min(span.stop, len(ids)) and ids[first] == null:
                first += 1
            starts.append(first)
            consumer.append(tuple(ids[first:span.stop]))
            if null is not None and null in consumer[-1] and error is None:
                error = (f"region {r}: no block allocated at block index "
                         f"{first + consumer[-1].index(null)}, inside the blocks to load")
            if params.mode is TransferMode.PULL:
                theirs = params.block_ids[r] if r < len(params.block_ids) else ()
                producer.append(tuple(theirs[first:span.stop]))
                if len(theirs) < span.stop and error is None:
                    error = (f"region {r}: producer sent {len(theirs)} block ids, need block "
                             f"indices {span.start}..{span.stop - 1}")
                elif null is not None and null in producer[-1] and error is None:
                    error = (f"region {r}: the producer no longer holds block index "
                             f"{first + producer[-1].index(null)} (its engine released it as "
                             f"the request finished: out of the producer's sliding window, "
                             f"inside this consumer's)")
        chain = b""
        if params.mode is TransferMode.PUSH and error is None:
            try:  # what the producer compares with its own prompt before writing
                chain = self._chain(request, min(params.num_tokens, request.num_prompt_tokens))
            except TransferParamsError as exc:
                error = f"{exc.field}: {exc.reason}"
        self._pending.loads.append(LoadOrder(request.request_id, params, tuple(consumer),
                                             tuple(producer), tuple(starts), error,
                                             record, chain))
        self._stats["loads_ordered"] += 1
        self._stats["blocks_ordered"] += sum(len(ids) for ids in consumer)

    def _release(self, request_id: str, params: TransferParams) -> None:
        record = record_digest(params) if params.seal is not None else b""
        self._pending.releases.append(ReleaseOrder(request_id, params, record))
        self._stats["releases_ordered"] += 1

    # ------------------------------------------------------------------ both

    def build_connector_meta(self, step: SchedulerStep) -> PdMetadata:
        pushes = []
        if self.ctx.role.is_producer and self.settings.mode is TransferMode.PUSH:
            for item in step.scheduled:
                req = item.request
                params = req.transfer_params
                if not req.remote_decode or params is None or params.mode is not TransferMode.PUSH:
                    continue
                end = item.num_computed_tokens + item.num_scheduled_tokens
                upto = min(req.num_prompt_tokens, params.num_tokens or req.num_prompt_tokens)
                final = end >= upto
                chain = self._push_chains.get(req.request_id)
                if chain is None:
                    chain = self._push_chains[req.request_id] = self._chain(req, upto)
                pushes.append(PushOrder(req.request_id, params, item.block_ids, end, final,
                                        chain))
        heartbeats: tuple[TransferParams, ...] = ()
        now = time.monotonic()
        if self._waiting and now - self._last_heartbeat >= self.settings.heartbeat_interval_s:
            heartbeats = tuple(self._waiting.values())
            self._last_heartbeat = now
        meta = PdMetadata(step.step_id, tuple(self._pending.loads),
                            tuple(self._pending.releases), tuple(self._pending.holds),
                            tuple(pushes), heartbeats, tuple(self._pending.cancels),
                            tuple(self._pending.drops))
        self._pending = _SchedState()
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self._stats["finished_sending"] += len(output.finished_sending)
        self._stats["finished_recving"] += len(output.finished_recving)
        self._stats["failed_recving"] += len(output.failed_recving)
        for rid in output.failed_recving:
            self._check.failed(rid)
        for rid in output.finished_recving:
            if rid not in output.failed_recving:
                self._check.finished(rid)

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        rid = request.request_id
        params = self._waiting.pop(rid, None)
        if params is not None:  # consumer: matched but never allocated (abort, error)
            self._release(rid, params)
            self._handled.discard(rid)
            return False, None
        handled = rid in self._handled
        self._handled.discard(rid)
        if request.transfer_params is not None and not request.remote_decode \
                and self.ctx.role.is_consumer:
            if not handled:
                # finished before the connector was ever asked (aborted while queued)
                self._release(rid, request.transfer_params)
            else:
                self._pending.cancels.append(rid)  # a no-op for loads already finished
            return False, None
        if not (self.ctx.role.is_producer and request.remote_decode):
            return False, None
        self._push_chains.pop(rid, None)
        push = self.settings.mode is TransferMode.PUSH
        num_tokens = min(request.num_prompt_tokens, request.num_computed_tokens)
        # A remote prefill ends by producing its one token; without it the request was
        # aborted (or failed) and nobody will come for its blocks: free them now.
        complete = request.num_tokens > request.num_prompt_tokens and \
            request.num_computed_tokens >= request.num_prompt_tokens
        if num_tokens <= 0 or not any(block_ids) or not complete:
            if push:
                self._pending.drops.append(rid)
            return False, None
        ids = tuple(tuple(g) for g in block_ids)
        if push:
            self._pending.holds.append(HoldOrder(rid, ids, push))
            self._stats["holds_ordered"] += 1
            return True, request.transfer_params
        host, port = self.endpoint() or (self.settings.public_host, 1)
        params = self._sealer.seal(TransferParams(
            mode=TransferMode.PULL, producer_engine_id=self.ctx.engine_id,
            producer_host=host, producer_port=port, producer_request_id=rid,
            block_ids=ids, producer_topology=self.ctx.topology.sizes(), num_tokens=num_tokens,
            spec_fingerprint=self.ctx.spec.fingerprint()), self._chain(request, num_tokens))
        self._pending.holds.append(HoldOrder(rid, ids, push, record_digest(params)))
        self._stats["holds_ordered"] += 1
        return True, params

    def get_stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self._stats)
        if self._server is not None:
            out["handshake_requests_served"] = self._server.requests_served
        return out

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
