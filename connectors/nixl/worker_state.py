"""The state every part of a :class:`~kvbridge.connectors.nixl.worker.NixlWorker` shares.

:class:`WorkerState` is the base of the worker's parts (:mod:`.loads`,
:mod:`.load_checks`, :mod:`.push_consumer`, :mod:`.holds`, :mod:`.hold_digests`,
:mod:`.push`, :mod:`.pump`): it creates all of the rank's state in ``__init__`` (sessions,
loads in flight, leases, known consumer peers, push jobs, digesters,
counters) and holds the few helpers every part uses (counters, transfer
records, the XXH3-64 digester). The parts are mixins rather than objects
of their own: their state is one web (a failed handshake fails loads, a
``begin`` is answered from the leases and the digests, a push writes to the
consumer peers that said hello), and ``tools/trace/__init__.py`` instruments a worker by
wrapping its methods on the one object (``_fail``, ``_verify``,
``_on_notif``), so every internal call must go through ``self``.

Every method of a part runs under the worker's state lock (a hook through
:func:`_locked`, or the idle pump holding it). What one part calls of another
is declared at the end of :class:`WorkerState` (for the type checker only),
next to the module that implements it: the seams between the parts.

This module owns the state's shape and the shared records; it may not hold a
part's logic, and it imports none of the parts (they import it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvbridge.backends.device.fence import Fence, record_fence
from kvbridge.backends.nixl import DescList, NixlTransport, PeerHandle
from kvbridge.connectors.api import BlockRef, ConnectorContext, WorkerConnector
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.leases import LeaseTable, Verdict
from kvbridge.connectors.nixl.routing import DescTable
from kvbridge.connectors.nixl.scheduler import PushOrder, ReleaseOrder
from kvbridge.connectors.nixl.send_state import PushJob
from kvbridge.connectors.nixl.session import LocalLists, PeerSession, SessionKey
from kvbridge.connectors.nixl.settings import NixlSettings
from kvbridge.connectors.nixl.state import RecvTransfer
from kvbridge.connectors.nixl.verify import DigestAsk, SlicePlan
from kvbridge.connectors.params import TransferParams
from kvbridge.handshake import AgentMetadata, CompatHeader, HandshakeClient
from kvbridge.handshake import TransferMode as WireMode
from kvbridge.layouts import LayerMemory, ParallelTopology
from kvbridge.layouts.digests import SLICE_ALGORITHMS, Digester, slice_algorithm_of
from kvbridge.layouts.plan import rank_index

#: One logger for every part of the worker, named as when it was one module: tools
#: and tests listen on it (``tools/trace/__init__.py``, ``tests/connectors/nixl/netns_driver.py``).
logger = logging.getLogger("kvbridge.connectors.nixl.worker")

#: Transfer latency samples kept per rank (for percentiles in the demo and bench).
MAX_SAMPLES = 100_000
#: consumer agents a producer rank keeps as NIXL peers at once (a hello past it is refused)
MAX_CONSUMER_PEERS = 1024
#: push registrations kept for requests this rank does not hold yet
MAX_EARLY_REGISTERS = 4096
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


#: the name the worker's parts, tools and tests know a push job by
_PushJob = PushJob


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
    ``nixl_xfer_s``: NIXL's own telemetry of each READ of a pull load (post to
    completion, one per NIXL transfer; what vLLM's NixlConnector reports).
    """

    request_id: str
    ok: bool
    nbytes: int
    num_descs: int
    duration_s: float
    started_at: float = 0.0
    num_runs: int = 0  # contiguous runs NIXL posted after merging descriptors
    nixl_xfer_s: tuple[float, ...] = ()


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a hook under the worker's state lock (the idle pump shares the state)."""

    @functools.wraps(method)
    def wrapper(self: WorkerState, *args: Any, **kwargs: Any) -> Any:
        with self._state_lock:
            self._last_progress = time.monotonic()
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)

class WorkerState(WorkerConnector):
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
        #: records the push fence of a saved layer (so no WRITE precedes its kernels); a test may
        #: stand in for it
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
            # producer, push: registers not naming this request's prompt (or a second one)
            "registers_refused": 0,
            # producer: notifications of agents not (yet) peers, kept until their hello
            # or, after early_grace_s, rejected (notifs_rejected)
            "notifs_deferred": 0,
            # producer: begins that came before the hold started, answered when it did
            "begins_before_hold": 0,
            # verified KV: blocks checked against the producer's digests, found
            # different (each a failed load of that block), and loaded without a check
            "blocks_verified": 0, "digest_mismatches": 0, "blocks_unverified": 0,
            "loads_corrupt": 0, "digests_served": 0,
            # time and bytes this rank spent taking (producer) and checking (consumer) them
            "digest_time_s": 0.0, "digest_bytes": 0,
        }
        #: producer: notifications of agents that have not said hello, (received at, msg)
        self._deferred: dict[str, list[tuple[float, messages.Notif]]] = {}
        self._rejected_senders: dict[str, None] = {}  # insertion-ordered, bounded
        #: producer: agents whose hello did not authenticate (insertion-ordered, bounded):
        #: what they send next is rejected at once, not kept for a hello that came
        self._unauthenticated: dict[str, None] = {}
        self._expected_by_sizes: dict[ParallelTopology, int] = {}
        self._closed = False
        self._state_lock = threading.RLock()
        self._last_progress = time.monotonic()
        self._pump_stop = threading.Event()
        self._pump: threading.Thread | None = None
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
        #: producer: per request held, per (consumer rank topology, slice algorithm)
        #: known at hold start, block id -> slice digest per region (head slices at
        #: another TP)
        self._hold_slices: dict[str, dict[tuple[ParallelTopology, str],
                                          tuple[dict[int, int], ...]]] = {}
        # blocks x consumer-rank plans slice-digested as a hold started, or later (the
        # consumer rank was not known yet: its ``begin`` came first)
        self._counters.update({"slice_digests_at_hold": 0, "slice_digests_at_begin": 0})

    def _slicer(self, algorithm: str) -> Digester | None:
        """The digester that takes slice digests in ``algorithm`` (a slice algorithm): this
        rank's digester of its block algorithm (None: not one this rank computes)."""
        base = SLICE_ALGORITHMS.get(algorithm)
        return self._digesters.get(base) if base is not None else None

    @property
    def _slice_algorithms(self) -> tuple[str, ...]:
        """The slice algorithms this rank computes, in its preference order (one per
        digester: ``xxh3-64-slices``, ``torch-mix64-v1-slices``)."""
        return tuple(s for s in map(slice_algorithm_of, self._digesters) if s is not None)

    def _session_key(self, params: TransferParams) -> SessionKey:
        return (params.producer_engine_id, params.producer_host, params.producer_port)

    def _count_digests(self, started: float, block_ids: Sequence[Sequence[int]]) -> None:
        assert self._digester is not None
        self._counters["digest_time_s"] += time.perf_counter() - started
        self._counters["digest_bytes"] += sum(len(ids) * self._digester.block_bytes(r)
                                              for r, ids in enumerate(block_ids))

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

    def _lease_counters(self) -> dict[str, int]:
        lease = self._leases.stats
        return {"lease_expiries": lease.expiries, "late_notifs": lease.late_notifs,
                "unknown_notifs": lease.unknown_notifs, "holds_promised": lease.guarantees,
                "holds_promise_refused": lease.guarantees_refused,
                # begins, reads and releases not naming the sealed record, or from
                # another consumer engine than the one that claimed the hold
                "holds_refused": lease.refused}

    # ------------------------------------------------------------------ seams
    # What one part calls of another, for the type checker only (at run time the
    # NixlWorker's bases supply them; mypy checks each against its implementation).
    if TYPE_CHECKING:
        # .loads
        def _progress_recv(self, now: float) -> None: ...
        def _fail(self, recv: RecvTransfer, reason: str, now: float, *,
                  tell_producer: bool = True,
                  blocks: frozenset[tuple[int, int]] | None = None) -> None: ...
        def _send_releases(self, now: float) -> None: ...
        def _on_answer(self, sender: str, msg: messages.Ack | messages.Pushed,
                       now: float) -> None: ...
        def _on_held(self, sender: str, msg: messages.Held) -> None: ...

        # .load_checks
        def _begin_for(self, recv: RecvTransfer, session: PeerSession,
                       p: int) -> messages.Begin: ...
        def _ask_for(self, recv: RecvTransfer, session: PeerSession,
                     p: int) -> DigestAsk | None: ...
        def _take_digests(self, recv: RecvTransfer, producer_rank: int,
                          digests: tuple[bytes, ...], algorithm: str, reason: str) -> None: ...
        def _count_unchecked(self, recv: RecvTransfer) -> None: ...
        def _verify(self, recv: RecvTransfer) -> set[tuple[int, int]]: ...

        # .holds
        def _on_consumer_notif(self, sender: str, msg: messages.Notif, now: float) -> None: ...
        def _expire_deferred(self, now: float) -> None: ...
        def _reject(self, sender: str, reason: str) -> None: ...
        def _on_hello(self, sender: str, msg: messages.Hello, now: float) -> None: ...
        def _answer(self, verdict: Verdict) -> None: ...
        def _send_to(self, agent: str, msg: messages.Notif) -> None: ...

        # .hold_digests
        def _digests_for(self, begin: messages.Begin) -> tuple[tuple[bytes, ...], str]: ...
        def _slice_plan(self, topology: ParallelTopology) -> SlicePlan | None: ...
        def _count_slices(self, started: float, plan: SlicePlan,
                          block_ids: Sequence[Sequence[int]], counter: str) -> None: ...
        def _slice_digests_for(self, begin: messages.Begin, consumer: _ConsumerPeer
                               ) -> tuple[tuple[bytes, ...], str]: ...

        # .push_consumer
        def _post_registers(self, recv: RecvTransfer, session: PeerSession) -> None: ...

        # .push
        def _prepare_push(self, consumer: _ConsumerPeer) -> _PushLists | None: ...
        def _on_register(self, sender: str, reg: messages.Register, now: float) -> None: ...
        def _progress_pushes(self, now: float) -> None: ...

        # .pump
        @property
        def handshake_deadline_s(self) -> float: ...
        def _ensure_session(self, params: TransferParams, now: float) -> None: ...
        def _session_ready(self, key: SessionKey) -> PeerSession | None: ...
        def _drop_session(self, key: SessionKey, now: float, reason: str) -> None: ...
