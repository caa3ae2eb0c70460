"""Worker half of the PD connector: one transport agent per rank; pull and push data paths.

Registration happens once (:meth:`PdWorker.register_kv_caches`: every layer
tensor is one registered region). Descriptor lists are prepared once per plan
(local) and per remote rank (right after the handshake, see
:mod:`~kvbridge.connectors.pd.session`); a request only builds index arrays.

Every engine step the worker *progresses*: it drains the transport's notifications (which
also progresses a transport without a thread of its own, as the passive side of a
READ must), settles
handshakes run on its handshake threads (each bounded by a deadline), posts what became postable,
polls transfers, enforces deadlines and leases, and sends heartbeats. A rank
never blocks on the network inside a hook.

Consumer rank, pull: for each source producer rank, send ``begin`` (the
producer answers ``held``: a promise to keep the blocks ``lease_s`` longer, or
no promise), READ (block pairs ordered so a transport can merge contiguous runs), then
send a ``read`` notification once the READ is done here; the producer answers
each ``read`` with an ``ack`` (``ok=False`` when its lease had expired: the
bytes may be stale). The request is DONE when, for every source, the ack came
ok or the READ ended inside that source's promise (measured from sending the
``begin``: no clock is shared). Consumer rank, push: ``register`` its block
ids with every producer rank it notifies, DONE when every source sent
``pushed``.

Producer rank: holds finished requests under a :class:`LeaseTable`; pull
completes when every expected consumer rank notified (promises given to
``begin`` are kept: by the lease, and past :meth:`PdWorker.shutdown` by
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
past :attr:`PdWorker.handshake_deadline_s` fails its requests and is abandoned.

Where it lives: this module owns :class:`PdWorker` (the public class, a
facade), registration (the transport its adapter's factory makes, the
registered regions, the digesters, the handshake record), the engine's hooks (each under the state lock, routed
to the parts) and the order of a progress step, and shutdown. The state lives
in the parts, objects that own it and talk through explicit calls, each given
the narrow :class:`~kvbridge.connectors.pd.worker_state.WorkerContext`:
:mod:`.sessions` (the consumer's sessions), :mod:`.loads` (the consumer's
loads), :mod:`.load_checks` (verification of landed blocks),
:mod:`.push_consumer` (a push load's registers), :mod:`.holds` (the producer's
lease/hold side), :mod:`.hold_digests` (the producer's digests), :mod:`.push`
(the producer side of push), the :class:`~.leases.LeaseTable`, and
:mod:`.pump` (the state lock and the idle thread). The parts speak to the
transport through :class:`~.transport.PdTransport`; tracing attaches an
observer (:meth:`PdWorker.observe`, :mod:`.observe`); fault injection wraps
the transport (:meth:`PdWorker.wrap_transport`, :mod:`.faults`). This module
may not hold a part's logic; names other modules import from here stay
importable from here (``__all__``).
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from kvbridge.backends.device.fence import Fence, record_fence
from kvbridge.backends.transfer import TransportCounters
from kvbridge.connectors.api import BlockRef, ConnectorContext, KVCaches, WorkerConnector
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.hold_digests import HoldDigests
from kvbridge.connectors.pd.holds import MAX_DEFERRED_PER_AGENT, Holds
from kvbridge.connectors.pd.leases import LeaseTable
from kvbridge.connectors.pd.load_checks import LoadChecks
from kvbridge.connectors.pd.loads import Loads
from kvbridge.connectors.pd.observe import ObservedTransport, WorkerObserver
from kvbridge.connectors.pd.pump import Pump
from kvbridge.connectors.pd.push import PushSender
from kvbridge.connectors.pd.push_consumer import PushRegisters
from kvbridge.connectors.pd.scheduler import PdMetadata
from kvbridge.connectors.pd.sessions import Sessions
from kvbridge.connectors.pd.transport import PdTransport, TransportFactory
from kvbridge.connectors.pd.worker_state import (
    LATENCY_BUCKETS_MS,
    TransferRecord,
    WorkerContext,
    _PushJob,
    histogram_percentile,
    latency_key,
    logger,
)
from kvbridge.handshake import AgentMetadata, encode_agent
from kvbridge.layouts import LayerMemory
from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    TORCH_ALGORITHM,
    TORCH_SLICE_ALGORITHM,
    BlockDigester,
    Digester,
    LayerSpan,
    digest_algorithms,
    slice_algorithm_of,
)
from kvbridge.layouts.kv_memory import all_host_readable
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

#: What other modules, tools and tests import from here (the worker was one module):
#: the class, its records, the latency histogram and the bounds tests check against.
__all__ = [
    "LATENCY_BUCKETS_MS",
    "MAX_DEFERRED_PER_AGENT",
    "OFFERED_DIGESTS",
    "PdWorker",
    "TransferRecord",
    "_PushJob",
    "histogram_percentile",
    "keep_alive",
    "latency_key",
]

#: KV memory of shut-down workers that promised a hold which has not run out yet:
#: ``(until, tensors)``, dropped lazily once ``until`` passed (see ``PdWorker.shutdown``).
_KEPT_ALIVE: list[tuple[float, list[Any]]] = []
_KEPT_LOCK = threading.Lock()


def keep_alive(tensors: list[Any], until: float) -> None:
    """Keep ``tensors`` referenced until ``time.monotonic() >= until`` (checked lazily)."""
    now = time.monotonic()
    with _KEPT_LOCK:
        _KEPT_ALIVE[:] = [(u, t) for u, t in _KEPT_ALIVE if u > now]
        if until > now and tensors:
            _KEPT_ALIVE.append((until, tensors))


#: the digest algorithms this version may offer (its handshake record, see _offered_digests);
#: each block algorithm's slice digests come right after it (its digester computes them):
#: host memory, by default ``("xxh3-64", "xxh3-64-slices", "torch-mix64-v1",
#: "torch-mix64-v1-slices")``; a GPU rank ``("torch-mix64-v1", "torch-mix64-v1-slices")``
OFFERED_DIGESTS = (ALGORITHM, SLICE_ALGORITHM, TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run a hook under the worker's state lock (the idle pump shares the state)."""

    @functools.wraps(method)
    def wrapper(self: PdWorker, *args: Any, **kwargs: Any) -> Any:
        with self.pump.lock:
            self.pump.touch()
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


class PdWorker(WorkerConnector):
    """One rank's PD worker: a facade over its parts, routing the engine's hooks.

    Every hook that touches the state runs under the state lock (:func:`_locked`),
    as the idle pump does: the state is only ever touched by one thread at a time."""

    def __init__(self, ctx: ConnectorContext, transport_factory: TransportFactory) -> None:
        super().__init__(ctx)
        #: makes this rank's transport at registration (the adapter's choice)
        self.transport_factory = transport_factory
        cx = self.cx = WorkerContext(ctx)
        self.settings = cx.settings
        self.rank = cx.rank
        self.rank_index = cx.rank_index
        #: records the push fence of a saved layer (so no WRITE precedes its kernels); a test may
        #: stand in for it
        self.record_fence: Callable[[Any], Fence] = record_fence
        self.leases = LeaseTable(cx.settings.lease_s, cx.settings.early_grace_s)
        self.sessions = Sessions(cx)
        self.checks = LoadChecks(cx)
        self.registers = PushRegisters(cx, self.checks)
        self.loads = Loads(cx, self.sessions, self.checks, self.registers)
        self.hold_digests = HoldDigests(cx)
        self.holds = Holds(cx, self.leases, self.hold_digests)
        self.push = PushSender(cx, self.leases, self.holds, self.hold_digests)
        self.holds.attach(self.push)
        self.pump = Pump(cx, self._progress, self._peer_may_wait, self.loads.reading)
        self._kv_tensors: list[Any] = []
        self._final_counters: TransportCounters | None = None

    @property
    def transport(self) -> PdTransport | None:
        """This rank's transport (None before ``register_kv_caches``)."""
        return self.cx.transport

    @property
    def memory(self) -> dict[int, LayerMemory]:
        """This rank's KV memory per layer (empty before ``register_kv_caches``)."""
        return self.cx.memory

    @property
    def handshake_deadline_s(self) -> float:
        """Longest one handshake may take before its requests fail and it is abandoned."""
        return self.sessions.handshake_deadline_s

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, caches: KVCaches) -> None:
        cx = self.cx
        name = f"kvb-{self.ctx.engine_id[:32]}-r{cx.rank_index}-{uuid.uuid4().hex[:8]}"
        transport = self.transport_factory(name, cx.settings)
        cx.transport = transport
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
                cx.memory[layer] = LayerMemory(int(tensor.data_ptr()), stride,
                                               caches.num_blocks[index])
                num_blocks.add(caches.num_blocks[index])
            strides.append(stride)
        # One registration per backing storage: views that alias (vLLM's hybrid groups)
        # or share one allocation are registered once, not once per view.
        transport.register_regions(caches.backing_spans())
        self._kv_tensors = tensors  # kept alive past shutdown while a hold is promised
        self.pump.start()
        mem_type, device_id = transport.memory_type  # announced: peers prep our lists with it
        if cx.settings.verify_policy.enabled:
            # XXH3 reads the KV through host pointers: only KV the host may read (not
            # GPU memory, not guarded host memory standing in for it)
            cx.digesters = self._make_digesters(
                caches, tensors, mem_type == "DRAM" and all_host_readable(tensors))
            cx.digester = next(iter(cx.digesters.values()), None)
        meta = AgentMetadata.build(self.ctx.engine_id, name, transport.agent_metadata(),
                                   self.ctx.spec, cx.rank, layer_addrs,
                                   max(num_blocks) if num_blocks else 0, strides,
                                   mem_type=mem_type, device_id=device_id,
                                   digests=self._offered_digests())
        cx.agent_doc = encode_agent(meta)

    def _make_digesters(self, caches: KVCaches, tensors: list[Any], host_memory: bool
                        ) -> dict[str, Digester]:
        """The digesters of every algorithm this rank offers (``verify_algorithms``, less
        XXH3-64 when the KV is not in host memory), in preference order."""
        regions = [s.layer_ids for s in caches.shapes]
        block_bytes = {layer: caches.shapes[caches.region_index_of_layer(layer)]
                       .block_bytes_per_layer for layer in self.cx.memory}
        out: dict[str, Digester] = {}
        for alg in digest_algorithms(host_memory, self.cx.settings.verify_algorithms):
            if alg == ALGORITHM:
                out[alg] = BlockDigester(
                    {layer: LayerSpan(mem.base_addr, mem.block_stride, block_bytes[layer],
                                      mem.num_blocks) for layer, mem in self.cx.memory.items()},
                    regions, owner=tensors)
            else:  # torch-mix64-v1: on the tensors' own device (GPU memory included)
                out[alg] = TorchBlockDigester(
                    {layer: TensorSpan(caches.layers[layer], mem.block_stride,
                                       block_bytes[layer], mem.num_blocks)
                     for layer, mem in self.cx.memory.items()}, regions)
        if self.cx.settings.verify_algorithms and not out:
            logger.warning("pd: engine=%s rank=%d: none of verify_algorithms %s can digest "
                           "this rank's KV (XXH3-64 needs host memory); it offers no digests",
                           self.cx.engine_id, self.cx.rank_index,
                           list(self.cx.settings.verify_algorithms))
        return out

    def _offered_digests(self) -> tuple[str, ...]:
        """The algorithms this rank's handshake offers: its digesters' (preference order),
        each followed by its slice algorithm (the same digester computes it)."""
        out: list[str] = []
        for alg in self.cx.digesters:
            sliced = slice_algorithm_of(alg)
            out.extend(a for a in (alg, sliced) if a in OFFERED_DIGESTS)
        return tuple(out)

    def get_handshake_metadata(self) -> bytes | None:
        return self.cx.agent_doc

    # ------------------------------------------------------------------ tools

    @_locked
    def observe(self, observer: WorkerObserver) -> None:
        """Tell ``observer`` what this rank does from now on (tracing, fault injection):
        the parts' events, and the transport's (wrapped in an
        :class:`~.observe.ObservedTransport`). Call after ``register_kv_caches``."""
        assert self.cx.transport is not None, "observe a registered worker"
        self.cx.observer.attach(observer)
        self.cx.transport = ObservedTransport(self.cx.transport, observer)

    @_locked
    def wrap_transport(self, wrap: Callable[[PdTransport], PdTransport]) -> None:
        """Put ``wrap(transport)`` between the parts and the transport from now on (fault
        injection, :mod:`.faults`). Call after ``register_kv_caches``."""
        assert self.cx.transport is not None, "wrap a registered worker's transport"
        self.cx.transport = wrap(self.cx.transport)

    # ------------------------------------------------------------------ hooks

    @_locked
    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, PdMetadata)
        now = time.monotonic()
        for hold in meta.holds:
            if hold.push:
                self.push.start(hold, now)
            self.holds.start(hold, now)
        self.cx.observer.loads_ordered(meta.loads)
        for order in meta.loads:
            self.loads.start(order, now)
        for release in meta.releases:
            self.loads.release(release, now)
        for params in meta.heartbeats:
            self.sessions.heartbeat(params, now)
        for rid in meta.cancels:
            self.loads.cancel(rid, now)
        self.push.take_orders(meta.drops, meta.pushes, now)
        self._progress()

    def wait_for_layer_load(self, layer_id: int) -> None:
        """Loads are asynchronous (requests wait in WAITING_FOR_REMOTE_KVS): nothing to wait for."""

    @_locked
    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None:
        self.push.fence_layer(layer_id, kv_layer, self.record_fence)

    @_locked
    def wait_for_save(self) -> None:
        """Writes stay in flight across steps; the blocks are held by ``delay_free``.

        A fence over the whole step covers every layer of the step's final pushes
        (for engines that do not call ``save_kv_layer`` per layer)."""
        self.push.fence_step(self._kv_tensors[0] if self._kv_tensors else None,
                             self.record_fence)

    @_locked
    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        self._progress()
        done_sending: set[str] = set()
        completed, expired = self.leases.take_finished()
        for rid in completed + expired:
            done_sending.add(rid)
            self.push.forget(rid)
            self.hold_digests.forget(rid)
        self.cx.stats.count("finished_sending", len(done_sending))
        done_recving = self.loads.take_finished()
        self.cx.observer.finished(done_sending, done_recving)
        return done_sending, done_recving

    @_locked
    def get_failed_recving(self) -> set[str]:
        """The failed ones among the loads the last :meth:`get_finished` reported."""
        return self.loads.take_failed()

    @_locked
    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        return self.loads.take_load_errors()

    @_locked
    def get_stats(self) -> dict[str, int | float]:
        """This rank's cumulative counters (the engine keeps the latest snapshot)."""
        stats = self.cx.stats.snapshot()
        stats.update(self._lease_counters())
        return stats

    @_locked
    def totals(self) -> dict[str, int | float]:
        """Cumulative counters of this rank (not reset by :meth:`get_stats`)."""
        stats = self.cx.stats.snapshot()
        stats.update(self._lease_counters())
        stats["held"] = len(self.leases.held())
        stats["in_flight"] = self.loads.in_flight
        stats["sessions"] = len(self.sessions.items())
        if self.cx.transport is not None:
            c = self.cx.transport.counters()
            kind = self.transport_factory.name
            stats.update({f"{kind}_registrations": c.registrations, f"{kind}_dlists": c.dlists,
                          f"{kind}_xfer_handles": c.xfer_handles, f"{kind}_peers": c.peers,
                          f"{kind}_zombies": c.zombies,
                          f"{kind}_forced_releases": c.forced_releases})
        return stats

    def _lease_counters(self) -> dict[str, int]:
        lease = self.leases.stats
        return {"lease_expiries": lease.expiries, "late_notifs": lease.late_notifs,
                "unknown_notifs": lease.unknown_notifs, "holds_promised": lease.guarantees,
                "holds_promise_refused": lease.guarantees_refused,
                # begins, reads and releases not naming the sealed record, or from
                # another consumer engine than the one that claimed the hold
                "holds_refused": lease.refused}

    @_locked
    def records(self) -> list[TransferRecord]:
        """Finished loads/pushes of this rank (latency samples), oldest first."""
        return self.cx.stats.records()

    @_locked
    def progress(self) -> None:
        """Progress outside an engine step (an idle engine loop may call it)."""
        self._progress()

    # ------------------------------------------------------------------ the pump's step

    def _progress(self) -> None:
        """One step of every part, in order (under the state lock: a hook or the pump)."""
        if self.cx.transport is None or self.pump.closed:
            return
        now = time.monotonic()
        self.pump.touch()
        self._drain_notifs(now)
        for key, reason, handshake in self.sessions.settle(now):
            self.loads.fail_key(key, reason, now, handshake=handshake)
        if self.loads.progress(now):
            # a READ just ended (often inside the post: shared memory copies at once);
            # the producers' ``held`` answers arrived meanwhile: take them now, not a
            # step later, so the load completes in this very call
            now = time.monotonic()
            self._drain_notifs(now)
            self.loads.progress(now)
        self.loads.send_releases(now)
        self.push.progress(now)
        self.holds.expire(now)
        self.push.prune(now)
        self.loads.prune(now)
        self.sessions.heartbeats(now, self.loads.producer_rids_by_key)

    def _peer_may_wait(self) -> bool:
        """Outstanding work a peer may be waiting on (read without the lock: a
        hint for the pump's interval only, never for the worker's state)."""
        return (self.loads.busy or self.push.busy or self.sessions.busy
                or bool(self.leases.held()))

    def _drain_notifs(self, now: float) -> None:
        assert self.cx.transport is not None
        for sender, msgs in self.cx.transport.get_notifs().items():
            for raw in msgs:
                try:
                    msg = messages.decode(raw)
                except messages.NotifError as exc:
                    self.cx.stats.count("bad_notifs")
                    logger.warning("pd: bad notification from %s: %s", sender, exc)
                    continue
                try:
                    self._on_notif(sender, msg, now)
                except Exception as exc:  # one peer's bad message must not stop the rank
                    self.cx.stats.count("bad_notifs")
                    logger.warning("pd: notification %s from %s refused: %s",
                                   type(msg).__name__, sender, exc)

    def _on_notif(self, sender: str, msg: messages.Notif, now: float) -> None:
        """Route a notification to the part it is for."""
        self.cx.observer.notif_received(sender, msg)
        if isinstance(msg, messages.Hello):
            self.holds.on_hello(sender, msg, now)
        elif isinstance(msg, messages.Ack | messages.Pushed):
            self.loads.on_answer(sender, msg, now)  # bound to the session's producer agent
        elif isinstance(msg, messages.Held):
            self.loads.on_held(sender, msg)
        else:
            self.holds.on_consumer_notif(sender, msg, now)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if not self.pump.stop():
            return
        self.sessions.stop_handshakes()
        transport = self.cx.transport
        if transport is None:
            return
        now = time.monotonic()
        self.loads.close(now)
        self.sessions.close()
        self.push.close()
        self.holds.close()
        # a consumer may be reading under our promise (``held``): the memory must stay
        # as it is until the promise ran out, even though this worker is gone
        keep_alive(self._kv_tensors, self.leases.guaranteed_until)
        self._kv_tensors = []
        final = transport.close(strict=False)
        if final.live:
            logger.error("pd worker %s rank %d leaked at shutdown: %s", self.ctx.engine_id,
                         self.rank_index, final)
        self._final_counters = final
