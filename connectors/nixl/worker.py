"""Worker half of the NIXL connector: one NIXL agent per rank; pull and push data paths.

Registration happens once (:meth:`NixlWorker.register_kv_caches`: every layer
tensor is one registered region). Descriptor lists are prepared once per plan
(local) and per remote rank (right after the handshake, see
:mod:`~kvbridge.connectors.nixl.session`); a request only builds index arrays.

Every engine step the worker *progresses*: it drains NIXL notifications (which
also progresses the UCX worker, as the passive side of a READ must), settles
handshakes run on its handshake threads (each bounded by a deadline), posts what became postable,
polls transfers, enforces deadlines and leases, and sends heartbeats. A rank
never blocks on the network inside a hook.

Consumer rank, pull: for each source producer rank, send ``begin`` (the
producer answers ``held``: a promise to keep the blocks ``lease_s`` longer, or
no promise), READ (block pairs ordered so NIXL merges contiguous runs), then
send a ``read`` notification once the READ is done here; the producer answers
each ``read`` with an ``ack`` (``ok=False`` when its lease had expired: the
bytes may be stale). The request is DONE when, for every source, the ack came
ok or the READ ended inside that source's promise (measured from sending the
``begin``: no clock is shared). Consumer rank, push: ``register`` its block
ids with every producer rank it notifies, DONE when every source sent
``pushed``.

Producer rank: holds finished requests under a :class:`LeaseTable`; pull
completes when every expected consumer rank notified (promises given to
``begin`` are kept: by the lease, and past :meth:`NixlWorker.shutdown` by
keeping the KV memory alive until they end); push writes a layer's
blocks to every registered consumer rank as the layer completes in the
prompt's last step (or everything at once when the registration comes later),
then sends ``pushed``.

Failures (handshake, transfer error or deadline, dead or restarted peer, late
read) fail exactly the affected requests with their local block ids as load
errors, drop the remote session (re-handshaken on next use), and log one line
each with the engine ids, request id and block count. A request whose own data
is bad (a block id outside the registered blocks) fails alone, before anything
is posted: the session and the other loads on it go on. A handshake that runs
past :attr:`NixlWorker.handshake_deadline_s` fails its requests and is abandoned.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import numpy as np

from kvbridge.auth import AuthError, Label, is_sealed
from kvbridge.backends.fence import Fence, record_fence
from kvbridge.backends.nixl import (
    DescList,
    NixlTransport,
    NixlTransportError,
    PeerHandle,
    Transfer,
    XferOp,
    XferState,
)
from kvbridge.connectors.api import BlockRef, ConnectorContext, KVCaches, WorkerConnector
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.leases import LeaseTable, Verdict, VerdictKind
from kvbridge.connectors.nixl.routing import (
    DescTable,
    build_table,
    expected_notifs,
    notify_targets,
    pair_indices,
    pull_indices,
)
from kvbridge.connectors.nixl.scheduler import LoadOrder, NixlMetadata, PushOrder, ReleaseOrder
from kvbridge.connectors.nixl.session import (
    LocalLists,
    PeerSession,
    SessionKey,
    check_remote_coverage,
    open_session,
)
from kvbridge.connectors.nixl.settings import NixlSettings
from kvbridge.connectors.nixl.state import RecvState, RecvTransfer
from kvbridge.connectors.nixl.verify import (
    MAX_ASK_BLOCKS,
    DigestAsk,
    SliceCheck,
    SlicePlan,
    answer_ask,
    check_answer,
    check_slices,
    count_slices,
    plan_ask,
    plan_slice_check,
    producer_slice_plan,
    slice_bytes,
    take_hold_digests,
    take_slice_digests,
    whole_block_regions,
)
from kvbridge.connectors.params import TransferMode, TransferParams
from kvbridge.handshake import (
    AgentMetadata,
    CompatHeader,
    HandshakeClient,
    decode_agent,
    encode_agent,
)
from kvbridge.handshake import TransferMode as WireMode
from kvbridge.layouts import LayerMemory, LayoutError, ParallelTopology
from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    TORCH_ALGORITHM,
    BlockDigester,
    Digester,
    LayerSpan,
    digest_algorithms,
    pick_algorithm,
)
from kvbridge.layouts.plan import plan_consumer_rank, plan_transfer, rank_index
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

logger = logging.getLogger(__name__)

#: A consumer trusts a producer's ``held`` promise of ``lease_s`` only up to
#: ``lease_s * (1 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S`` after sending its
#: ``begin`` (clock rates of two hosts differ by far less than 0.1 %).
GUARANTEE_RATE_MARGIN = 1e-3
GUARANTEE_SLACK_S = 0.005

#: KV memory of shut-down workers that promised a hold which has not run out yet:
#: ``(until, tensors)``, dropped lazily once ``until`` passed (see ``NixlWorker.shutdown``).
_KEPT_ALIVE: list[tuple[float, list[Any]]] = []
_KEPT_LOCK = threading.Lock()


def keep_alive(tensors: list[Any], until: float) -> None:
    """Keep ``tensors`` referenced until ``time.monotonic() >= until`` (checked lazily)."""
    now = time.monotonic()
    with _KEPT_LOCK:
        _KEPT_ALIVE[:] = [(u, t) for u, t in _KEPT_ALIVE if u > now]
        if until > now and tensors:
            _KEPT_ALIVE.append((until, tensors))


#: Handshake threads per rank: a peer that is slow to answer delays only its own
#: handshake, not those of other producers.
HANDSHAKE_THREADS = 4
#: Allowance (s) for NIXL's local steps of a handshake (loading the peer's metadata,
#: preparing lists) on top of the side channel's timeouts and backoff.
HANDSHAKE_SLACK_S = 5.0

#: Transfer latency samples kept per rank (for percentiles in the demo and bench).
MAX_SAMPLES = 100_000

#: NIXL may deliver a consumer rank's READ notification before its hello, so a
#: producer keeps what an agent it does not know yet sends, without acting on
#: it, for ``NixlSettings.early_grace_s`` and up to these bounds (per agent, and
#: agents at once); what does not fit, and what its hello never follows, is
#: rejected (``notifs_rejected``)
MAX_DEFERRED_PER_AGENT = 64
MAX_DEFERRED_AGENTS = 64
#: consumer agents a producer rank keeps as NIXL peers at once (a hello past it is refused)
MAX_CONSUMER_PEERS = 1024
#: push registrations kept for requests this rank does not hold yet
MAX_EARLY_REGISTERS = 4096
#: block ids asked by digest-asking ``begin``s waiting for their hold, at most (all agents)
MAX_EARLY_BEGIN_IDS = 1 << 18
#: senders whose rejected notifications were logged (each once), remembered
MAX_LOGGED_SENDERS = 1024
#: the digest algorithms this version may offer (its handshake record, see _offered_digests);
#: slice digests (``xxh3-64-slices``) come right after XXH3-64, whose digester computes
#: them: host memory, by default ``("xxh3-64", "xxh3-64-slices", "torch-mix64-v1")``; a
#: GPU rank offers ``torch-mix64-v1`` alone (no head-slice digests without a host digester)
OFFERED_DIGESTS = (ALGORITHM, SLICE_ALGORITHM, TORCH_ALGORITHM)
#: consumer-rank plans a producer rank takes slice digests for as a hold starts, at most
#: (more known consumer topologies: the others' are taken when their ``begin`` comes)
MAX_HOLD_SLICE_PLANS = 16

#: Upper bounds (ms) of the latency histogram reported in stats as ``latency_ms_le_<bound>``
#: counters: counts add up across ranks (percentiles would not), so the engine-wide
#: sum still gives percentiles to within one bucket (:func:`histogram_percentile`).
LATENCY_BUCKETS_MS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                      10000, 30000, 60000)


def latency_key(bound_ms: float) -> str:
    return f"latency_ms_le_{bound_ms:g}"


def histogram_percentile(stats: dict[str, Any], q: float) -> float | None:
    """The ``q``-quantile (0..1) in ms from summed ``latency_ms_le_*`` counters
    (the upper bound of the bucket holding it); None without samples."""
    counts = [(b, int(stats.get(latency_key(b), 0))) for b in LATENCY_BUCKETS_MS]
    counts.append((float("inf"), int(stats.get("latency_ms_le_inf", 0))))
    total = sum(c for _, c in counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for bound, count in counts:
        seen += count
        if seen >= rank and count:
            return bound
    return counts[-1][0]


@dataclass
class _Connecting:
    future: Future[PeerSession]
    started_at: float


@dataclass
class _PushLists:
    """Prepared lists to WRITE one consumer rank's part of this producer rank's KV.

    Built once per consumer rank (at its ``hello``), reused by every request."""

    local: DescTable
    remote: DescTable
    local_list: DescList
    remote_list: DescList
    layers_needed: frozenset[int]


@dataclass
class _ConsumerPeer:
    """A consumer rank known to this producer rank (from its ``hello``)."""

    peer: PeerHandle
    meta: AgentMetadata
    push: _PushLists | None = None


@dataclass
class _PushTarget:
    consumer_rank: int
    peer: PeerHandle
    register: messages.Register
    local: DescTable | None = None
    remote: DescTable | None = None
    local_list: DescList | None = None
    remote_list: DescList | None = None
    layers_needed: frozenset[int] = frozenset()
    layers_written: set[int] = field(default_factory=set)
    transfers: list[Transfer] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    runs: int = 0  # contiguous runs posted (what NIXL moves after merging)
    #: slice digests per region of the blocks registered (``xxh3-64-slices`` asked)
    slice_digests: tuple[dict[int, int], ...] | None = None


@dataclass
class _PushJob:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...] = ()
    final: bool = False
    dropped: bool = False
    layers_ready: set[int] = field(default_factory=set)
    # push fence (issue 15): layers saved whose kernels may still run; ready once done()
    fenced: list[tuple[Fence, frozenset[int]]] = field(default_factory=list)
    targets: dict[int, _PushTarget] = field(default_factory=dict)
    started_at: float = 0.0
    #: block id -> digest per region, taken once every layer is final (issue 18)
    digests: tuple[dict[int, int], ...] | None = None
    #: the same in the producer's other algorithms consumers ask for (not the first)
    alg_digests: dict[str, tuple[dict[int, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferRecord:
    """One finished request load (consumer) or push (producer) on this rank.

    ``started_at`` is the ``time.monotonic()`` of the load's or push's start in
    this process (so records of ranks in one engine process share a clock and
    their busy intervals ``[started_at, started_at + duration_s]`` can be merged);
    ``duration_s`` runs from that start (handshake wait included) to completion.
    ``num_descs`` counts prepared descriptors (one per block and layer slice),
    ``num_runs`` the contiguous runs they merged into (:func:`pair_indices`):
    far fewer runs than descriptors means the blocks were laid out contiguously.
    """

    request_id: str
    ok: bool
    nbytes: int
    num_descs: int
    duration_s: float
    started_at: float = 0.0
    num_runs: int = 0  # contiguous runs NIXL posted after merging descriptors


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a hook under the worker's state lock (the idle pump shares the state)."""

    @functools.wraps(method)
    def wrapper(self: NixlWorker, *args: Any, **kwargs: Any) -> Any:
        with self._state_lock:
            self._last_progress = time.monotonic()
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


class NixlWorker(WorkerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        assert ctx.rank is not None
        self.settings: NixlSettings = ctx.extra if isinstance(ctx.extra, NixlSettings) \
            else NixlSettings()
        self.rank: ParallelTopology = ctx.rank
        self.sizes = ctx.topology.sizes()
        self.rank_index = rank_index(ctx.rank)
        self.header = CompatHeader.from_spec(ctx.spec, WireMode(self.settings.mode.value))
        self.transport: NixlTransport | None = None
        self.memory: dict[int, LayerMemory] = {}
        self._agent_doc = b""
        self._executor: ThreadPoolExecutor | None = None
        self.auth = self.settings.cluster_auth()
        self._client = HandshakeClient(timeout_s=self.settings.handshake_timeout_s,
                                       retries=self.settings.handshake_retries,
                                       expected=self.header, auth=self.auth)
        self._sessions: dict[SessionKey, PeerSession] = {}
        self._connecting: dict[SessionKey, _Connecting] = {}
        self._abandoned: list[Future[PeerSession]] = []  # handshakes past their deadline
        self._revalidating: dict[SessionKey, Future[Any]] = {}
        self._local_cache: dict[ParallelTopology, LocalLists] = {}
        self._recv: dict[str, RecvTransfer] = {}
        self._by_producer_rid: dict[tuple[str, str], str] = {}
        self._releases: list[ReleaseOrder] = []
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_reported: set[str] = set()
        self._load_errors: set[BlockRef] = set()
        self._leases = LeaseTable(self.settings.lease_s, self.settings.early_grace_s)
        self._consumers: dict[str, _ConsumerPeer] = {}
        #: answers to agents that are not (or no more) peers: (queued at, answer)
        self._pending_acks: dict[str, list[tuple[float, messages.Notif]]] = {}
        self._push_jobs: dict[str, _PushJob] = {}
        #: records the push fence of a saved layer (issue 15); a test may stand in for it
        self.record_fence: Callable[[Any], Fence] = record_fence
        self._early_registers: dict[str, list[tuple[str, messages.Register]]] = {}
        self._step_pushes: tuple[PushOrder, ...] = ()
        self._last_heartbeat = time.monotonic()
        self._records: list[TransferRecord] = []
        self._counters: dict[str, int | float] = {
            "transfers": 0, "transfer_bytes": 0, "transfer_descs": 0, "transfer_runs": 0,
            "transfer_time_s": 0.0,
            "loads_done": 0, "loads_done_on_promise": 0, "promises_contradicted": 0,
            "loads_failed": 0, "handshakes": 0, "handshake_failures": 0,
            "transfer_failures": 0, "lease_expiries": 0, "late_notifs": 0,
            "unknown_notifs": 0, "bad_notifs": 0, "heartbeats_sent": 0, "releases_sent": 0,
            "pushes_done": 0, "pushes_failed": 0, "sessions_dropped": 0, "finished_sending": 0,
            "peer_restarts": 0, "requests_refused": 0, "handshakes_abandoned": 0,
            "notifs_rejected": 0,
            # verified KV (issue 18): blocks checked against the producer's digests, found
            # different (each a failed load of that block), and loaded without a check
            "blocks_verified": 0, "digest_mismatches": 0, "blocks_unverified": 0,
            "loads_corrupt": 0, "digests_served": 0,
            # time and bytes this rank spent taking (producer) and checking (consumer) them
            "digest_time_s": 0.0, "digest_bytes": 0,
        }
        #: producer: notifications of agents that have not said hello, (received at, msg)
        self._deferred: dict[str, list[tuple[float, messages.Notif]]] = {}
        self._rejected_senders: dict[str, None] = {}  # insertion-ordered, bounded
        self._expected_by_sizes: dict[ParallelTopology, int] = {}
        self._closed = False
        self._state_lock = threading.RLock()
        self._last_progress = time.monotonic()
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = None
        self._fault_next_loads = False
        self._faulty: set[str] = set()
        self._cancelled: dict[str, float] = {}  # producer: push rids cancelled before known
        self._kv_tensors: list[Any] = []
        self._reads_ended = False
        #: consumer: loads finished on the producers' ``held`` promises before their acks
        #: came, (producer engine id, producer request id) -> (request id, forget at)
        self._done_on_promise: dict[tuple[str, str], tuple[str, float]] = {}
        #: the digesters of the algorithms this rank offers, in its preference order
        #: (host memory: XXH3-64 and torch-mix64-v1; GPU memory: torch-mix64-v1 only)
        self._digesters: dict[str, Digester] = {}
        #: the first of them, whose digests a producer takes as every hold starts (None:
        #: verification off)
        self._digester: Digester | None = None
        #: producer: other algorithms consumers asked for, taken as holds start too
        self._hold_algs: set[str] = set()
        #: producer: (request id, algorithm) -> digests per region in a non-first algorithm
        self._alg_digests: dict[tuple[str, str], tuple[dict[int, int], ...]] = {}
        #: producer: block id -> digest per region of each request held (taken when the
        #: hold starts), to answer the digest asks of consumers
        self._hold_digests: dict[str, tuple[dict[int, int], ...]] = {}
        self._unverified_logged: set[str] = set()  # reasons logged once
        #: producer: digest-asking ``begin``s that came before the hold started (the
        #: router can be faster than the next step), answered when it starts or after
        #: ``early_grace_s``; bounded like early registrations
        self._early_begins: dict[str, list[tuple[float, str, messages.Begin]]] = {}
        self._early_begin_ids = 0  # block ids those begins ask for, bounded
        #: producer: per consumer rank topology, what it reads from this rank (slices)
        self._slice_plans: dict[ParallelTopology, SlicePlan | None] = {}
        #: producer: per request held, per consumer rank topology known at hold start,
        #: block id -> slice digest per region (head slices at another TP)
        self._hold_slices: dict[str, dict[ParallelTopology, tuple[dict[int, int], ...]]] = {}
        # blocks x consumer-rank plans slice-digested as a hold started, or later (the
        # consumer rank was not known yet: its ``begin`` came first)
        self._counters.update({"slice_digests_at_hold": 0, "slice_digests_at_begin": 0})

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, caches: KVCaches) -> None:
        name = f"kvb-{self.ctx.engine_id[:32]}-r{self.rank_index}-{uuid.uuid4().hex[:8]}"
        transport = NixlTransport(name)
        self.transport = transport
        tensors = []
        layer_addrs: dict[int, int] = {}
        num_blocks = set()
        strides: list[int] = []
        for index, shape in enumerate(caches.shapes):
            stride = shape.block_bytes_per_layer
            for layer in shape.layer_ids:
                tensor = caches.layers[layer]
                tensors.append(tensor)
                stride = caches.block_stride(layer)
                layer_addrs[layer] = int(tensor.data_ptr())
                self.memory[layer] = LayerMemory(int(tensor.data_ptr()), stride,
                                                 caches.num_blocks[index])
                num_blocks.add(caches.num_blocks[index])
            strides.append(stride)
        # One registration per backing storage: views that alias (vLLM's hybrid groups)
        # or share one allocation are registered once, not once per view.
        transport.register_regions(caches.backing_spans())
        self._kv_tensors = tensors  # kept alive past shutdown while a hold is promised
        if self.settings.idle_progress_ms > 0:
            self._pump = threading.Thread(target=self._pump_loop, daemon=True,
                                          name=f"kvb-nixl-pump-r{self.rank_index}")
            self._pump.start()
        mem_type, device_id = transport.memory_type  # announced: peers prep our lists with it
        if self.settings.verify_policy.enabled:
            self._digesters = self._make_digesters(caches, tensors, mem_type == "DRAM")
            self._digester = next(iter(self._digesters.values()), None)
        meta = AgentMetadata.build(self.ctx.engine_id, name, transport.agent_metadata(),
                                   self.ctx.spec, self.rank, layer_addrs,
                                   max(num_blocks) if num_blocks else 0, strides,
                                   mem_type=mem_type, device_id=device_id,
                                   digests=self._offered_digests())
        self._agent_doc = encode_agent(meta)

    def _make_digesters(self, caches: KVCaches, tensors: list[Any], host_memory: bool
                        ) -> dict[str, Digester]:
        """The digesters of every algorithm this rank offers (``verify_algorithms``, less
        XXH3-64 when the KV is not in host memory), in preference order."""
        regions = [s.layer_ids for s in caches.shapes]
        block_bytes = {layer: caches.shapes[caches.region_index_of_layer(layer)]
                       .block_bytes_per_layer for layer in self.memory}
        out: dict[str, Digester] = {}
        for alg in digest_algorithms(host_memory, self.settings.verify_algorithms):
            if alg == ALGORITHM:
                out[alg] = BlockDigester(
                    {layer: LayerSpan(mem.base_addr, mem.block_stride, block_bytes[layer],
                                      mem.num_blocks) for layer, mem in self.memory.items()},
                    regions, owner=tensors)
            else:  # torch-mix64-v1: on the tensors' own device (GPU memory included)
                out[alg] = TorchBlockDigester(
                    {layer: TensorSpan(caches.layers[layer], mem.block_stride,
                                       block_bytes[layer], mem.num_blocks)
                     for layer, mem in self.memory.items()}, regions)
        if self.settings.verify_algorithms and not out:
            logger.warning("nixl: engine=%s rank=%d: none of verify_algorithms %s can digest "
                           "this rank's KV (XXH3-64 needs host memory); it offers no digests",
                           self.ctx.engine_id, self.rank_index,
                           list(self.settings.verify_algorithms))
        return out

    @property
    def _xxh3(self) -> BlockDigester | None:
        """This rank's XXH3-64 digester (host memory), which also takes slice digests."""
        digester = self._digesters.get(ALGORITHM)
        return digester if isinstance(digester, BlockDigester) else None

    def _offered_digests(self) -> tuple[str, ...]:
        """The algorithms this rank's handshake offers: its digesters' (preference order),
        with ``xxh3-64-slices`` right after ``xxh3-64`` (the same host digester)."""
        out: list[str] = []
        for alg in self._digesters:
            if alg in OFFERED_DIGESTS:
                out.append(alg)
            if alg == ALGORITHM and SLICE_ALGORITHM in OFFERED_DIGESTS:
                out.append(SLICE_ALGORITHM)
        return tuple(out)

    def get_handshake_metadata(self) -> bytes | None:
        return self._agent_doc

    # ------------------------------------------------------------------ hooks

    @_locked
    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, NixlMetadata)
        now = time.monotonic()
        for hold in meta.holds:
            if hold.push:
                self._push_jobs.setdefault(hold.request_id, _PushJob(hold.request_id,
                                                                     hold.block_ids,
                                                                     started_at=now))
            if not hold.push:
                self._take_hold_digests(hold.request_id, hold.block_ids)
            for verdict in self._leases.hold(hold.request_id, now):
                self._answer(verdict)
            for _at, sender, begin in self._early_begins.pop(hold.request_id, []):
                self._early_begin_ids -= sum(len(g) for g in begin.digest_ids)
                self._on_consumer_notif(sender, begin, now)
        for order in meta.loads:
            self._start_load(order, now)
            if self._fault_next_loads:
                self._faulty.add(order.request_id)
        self._fault_next_loads = False
        for release in meta.releases:
            self._releases.append(release)
            self._ensure_session(release.params, now)
        for params in meta.heartbeats:
            self._heartbeat_params(params)
        for rid in meta.cancels:
            self._cancel_load(rid, now)
        for rid in meta.drops:
            self._early_registers.pop(rid, None)
            job = self._push_jobs.get(rid)
            if job is not None:
                job.dropped = True
                for target in job.targets.values():
                    if not target.finished and not self._writes_pending(target):
                        self._finish_push_target(job, target, False, "producer request aborted",
                                                 now)
                self._maybe_drop_job(job)
        self._step_pushes = meta.pushes
        for push in meta.pushes:
            job = self._push_jobs.setdefault(push.request_id,
                                             _PushJob(push.request_id, started_at=now))
            if self._cancelled.pop(push.request_id, None) is not None:
                job.dropped = True
            job.block_ids = tuple(tuple(g) for g in push.block_ids)
            job.final = job.final or push.final
            for sender, reg in self._early_registers.pop(push.request_id, []):
                self._on_register(sender, reg, now)
        self._progress()

    def wait_for_layer_load(self, layer_id: int) -> None:
        """Loads are asynchronous (requests wait in WAITING_FOR_REMOTE_KVS): nothing to wait for."""

    @_locked
    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None:
        if not self._step_pushes:
            return
        fence: Fence | None = None
        for push in self._step_pushes:
            job = self._push_jobs.get(push.request_id)
            if job is not None and push.final:
                if fence is None:  # one fence for the layer, whatever the number of requests
                    fence = self.record_fence(kv_layer)
                job.fenced.append((fence, frozenset((layer_id,))))
                if self._release_fenced(job):
                    self._post_push_writes(job)

    @_locked
    def wait_for_save(self) -> None:
        """Writes stay in flight across steps; the blocks are held by ``delay_free``.

        A fence over the whole step covers every layer of the step's final pushes
        (for engines that do not call ``save_kv_layer`` per layer)."""
        fence: Fence | None = None
        for push in self._step_pushes:
            job = self._push_jobs.get(push.request_id)
            if job is not None and push.final and self.memory:
                if fence is None:
                    fence = self.record_fence(self._kv_tensors[0] if self._kv_tensors
                                              else None)
                job.fenced.append((fence, frozenset(self.memory)))
                if self._release_fenced(job):
                    self._post_push_writes(job)
        self._step_pushes = ()

    def _release_fenced(self, job: _PushJob) -> bool:
        """Move the layers of passed fences into ``layers_ready``; True if any moved.

        A WRITE of a layer is posted only from ``layers_ready``: never before the
        kernels that wrote the layer finished (on host memory fences pass at once)."""
        if not job.fenced:
            return False
        waiting = []
        moved = False
        for fence, layers in job.fenced:
            if fence.done():
                job.layers_ready |= layers
                moved = True
            else:
                waiting.append((fence, layers))
        job.fenced = waiting
        return moved

    @_locked
    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        self._progress()
        done_sending: set[str] = set()
        completed, expired = self._leases.take_finished()
        for rid in completed + expired:
            done_sending.add(rid)
            self._drop_push_job(rid)
            self._hold_digests.pop(rid, None)
            self._hold_slices.pop(rid, None)
            for alg in self._hold_algs:
                self._alg_digests.pop((rid, alg), None)
        self._counters["finished_sending"] += len(done_sending)
        done_recving, self._done_recving = self._done_recving, set()
        # failures reported with *these* finished ids only: the pump may fail more
        # loads before get_failed_recving runs, and those belong to the next report
        # (reporting them now would finish them twice)
        self._failed_reported = self._failed_recving & done_recving
        self._failed_recving -= self._failed_reported
        return done_sending, done_recving

    @_locked
    def get_failed_recving(self) -> set[str]:
        """The failed ones among the loads the last :meth:`get_finished` reported."""
        failed, self._failed_reported = self._failed_reported, set()
        return failed

    @_locked
    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @_locked
    def get_stats(self) -> dict[str, int | float]:
        """This rank's cumulative counters (the engine keeps the latest snapshot)."""
        stats = dict(self._counters)
        stats.update(self._lease_counters())
        return stats

    def _lease_counters(self) -> dict[str, int]:
        lease = self._leases.stats
        return {"lease_expiries": lease.expiries, "late_notifs": lease.late_notifs,
                "unknown_notifs": lease.unknown_notifs, "holds_promised": lease.guarantees,
                "holds_promise_refused": lease.guarantees_refused}

    @_locked
    def totals(self) -> dict[str, int | float]:
        """Cumulative counters of this rank (not reset by :meth:`get_stats`)."""
        stats = dict(self._counters)
        stats.update(self._lease_counters())
        stats["held"] = len(self._leases.held())
        stats["in_flight"] = len(self._recv)
        stats["sessions"] = len(self._sessions)
        if self.transport is not None:
            c = self.transport.counters()
            stats.update({"nixl_registrations": c.registrations, "nixl_dlists": c.dlists,
                          "nixl_xfer_handles": c.xfer_handles, "nixl_peers": c.peers,
                          "nixl_zombies": c.zombies, "nixl_forced_releases": c.forced_releases})
        return stats

    @_locked
    def records(self) -> list[TransferRecord]:
        """Finished loads/pushes of this rank (latency samples), oldest first."""
        return list(self._records)

    # ------------------------------------------------------------------ consumer: loads

    def _session_key(self, params: TransferParams) -> SessionKey:
        return (params.producer_engine_id, params.producer_host, params.producer_port)

    def _start_load(self, order: LoadOrder, now: float) -> None:
        recv = RecvTransfer(order.request_id, order.params, order.consumer_block_ids,
                            order.producer_block_ids, order.start,
                            deadline=now + self.settings.transfer_timeout_s, started_at=now)
        self._recv[order.request_id] = recv
        self._by_producer_rid[(order.params.producer_engine_id,
                               order.params.producer_request_id)] = order.request_id
        if order.error:
            self._fail(recv, f"refused: {order.error}", now)
            return
        self._ensure_session(order.params, now)

    def _ensure_session(self, params: TransferParams, now: float) -> None:
        key = self._session_key(params)
        session = self._sessions.get(key)
        if session is not None:
            if (now - session.validated_at > self.settings.revalidate_s
                    and key not in self._revalidating and session.active == 0):
                self._revalidating[key] = self._pool().submit(
                    self._client.fetch, session.address, expected=self.header)
            return
        if key in self._connecting:
            return
        assert self.transport is not None
        future = self._pool().submit(
            open_session, key, self.transport, self._client, self.header, self.ctx.spec,
            self.sizes, self.rank, self.memory, self._hello_doc(), self._local_cache)
        self._connecting[key] = _Connecting(future, now)
        self._counters["handshakes"] += 1

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=HANDSHAKE_THREADS,
                thread_name_prefix=f"kvb-nixl-hs-r{self.rank_index}")
        return self._executor

    @property
    def handshake_deadline_s(self) -> float:
        """Longest one handshake may take before its requests fail and it is abandoned:
        every attempt's timeout, the backoff between them, and NIXL's local steps."""
        s = self.settings
        return (s.handshake_timeout_s * (s.handshake_retries + 1)
                + self._client.max_backoff_s * s.handshake_retries + HANDSHAKE_SLACK_S)

    def _settle_sessions(self, now: float) -> None:
        for future in list(self._abandoned):
            if future.done():  # finished after its deadline: nobody wants it any more
                self._abandoned.remove(future)
                if not future.cancelled() and future.exception() is None:
                    assert self.transport is not None
                    future.result().close(self.transport)
        for key, pending in list(self._connecting.items()):
            if not pending.future.done():
                if now - pending.started_at > self.handshake_deadline_s:
                    # a peer that keeps one handshake busy fails its own requests only;
                    # the next request to it starts a fresh handshake
                    del self._connecting[key]
                    self._abandoned.append(pending.future)
                    self._counters["handshake_failures"] += 1
                    self._counters["handshakes_abandoned"] += 1
                    self._fail_key(key, f"handshake with {key[1]}:{key[2]} took longer than "
                                        f"{self.handshake_deadline_s:.1f} s", now)
                    self._releases = [r for r in self._releases
                                      if self._session_key(r.params) != key]
                continue
            del self._connecting[key]
            try:
                session = pending.future.result()
            except Exception as exc:
                self._counters["handshake_failures"] += 1
                self._fail_key(key, f"handshake with {key[1]}:{key[2]} failed: {exc}", now)
                self._releases = [r for r in self._releases
                                  if self._session_key(r.params) != key]
                continue
            self._sessions[key] = session
        for key, future in list(self._revalidating.items()):
            if not future.done():
                continue
            del self._revalidating[key]
            current = self._sessions.get(key)
            if current is None:
                continue
            try:
                fresh = future.result().metadata
            except Exception as exc:
                logger.warning("nixl: revalidating %s:%s failed (%s); dropping the session",
                               key[1], key[2], exc)
                self._drop_session(key, now, reason=f"revalidation failed: {exc}")
                continue
            if (fresh.incarnation != current.metadata.incarnation
                    or fresh.generation != current.metadata.generation):
                self._counters["peer_restarts"] += 1
                logger.warning("nixl: peer %s at %s:%s changed (incarnation %s gen %d -> %s gen "
                               "%d); re-handshaking", key[0], key[1], key[2],
                               current.metadata.incarnation, current.metadata.generation,
                               fresh.incarnation, fresh.generation)
                self._drop_session(key, now, reason="peer restarted")
            else:
                current.validated_at = now

    def _session_ready(self, key: SessionKey) -> PeerSession | None:
        # A revalidation runs in the background and never delays a post: a READ to a
        # restarted peer fails fast (disconnect) and only that request fails.
        return self._sessions.get(key)

    def _post(self, recv: RecvTransfer, session: PeerSession, now: float) -> None:
        assert self.transport is not None
        params = recv.params
        rid = params.producer_request_id
        transfers: list[object] = []
        if recv.request_id in self._faulty:
            self._faulty.discard(recv.request_id)
            for peer in list(session.peers.values()):
                self.transport.remove_peer(peer)  # the real NIXL call: the peer vanishes
        indices: dict[int, tuple[Any, Any, int]] = {}
        if params.mode is TransferMode.PULL:
            # This request's own data (its block ids) is checked before any I/O: a bad
            # id fails this request alone; the session and every other load on it stay.
            try:
                for p in session.targets:
                    if p in session.rank_plan.sources:
                        assert session.local is not None
                        indices[p] = pull_indices(session.rank_plan, session.local.table,
                                                  session.remote_tables[p], p,
                                                  recv.consumer_block_ids,
                                                  recv.producer_block_ids)
            except LayoutError as exc:
                self._counters["requests_refused"] += 1
                self._fail(recv, f"refused: {exc}", now)
                return
        try:
            if params.mode is TransferMode.PULL:
                local = session.local
                for p in session.targets:
                    peer = session.peers[p]
                    if p not in session.rank_plan.sources:
                        self.transport.send_notif(peer, messages.encode(messages.ReadDone(
                            rid, self.rank_index, session.expected[p], read=False)))
                        continue
                    assert local is not None
                    lidx, ridx, runs = indices[p]
                    notif = messages.encode(messages.ReadDone(rid, self.rank_index,
                                                              session.expected[p]))
                    if lidx.size == 0:
                        self.transport.send_notif(peer, notif)
                        continue
                    # ``begin`` first: its ``held`` answer (while the READ runs) lets the
                    # load finish when the READ is done, not one ack round trip later;
                    # the time is taken before sending, so the promise is conservative
                    begin = self._begin_for(recv, session, p)
                    recv.begun_at[p] = time.monotonic()
                    self.transport.send_notif(peer, messages.encode(begin))
                    xfer = self.transport.post(XferOp.READ, local.dlist, lidx,
                                               session.remote_lists[p], ridx, b"",
                                               deadline_s=max(0.001, recv.deadline - now))
                    transfers.append(xfer)
                    # The ReadDone goes as a standalone notification once the READ is
                    # DONE here (its bytes are then in our memory), not attached to the
                    # READ: NIXL delivers an attached one only after a flush that waits
                    # on the peer's progress (measured +0.3-0.5 ms per READ on one host).
                    recv.read_notifs[xfer.transfer_id] = (p, peer, notif)
                    recv.nbytes += xfer.nbytes
                    recv.num_descs += xfer.num_descs
                    recv.num_runs += runs
            else:
                for p in session.targets:
                    ask = self._ask_for(recv, session, p) \
                        if p in session.rank_plan.sources else None
                    reg = messages.Register(rid, self.rank_index, session.expected[p],
                                            recv.start, recv.consumer_block_ids,
                                            algorithm=ask.algorithm if ask else "")
                    self.transport.send_notif(session.peers[p], messages.encode(reg))
        except Exception as exc:
            self._fail(recv, f"posting failed: {exc}", now)
            self._drop_session(session.key, now, reason=str(exc))
            return
        self._count_unchecked(recv)
        session.active += 1
        recv.counted_active = True
        expected = frozenset(session.rank_plan.sources)
        recv.posted(expected, transfers, params.mode is TransferMode.PULL)
        if recv.read_notifs:
            self._poll_reads(recv, now)  # a READ over shared memory is often DONE at once

    @_locked
    def inject_fault_next_loads(self) -> None:
        """Fault injection (tests, conformance): the loads ordered in the next step lose
        their NIXL peers just before posting (the real ``remove_remote_agent``), so they
        fail the way a vanished peer makes them fail."""
        self._fault_next_loads = True

    def _cancel_load(self, request_id: str, now: float) -> None:
        """The engine finished a request while it was loading (abort). Pull: its READ
        settles as usual (the blocks stay pinned until then). Push: ask the producer to
        stop; its answer (after in-flight writes settle) finishes the request."""
        recv = self._recv.get(request_id)
        if recv is None or recv.params.mode is not TransferMode.PUSH:
            return
        session = self._sessions.get(self._session_key(recv.params))
        if session is None or recv.state is RecvState.BOOTSTRAPPING:
            self._fail(recv, "cancelled before registration", now)
            return
        assert self.transport is not None
        for p in session.targets:
            # the count of notifying ranks the producer rank computes too (else refused)
            msg = messages.encode(messages.Register(
                recv.params.producer_request_id, self.rank_index, session.expected[p],
                recv.start, recv.consumer_block_ids, cancel=True))
            try:
                self.transport.send_notif(session.peers[p], msg)
            except NixlTransportError as exc:
                self._fail(recv, f"cancel: {exc}", now)
                return

    def _progress_recv(self, now: float) -> None:
        assert self.transport is not None
        for recv in list(self._recv.values()):
            if recv.state is RecvState.BOOTSTRAPPING:
                key = self._session_key(recv.params)
                session = self._session_ready(key)
                if session is not None:
                    self._post(recv, session, now)
                elif key not in self._connecting:
                    self._ensure_session(recv.params, now)
            if recv.state is RecvState.TRANSFERRING:
                self._poll_reads(recv, now)
            before = recv.state
            state = recv.poll(now)
            if state is RecvState.FAILED:
                refused = recv.error is not None and recv.error.startswith("producer rank")
                self._fail(recv, recv.error or "failed", now, tell_producer=not refused)
                if not refused and before in (RecvState.TRANSFERRING, RecvState.WAITING):
                    # the peer stopped answering: drop it, re-handshake on next use
                    self._drop_session(self._session_key(recv.params), now,
                                       reason=f"request {recv.request_id} timed out")
            elif state is RecvState.DONE:
                bad = self._verify(recv)
                if recv.digest_asks:  # the load ends when its blocks are checked
                    recv.finished_at = time.monotonic()
                if bad:
                    shown = ", ".join(f"region {r} block {b}" for r, b in sorted(bad)[:8])
                    recv.corrupt(f"digest mismatch in {len(bad)} of {recv.num_blocks} blocks "
                                 f"({shown}{', ...' if len(bad) > 8 else ''}; the digest "
                                 f"covers every layer of a block)")
                    self._counters["loads_corrupt"] += 1
                    self._fail(recv, recv.error or "digest mismatch", now,
                               tell_producer=False, blocks=frozenset(bad))
                else:
                    self._complete(recv)

    def _poll_reads(self, recv: RecvTransfer, now: float) -> None:
        """Advance a pull load's READs: tell each producer rank its READ is done (the
        ReadDone it acks) as soon as it is; fail the load on a failed or late READ."""
        assert self.transport is not None
        states = [self.transport.poll(x) for x in recv.transfers if isinstance(x, Transfer)]
        bad = [x for x in recv.transfers if isinstance(x, Transfer)
               and x.state in (XferState.FAILED, XferState.TIMED_OUT)]
        if bad:
            first = bad[0]
            self._counters["transfer_failures"] += 1
            self._fail(recv, f"READ {first.state.value}: {first.error}", now)
            self._drop_session(self._session_key(recv.params), now,
                               reason=f"transfer {first.state.value}")
            return
        for x in recv.transfers:
            if isinstance(x, Transfer) and x.state is XferState.DONE:
                pending = recv.read_notifs.pop(x.transfer_id, None)
                if pending is None:
                    continue
                source, peer, notif = pending
                assert isinstance(peer, PeerHandle)
                recv.read_done(source, time.monotonic())  # seen done: at or after the fact
                try:
                    self.transport.send_notif(peer, notif)
                except NixlTransportError as exc:
                    self._fail(recv, f"read-done notification: {exc}", now)
                    self._drop_session(self._session_key(recv.params), now, reason=str(exc))
                    return
        if all(s is XferState.DONE for s in states):
            recv.transfers_done()
            self._reads_ended = True

    def _complete(self, recv: RecvTransfer) -> None:
        self._recv.pop(recv.request_id, None)
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self._counters["loads_done"] += 1
        if recv.done_on_promise:
            # the acks still come; one saying "late" would contradict a promise
            self._counters["loads_done_on_promise"] += 1
            key = (recv.params.producer_engine_id, recv.params.producer_request_id)
            self._done_on_promise[key] = (recv.request_id,
                                          time.monotonic() + 2 * self.settings.lease_s)
            while len(self._done_on_promise) > MAX_SAMPLES:  # oldest first
                del self._done_on_promise[next(iter(self._done_on_promise))]
        self._count_transfer(recv.nbytes, recv.num_descs, recv.duration_s or 0.0, recv.num_runs)
        self._record(TransferRecord(recv.request_id, True, recv.nbytes, recv.num_descs,
                                    recv.duration_s or 0.0, recv.started_at, recv.num_runs))
        self._uncount(recv)

    def _fail(self, recv: RecvTransfer, reason: str, now: float, *,
              tell_producer: bool = True,
              blocks: frozenset[tuple[int, int]] | None = None) -> None:
        """Finish ``recv`` as failed: exact local blocks as load errors, one log line.

        ``tell_producer``: queue a release for the producer (it holds the blocks
        under a lease; without a word it would wait for the lease to run out).
        False when the failure *is* the producer's answer (or the READs are done
        and the producer was told). ``blocks``: the local blocks that failed
        (default: every block of the load), e.g. those whose digests differ."""
        recv.fail(reason, now)
        if recv.request_id not in self._recv:
            return
        if tell_producer:
            self._releases.append(ReleaseOrder(recv.request_id, recv.params))
        del self._recv[recv.request_id]
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self._failed_recving.add(recv.request_id)
        self._load_errors |= recv.local_blocks if blocks is None else blocks
        self._counters["loads_failed"] += 1
        self._record(TransferRecord(recv.request_id, False, recv.nbytes, recv.num_descs,
                                    now - recv.started_at, recv.started_at, recv.num_runs))
        params = recv.params
        logger.warning(
            "nixl load failed: engine=%s rank=%d request=%s producer_engine=%s "
            "producer_request=%s mode=%s blocks=%d state=%s reason=%s",
            self.ctx.engine_id, self.rank_index, recv.request_id, params.producer_engine_id,
            params.producer_request_id, params.mode.value, recv.num_blocks,
            recv.state.value, reason)
        self._uncount(recv)

    def _uncount(self, recv: RecvTransfer) -> None:
        """A posted load no longer uses its session (one that was never posted did not
        count: refused before posting, or failed while bootstrapping)."""
        if not recv.counted_active:
            return
        recv.counted_active = False
        session = self._sessions.get(self._session_key(recv.params))
        if session is not None and session.active > 0:
            session.active -= 1

    def _unindex(self, recv: RecvTransfer) -> None:
        self._by_producer_rid.pop((recv.params.producer_engine_id,
                                   recv.params.producer_request_id), None)

    def _fail_key(self, key: SessionKey, reason: str, now: float) -> None:
        for recv in list(self._recv.values()):
            if self._session_key(recv.params) == key:
                self._fail(recv, reason, now)

    def _drop_session(self, key: SessionKey, now: float, reason: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self._counters["sessions_dropped"] += 1
        assert self.transport is not None
        session.close(self.transport)
        self._client.invalidate(session.address)
        self._fail_key(key, f"session to {key[1]}:{key[2]} dropped: {reason}", now)

    def _send_releases(self, now: float) -> None:
        keep = []
        for release in self._releases:
            key = self._session_key(release.params)
            session = self._session_ready(key)
            if session is None:
                if key not in self._connecting:
                    self._ensure_session(release.params, now)
                keep.append(release)
                continue
            rid = release.params.producer_request_id
            assert self.transport is not None
            for p in session.targets:
                if release.params.mode is TransferMode.PULL:
                    msg: messages.Notif = messages.ReadDone(rid, self.rank_index,
                                                            session.expected[p], read=False)
                else:
                    msg = messages.Register(rid, self.rank_index, session.expected[p],
                                            tuple(0 for _ in self.ctx.spec.regions),
                                            tuple(() for _ in self.ctx.spec.regions),
                                            cancel=True)
                try:
                    self.transport.send_notif(session.peers[p], messages.encode(msg))
                    self._counters["releases_sent"] += 1
                except NixlTransportError as exc:
                    logger.warning("nixl: release of %s to producer rank %d failed: %s "
                                   "(its lease will expire)", rid, p, exc)
        self._releases = keep

    def _heartbeat_params(self, params: TransferParams) -> None:
        session = self._sessions.get(self._session_key(params))
        if session is None:
            self._ensure_session(params, time.monotonic())
            return
        self._send_heartbeat(session, [params.producer_request_id])

    def _send_heartbeat(self, session: PeerSession, rids: Sequence[str]) -> None:
        assert self.transport is not None
        msg = messages.encode(messages.Heartbeat(tuple(rids)))
        for p in session.targets:
            try:
                self.transport.send_notif(session.peers[p], msg)
                self._counters["heartbeats_sent"] += 1
            except NixlTransportError as exc:
                logger.info("nixl: heartbeat to producer rank %d failed: %s", p, exc)

    def _heartbeats(self, now: float) -> None:
        if now - self._last_heartbeat < self.settings.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        by_key: dict[SessionKey, list[str]] = {}
        for recv in self._recv.values():
            by_key.setdefault(self._session_key(recv.params), []).append(
                recv.params.producer_request_id)
        for key, rids in by_key.items():
            session = self._sessions.get(key)
            if session is not None:
                self._send_heartbeat(session, rids)

    # ------------------------------------------------------------------ notifications

    def _pump_loop(self) -> None:
        """Progress while the engine is idle (no hook call for ``idle_progress_ms``).

        An idle engine does not step, yet a peer may be reading from this rank
        (the passive side must progress its UCX worker) or waiting for an ack.
        The pump runs the same :meth:`_progress` as the hooks, under the same
        lock, so the worker's state is only ever touched by one thread at a time.

        While a peer may be waiting on this rank (blocks held under a lease, loads,
        pushes, releases or handshakes in flight) it polls every
        ``busy_progress_ms`` (0.2 ms) at most: a consumer's ``begin`` is then
        answered (and its ``read`` acked) within a fraction of a millisecond
        instead of a full idle interval: one of them is on every pull load's
        critical path."""
        idle = self.settings.idle_progress_ms / 1000.0
        busy = min(idle, self.settings.busy_progress_ms / 1000.0)
        interval = idle
        while not self._pump_stop.wait(interval):
            interval = busy if self._peer_may_wait() else idle
            if time.monotonic() - self._last_progress < interval:
                continue
            with self._state_lock:
                if self._closed:
                    return
                try:
                    self._progress()
                except Exception:  # never kill the pump; the next hook reports properly
                    logger.exception("nixl: idle progress failed on rank %d", self.rank_index)

    def _peer_may_wait(self) -> bool:
        """Outstanding work a peer may be waiting on (read without the lock: a
        hint for the pump's interval only, never for the worker's state)."""
        return bool(self._recv or self._push_jobs or self._releases or self._connecting
                    or self._leases.held())

    def _drain_notifs(self, now: float) -> None:
        assert self.transport is not None
        self._handle_batch(self.transport.get_notifs(), now)

    def _handle_batch(self, batch: dict[str, list[bytes]], now: float) -> None:
        for sender, msgs in batch.items():
            for raw in msgs:
                try:
                    msg = messages.decode(raw)
                except messages.NotifError as exc:
                    self._counters["bad_notifs"] += 1
                    logger.warning("nixl: bad notification from %s: %s", sender, exc)
                    continue
                try:
                    self._on_notif(sender, msg, now)
                except Exception as exc:  # one peer's bad message must not stop the rank
                    self._counters["bad_notifs"] += 1
                    logger.warning("nixl: notification %s from %s refused: %s",
                                   type(msg).__name__, sender, exc)

    def _on_notif(self, sender: str, msg: messages.Notif, now: float) -> None:
        if isinstance(msg, messages.Hello):
            self._on_hello(sender, msg, now)
        elif isinstance(msg, messages.Ack | messages.Pushed):
            self._on_answer(sender, msg, now)  # bound to the session's producer agent
        elif isinstance(msg, messages.Held):
            self._on_held(sender, msg)
        else:
            self._on_consumer_notif(sender, msg, now)

    def _on_consumer_notif(self, sender: str, msg: messages.Notif, now: float) -> None:
        """What consumer ranks send a producer rank, acted on only from a session.

        The sender must be an agent that said hello (an unknown one's messages
        wait for its hello, bounded, see ``MAX_DEFERRED_PER_AGENT``), and a
        message naming a consumer rank must name the rank that agent's hello
        described, with the count of notifying ranks this producer rank
        computes for that consumer's topology itself. Anything else is
        rejected: counted, logged once per sender, never acted on.
        """
        consumer = self._consumers.get(sender)
        if consumer is None:
            self._defer(sender, msg, now)
            return
        if isinstance(msg, messages.ReadDone | messages.Register | messages.Begin):
            mine = consumer.meta.rank_index
            if msg.consumer_rank != mine:
                self._reject(sender, f"{type(msg).__name__} names consumer rank "
                                     f"{msg.consumer_rank}, its hello said {mine}")
                return
        if isinstance(msg, messages.ReadDone | messages.Register):
            expected = self._expected_from(consumer)
            if msg.expected != expected:
                self._reject(sender, f"{type(msg).__name__} expects {msg.expected} notifying "
                                     f"consumer ranks; its topology gives {expected}")
                return
        if isinstance(msg, messages.ReadDone):
            verdict = self._leases.notify(msg.request_id, msg.consumer_rank, msg.expected,
                                          sender, now)
            if verdict is not None and msg.read:
                self._answer(verdict)
        elif isinstance(msg, messages.Heartbeat):
            for rid in msg.request_ids:
                self._leases.renew(rid, now)
        elif isinstance(msg, messages.Register):
            self._on_register(sender, msg, now)
        elif isinstance(msg, messages.Begin):
            asked = sum(len(g) for g in msg.digest_ids)
            if (msg.digest_ids and self._digester is not None
                    and not self._leases.is_held(msg.request_id)
                    and self._leases.ended(msg.request_id) is None
                    and sum(len(v) for v in self._early_begins.values()) < MAX_EARLY_REGISTERS
                    and self._early_begin_ids + asked <= MAX_EARLY_BEGIN_IDS):
                # not held yet: answer with the digests once the hold starts
                self._early_begins.setdefault(msg.request_id, []).append((now, sender, msg))
                self._early_begin_ids += asked
                return
            lease_s, reason = self._leases.guarantee(msg.request_id, now)
            digests: tuple[bytes, ...] = ()
            # digests even without a promise: a READ that beat the hold's start (the router
            # is faster than the producer's next step) completes the lease as the hold
            # starts, before this early begin is answered; the digests taken then still
            # describe the blocks it read (the ack decides whether they were still held)
            if msg.digest_ids:
                digests, why = self._slice_digests_for(msg, consumer) \
                    if msg.algorithm == SLICE_ALGORITHM else self._digests_for(msg)
                reason = reason or why
            self._send_to(sender, messages.Held(msg.request_id, self.rank_index,
                                                lease_s is not None, lease_s or 0.0, reason,
                                                digests, msg.algorithm if digests else ""))

    def _expected_from(self, consumer: _ConsumerPeer) -> int:
        """How many ranks of ``consumer``'s engine notify this producer rank per request."""
        sizes = consumer.meta.topology.sizes()
        expected = self._expected_by_sizes.get(sizes)
        if expected is None:
            plan = plan_transfer(self.ctx.spec, self.sizes, sizes)
            expected = expected_notifs(notify_targets(plan), self.rank_index)
            self._expected_by_sizes[sizes] = expected
        return expected

    def _defer(self, sender: str, msg: messages.Notif, now: float) -> None:
        waiting = self._deferred.get(sender)
        if waiting is None:
            if len(self._deferred) >= MAX_DEFERRED_AGENTS:
                self._reject(sender, "no hello from it, and too many such agents at once")
                return
            waiting = self._deferred[sender] = []
        if len(waiting) >= MAX_DEFERRED_PER_AGENT:
            self._reject(sender, f"no hello from it after {MAX_DEFERRED_PER_AGENT} messages")
            return
        waiting.append((now, msg))

    def _expire_deferred(self, now: float) -> None:
        for rid, begins in list(self._early_begins.items()):
            if now - begins[0][0] >= self.settings.early_grace_s:
                del self._early_begins[rid]
                for _at, sender, begin in begins:  # no promise, no digests: the ack decides
                    self._early_begin_ids -= sum(len(g) for g in begin.digest_ids)
                    self._send_to(sender, messages.Held(rid, self.rank_index, False, 0.0,
                                                        "not held (yet)"))
        for agent, answers in list(self._pending_acks.items()):
            if now - answers[0][0] >= self.settings.lease_s:  # no hello again: it is gone
                del self._pending_acks[agent]
        for sender, waiting in list(self._deferred.items()):
            if now - waiting[0][0] >= self.settings.early_grace_s:
                del self._deferred[sender]
                for _ in waiting:
                    self._reject(sender, f"no hello from it within "
                                         f"{self.settings.early_grace_s:g} s")

    def _reject(self, sender: str, reason: str) -> None:
        self._counters["notifs_rejected"] += 1
        if sender in self._rejected_senders:
            return
        if len(self._rejected_senders) >= MAX_LOGGED_SENDERS:
            self._rejected_senders.pop(next(iter(self._rejected_senders)))
        self._rejected_senders[sender] = None
        logger.warning("nixl: producer engine=%s rank=%d: rejecting notifications of agent %s "
                       "(%s; logged once per agent, counted in notifs_rejected)",
                       self.ctx.engine_id, self.rank_index, sender[:128], reason)

    def _hello_doc(self) -> bytes:
        """What our ``hello`` carries: our agent record, sealed afresh with the secret."""
        if self.auth is None:
            return self._agent_doc
        return self.auth.seal_request(Label.NIXL_HELLO, self._agent_doc)[0]

    def _on_hello(self, sender: str, msg: messages.Hello, now: float) -> None:
        assert self.transport is not None
        agent = msg.agent
        if self.auth is not None:  # only a member becomes a peer (and may then be answered)
            try:
                agent = self.auth.open_request(Label.NIXL_HELLO, agent).body
            except AuthError as exc:
                self._reject(sender, f"its hello does not authenticate: {exc.reason}")
                return
        elif is_sealed(agent):
            self._reject(sender, "its hello is sealed with a cluster secret; this rank has none")
            return
        meta = decode_agent(agent)
        if meta.agent_name != sender:
            raise NixlTransportError(f"hello from {sender} names agent {meta.agent_name}")
        known = self._consumers.get(sender)
        if known is None and len(self._consumers) >= MAX_CONSUMER_PEERS:
            raise NixlTransportError(f"hello from {sender}: already {MAX_CONSUMER_PEERS} "
                                     f"consumer agents; refused")
        peer = self.transport.add_peer(sender, meta.agent_blob)
        if known is not None and known.peer == peer:
            return  # a repeated hello (the consumer re-handshook): everything is in place
        if known is not None and known.push is not None:
            self.transport.release_dlist(known.push.local_list)
        consumer = _ConsumerPeer(peer, meta)
        if self.settings.mode is TransferMode.PUSH and self.ctx.role.is_producer:
            try:
                consumer.push = self._prepare_push(consumer)
            except BaseException:
                # refused (e.g. memory its registration does not cover): forget it whole
                self._consumers.pop(sender, None)
                self.transport.remove_peer(peer)
                raise
        self._consumers[sender] = consumer
        for _at, pending in self._pending_acks.pop(sender, []):
            self._send_to(sender, pending)
        for _at, waiting in self._deferred.pop(sender, []):
            try:
                self._on_consumer_notif(sender, waiting, now)
            except Exception as exc:  # as in _handle_batch: one message, not the rank
                self._counters["bad_notifs"] += 1
                logger.warning("nixl: notification %s from %s refused: %s",
                               type(waiting).__name__, sender, exc)

    def _prepare_push(self, consumer: _ConsumerPeer) -> _PushLists | None:
        """Lists for writing to ``consumer``'s rank, prepared right after its hello."""
        assert self.transport is not None
        # one consumer rank's plan: never the whole engine it claims to belong to
        sub = plan_consumer_rank(self.ctx.spec, self.sizes,
                                 consumer.meta.topology).for_producer(self.rank_index)
        if not sub.num_descriptors:
            return None
        remote_memory = consumer.meta.layer_memory()
        check_remote_coverage(self.transport, consumer.peer, remote_memory,
                              sub.layers.tolist(), f"consumer {consumer.meta.agent_name}",
                              consumer.meta.mem_type, consumer.meta.device_id)
        local = build_table(sub.regions, sub.layers, sub.producer_offsets, sub.lengths,
                            self.memory, "producer")
        remote = build_table(sub.regions, sub.layers, sub.consumer_offsets, sub.lengths,
                             remote_memory, "consumer")
        local_list = self.transport.prepare_local_descs(
            local.strided(self.transport.memory_type[1]))
        try:
            remote_list = self.transport.prepare_remote(  # the consumer's memory type
                consumer.peer, remote.strided(consumer.meta.device_id), consumer.meta.mem_type)
        except BaseException:
            self.transport.release_dlist(local_list)
            raise
        return _PushLists(local, remote, local_list, remote_list,
                          frozenset(int(x) for x in sub.layers.tolist()))

    def _answer(self, verdict: Verdict) -> None:
        if verdict.ok:
            ack: messages.Notif = messages.Ack(verdict.request_id, self.rank_index, True)
        else:
            ack = messages.Ack(verdict.request_id, self.rank_index, False,
                               f"lease {verdict.kind.value} on producer rank {self.rank_index}")
            log = logger.warning if verdict.kind is VerdictKind.LATE else logger.info
            log("nixl: producer engine=%s rank=%d request=%s: %s notification from "
                           "consumer rank %d (%s)", self.ctx.engine_id, self.rank_index,
                           verdict.request_id, verdict.kind.value, verdict.consumer_rank,
                           verdict.peer)
        self._send_to(verdict.peer, ack)

    def _send_to(self, agent: str, msg: messages.Notif) -> None:
        consumer = self._consumers.get(agent)
        if consumer is None:  # answered once it says hello (again), within bounds
            pending = self._pending_acks.get(agent)
            if pending is None and len(self._pending_acks) < MAX_DEFERRED_AGENTS:
                pending = self._pending_acks[agent] = []
            if pending is not None and len(pending) < MAX_DEFERRED_PER_AGENT:
                pending.append((time.monotonic(), msg))
            else:
                logger.info("nixl: no hello from %s; dropping the answer %s",
                            agent[:128], type(msg).__name__)
            return
        assert self.transport is not None
        try:
            self.transport.send_notif(consumer.peer, messages.encode(msg))
        except NixlTransportError as exc:
            logger.warning("nixl: cannot answer consumer %s: %s; dropping it", agent, exc)
            self._forget_consumer(agent)

    def _forget_consumer(self, agent: str) -> None:
        consumer = self._consumers.pop(agent, None)
        if consumer is not None and self.transport is not None:
            if consumer.push is not None:
                self.transport.release_dlist(consumer.push.local_list)
            self.transport.remove_peer(consumer.peer)  # releases its remote lists

    def _find_recv(self, sender: str, producer_rank: int, producer_rid: str
                   ) -> tuple[str | None, RecvTransfer | None]:
        """(producer engine id, the load) a producer rank's answer is about."""
        for key, session in self._sessions.items():
            peer = session.peers.get(producer_rank)
            if peer is None or peer.name != sender:
                continue
            rid = self._by_producer_rid.get((key[0], producer_rid))
            return key[0], (self._recv.get(rid) if rid is not None else None)
        return None, None

    def _on_answer(self, sender: str, msg: messages.Ack | messages.Pushed, now: float) -> None:
        engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is not None and isinstance(msg, messages.Pushed):
            self._take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if recv is not None:
            recv.answer(msg.producer_rank, msg.ok, msg.reason, now)
            return
        promised = (self._done_on_promise.get((engine_id, msg.request_id))
                    if engine_id is not None else None)
        if promised is not None and not msg.ok:
            # cannot happen while the producer keeps its promises (and clocks run at
            # about the same rate): say so loudly, the request already finished
            self._counters["promises_contradicted"] += 1
            logger.error("nixl: producer engine=%s rank=%d answered %r for request %s (%s), "
                         "which finished on its promise to hold the blocks",
                         engine_id, msg.producer_rank, msg.reason, promised[0],
                         msg.request_id)

    def _on_held(self, sender: str, msg: messages.Held) -> None:
        _engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is None:
            return
        self._take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if not msg.ok:
            return  # no promise: the ack of the read decides
        recv.promised(msg.producer_rank,
                      msg.lease_s * (1.0 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S)

    # ------------------------------------------------------------------ verified KV

    def _begin_for(self, recv: RecvTransfer, session: PeerSession, p: int) -> messages.Begin:
        """The ``begin`` of a pull READ from producer rank ``p``, asking for the digests
        of the blocks this rank will check (issue 18; see ``connectors.nixl.verify``)."""
        rid = recv.params.producer_request_id
        ask = self._ask_for(recv, session, p)
        if ask is None:
            return messages.Begin(rid, self.rank_index)
        return messages.Begin(rid, self.rank_index, ask.producer_ids, ask.algorithm)

    def _ask_for(self, recv: RecvTransfer, session: PeerSession, p: int) -> DigestAsk | None:
        """The blocks of ``recv`` this rank checks against producer rank ``p``'s digests
        (None: none); blocks it cannot check are counted unverified, said once."""
        policy = self.settings.verify_policy
        if not policy.enabled:
            return None
        known = session.digest_regions.get(p)
        if known is None:
            known = session.digest_regions[p] = self._digest_regions(session, p)
        regions, why = known
        check = self._slice_check(session)
        slices = check.regions & check.regions_of(p)
        recv.checked_regions |= regions | slices
        recv.unchecked_why = recv.unchecked_why or (check.why if regions else "") or why
        # push: the producer maps registered blocks to its own (ids unused here)
        pull = recv.params.mode is TransferMode.PULL
        ask = plan_ask(policy, recv.request_id, regions, recv.consumer_block_ids,
                       recv.producer_block_ids if pull else recv.consumer_block_ids, slices)
        if slices:
            ask = replace(ask, slice_ranges=check.ranges[p],
                          slice_sources={r: check.sources[r] for r in slices})
        if ask.unverified:
            self._unverified(recv, ask.unverified, f"more than {MAX_ASK_BLOCKS} blocks in one "
                                                   f"load")
        if not ask.num_blocks:
            return None
        if ask.algorithm != SLICE_ALGORITHM:  # whole blocks only: the session's choice
            alg = session.digest_algorithms.get(p)
            assert alg is not None  # regions are checked only with an algorithm in common
            ask = replace(ask, algorithm=alg)
        # xxh3-64-slices covers the whole ask (a region read whole: its XXH3-64 digest)
        recv.digest_asks[p] = ask
        recv.digest_algorithms[p] = ask.algorithm
        return ask

    def _count_digests(self, started: float, block_ids: Sequence[Sequence[int]]) -> None:
        assert self._digester is not None
        self._counters["digest_time_s"] += time.perf_counter() - started
        self._counters["digest_bytes"] += sum(len(ids) * self._digester.block_bytes(r)
                                              for r, ids in enumerate(block_ids))

    def _take_digests(self, recv: RecvTransfer, producer_rank: int, digests: tuple[bytes, ...],
                      algorithm: str, reason: str) -> None:
        """The first answer of ``producer_rank`` to this load's digest ask (held, pushed)."""
        if producer_rank not in recv.digest_asks or producer_rank in recv.digests:
            return
        ok = bool(digests) and algorithm == recv.digest_asks[producer_rank].algorithm
        recv.digests[producer_rank] = digests if ok else None
        if not ok:  # its slice-region blocks are counted once per block in _verify_slices
            self._unverified(recv, recv.digest_asks[producer_rank].whole_blocks,
                             f"producer rank {producer_rank} sent no digests "
                             f"({reason or 'no reason given'})")

    def _count_unchecked(self, recv: RecvTransfer) -> None:
        """After every producer rank was asked: the load's blocks in regions no producer
        rank's digests cover, counted once (not once per producer rank read from)."""
        if not self.settings.verify_policy.enabled:
            return
        unchecked = sum(len(ids) for r, ids in enumerate(recv.consumer_block_ids)
                        if r not in recv.checked_regions)
        if unchecked:
            self._unverified(recv, unchecked, recv.unchecked_why or "no producer rank's digests "
                                                                    "cover these blocks")

    def _digest_regions(self, session: PeerSession, p: int) -> tuple[frozenset[int], str]:
        """The regions this rank checks against producer rank ``p``'s digests (and why
        not the others): the same for every load of the session."""
        remote = next((m for m in session.metadata.ranks if m.rank_index == p), None)
        if not self._digesters:
            return frozenset(), "this rank computes no digests"
        alg = session.digest_algorithms[p] = self._digest_algorithm(remote)
        if remote is None or alg is None:
            return frozenset(), (f"producer rank {p} offers no digests this rank computes "
                                 f"({list(remote.digests) if remote else []} against "
                                 f"{list(self._digesters)}: an older kvbridge, verification "
                                 f"off there, or GPU memory against XXH3-64 only)")
        regions = whole_block_regions(
            session.rank_plan, p, [s.block_bytes_per_layer
                                   for s in self.ctx.spec.rank_shapes(self.rank)],
            [r.block_bytes_per_layer for r in remote.regions],
            [s.layer_ids for s in self.ctx.spec.rank_shapes(remote.topology)])
        return regions, "blocks not copied whole from one producer rank (head slices at " \
                        "another TP, or another pipeline split)"

    def _digest_algorithm(self, remote: AgentMetadata | None) -> str | None:
        """The algorithm this consumer rank asks producer rank ``remote`` for: the first of
        its own (preference-ordered, computable here) that the producer offers."""
        return pick_algorithm(list(self._digesters), remote.digests) if remote else None

    def _unverified(self, recv: RecvTransfer, num_blocks: int, why: str) -> None:
        recv.unverified += num_blocks
        self._counters["blocks_unverified"] += num_blocks
        if why not in self._unverified_logged and len(self._unverified_logged) < 64:
            self._unverified_logged.add(why)
            logger.warning("nixl: engine=%s rank=%d: loads from producer engine %s are not "
                           "verified: %s (counted in blocks_unverified; logged once)",
                           self.ctx.engine_id, self.rank_index,
                           recv.params.producer_engine_id, why)

    def _verify(self, recv: RecvTransfer) -> set[tuple[int, int]]:
        """A finished pull load's blocks whose digests differ (checked against the
        answers of its producer ranks). Unchecked blocks fail too when the policy
        does not allow them."""
        bad: set[tuple[int, int]] = set()
        for p, ask in recv.digest_asks.items():
            packed = recv.digests.get(p)
            if packed is None:
                continue  # counted unverified when the answer came
            alg = recv.digest_algorithms[p]  # a slice ask's whole regions: XXH3-64 digests
            digester = self._digesters[ALGORITHM if alg == SLICE_ALGORITHM else alg]
            started = time.perf_counter()
            verified, mismatched = check_answer(ask, packed, digester,
                                                whole_load=recv.params.mode is TransferMode.PUSH)
            self._count_digests(started, [() if r in ask.slices else ids
                                          for r, ids in enumerate(ask.consumer_ids)])
            self._counters["blocks_verified"] += verified
            self._counters["digest_mismatches"] += len(mismatched)
            bad.update(mismatched)
        self._verify_slices(recv, bad)
        if recv.unverified and not self.settings.verify_allow_unverified:
            bad |= set(recv.local_blocks)
        return bad

    def _take_hold_digests(self, request_id: str,
                           block_ids: Sequence[Sequence[int]]) -> None:
        """Producer: digests of a request's blocks as its hold starts (the KV is final)."""
        if self._digester is None:
            return
        try:
            started = time.perf_counter()
            self._hold_digests[request_id] = take_hold_digests(self._digester, block_ids)
            self._count_digests(started, block_ids)
            for alg in self._hold_algs:  # other algorithms consumers asked for before
                started = time.perf_counter()
                self._alg_digests[(request_id, alg)] = take_hold_digests(
                    self._digesters[alg], block_ids)
                self._count_digests(started, block_ids)
        except LayoutError as exc:  # a block id outside the tensors: no digests, said why
            logger.warning("nixl: producer engine=%s rank=%d request=%s: no digests: %s",
                           self.ctx.engine_id, self.rank_index, request_id, exc)
            return
        self._take_hold_slices(request_id, block_ids)

    def _digests_for(self, begin: messages.Begin) -> tuple[tuple[bytes, ...], str]:
        """Producer: digests of the blocks a ``begin`` asks for, or () and why not."""
        held = self._held_digests(begin.request_id, begin.algorithm,
                                  self._hold_digests.get(begin.request_id))
        if begin.algorithm not in self._digesters:
            return (), f"no {begin.algorithm} digests on producer rank {self.rank_index}"
        if held is None:
            return (), f"no digests of request {begin.request_id} (not held)"
        answer = answer_ask(held, begin.digest_ids)
        if isinstance(answer, str):
            return (), answer
        self._counters["digests_served"] += sum(len(g) for g in begin.digest_ids)
        return answer, ""

    def _held_digests(self, request_id: str, alg: str,
                      first: tuple[dict[int, int], ...] | None
                      ) -> tuple[dict[int, int], ...] | None:
        """Producer: the digests in ``alg`` of a request whose digests in the first
        algorithm are ``first`` (None: none). An algorithm no consumer asked for before
        is taken now, of the same blocks, and from then on as every hold starts."""
        digester = self._digesters.get(alg)
        if digester is None or first is None or digester is self._digester:
            return first
        have = self._alg_digests.get((request_id, alg))
        if have is None:
            self._hold_algs.add(alg)
            block_ids = [tuple(ids) for ids in first]
            started = time.perf_counter()
            have = take_hold_digests(digester, block_ids)
            self._count_digests(started, block_ids)
            self._alg_digests[(request_id, alg)] = have
        return have

    # ------------------------------------------------------------------ slice digests

    def _slice_check(self, session: PeerSession) -> SliceCheck:
        """Consumer: the regions of ``session``'s plan checked with slice digests (those
        no producer rank covers whole, each of whose sources offers them); once."""
        if session.slice_check is None:
            if self._xxh3 is None:
                session.slice_check = SliceCheck(why="this rank computes no XXH3-64 digests "
                                                     "(GPU memory): head slices need them")
            else:
                whole = {}
                for p in session.rank_plan.sources:
                    known = session.digest_regions.get(p)
                    if known is None:
                        known = session.digest_regions[p] = self._digest_regions(session, p)
                    whole[p] = known[0]
                offering = [m.rank_index for m in session.metadata.ranks
                            if SLICE_ALGORITHM in m.digests]
                session.slice_check = plan_slice_check(session.rank_plan, whole, offering)
        return session.slice_check

    def _verify_slices(self, recv: RecvTransfer, bad: set[tuple[int, int]]) -> None:
        """Consumer: check and count the slice-region blocks of a finished load; each
        block counts once, verified only when every producer rank it came from matched."""
        asks = {p: a for p, a in recv.digest_asks.items() if a.slices}
        if not asks:
            return
        xxh3 = self._xxh3
        assert xxh3 is not None  # slice regions are chosen only with it
        matched: dict[int, list[tuple[int, int]]] = {}
        failed: set[tuple[int, int]] = set()
        started = time.perf_counter()
        nbytes = 0
        for p, ask in asks.items():
            packed = recv.digests.get(p)
            if packed is None:
                continue  # no answer: its parts stay unchecked (counted below)
            matched[p], mismatched = check_slices(ask, packed, xxh3,
                                                  whole_load=recv.params.mode is TransferMode.PUSH)
            failed.update(mismatched)
            nbytes += sum(len(ask.consumer_ids[r]) * slice_bytes(ask.slice_ranges[r])
                          for r in ask.slices)
        self._counters["digest_time_s"] += time.perf_counter() - started
        self._counters["digest_bytes"] += nbytes
        verified, unverified = count_slices(asks, matched, failed)
        self._counters["blocks_verified"] += verified
        self._counters["digest_mismatches"] += len(failed)
        bad.update(failed)
        if unverified:
            self._unverified(recv, unverified, "a producer rank sent no slice digests for "
                                               "head slices it was asked for")

    def _slice_plan(self, topology: ParallelTopology) -> SlicePlan | None:
        """Producer: what consumer rank ``topology`` reads from this rank (None: nothing,
        or a topology this model cannot be served to)."""
        if topology not in self._slice_plans:
            if len(self._slice_plans) >= MAX_CONSUMER_PEERS:
                self._slice_plans.clear()  # bounded: recomputed on demand
            try:
                sub = plan_consumer_rank(self.ctx.spec, self.sizes,
                                         topology).for_producer(self.rank_index)
            except LayoutError:
                self._slice_plans[topology] = None
            else:
                shapes = self.ctx.spec.rank_shapes(self.rank)
                self._slice_plans[topology] = producer_slice_plan(
                    sub, self.rank_index, [s.block_bytes_per_layer for s in shapes],
                    [s.layer_ids for s in shapes]) if sub.num_descriptors else None
        return self._slice_plans[topology]

    def _take_hold_slices(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """Producer, as a hold starts: slice digests of the request's blocks for every
        consumer rank this rank knows that reads head slices of it (its hello listed
        ``xxh3-64-slices``), at most :data:`MAX_HOLD_SLICE_PLANS` plans."""
        xxh3 = self._xxh3
        if xxh3 is None:
            return  # no slice digests offered (GPU memory)
        held: tuple[dict[int, int], ...] | None = None
        taken: dict[ParallelTopology, tuple[dict[int, int], ...]] = {}
        for consumer in self._consumers.values():
            topology = consumer.meta.topology
            if topology in taken or SLICE_ALGORITHM not in consumer.meta.digests:
                continue
            plan = self._slice_plan(topology)
            if plan is None or not plan.needed:
                continue
            if len(taken) >= MAX_HOLD_SLICE_PLANS:
                break
            try:
                if held is None:  # XXH3-64 block digests: the slices of regions read whole
                    held = self._held_digests(request_id, ALGORITHM,
                                              self._hold_digests[request_id])
                    assert held is not None
                started = time.perf_counter()
                taken[topology] = take_slice_digests(xxh3, plan, block_ids, held)
            except LayoutError as exc:
                logger.warning("nixl: producer engine=%s rank=%d request=%s: no slice "
                               "digests: %s", self.ctx.engine_id, self.rank_index,
                               request_id, exc)
                return
            self._count_slices(started, plan, block_ids, "slice_digests_at_hold")
        if taken:
            self._hold_slices[request_id] = taken

    def _count_slices(self, started: float, plan: SlicePlan,
                      block_ids: Sequence[Sequence[int]], counter: str) -> None:
        hashed = [(r, len(ids)) for r, ids in enumerate(block_ids)
                  if r < len(plan.layers) and plan.layers[r] and r not in plan.whole]
        self._counters["digest_time_s"] += time.perf_counter() - started
        self._counters["digest_bytes"] += sum(n * slice_bytes(plan.layers[r]) for r, n in hashed)
        self._counters[counter] += sum(n for _r, n in hashed)

    def _slice_digests_for(self, begin: messages.Begin, consumer: _ConsumerPeer
                           ) -> tuple[tuple[bytes, ...], str]:
        """Producer: slice digests of the blocks a ``begin`` asks for, as read by the
        consumer rank that sent it: those taken at hold start, else taken now (only of
        asked blocks this rank holds for the request), or () and why not."""
        xxh3 = self._xxh3
        if xxh3 is None:
            return (), f"no {begin.algorithm} digests on producer rank {self.rank_index}"
        try:  # the XXH3-64 block digests (the slices of regions read whole)
            held = self._held_digests(begin.request_id, ALGORITHM,
                                      self._hold_digests.get(begin.request_id))
        except LayoutError as exc:
            return (), f"no slice digests: {exc}"
        if held is None:
            return (), f"no digests of request {begin.request_id} (not held)"
        topology = consumer.meta.topology
        plan = self._slice_plan(topology)
        if plan is None:
            return (), f"consumer rank {topology.describe()} reads nothing of producer rank " \
                       f"{self.rank_index}"
        taken = self._hold_slices.setdefault(begin.request_id, {})
        mine = taken.get(topology)
        if len(begin.digest_ids) > len(held):
            return (), f"asked for {len(begin.digest_ids)} regions; the request has {len(held)}"
        # the consumer rank was not known as the hold started: hash the asked blocks it
        # holds that were not hashed for this consumer topology yet (kept: a repeated ask
        # costs nothing more), at most one answer's worth
        missing = [[b for b in ids if b in held[r] and r not in plan.whole
                    and (mine is None or b not in mine[r])]
                   for r, ids in enumerate(begin.digest_ids)]
        if mine is None or any(missing):
            if sum(len(ids) for ids in missing) > MAX_ASK_BLOCKS:
                return (), f"more than {MAX_ASK_BLOCKS} digests asked"
            started = time.perf_counter()
            try:
                new = take_slice_digests(xxh3, plan, missing, held)
            except LayoutError as exc:
                return (), f"no slice digests: {exc}"
            self._count_slices(started, plan, missing, "slice_digests_at_begin")
            mine = tuple(held[r] if r in plan.whole else
                         {**(mine[r] if mine is not None and r < len(mine) else {}),
                          **(new[r] if r < len(new) else {})}
                         for r in range(len(held)))
            taken[topology] = mine
        answer = answer_ask(mine, begin.digest_ids)
        if isinstance(answer, str):
            return (), answer
        self._counters["digests_served"] += sum(len(g) for g in begin.digest_ids)
        return answer, ""

    def _take_push_slices(self, job: _PushJob, target: _PushTarget) -> None:
        """Producer, push: slice digests of the blocks registered by ``target`` (every
        layer is final), before its remaining WRITEs are posted."""
        xxh3 = self._xxh3
        assert xxh3 is not None and job.digests
        consumer = self._consumers.get(target.peer.name)
        plan = self._slice_plan(consumer.meta.topology) if consumer is not None else None
        target.slice_digests = ()
        if plan is None:
            return
        reg = target.register
        ids = [job.block_ids[r][start:start + len(reg.block_ids[r])]
               if r < len(job.block_ids) else () for r, start in enumerate(reg.start)]
        started = time.perf_counter()
        try:
            held = self._push_alg_digests(job, ALGORITHM)  # the slices of regions read whole
            target.slice_digests = take_slice_digests(xxh3, plan, ids, held)
        except LayoutError as exc:
            logger.warning("nixl: producer engine=%s rank=%d request=%s: no slice digests: %s",
                           self.ctx.engine_id, self.rank_index, job.request_id, exc)
            return
        self._count_slices(started, plan, ids, "slice_digests_at_hold")

    def _push_slice_digests(self, job: _PushJob, target: _PushTarget
                            ) -> tuple[bytes, ...] | str:
        """Producer: slice digests of every block written for ``target``, or why none."""
        if not target.slice_digests:
            return f"no {SLICE_ALGORITHM} digests on producer rank {self.rank_index}"
        reg = target.register
        # a region this consumer rank reads nothing of from this rank (another rank's
        # replicated region) is answered empty: the consumer checks it against that rank
        asked = [job.block_ids[r][start:start + len(reg.block_ids[r])]
                 if r < len(target.slice_digests) and target.slice_digests[r] else ()
                 for r, start in enumerate(reg.start)]
        answer = answer_ask(target.slice_digests, asked)
        if not isinstance(answer, str):
            self._counters["digests_served"] += sum(len(g) for g in asked)
        return answer

    # ------------------------------------------------------------------ producer: push

    def _on_register(self, sender: str, reg: messages.Register, now: float) -> None:
        rid = reg.request_id
        job = self._push_jobs.get(rid)
        if reg.cancel:
            target_c = job.targets.get(reg.consumer_rank) if job is not None else None
            if job is not None and target_c is not None and not target_c.finished:
                target_c.cancelled = True  # answered once its writes settle
                if not self._writes_pending(target_c):
                    self._finish_push_target(job, target_c, False, "cancelled by consumer",
                                             now)
                return
            self._send_to(sender, messages.Pushed(rid, self.rank_index, False,
                                                  "cancelled by consumer"))
            if job is None:
                self._cancelled[rid] = now  # a later push order starts dropped
            self._leases.notify(rid, reg.consumer_rank, reg.expected, sender, now)
            return
        if job is None:
            if self._leases.ended(rid) == "expired":
                self._counters["pushes_failed"] += 1
                self._send_to(sender, messages.Pushed(rid, self.rank_index, False,
                                                      "lease expired before registration"))
                return
            if rid not in self._early_registers and \
                    len(self._early_registers) >= MAX_EARLY_REGISTERS:
                self._reject(sender, f"register for {rid[:64]!r}, not held, past "
                                     f"{MAX_EARLY_REGISTERS} such requests")
                return
            self._early_registers.setdefault(rid, []).append((sender, reg))
            return
        consumer = self._consumers.get(sender)
        if consumer is None:
            raise NixlTransportError(f"register from {sender} before its hello")
        if reg.consumer_rank != consumer.meta.rank_index:
            raise NixlTransportError(f"register from {sender} names consumer rank "
                                     f"{reg.consumer_rank}, its hello said "
                                     f"{consumer.meta.rank_index}")
        target = _PushTarget(reg.consumer_rank, consumer.peer, reg)
        lists = consumer.push
        if lists is not None:
            target.local, target.remote = lists.local, lists.remote
            target.local_list, target.remote_list = lists.local_list, lists.remote_list
            target.layers_needed = lists.layers_needed
        job.targets[reg.consumer_rank] = target
        if not target.layers_needed:
            target.finished = True
            self._leases.notify(rid, reg.consumer_rank, reg.expected, sender, now)
            return
        if job.final and not self._step_pushes and not job.fenced:
            job.layers_ready |= set(self.memory)  # prefill already complete: everything
        self._post_push_writes(job)

    def _post_push_writes(self, job: _PushJob) -> None:
        assert self.transport is not None
        now = time.monotonic()
        if job.dropped:
            return
        if (job.digests is None and self._digester is not None and job.final
                and job.layers_ready >= self.memory.keys()):
            try:  # every layer is final: what the consumer must find after the writes
                started = time.perf_counter()
                job.digests = take_hold_digests(self._digester, job.block_ids)
                self._count_digests(started, job.block_ids)
                asked = {ALGORITHM if t.register.algorithm == SLICE_ALGORITHM
                         else t.register.algorithm for t in job.targets.values()}
                for alg in (self._hold_algs | asked) & self._digesters.keys():
                    if self._digesters[alg] is not self._digester:
                        started = time.perf_counter()
                        job.alg_digests[alg] = take_hold_digests(self._digesters[alg],
                                                                 job.block_ids)
                        self._count_digests(started, job.block_ids)
            except LayoutError as exc:
                logger.warning("nixl: producer engine=%s rank=%d request=%s: no digests: %s",
                               self.ctx.engine_id, self.rank_index, job.request_id, exc)
                job.digests = ()
        for target in job.targets.values():
            if (job.digests and target.slice_digests is None and not target.finished
                    and target.register.algorithm == SLICE_ALGORITHM and self._xxh3 is not None):
                self._take_push_slices(job, target)
        for target in job.targets.values():
            if (target.finished or target.cancelled or target.local is None
                    or target.remote is None):
                continue
            layers = (job.layers_ready & target.layers_needed) - target.layers_written
            if not layers:
                continue
            assert target.local_list is not None and target.remote_list is not None
            reg = target.register
            producer_ids = []
            for r, start in enumerate(reg.start):
                theirs = job.block_ids[r] if r < len(job.block_ids) else ()
                producer_ids.append(theirs[start:start + len(reg.block_ids[r])])
            which = np.flatnonzero(np.isin(target.local.layers,
                                           np.fromiter(layers, dtype=np.int64)))
            try:
                if any(len(p) != len(c) for p, c in zip(producer_ids, reg.block_ids,
                                                        strict=True)):
                    raise NixlTransportError(f"consumer registered {[len(c) for c in reg.block_ids]}"
                                             f" blocks; producer holds {[len(p) for p in producer_ids]}")
                lidx, ridx, runs = pair_indices(target.local, which, producer_ids, "producer",
                                                target.remote, which, reg.block_ids,
                                                "consumer")
                target.runs += runs
                target.layers_written |= layers
                if lidx.size:
                    target.transfers.append(self.transport.post(
                        XferOp.WRITE, target.local_list, lidx, target.remote_list, ridx,
                        b"", deadline_s=self.settings.transfer_timeout_s))
            except Exception as exc:
                self._finish_push_target(job, target, False, f"write refused: {exc}", now)

    def _writes_pending(self, target: _PushTarget) -> bool:
        assert self.transport is not None
        return any(self.transport.poll(x) is XferState.PENDING or not x.quiesced
                   for x in target.transfers)

    def _maybe_drop_job(self, job: _PushJob) -> None:
        if job.dropped and all(t.finished for t in job.targets.values()):
            self._drop_push_job(job.request_id)

    def _progress_pushes(self, now: float) -> None:
        assert self.transport is not None
        for job in list(self._push_jobs.values()):
            if self._release_fenced(job):
                self._post_push_writes(job)
            self._maybe_drop_job(job)
            for target in job.targets.values():
                if target.finished:
                    continue
                if target.cancelled or job.dropped:
                    if not self._writes_pending(target):
                        self._finish_push_target(job, target, False, "cancelled", now)
                    continue
                states = [self.transport.poll(x) for x in target.transfers]
                bad = [x for x in target.transfers
                       if x.state in (XferState.FAILED, XferState.TIMED_OUT)]
                if bad:
                    self._counters["transfer_failures"] += 1
                    self._finish_push_target(job, target, False,
                                             f"WRITE {bad[0].state.value}: {bad[0].error}", now)
                    continue
                if (target.layers_written >= target.layers_needed
                        and all(s is XferState.DONE for s in states)):
                    self._finish_push_target(job, target, True, "", now)

    def _finish_push_target(self, job: _PushJob, target: _PushTarget, ok: bool, reason: str,
                            now: float) -> None:
        target.finished = True
        nbytes = sum(x.nbytes for x in target.transfers)
        ndescs = sum(x.num_descs for x in target.transfers)
        self._counters["pushes_done" if ok else "pushes_failed"] += 1
        if ok:
            self._count_transfer(nbytes, ndescs, now - job.started_at, target.runs)
        else:
            logger.warning("nixl push failed: engine=%s rank=%d request=%s consumer_rank=%d "
                           "blocks=%d reason=%s", self.ctx.engine_id, self.rank_index,
                           job.request_id, target.consumer_rank,
                           sum(len(g) for g in target.register.block_ids), reason)
        self._record(TransferRecord(job.request_id, ok, nbytes, ndescs, now - job.started_at,
                                    job.started_at, target.runs))
        digests: tuple[bytes, ...] = ()
        reg = target.register
        if ok and reg.algorithm:
            answer = self._push_slice_digests(job, target) \
                if reg.algorithm == SLICE_ALGORITHM else self._push_digests(job, reg)
            if isinstance(answer, str):
                reason = answer
            else:
                digests = answer
        self._send_to(target.peer.name, messages.Pushed(job.request_id, self.rank_index, ok,
                                                        reason, digests,
                                                        reg.algorithm if digests else ""))
        self._leases.notify(job.request_id, reg.consumer_rank, reg.expected, target.peer.name,
                            now)

    def _push_digests(self, job: _PushJob, reg: messages.Register) -> tuple[bytes, ...] | str:
        """Producer: digests of every block written for ``reg``, or why there are none."""
        if reg.algorithm not in self._digesters or not job.digests:
            return f"no {reg.algorithm} digests on producer rank {self.rank_index}"
        asked = [job.block_ids[r][start:start + len(reg.block_ids[r])]
                 for r, start in enumerate(reg.start)]
        answer = answer_ask(self._push_alg_digests(job, reg.algorithm), asked)
        if not isinstance(answer, str):
            self._counters["digests_served"] += sum(len(g) for g in asked)
        return answer

    def _push_alg_digests(self, job: _PushJob, alg: str) -> tuple[dict[int, int], ...]:
        """Producer: a push job's digests in ``alg`` (taken now when no target asked for
        it as the last layer was final; the layers are final, so the same bytes)."""
        assert job.digests is not None
        if self._digesters[alg] is self._digester:
            return job.digests
        have = job.alg_digests.get(alg)
        if have is None:
            self._hold_algs.add(alg)
            started = time.perf_counter()
            have = job.alg_digests[alg] = take_hold_digests(self._digesters[alg], job.block_ids)
            self._count_digests(started, job.block_ids)
        return have

    def _drop_push_job(self, rid: str) -> None:
        """Forget a push request (its lists belong to the consumer peer and stay)."""
        self._push_jobs.pop(rid, None)

    # ------------------------------------------------------------------ the loop

    def _progress(self) -> None:
        if self.transport is None or self._closed:
            return
        now = time.monotonic()
        self._last_progress = now
        self._drain_notifs(now)
        self._settle_sessions(now)
        self._reads_ended = False
        self._progress_recv(now)
        if self._reads_ended:
            # a READ just ended (often inside the post: shared memory copies at once);
            # the producers' ``held`` answers arrived meanwhile: take them now, not a
            # step later, so the load completes in this very call
            now = time.monotonic()
            self._drain_notifs(now)
            self._progress_recv(now)
        self._send_releases(now)
        self._progress_pushes(now)
        for verdict in self._leases.expire(now):
            self._answer(verdict)
        self._expire_deferred(now)
        for rid, at in list(self._cancelled.items()):
            if now - at > self.settings.lease_s:
                del self._cancelled[rid]
        if self._done_on_promise:
            for key, (_rid, forget_at) in list(self._done_on_promise.items()):
                if now >= forget_at:
                    del self._done_on_promise[key]
        self._heartbeats(now)

    def _count_transfer(self, nbytes: int, ndescs: int, duration_s: float, runs: int) -> None:
        self._counters["transfers"] += 1
        self._counters["transfer_bytes"] += nbytes
        self._counters["transfer_descs"] += ndescs
        self._counters["transfer_runs"] += runs
        self._counters["transfer_time_s"] += duration_s

    def _record(self, record: TransferRecord) -> None:
        if record.ok:
            ms = record.duration_s * 1000.0
            key = next((latency_key(b) for b in LATENCY_BUCKETS_MS if ms <= b),
                       "latency_ms_le_inf")
            self._counters[key] = self._counters.get(key, 0) + 1
        self._records.append(record)
        if len(self._records) > MAX_SAMPLES:
            del self._records[: len(self._records) - MAX_SAMPLES]

    @_locked
    def progress(self) -> None:
        """Progress outside an engine step (an idle engine loop may call it)."""
        self._progress()

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        with self._state_lock:
            self._closed = True
        self._pump_stop.set()
        if self._pump is not None:
            self._pump.join(timeout=5)
            self._pump = None
        if self._executor is not None:
            # bounded: a handshake still running past this gives up on the closed transport
            running = [p.future for p in self._connecting.values()] + self._abandoned
            running += list(self._revalidating.values())
            self._executor.shutdown(wait=False, cancel_futures=True)
            wait_futures(running, timeout=self.handshake_deadline_s)
            self._executor = None
        transport = self.transport
        if transport is None:
            return
        now = time.monotonic()
        for future in [p.future for p in self._connecting.values()] + self._abandoned:
            with contextlib.suppress(Exception):  # failed or still running: nothing to close
                future.result(timeout=0).close(transport)
        self._connecting.clear()
        self._abandoned.clear()
        for recv in list(self._recv.values()):
            self._fail(recv, "connector shut down", now)
        for key in list(self._sessions):
            self._sessions.pop(key).close(transport)
        for rid in list(self._push_jobs):
            self._drop_push_job(rid)
        for agent in list(self._consumers):
            self._forget_consumer(agent)
        self._local_cache.clear()
        # a consumer may be reading under our promise (``held``): the memory must stay
        # as it is until the promise ran out, even though this worker is gone
        keep_alive(self._kv_tensors, self._leases.guaranteed_until)
        self._kv_tensors = []
        final = transport.close(strict=False)
        if final.live:
            logger.error("nixl worker %s rank %d leaked at shutdown: %s", self.ctx.engine_id,
                         self.rank_index, final)
        self._final_counters = final
