"""What every part of a :class:`~kvbridge.connectors.pd.worker.PdWorker` shares: its context.

The worker is composed of parts that own their state (:mod:`.loads`,
:mod:`.load_checks`, :mod:`.push_consumer`, :mod:`.holds`, :mod:`.hold_digests`,
:mod:`.push`, :mod:`.sessions`); each gets the narrow
:class:`WorkerContext` (who the rank is, its settings, the transport, its KV
memory and digesters, the counters, the log, the observer) and the parts it
calls, passed in. No part writes another's attributes: a part asks another
through its methods (``tests/connectors/pd/test_part_ownership.py`` checks it).

This module owns the context, the counters and transfer records
(:class:`WorkerStats`, the one sink every part counts into) and the small
records the parts pass each other; it imports none of the parts (they import it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvbridge.backends.transfer import DescList, PeerHandle
from kvbridge.connectors.api import ConnectorContext
from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd.observe import Observers
from kvbridge.connectors.pd.routing import DescTable
from kvbridge.connectors.pd.send_state import PushJob
from kvbridge.connectors.pd.session import PeerSession, SessionKey
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.pd.transport import PdTransport
from kvbridge.connectors.pd.verify import SlicePlan, slice_bytes
from kvbridge.handshake import AgentMetadata, CompatHeader
from kvbridge.handshake import TransferMode as WireMode
from kvbridge.layouts import LayerMemory, ParallelTopology
from kvbridge.layouts.digests import SLICE_ALGORITHMS, Digester, slice_algorithm_of
from kvbridge.layouts.plan import rank_index

#: One logger for every part of the worker, named as when it was one module: tools
#: and tests listen on it (``tools/trace/__init__.py``, the network-namespace driver).
logger = logging.getLogger("kvbridge.connectors.pd.worker")

#: Transfer latency samples kept per rank (for percentiles in the demo and bench).
MAX_SAMPLES = 100_000
#: consumer agents a producer rank keeps as transport peers at once (a hello past it is refused)
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
    ``library_xfer_s``: the transport library's own telemetry of each READ of a pull
    load (post to completion, one per transfer), where the library gives one.
    """

    request_id: str
    ok: bool
    nbytes: int
    num_descs: int
    duration_s: float
    started_at: float = 0.0
    num_runs: int = 0  # contiguous runs the transport posted after merging descriptors
    library_xfer_s: tuple[float, ...] = ()


class WorkerStats:
    """One rank's counters and transfer records: the one sink every part counts into.

    Parts count through :meth:`count` and :meth:`record` (never by writing the
    dictionary); the facade reads :meth:`snapshot` and :meth:`records`."""

    def __init__(self) -> None:
        self._values: dict[str, int | float] = {
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
            # blocks x consumer-rank plans slice-digested as a hold started, or later (the
            # consumer rank was not known yet: its ``begin`` came first)
            "slice_digests_at_hold": 0, "slice_digests_at_begin": 0,
        }
        self._records: list[TransferRecord] = []

    def count(self, name: str, n: int | float = 1) -> None:
        self._values[name] = self._values.get(name, 0) + n

    def count_transfer(self, nbytes: int, ndescs: int, duration_s: float, runs: int) -> None:
        self.count("transfers")
        self.count("transfer_bytes", nbytes)
        self.count("transfer_descs", ndescs)
        self.count("transfer_runs", runs)
        self.count("transfer_time_s", duration_s)

    def record(self, record: TransferRecord) -> None:
        if record.ok:
            ms = record.duration_s * 1000.0
            self.count(next((latency_key(b) for b in LATENCY_BUCKETS_MS if ms <= b),
                            "latency_ms_le_inf"))
        self._records.append(record)
        if len(self._records) > MAX_SAMPLES:
            del self._records[: len(self._records) - MAX_SAMPLES]

    def snapshot(self) -> dict[str, int | float]:
        return dict(self._values)

    def records(self) -> list[TransferRecord]:
        return list(self._records)


class WorkerContext:
    """What every part of one rank's worker may use: who it is, its settings, the
    transport, its KV memory and digesters, the counters, the observer.

    The facade (:class:`~kvbridge.connectors.pd.worker.PdWorker`) fills it (the
    transport, memory and digesters at ``register_kv_caches``) and is the only
    writer of its fields; a part reads them."""

    def __init__(self, ctx: ConnectorContext) -> None:
        assert ctx.rank is not None
        self.ctx = ctx
        self.engine_id = ctx.engine_id
        self.spec = ctx.spec
        self.settings: PdSettings = ctx.extra if isinstance(ctx.extra, PdSettings) \
            else PdSettings()
        self.rank: ParallelTopology = ctx.rank
        self.sizes = ctx.topology.sizes()
        self.rank_index = rank_index(ctx.rank)
        #: the engine's "no block here" id (:class:`~kvbridge.connectors.ConnectorContext`)
        self.null_block_id = ctx.null_block_id
        self.header = CompatHeader.from_spec(ctx.spec, WireMode(self.settings.mode.value))
        self.auth = self.settings.cluster_auth()
        self.stats = WorkerStats()
        self.log = logger
        #: the observers attached (tracing, fault injection); none by default
        self.observer = Observers()
        #: None until ``register_kv_caches``; the parts run only after it
        self.transport: PdTransport | None = None
        self.memory: dict[int, LayerMemory] = {}
        #: the digesters of the algorithms this rank offers, in its preference order
        #: (host memory: XXH3-64 and torch-mix64-v1; GPU memory: torch-mix64-v1 only)
        self.digesters: dict[str, Digester] = {}
        #: the first of them, whose digests a producer takes as every hold starts (None:
        #: verification off)
        self.digester: Digester | None = None
        #: this rank's agent record (``hello``s carry it), set at registration
        self.agent_doc = b""

    @property
    def io(self) -> PdTransport:
        """The transport (the parts run only once the KV is registered)."""
        assert self.transport is not None
        return self.transport

    def slicer(self, algorithm: str) -> Digester | None:
        """The digester that takes slice digests in ``algorithm`` (a slice algorithm): this
        rank's digester of its block algorithm (None: not one this rank computes)."""
        base = SLICE_ALGORITHMS.get(algorithm)
        return self.digesters.get(base) if base is not None else None

    @property
    def slice_algorithms(self) -> tuple[str, ...]:
        """The slice algorithms this rank computes, in its preference order (one per
        digester: ``xxh3-64-slices``, ``torch-mix64-v1-slices``)."""
        return tuple(s for s in map(slice_algorithm_of, self.digesters) if s is not None)

    def count_digests(self, started: float, block_ids: Sequence[Sequence[int]]) -> None:
        assert self.digester is not None
        self.stats.count("digest_time_s", time.perf_counter() - started)
        self.stats.count("digest_bytes", sum(len(ids) * self.digester.block_bytes(r)
                                             for r, ids in enumerate(block_ids)))

    def count_slices(self, started: float, plan: SlicePlan,
                     block_ids: Sequence[Sequence[int]], counter: str) -> None:
        hashed = [(r, len(ids)) for r, ids in enumerate(block_ids)
                  if r < len(plan.layers) and plan.layers[r] and r not in plan.whole]
        self.stats.count("digest_time_s", time.perf_counter() - started)
        self.stats.count("digest_bytes", sum(n * slice_bytes(plan.layers[r]) for r, n in hashed))
        self.stats.count(counter, sum(n for _r, n in hashed))


def session_key(params: TransferParams) -> SessionKey:
    """The producer engine a load's params name: its session's key."""
    return (params.producer_engine_id, params.producer_host, params.producer_port)
