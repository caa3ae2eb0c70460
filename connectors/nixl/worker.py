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

Where it lives: this module owns :class:`NixlWorker` (the public class),
registration (the NIXL agent, the registered regions, the digesters, the
handshake record), the engine's hooks (each under the state lock, in the order
of work above) and shutdown. The rest are the worker's parts, mixins over
:class:`~kvbridge.connectors.nixl.worker_state.WorkerState` (the shared state,
and why mixins): :mod:`.loads` (the consumer's load path), :mod:`.load_checks`
(verification of landed blocks), :mod:`.holds` (the producer's lease/hold side),
:mod:`.hold_digests` (the producer's digests), :mod:`.push` (both sides of
push), :mod:`.pump` (the progress pump and the consumer's sessions). Fault
injection for tests and demos is a wrapper around a worker, :mod:`.faults`.
This module may not hold a part's logic; names other modules import from here
stay importable from here (``__all__``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import wait as wait_futures
from typing import Any

from kvbridge.backends.device.fence import Fence
from kvbridge.backends.nixl import NixlTransport
from kvbridge.connectors.api import BlockRef, KVCaches
from kvbridge.connectors.nixl.hold_digests import HoldDigests
from kvbridge.connectors.nixl.holds import MAX_DEFERRED_PER_AGENT, HoldSide
from kvbridge.connectors.nixl.load_checks import LoadChecks
from kvbridge.connectors.nixl.loads import LoadPath
from kvbridge.connectors.nixl.pump import ProgressPump
from kvbridge.connectors.nixl.push import PushSender
from kvbridge.connectors.nixl.push_consumer import PushRegisters
from kvbridge.connectors.nixl.scheduler import NixlMetadata
from kvbridge.connectors.nixl.worker_state import (
    LATENCY_BUCKETS_MS,
    TransferRecord,
    WorkerState,
    _locked,
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
    "NixlWorker",
    "TransferRecord",
    "_PushJob",
    "histogram_percentile",
    "keep_alive",
    "latency_key",
]

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


#: the digest algorithms this version may offer (its handshake record, see _offered_digests);
#: each block algorithm's slice digests come right after it (its digester computes them):
#: host memory, by default ``("xxh3-64", "xxh3-64-slices", "torch-mix64-v1",
#: "torch-mix64-v1-slices")``; a GPU rank ``("torch-mix64-v1", "torch-mix64-v1-slices")``
OFFERED_DIGESTS = (ALGORITHM, SLICE_ALGORITHM, TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)


class NixlWorker(LoadPath, LoadChecks, PushRegisters, HoldSide, HoldDigests, PushSender,
                 ProgressPump, WorkerState):
    """One rank's NIXL worker: its parts (the bases) and the hooks the engine calls.

    Every hook that touches the state runs under the state lock (:func:`_locked`),
    as the idle pump does: the state is only ever touched by one thread at a time."""

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, caches: KVCaches) -> None:
        name = f"kvb-{self.ctx.engine_id[:32]}-r{self.rank_index}-{uuid.uuid4().hex[:8]}"
        transport = NixlTransport(name, lanes=self.settings.lanes)
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
            # XXH3 reads the KV through host pointers: only KV the host may read (not
            # GPU memory, not guarded host memory standing in for it)
            self._digesters = self._make_digesters(
                caches, tensors, mem_type == "DRAM" and all_host_readable(tensors))
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

    def _offered_digests(self) -> tuple[str, ...]:
        """The algorithms this rank's handshake offers: its digesters' (preference order),
        each followed by its slice algorithm (the same digester computes it)."""
        out: list[str] = []
        for alg in self._digesters:
            sliced = slice_algorithm_of(alg)
            out.extend(a for a in (alg, sliced) if a in OFFERED_DIGESTS)
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
            for verdict in self._leases.hold(hold.request_id, now, hold.record):
                self._answer(verdict)
            for _at, sender, begin in self._early_begins.pop(hold.request_id, []):
                self._early_begin_ids -= sum(len(g) for g in begin.digest_ids)
                self._on_consumer_notif(sender, begin, now)
        for order in meta.loads:
            self._start_load(order, now)
        for release in meta.releases:
            self._releases.append(release)
            self._ensure_session(release.params, now)
        for params in meta.heartbeats:
            self._heartbeat_params(params)
        for rid in meta.cancels:
            self._cancel_load(rid, now)
        self._take_push_orders(meta.drops, meta.pushes, now)
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
                job.fence(fence, frozenset((layer_id,)))
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
                job.fence(fence, frozenset(self.memory))
                if self._release_fenced(job):
                    self._post_push_writes(job)
        self._step_pushes = ()

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
