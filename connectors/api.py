"""The engine-neutral, two-sided connector API.

A connector moves KV between an engine's paged KV cache and somewhere else (a
peer engine, a store, an offload tier). It has two halves, created by its
:class:`ConnectorPlugin` from a :class:`ConnectorContext`:

* :class:`SchedulerConnector` -- one per engine, on the scheduler thread
  (single-threaded: no hook is called concurrently with another).
* :class:`WorkerConnector` -- one per worker rank; it sees that rank's KV
  tensors (see :mod:`kvbridge.layouts.spec` for the memory model).

The scheduler tells the workers what to do each step through a
:class:`ConnectorMetadata` it builds; the workers report back through a
:class:`WorkerOutput` per rank, which the engine aggregates across ranks into
one :class:`ConnectorOutput` (:class:`OutputAggregator`).

Hook order, per engine step (what ``kvbridge.engine`` does, and what a real
engine adapter must do)::

    scheduler, for each waiting request it may schedule:
        get_num_new_matched_tokens(request, num_computed)   -> (n | None, async)
            None: "ask again next step" (async lookup in flight), nothing allocated
        allocate blocks for num_computed + n (+ tokens to compute now)
        update_state_after_alloc(request, block_ids, n)     (also when n == 0)
            async == True: the request waits (WAITING_FOR_REMOTE_KVS), not computed
    scheduler: meta = build_connector_meta(step)            (exactly once per step)
    each worker rank:
        bind_connector_metadata(meta)
        start_load_kv()
        for each layer of the rank: wait_for_layer_load(layer); <compute>; save_kv_layer(layer, kv)
        wait_for_save()
        get_finished(finished_request_ids) -> (done_sending, done_recving)
        get_failed_recving(); get_block_ids_with_load_errors(); get_stats(); take_events()
        clear_connector_metadata()
    engine: aggregate the WorkerOutputs of all ranks
    scheduler: update_connector_output(output)
    scheduler, for each request that finished (or was aborted) this step:
        request_finished(request, block_ids) -> (delay_free, transfer_params)
            delay_free: blocks stay allocated until the request shows up in a
            later output's finished_sending
    scheduler: take_events()

Rules a connector can rely on and must keep:

* Every request a worker is told to load is eventually reported in
  ``finished_recving`` by *every* rank (a rank with nothing to do reports it at
  once). A failed receive is reported in ``failed_recving`` *and* is finished;
  its local blocks that were not loaded are reported in
  ``get_block_ids_with_load_errors`` the same step. The engine then
  recomputes those blocks (never trusts their bytes).
* Every request for which ``request_finished`` returned ``delay_free=True`` is
  eventually reported in ``finished_sending`` by every rank (after a peer read
  it, or after the connector's own abort timeout).
* ``block_ids`` are local block ids per region (:data:`BlockIds`); a block of
  region ``r`` covers ``ctx.block_tokens(r)`` tokens of the request.
* Nothing here imports an engine; the types are kvbridge's own.
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvbridge.connectors.config import ConnectorConfig, KVRole, LoadFailurePolicy
from kvbridge.connectors.errors import ConfigError, ContractError, RoleError
from kvbridge.connectors.params import BlockIds, TransferMode, TransferParams
from kvbridge.events import EventBuffer, KVEvent
from kvbridge.layouts import BlockHash, KVCacheSpec, ParallelTopology, RankRegionShape

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BlockIds",
    "BlockRef",
    "ConnectorConfig",
    "ConnectorContext",
    "ConnectorMetadata",
    "ConnectorOutput",
    "ConnectorPlugin",
    "ConnectorRequest",
    "EventBuffer",
    "KVCaches",
    "KVRole",
    "LoadFailurePolicy",
    "OutputAggregator",
    "ScheduledRequest",
    "SchedulerConnector",
    "SchedulerStep",
    "TransferMode",
    "TransferParams",
    "WorkerConnector",
    "WorkerOutput",
    "block_range",
]

#: A block of one region: ``(region_index, block_id)``. Load errors are reported as these.
BlockRef = tuple[int, int]

Stats = Mapping[str, int | float]


def block_range(block_tokens: int, start_token: int, end_token: int) -> range:
    """Indices (into a request's block list of one region) of the blocks that hold
    tokens ``[start_token, end_token)`` when each block covers ``block_tokens`` tokens."""
    if end_token <= start_token:
        return range(0)
    return range(start_token // block_tokens, -(-end_token // block_tokens))


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ConnectorRequest:
    """What a connector sees of a request: an immutable view built per hook call.

    ``token_ids`` are all tokens so far (prompt, then generated ones).
    ``block_hashes[r]`` are the chained hashes (``kvbridge.layouts.hash_blocks``)
    of every *full* key of region ``r`` over ``token_ids``, where a key covers
    ``ctx.block_tokens(r)`` tokens (``block_size * dcp_size`` for token-sharded
    regions); extra keys include ``cache_salt`` when set.
    ``num_computed_tokens`` is how many leading tokens have valid KV in this
    engine (local prefix-cache hits and computed tokens) when the view was made.

    ``transfer_params``: where this request's KV comes from (consumer; pull or
    push), or, on a producer in push mode, where to write it.
    ``remote_decode``: the router asked this engine (a producer) to prefill and
    hand the KV to a remote decoder: ``request_finished`` should hold the
    blocks (pull) and return the ``TransferParams`` for the router.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_hashes: tuple[tuple[BlockHash, ...], ...]
    num_computed_tokens: int = 0
    transfer_params: TransferParams | None = None
    remote_decode: bool = False
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[:self.num_prompt_tokens]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in a step, as the scheduler connector sees it.

    ``block_ids``: all blocks of the request now, per region.
    ``num_computed_tokens``: tokens with valid KV before this step's compute
    (including tokens a connector loads synchronously this step).
    ``num_scheduled_tokens``: tokens computed this step, from
    ``num_computed_tokens`` on. ``is_new``: first schedule (or first after a
    preemption, which dropped the old blocks): ``block_ids`` are a fresh list.
    """

    request: ConnectorRequest
    block_ids: BlockIds
    num_computed_tokens: int
    num_scheduled_tokens: int
    is_new: bool


@dataclass(frozen=True)
class SchedulerStep:
    """What the scheduler decided this step (the argument of ``build_connector_meta``)."""

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()


class ConnectorMetadata:
    """Base of the per-step message from a scheduler connector to its workers.

    Connectors subclass it as a dataclass. The engine passes the *same* object
    to every rank of the step; workers must treat it as read-only. The
    in-process reference engine never serializes it; adapters that cross
    processes send :func:`kvbridge.connectors.metadata_wire.encode_metadata`'s
    msgpack bytes, so its fields must be of the types that codec names.
    """


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class KVCaches:
    """The KV tensors of one worker rank, as registered with its connector.

    ``layers[layer_id]`` has shape ``shapes[r].tensor_shape(num_blocks[r])`` for
    the region ``r`` that owns ``layer_id``. Only this pipeline stage's layers
    are present.
    """

    shapes: tuple[RankRegionShape, ...]
    num_blocks: tuple[int, ...]
    layers: Mapping[int, torch.Tensor]

    def region_index_of_layer(self, layer_id: int) -> int:
        for index, shape in enumerate(self.shapes):
            if layer_id in shape.layer_ids:
                return index
        raise ContractError("layer_id", f"layer {layer_id} is not held by this rank")

    def region_layers(self, region_index: int) -> tuple[tuple[int, torch.Tensor], ...]:
        """``(layer_id, tensor)`` of one region's layers on this rank, in layer order."""
        return tuple((layer, self.layers[layer]) for layer in self.shapes[region_index].layer_ids)

    def block_stride(self, layer_id: int) -> int:
        """Bytes from one block of a layer to the next: the tensor's own dim-0 stride
        (larger than a block for padded pages, e.g. vLLM's hybrid or MLA caches)."""
        tensor = self.layers[layer_id]
        return int(tensor.stride(0)) * int(tensor.element_size())

    def backing_spans(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of each distinct backing storage of the layer tensors, once.

        Tensors that alias (vLLM's hybrid allocator puts layer i of every KV cache
        group on the same bytes) or are views of one allocation share a storage,
        which a transport must register once.
        """
        spans: dict[int, int] = {}
        for tensor in self.layers.values():
            storage = tensor.untyped_storage()
            spans[int(storage.data_ptr())] = int(storage.nbytes())
        return sorted(spans.items())


@dataclass(frozen=True)
class WorkerOutput:
    """What one rank reports after a step.

    ``failed_recving`` is always a subset of ``finished_recving`` (a failed
    receive is finished: enforced on construction). ``invalid_block_ids`` are
    local blocks whose load failed (their bytes must not be used).
    """

    worker_index: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[BlockRef] = frozenset()
    stats: Stats = field(default_factory=dict)
    events: tuple[KVEvent, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "finished_sending", frozenset(self.finished_sending))
        object.__setattr__(self, "failed_recving", frozenset(self.failed_recving))
        object.__setattr__(self, "finished_recving",
                           frozenset(self.finished_recving) | self.failed_recving)
        refs = frozenset(self.invalid_block_ids)
        for ref in refs:
            if (not isinstance(ref, tuple) or len(ref) != 2
                    or not all(isinstance(x, int) and x >= 0 for x in ref)):
                raise ContractError("invalid_block_ids",
                                    f"expected (region_index, block_id) pairs, got {ref!r}")
        object.__setattr__(self, "invalid_block_ids", refs)
        object.__setattr__(self, "events", tuple(self.events))


@dataclass(frozen=True)
class ConnectorOutput:
    """The engine-wide result of one step, given to ``update_connector_output``.

    A request id appears in ``finished_sending`` / ``finished_recving`` once,
    in the step where the last participating rank reported it. It is in
    ``failed_recving`` if any rank reported it failed. ``invalid_block_ids``
    is the union over ranks, reported as soon as any rank reports it.
    ``worker_stats`` holds each rank's latest cumulative stats (index = worker).
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[BlockRef] = frozenset()
    worker_stats: tuple[Stats, ...] = ()
    events: tuple[KVEvent, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.events)

    def merged_stats(self) -> dict[str, int | float]:
        """Sum of every numeric stat over ranks (engine-wide cumulative counters)."""
        total: dict[str, int | float] = {}
        for stats in self.worker_stats:
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total


class OutputAggregator:
    """Combines the ranks' :class:`WorkerOutput` into one :class:`ConnectorOutput` per step.

    Stateful across steps: rank 0 may report a request finished in step 5 and
    rank 1 in step 6; the request is finished (once) in step 6. Invariant: a
    request is finished only when every one of ``num_workers`` ranks reported
    it; it is failed if any rank reported it failed.

    KV events (as vLLM aggregates worker events): an event is emitted once every
    rank that *holds* its block reported an equal event -- ``holders[g]`` are the
    worker indices holding layers of region (KV-cache group) ``g``, for events
    with ``group_idx == g``; all ranks for other events or without ``holders``.
    Reports from ranks outside the holders are ignored. Reports are counted, not
    just noted: an event that every holder reported ``k`` times is emitted ``k``
    times (a block stored, removed and stored again is announced twice), even
    when one rank reports both before another reports the first.
    """

    def __init__(self, num_workers: int,
                 holders: Sequence[frozenset[int]] | None = None) -> None:
        if num_workers < 1:
            raise ConfigError("num_workers", f"expected >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._holders = tuple(frozenset(h) for h in holders) if holders is not None else ()
        everyone = frozenset(range(num_workers))
        for group, ranks in enumerate(self._holders):
            if not ranks or not ranks <= everyone:
                raise ConfigError("holders", f"group {group}: expected a non-empty subset of "
                                             f"worker indices 0..{num_workers - 1}, got "
                                             f"{sorted(ranks)}")
        self._everyone = everyone
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}
        self._failed: set[str] = set()
        # event -> reports per worker index not yet matched by every holder (insertion
        # ordered: events complete in the order they were first reported)
        self._events: dict[KVEvent, dict[int, int]] = {}

    def aggregate(self, outputs: Sequence[WorkerOutput]) -> ConnectorOutput:
        sending_done: set[str] = set()
        recving_done: set[str] = set()
        invalid: set[BlockRef] = set()
        events: list[KVEvent] = []
        stats: list[Stats] = [{} for _ in range(self.num_workers)]
        for output in outputs:
            worker = output.worker_index
            if not 0 <= worker < self.num_workers:
                raise ContractError("worker_index", f"expected 0..{self.num_workers - 1}, "
                                                    f"got {worker}")
            stats[worker] = output.stats
            invalid |= output.invalid_block_ids
            self._failed |= output.failed_recving
            for request_id in output.finished_sending:
                if self._add(self._sending, request_id, worker):
                    sending_done.add(request_id)
            for request_id in output.finished_recving:
                if self._add(self._recving, request_id, worker):
                    recving_done.add(request_id)
            for event in output.events:
                if worker in self._holders_of(event):
                    counts = self._events.setdefault(event, {})
                    counts[worker] = counts.get(worker, 0) + 1
        events.extend(self._complete_events())
        failed = frozenset(recving_done & self._failed)
        self._failed -= recving_done
        return ConnectorOutput(
            finished_sending=frozenset(sending_done),
            finished_recving=frozenset(recving_done),
            failed_recving=failed,
            invalid_block_ids=frozenset(invalid),
            worker_stats=tuple(stats),
            events=tuple(events),
        )

    def _holders_of(self, event: KVEvent) -> frozenset[int]:
        group = getattr(event, "group_idx", None)
        if isinstance(group, int) and 0 <= group < len(self._holders):
            return self._holders[group]
        return self._everyone

    def _complete_events(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event, counts in list(self._events.items()):
            holders = self._holders_of(event)
            rounds = min(counts.get(w, 0) for w in holders)
            if rounds == 0:
                continue
            out.extend([event] * rounds)
            left = {w: n - rounds for w, n in counts.items() if n > rounds}
            if left:
                self._events[event] = left
            else:
                del self._events[event]
        return out

    @property
    def num_pending_events(self) -> int:
        """Distinct worker events some holder has not reported yet."""
        return len(self._events)

    def _add(self, table: dict[str, set[int]], request_id: str, worker: int) -> bool:
        ranks = table.setdefault(request_id, set())
        ranks.add(worker)
        if len(ranks) == self.num_workers:
            del table[request_id]
            return True
        return False

    def pending(self) -> dict[str, dict[str, int]]:
        """Requests some but not all ranks reported: ``{"sending": {id: n}, "recving": ...}``."""
        return {"sending": {k: len(v) for k, v in self._sending.items()},
                "recving": {k: len(v) for k, v in self._recving.items()}}


# --------------------------------------------------------------------------- context


@dataclass(frozen=True)
class ConnectorContext:
    """Everything a connector half is given about its engine.

    ``topology`` is the engine's parallel sizes (ranks 0). ``rank`` and
    ``worker_index`` are set for worker halves only (``worker_index`` is the
    rank's position in ``topology.ranks()``). ``extra`` is the plugin's parsed
    form of ``config.extra`` (``ConnectorPlugin.parse_extra``).
    ``num_blocks[r]`` is the engine's block-pool size of region ``r``.
    ``events`` is this half's own :class:`kvbridge.events.EventBuffer` (thread-safe):
    append ``kvbridge.events`` records (``BlockStored`` ...) to it; the engine
    takes them once per step (scheduler: ``take_events``; worker: into its
    :class:`WorkerOutput`).
    """

    spec: KVCacheSpec
    topology: ParallelTopology
    config: ConnectorConfig
    num_blocks: tuple[int, ...]
    extra: Any = None
    events: EventBuffer = field(default_factory=EventBuffer)
    rank: ParallelTopology | None = None
    worker_index: int | None = None

    @property
    def role(self) -> KVRole:
        return self.config.role

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def is_worker(self) -> bool:
        return self.rank is not None

    @property
    def num_workers(self) -> int:
        return self.topology.world_size

    def block_tokens(self, region_index: int) -> int:
        """Tokens covered by one block (and one hash key) of region ``region_index``."""
        return self.spec.regions[region_index].tokens_per_key(self.topology.dcp_size)

    def rank_shapes(self) -> tuple[RankRegionShape, ...]:
        if self.rank is None:
            raise ContractError("rank", "rank_shapes() is for worker halves only")
        return self.spec.rank_shapes(self.rank)

    def require_role(self, call: str, *allowed: KVRole) -> None:
        """Raise :class:`RoleError` unless this engine's role is one of ``allowed``."""
        if self.role not in allowed:
            raise RoleError("kv_role", f"{call} needs role {' or '.join(r.value for r in allowed)}"
                                       f"; this engine is {self.role.value}")


# --------------------------------------------------------------------------- the two halves


class SchedulerConnector(ABC):
    """Scheduler-side half: one per engine, called from the scheduler thread only."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` this connector can provide.

        Returns ``(num_tokens, load_async)``. ``num_tokens`` None means "not
        known yet, ask again next step" (an async lookup is in flight; the
        engine allocates nothing). ``load_async`` True: the load runs across
        steps and the request waits until it is in ``finished_recving``;
        False: the load completes inside the next step's forward
        (``start_load_kv`` / ``wait_for_layer_load``). May be called again for
        the same request in later steps (until it is scheduled).
        """

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for ``request``; called once per scheduling
        decision, also when ``num_external_tokens`` is 0 (e.g. a consumer with a
        full local prefix hit must still tell the producer to free).

        ``block_ids`` hold all of the request's blocks per region; the external
        tokens are ``[request.num_computed_tokens, + num_external_tokens)``
        (see :func:`block_range`).
        """

    @abstractmethod
    def build_connector_meta(self, step: SchedulerStep) -> ConnectorMetadata:
        """Called exactly once per step, after scheduling; resets per-step state."""

    def update_connector_output(self, output: ConnectorOutput) -> None:  # noqa: B027
        """The aggregated worker results of the step just run (default: ignore)."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        """``request`` finished or was aborted. Returns ``(delay_free, transfer_params)``.

        ``block_ids`` hold valid KV for ``request.num_computed_tokens`` tokens
        (a producer that prefilled a prompt and sampled one token has
        ``num_computed_tokens == num_prompt_tokens``; the sampled token has no
        KV yet). ``delay_free`` True: the engine keeps ``block_ids`` allocated
        until every rank reports the request in ``finished_sending``.
        ``transfer_params`` (producer): what the router forwards to the consumer.
        Called exactly once per request, also for aborted ones (a consumer
        aborted before it was scheduled must still let its producer free).
        """

    def take_events(self) -> list[KVEvent]:
        """KV events produced since the last call (default: drain ``ctx.events``)."""
        return self.ctx.events.take()

    def set_handshake_metadata(self, per_worker: Mapping[int, bytes]) -> None:  # noqa: B027
        """Each worker's ``get_handshake_metadata()`` (by worker index), given once
        after the workers registered their caches, so the scheduler side can
        serve them to peers (e.g. on a side channel)."""

    def endpoint(self) -> tuple[str, int] | None:
        """``(host, port)`` where peers reach this engine's connector, if any.

        Routers use it to fill ``producer_host``/``producer_port`` (or the
        consumer fields in push mode)."""
        return None

    def get_stats(self) -> dict[str, int | float]:
        """Scheduler-side counters (plain numbers a test or the CLI can read)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Release everything (threads, sockets, registrations). Idempotent."""


class WorkerConnector(ABC):
    """Worker-side half: one per rank. Sees the rank's KV tensors."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self._metadata: ConnectorMetadata | None = None

    @abstractmethod
    def register_kv_caches(self, caches: KVCaches) -> None:
        """Called once, before the first step, with the rank's KV tensors."""

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Called at the start of each step with the scheduler half's metadata."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called at the end of each step."""
        self._metadata = None

    @property
    def connector_metadata(self) -> ConnectorMetadata:
        if self._metadata is None:
            raise ContractError("connector_metadata", "no metadata bound: hooks that read it "
                                "run between bind_connector_metadata and clear")
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads (may return before they complete)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_id: int) -> None:
        """Block until synchronous loads into ``layer_id`` are done (before it is computed)."""

    @abstractmethod
    def save_kv_layer(self, layer_id: int, kv_layer: torch.Tensor) -> None:
        """``layer_id`` was just computed for this step; ``kv_layer`` is its tensor."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are safe (the engine may overwrite blocks next)."""

    @abstractmethod
    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` request ids since the last call.

        ``finished_request_ids``: requests the scheduler finished this step.
        A failed receive is included in ``done_recving`` (and in
        :meth:`get_failed_recving`).
        """

    def get_failed_recving(self) -> set[str]:
        """Requests whose receive failed since the last call (subset of done_recving)."""
        return set()

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        """``(region_index, block_id)`` of local blocks whose load failed since the last call."""

    def get_handshake_metadata(self) -> bytes | None:
        """Opaque bytes peers need to reach this rank (e.g. a NIXL agent's metadata)."""
        return None

    def get_stats(self) -> dict[str, int | float]:
        """This rank's cumulative counters (since creation; monotonic numbers).

        Reported every step; the engine keeps each rank's latest snapshot, so
        a counter is never double-counted.
        """
        return {}

    def take_events(self) -> list[KVEvent]:
        return self.ctx.events.take()

    @abstractmethod
    def shutdown(self) -> None:
        """Release every registration, handle, socket and thread. Idempotent."""

    def collect_output(self, finished_request_ids: frozenset[str]) -> WorkerOutput:
        """Call the reporting hooks in their fixed order and pack one :class:`WorkerOutput`.

        Order: get_finished, get_failed_recving, get_block_ids_with_load_errors,
        get_stats, take_events.
        """
        done_sending, done_recving = self.get_finished(finished_request_ids)
        failed = self.get_failed_recving()
        invalid = self.get_block_ids_with_load_errors()
        index = self.ctx.worker_index if self.ctx.worker_index is not None else 0
        return WorkerOutput(
            worker_index=index,
            finished_sending=frozenset(done_sending or ()),
            finished_recving=frozenset(done_recving or ()),
            failed_recving=frozenset(failed or ()),
            invalid_block_ids=frozenset(invalid or ()),
            stats=self.get_stats(),
            events=tuple(self.take_events()),
        )


# --------------------------------------------------------------------------- plugins


class ConnectorPlugin(ABC):
    """One registered connector: how to build its two halves and what it supports.

    Register a subclass under the entry-point group ``kvbridge.connectors``
    (``name = "package.module:PluginClass"``). The registry checks the role
    against ``supported_roles`` (:class:`RoleError` if not supported) and warns
    for ``deprecated_roles``; then calls ``parse_extra(config.extra)`` once and
    puts the result in ``ConnectorContext.extra``.

    ``backends`` names what ``kvbridge doctor`` must check for this connector
    (``"torch"``, ``"zmq"``, ``"msgpack"``, ``"nixl"``, ``"mooncake"``).
    ``conformance_cases()`` returns the cases with which the conformance suite
    (``kvbridge.connectors.testing``) exercises this connector.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    deprecated_roles: ClassVar[frozenset[KVRole]] = frozenset()
    backends: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> Any:
        """Validate connector-specific config; raise :class:`ConfigError` naming the key.

        Default: the connector takes no extra settings.
        """
        if extra:
            key = sorted(extra)[0]
            raise ConfigError(f"kv_connector_extra_config.{key}",
                              f"connector {cls.name!r} takes no extra settings")
        return None

    @classmethod
    def check_role(cls, role: KVRole) -> None:
        """Raise for an unsupported role, warn for a deprecated one."""
        if role not in cls.supported_roles:
            raise RoleError("kv_role", f"connector {cls.name!r} supports "
                                       f"{sorted(r.value for r in cls.supported_roles)}, "
                                       f"not {role.value!r}")
        if role in cls.deprecated_roles:
            message = (f"kv_role {role.value!r} is deprecated for connector {cls.name!r}: "
                       f"use kv_producer on prefill engines and kv_consumer on decode engines")
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            logger.warning(message)

    @classmethod
    @abstractmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        """The scheduler-side half for one engine."""

    @classmethod
    @abstractmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        """The worker-side half for one rank (``ctx.rank`` set)."""

    @classmethod
    def conformance_cases(cls) -> Sequence[Any]:
        """``kvbridge.connectors.testing.ConformanceCase`` objects; none by default."""
        return ()
