"""Push, producer side: this rank writes each layer to the consumer ranks that registered.

Lists for writing to a consumer rank are prepared once, at its ``hello``. A
push job (:class:`~.send_state.PushJob`, one per request) WRITEs a layer to
every registered consumer rank once the layer's push fence passed (never
before the kernels that wrote it finished), or everything at once when the
registration came after the prompt's last step; when a consumer rank's writes
are done it sends ``pushed`` (with the digests taken once every layer was
final) and notifies the lease. Each consumer rank's push is a
:class:`~.send_state.SendTransfer`, whose states change only through its
methods (:mod:`.send_state` draws both machines); this module decides when,
and does the I/O.

Owns: ``_push_jobs``, ``_early_registers``, ``_cancelled``, ``_step_pushes``,
the consumer peers' push lists (prepared here, kept by :mod:`.holds` with the
peer), the push counters, the ``pushed`` answers. Calls: the lease table, the
holds (answers, rejections, the consumer peers) and the hold digests
(algorithms, slice plans) it is given. May not touch: the consumer side of push
(:mod:`.push_consumer`), pull loads, nor the sessions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from kvbridge.backends.device.fence import Fence
from kvbridge.backends.transfer import TransportError, XferOp, XferState
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.hold_digests import HoldDigests
from kvbridge.connectors.pd.holds import Holds
from kvbridge.connectors.pd.leases import LeaseTable
from kvbridge.connectors.pd.routing import build_table, pair_indices
from kvbridge.connectors.pd.scheduler import HoldOrder, PushOrder
from kvbridge.connectors.pd.send_state import PushJob, SendState, SendTransfer
from kvbridge.connectors.pd.session import check_remote_coverage
from kvbridge.connectors.pd.verify import answer_ask, take_hold_digests, take_slice_digests
from kvbridge.connectors.pd.worker_state import (
    MAX_EARLY_REGISTERS,
    TransferRecord,
    WorkerContext,
    _ConsumerPeer,
    _PushLists,
)
from kvbridge.layouts import LayoutError
from kvbridge.layouts.digests import SLICE_ALGORITHMS, block_algorithm_of
from kvbridge.layouts.plan import plan_consumer_rank


class PushSender:
    """Push, producer: the per-layer WRITEs to the consumer ranks that registered."""

    def __init__(self, cx: WorkerContext, leases: LeaseTable, holds: Holds,
                 digests: HoldDigests) -> None:
        self.cx = cx
        self.leases = leases
        self.holds = holds
        self.digests = digests
        self._push_jobs: dict[str, PushJob] = {}
        self._early_registers: dict[str, list[tuple[str, messages.Register]]] = {}
        self._step_pushes: tuple[PushOrder, ...] = ()
        self._cancelled: dict[str, float] = {}  # push rids cancelled before known

    @property
    def jobs(self) -> Mapping[str, PushJob]:
        """The push jobs by request id (read only)."""
        return MappingProxyType(self._push_jobs)

    @property
    def busy(self) -> bool:
        """Pushes a consumer may be waiting on (a hint for the idle pump)."""
        return bool(self._push_jobs)

    def start(self, hold: HoldOrder, now: float) -> None:
        """A push hold starts: its job (the blocks come with the push orders)."""
        job = self._push_jobs.setdefault(hold.request_id,
                                         PushJob(hold.request_id, hold.block_ids,
                                                 started_at=now))
        job.release(hold.block_ids, self.cx.null_block_id)

    def fence_layer(self, layer_id: int, kv_layer: Any,
                    record_fence: Callable[[Any], Fence]) -> None:
        """``save_kv_layer``: the layer's writes wait for the fence of its kernels."""
        fence: Fence | None = None
        for push in self._step_pushes:
            job = self._push_jobs.get(push.request_id)
            if job is not None and push.final:
                if fence is None:  # one fence for the layer, whatever the number of requests
                    fence = record_fence(kv_layer)
                job.fence(fence, frozenset((layer_id,)))
                if self._release_fenced(job):
                    self._post_push_writes(job)

    def fence_step(self, kv_tensor: Any, record_fence: Callable[[Any], Fence]) -> None:
        """``wait_for_save``: a fence over the whole step covers every layer of the
        step's final pushes (for engines that do not call ``save_kv_layer`` per layer)."""
        fence: Fence | None = None
        for push in self._step_pushes:
            job = self._push_jobs.get(push.request_id)
            if job is not None and push.final and self.cx.memory:
                if fence is None:
                    fence = record_fence(kv_tensor)
                job.fence(fence, frozenset(self.cx.memory))
                if self._release_fenced(job):
                    self._post_push_writes(job)
        self._step_pushes = ()

    def prune(self, now: float) -> None:
        """Forget cancellations of requests no push order named within ``lease_s``."""
        for rid, at in list(self._cancelled.items()):
            if now - at > self.cx.settings.lease_s:
                del self._cancelled[rid]

    def close(self) -> None:
        """Shutdown: every push job is forgotten."""
        for rid in list(self._push_jobs):
            self.forget(rid)

    def take_orders(self, drops: tuple[str, ...], pushes: tuple[PushOrder, ...],
                          now: float) -> None:
        """Producer, in ``start_load_kv``: this step's aborted push requests (``drops``) and
        push orders (the prompt's blocks so far; ``final`` in its last step)."""
        for rid in drops:
            self._early_registers.pop(rid, None)
            job = self._push_jobs.get(rid)
            if job is not None:
                self._drop_job(job)
                for target in job.targets.values():
                    if target.state is SendState.CANCELLING \
                            and not self._writes_pending(target):
                        target.cancelled("producer request aborted", now)
                        self._finish_push_target(job, target, now)
                self._maybe_drop_job(job)
        self._step_pushes = pushes
        for push in pushes:
            job = self._push_jobs.setdefault(push.request_id,
                                             PushJob(push.request_id, started_at=now))
            if self._cancelled.pop(push.request_id, None) is not None:
                self._drop_job(job)  # its targets are answered as their writes settle
            job.order(tuple(tuple(g) for g in push.block_ids), push.final)
            job.chain = job.chain or push.chain
            for sender, reg in self._early_registers.pop(push.request_id, []):
                self.on_register(sender, reg, now)

    def _drop_job(self, job: PushJob) -> None:
        """The request is aborted: nothing more is posted, every consumer rank still
        pushed to is cancelled (answered once its writes in flight settled)."""
        job.drop()
        for target in job.targets.values():
            if not target.state.terminal:
                target.cancel()

    def _release_fenced(self, job: PushJob) -> bool:
        """Move the layers of passed fences into ``layers_ready``; True if any moved.

        A WRITE of a layer is posted only from ``layers_ready``: never before the
        kernels that wrote the layer finished (on host memory fences pass at once)."""
        return job.release_fenced()

    def prepare(self, consumer: _ConsumerPeer) -> _PushLists | None:
        """Lists for writing to ``consumer``'s rank, prepared right after its hello."""
        # one consumer rank's plan: never the whole engine it claims to belong to
        sub = plan_consumer_rank(self.cx.spec, self.cx.sizes,
                                 consumer.meta.topology).for_producer(self.cx.rank_index)
        if not sub.num_descriptors:
            return None
        remote_memory = consumer.meta.layer_memory()
        check_remote_coverage(self.cx.io, consumer.peer, remote_memory,
                              sub.layers.tolist(), f"consumer {consumer.meta.agent_name}",
                              consumer.meta.mem_type, consumer.meta.device_id)
        local = build_table(sub.regions, sub.layers, sub.producer_offsets, sub.lengths,
                            self.cx.memory, "producer")
        remote = build_table(sub.regions, sub.layers, sub.consumer_offsets, sub.lengths,
                             remote_memory, "consumer")
        local_list = self.cx.io.prepare_local_descs(
            local.strided(self.cx.io.memory_type[1]))
        try:
            remote_list = self.cx.io.prepare_remote(  # the consumer's memory type
                consumer.peer, remote.strided(consumer.meta.device_id), consumer.meta.mem_type)
        except BaseException:
            self.cx.io.release_dlist(local_list)
            raise
        return _PushLists(local, remote, local_list, remote_list,
                          frozenset(int(x) for x in sub.layers.tolist()))

    def on_register(self, sender: str, reg: messages.Register, now: float) -> None:
        rid = reg.request_id
        job = self._push_jobs.get(rid)
        if reg.cancel:
            target_c = job.targets.get(reg.consumer_rank) if job is not None else None
            if job is not None and target_c is not None and not target_c.state.terminal:
                target_c.cancel()  # answered once its writes settle
                if not self._writes_pending(target_c):
                    target_c.cancelled("cancelled by consumer", now)
                    self._finish_push_target(job, target_c, now)
                return
            self.holds.send_to(sender, messages.Pushed(rid, self.cx.rank_index, False,
                                                  "cancelled by consumer"))
            if job is None:
                self._cancelled[rid] = now  # a later push order starts dropped
            self.leases.notify(rid, reg.consumer_rank, reg.expected, sender, now)
            return
        if job is None:
            if self.leases.ended(rid) == "expired":
                self.cx.stats.count("pushes_failed")
                self.holds.send_to(sender, messages.Pushed(rid, self.cx.rank_index, False,
                                                      "lease expired before registration"))
                return
            if rid not in self._early_registers and \
                    len(self._early_registers) >= MAX_EARLY_REGISTERS:
                self.holds.reject(sender, f"register for {rid[:64]!r}, not held, past "
                                     f"{MAX_EARLY_REGISTERS} such requests")
                return
            self._early_registers.setdefault(rid, []).append((sender, reg))
            return
        consumer = self.holds.consumer(sender)
        if consumer is None:
            raise TransportError(f"register from {sender} before its hello")
        if reg.consumer_rank != consumer.meta.rank_index:
            raise TransportError(f"register from {sender} names consumer rank "
                                     f"{reg.consumer_rank}, its hello said "
                                     f"{consumer.meta.rank_index}")
        refused = self._refuse_register(job, reg, consumer.meta.engine_id)
        if refused:
            self.cx.stats.count("registers_refused")
            self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: register of consumer "
                           "%s rank %d refused: %s", self.cx.engine_id, self.cx.rank_index,
                           rid, consumer.meta.engine_id, reg.consumer_rank, refused)
            self.holds.send_to(sender, messages.Pushed(rid, self.cx.rank_index, False,
                                                  f"refused: {refused}"))
            return
        target = SendTransfer(reg.consumer_rank, consumer.peer, reg)
        lists = consumer.push
        if lists is not None:
            target.local, target.remote = lists.local, lists.remote
            target.local_list, target.remote_list = lists.local_list, lists.remote_list
            target.layers_needed = lists.layers_needed
        job.targets[reg.consumer_rank] = target
        if not target.layers_needed:
            target.nothing_needed(now)
            self.leases.notify(rid, reg.consumer_rank, reg.expected, sender, now)
            return
        if job.dropped:
            target.cancel()  # answered "cancelled" by the next progress
        if job.final and not self._step_pushes and not job.fenced:
            job.ready_all(set(self.cx.memory))  # prefill already complete: everything
        self._post_push_writes(job)

    def _refuse_register(self, job: PushJob, reg: messages.Register, engine: str) -> str:
        """Why a register may not have ``job``'s KV ("" if it may): its prompt is another
        (or it names none), or another consumer engine or this rank registered first."""
        if not job.chain or reg.chain != job.chain:
            return ("the consumer's prompt is not this request's prompt" if reg.chain else
                    "no prompt chain: a push register names the prompt it takes")
        if job.engine is None:
            job.engine = engine
        elif job.engine != engine:
            return f"registered by another consumer engine ({job.engine[:64]!r}) first"
        if reg.consumer_rank in job.targets:
            return f"consumer rank {reg.consumer_rank} registered already: once per rank"
        return ""

    def _post_push_writes(self, job: PushJob) -> None:
        now = time.monotonic()
        if job.dropped:
            return
        if (job.digests is None and self.cx.digester is not None and job.final
                and job.layers_ready >= self.cx.memory.keys()):
            try:  # every layer is final: what the consumer must find after the writes
                started = time.perf_counter()
                job.digests = take_hold_digests(self.cx.digester, job.block_ids)
                self.cx.count_digests(started, job.block_ids)
                asked = {block_algorithm_of(t.register.algorithm)
                         for t in job.targets.values()}
                for alg in (self.digests.algorithms | asked) & self.cx.digesters.keys():
                    if self.cx.digesters[alg] is not self.cx.digester:
                        started = time.perf_counter()
                        job.alg_digests[alg] = take_hold_digests(self.cx.digesters[alg],
                                                                 job.block_ids)
                        self.cx.count_digests(started, job.block_ids)
            except LayoutError as exc:
                self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: no digests: %s",
                               self.cx.engine_id, self.cx.rank_index, job.request_id, exc)
                job.digests = ()
        for target in job.targets.values():
            if (job.digests and target.slice_digests is None and not target.state.terminal
                    and self.cx.slicer(target.register.algorithm) is not None):
                self._take_push_slices(job, target)
        for target in job.targets.values():
            if not target.writable or target.local is None or target.remote is None:
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
            gone = sorted((r, i) for r, start in enumerate(reg.start)
                          for i in range(start, start + len(reg.block_ids[r]))
                          if (r, i) in job.released
                          or (r < len(job.block_ids) and i < len(job.block_ids[r])
                              and job.block_ids[r][i] == self.cx.null_block_id))
            if gone:  # what the engine no longer holds is not ours to write
                target.fail(f"producer no longer holds region {gone[0][0]} block index "
                            f"{gone[0][1]} ({len(gone)} such): its engine released them as "
                            "the request finished (out of its sliding window, inside the "
                            "consumer's)", now)
                self._finish_push_target(job, target, now)
                continue
            which = np.flatnonzero(np.isin(target.local.layers,
                                           np.fromiter(layers, dtype=np.int64)))
            try:
                if any(len(p) != len(c) for p, c in zip(producer_ids, reg.block_ids,
                                                        strict=True)):
                    raise TransportError(f"consumer registered {[len(c) for c in reg.block_ids]}"
                                             f" blocks; producer holds {[len(p) for p in producer_ids]}")
                lidx, ridx, runs = pair_indices(target.local, which, producer_ids, "producer",
                                                target.remote, which, reg.block_ids,
                                                "consumer")
                target.posted(layers, runs)
                if lidx.size:
                    target.transfers.append(self.cx.io.post(
                        XferOp.WRITE, target.local_list, lidx, target.remote_list, ridx,
                        b"", deadline_s=self.cx.settings.transfer_timeout_s))
            except Exception as exc:
                target.fail(f"write refused: {exc}", now)
                self._finish_push_target(job, target, now)

    def _writes_pending(self, target: SendTransfer) -> bool:
        return any(self.cx.io.poll(x) is XferState.PENDING or not x.quiesced
                   for x in target.transfers)

    def _maybe_drop_job(self, job: PushJob) -> None:
        if job.dropped and all(t.state.terminal for t in job.targets.values()):
            self.forget(job.request_id)

    def progress(self, now: float) -> None:
        for job in list(self._push_jobs.values()):
            if self._release_fenced(job):
                self._post_push_writes(job)
            self._maybe_drop_job(job)
            for target in job.targets.values():
                if target.state.terminal:
                    continue
                if target.state is SendState.CANCELLING:  # every target of a dropped job
                    if not self._writes_pending(target):
                        target.cancelled("cancelled", now)
                        self._finish_push_target(job, target, now)
                    continue
                states = [self.cx.io.poll(x) for x in target.transfers]
                bad = [x for x in target.transfers
                       if x.state in (XferState.FAILED, XferState.TIMED_OUT)]
                if bad:
                    self.cx.stats.count("transfer_failures")
                    target.fail(f"WRITE {bad[0].state.value}: {bad[0].error}", now)
                    self._finish_push_target(job, target, now)
                    continue
                if (target.layers_written >= target.layers_needed
                        and all(s is XferState.DONE for s in states)):
                    target.written(now)
                    self._finish_push_target(job, target, now)

    def _finish_push_target(self, job: PushJob, target: SendTransfer, now: float) -> None:
        """Count, record and answer a push to one consumer rank that just ended (PUSHED:
        ``pushed`` ok, with the digests it asked for; CANCELLED or FAILED: not ok)."""
        assert target.state.terminal
        ok = target.state is SendState.PUSHED
        reason = target.error or ""
        nbytes = sum(x.nbytes for x in target.transfers)
        ndescs = sum(x.num_descs for x in target.transfers)
        self.cx.stats.count("pushes_done" if ok else "pushes_failed")
        if ok:
            self.cx.stats.count_transfer(nbytes, ndescs, now - job.started_at, target.runs)
        else:
            self.cx.log.warning("pd push failed: engine=%s rank=%d request=%s consumer_rank=%d "
                           "blocks=%d reason=%s", self.cx.engine_id, self.cx.rank_index,
                           job.request_id, target.consumer_rank,
                           sum(len(g) for g in target.register.block_ids), reason)
        self.cx.stats.record(TransferRecord(job.request_id, ok, nbytes, ndescs, now - job.started_at,
                                    job.started_at, target.runs))
        digests: tuple[bytes, ...] = ()
        reg = target.register
        if ok and reg.algorithm:
            answer = self._push_slice_digests(job, target) \
                if reg.algorithm in SLICE_ALGORITHMS else self._push_digests(job, reg)
            if isinstance(answer, str):
                reason = answer
            else:
                digests = answer
        self.holds.send_to(target.peer.name, messages.Pushed(job.request_id, self.cx.rank_index, ok,
                                                        reason, digests,
                                                        reg.algorithm if digests else ""))
        self.leases.notify(job.request_id, reg.consumer_rank, reg.expected, target.peer.name,
                            now)

    def _push_digests(self, job: PushJob, reg: messages.Register) -> tuple[bytes, ...] | str:
        """Producer: digests of every block written for ``reg``, or why there are none."""
        if reg.algorithm not in self.cx.digesters or not job.digests:
            return f"no {reg.algorithm} digests on producer rank {self.cx.rank_index}"
        asked = [job.block_ids[r][start:start + len(reg.block_ids[r])]
                 for r, start in enumerate(reg.start)]
        answer = answer_ask(self._push_alg_digests(job, reg.algorithm), asked)
        if not isinstance(answer, str):
            self.cx.stats.count("digests_served", sum(len(g) for g in asked))
        return answer

    def _push_alg_digests(self, job: PushJob, alg: str) -> tuple[dict[int, int], ...]:
        """Producer: a push job's digests in ``alg`` (taken now when no target asked for
        it as the last layer was final; the layers are final, so the same bytes)."""
        assert job.digests is not None
        if self.cx.digesters[alg] is self.cx.digester:
            return job.digests
        have = job.alg_digests.get(alg)
        if have is None:
            self.digests.want(alg)
            started = time.perf_counter()
            have = job.alg_digests[alg] = take_hold_digests(self.cx.digesters[alg], job.block_ids)
            self.cx.count_digests(started, job.block_ids)
        return have

    def _take_push_slices(self, job: PushJob, target: SendTransfer) -> None:
        """Producer, push: slice digests of the blocks registered by ``target`` (every
        layer is final), before its remaining WRITEs are posted."""
        reg = target.register
        slicer = self.cx.slicer(reg.algorithm)
        assert slicer is not None and job.digests
        consumer = self.holds.consumer(target.peer.name)
        plan = self.digests.slice_plan(consumer.meta.topology) if consumer is not None else None
        target.slice_digests = ()
        if plan is None:
            return
        ids = [job.block_ids[r][start:start + len(reg.block_ids[r])]
               if r < len(job.block_ids) else () for r, start in enumerate(reg.start)]
        started = time.perf_counter()
        try:
            # the block digests in its block algorithm: the slices of regions read whole
            held = self._push_alg_digests(job, SLICE_ALGORITHMS[reg.algorithm])
            target.slice_digests = take_slice_digests(slicer, plan, ids, held)
        except LayoutError as exc:
            self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: no slice digests: %s",
                           self.cx.engine_id, self.cx.rank_index, job.request_id, exc)
            return
        self.cx.count_slices(started, plan, ids, "slice_digests_at_hold")

    def _push_slice_digests(self, job: PushJob, target: SendTransfer
                            ) -> tuple[bytes, ...] | str:
        """Producer: slice digests of every block written for ``target``, or why none."""
        if not target.slice_digests:
            return f"no {target.register.algorithm} digests on producer rank {self.cx.rank_index}"
        reg = target.register
        # a region this consumer rank reads nothing of from this rank (another rank's
        # replicated region) is answered empty: the consumer checks it against that rank
        asked = [job.block_ids[r][start:start + len(reg.block_ids[r])]
                 if r < len(target.slice_digests) and target.slice_digests[r] else ()
                 for r, start in enumerate(reg.start)]
        answer = answer_ask(target.slice_digests, asked)
        if not isinstance(answer, str):
            self.cx.stats.count("digests_served", sum(len(g) for g in asked))
        return answer

    def forget(self, rid: str) -> None:
        """Forget a push request (its lists belong to the consumer peer and stay)."""
        self._push_jobs.pop(rid, None)
