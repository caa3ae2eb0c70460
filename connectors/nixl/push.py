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

Owns: ``_push_jobs``, ``_early_registers``, ``_cancelled``, ``_step_pushes``'
jobs, the consumer peers' push lists, the push counters, the ``pushed``
answers. May not touch: the consumer side of push (:mod:`.push_consumer`),
pull loads or holds (beyond notifying the lease and answering through
:mod:`.holds`' ``_send_to``), nor the sessions.
"""

from __future__ import annotations

import time

import numpy as np

from kvbridge.backends.nixl import NixlTransportError, XferOp, XferState
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.routing import build_table, pair_indices
from kvbridge.connectors.nixl.scheduler import PushOrder
from kvbridge.connectors.nixl.send_state import PushJob, SendState, SendTransfer
from kvbridge.connectors.nixl.session import check_remote_coverage
from kvbridge.connectors.nixl.verify import answer_ask, take_hold_digests, take_slice_digests
from kvbridge.connectors.nixl.worker_state import (
    MAX_EARLY_REGISTERS,
    TransferRecord,
    WorkerState,
    _ConsumerPeer,
    _PushLists,
    logger,
)
from kvbridge.layouts import LayoutError
from kvbridge.layouts.digests import SLICE_ALGORITHMS, block_algorithm_of
from kvbridge.layouts.plan import plan_consumer_rank


class PushSender(WorkerState):
    """Push, producer: the per-layer WRITEs to the consumer ranks that registered."""

    def _take_push_orders(self, drops: tuple[str, ...], pushes: tuple[PushOrder, ...],
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
                self._on_register(sender, reg, now)

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

    def _on_register(self, sender: str, reg: messages.Register, now: float) -> None:
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
        refused = self._refuse_register(job, reg, consumer.meta.engine_id)
        if refused:
            self._counters["registers_refused"] += 1
            logger.warning("nixl: producer engine=%s rank=%d request=%s: register of consumer "
                           "%s rank %d refused: %s", self.ctx.engine_id, self.rank_index,
                           rid, consumer.meta.engine_id, reg.consumer_rank, refused)
            self._send_to(sender, messages.Pushed(rid, self.rank_index, False,
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
            self._leases.notify(rid, reg.consumer_rank, reg.expected, sender, now)
            return
        if job.dropped:
            target.cancel()  # answered "cancelled" by the next progress
        if job.final and not self._step_pushes and not job.fenced:
            job.ready_all(set(self.memory))  # prefill already complete: everything
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
                asked = {block_algorithm_of(t.register.algorithm)
                         for t in job.targets.values()}
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
            if (job.digests and target.slice_digests is None and not target.state.terminal
                    and self._slicer(target.register.algorithm) is not None):
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
                target.posted(layers, runs)
                if lidx.size:
                    target.transfers.append(self.transport.post(
                        XferOp.WRITE, target.local_list, lidx, target.remote_list, ridx,
                        b"", deadline_s=self.settings.transfer_timeout_s))
            except Exception as exc:
                target.fail(f"write refused: {exc}", now)
                self._finish_push_target(job, target, now)

    def _writes_pending(self, target: SendTransfer) -> bool:
        assert self.transport is not None
        return any(self.transport.poll(x) is XferState.PENDING or not x.quiesced
                   for x in target.transfers)

    def _maybe_drop_job(self, job: PushJob) -> None:
        if job.dropped and all(t.state.terminal for t in job.targets.values()):
            self._drop_push_job(job.request_id)

    def _progress_pushes(self, now: float) -> None:
        assert self.transport is not None
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
                states = [self.transport.poll(x) for x in target.transfers]
                bad = [x for x in target.transfers
                       if x.state in (XferState.FAILED, XferState.TIMED_OUT)]
                if bad:
                    self._counters["transfer_failures"] += 1
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
                if reg.algorithm in SLICE_ALGORITHMS else self._push_digests(job, reg)
            if isinstance(answer, str):
                reason = answer
            else:
                digests = answer
        self._send_to(target.peer.name, messages.Pushed(job.request_id, self.rank_index, ok,
                                                        reason, digests,
                                                        reg.algorithm if digests else ""))
        self._leases.notify(job.request_id, reg.consumer_rank, reg.expected, target.peer.name,
                            now)

    def _push_digests(self, job: PushJob, reg: messages.Register) -> tuple[bytes, ...] | str:
        """Producer: digests of every block written for ``reg``, or why there are none."""
        if reg.algorithm not in self._digesters or not job.digests:
            return f"no {reg.algorithm} digests on producer rank {self.rank_index}"
        asked = [job.block_ids[r][start:start + len(reg.block_ids[r])]
                 for r, start in enumerate(reg.start)]
        answer = answer_ask(self._push_alg_digests(job, reg.algorithm), asked)
        if not isinstance(answer, str):
            self._counters["digests_served"] += sum(len(g) for g in asked)
        return answer

    def _push_alg_digests(self, job: PushJob, alg: str) -> tuple[dict[int, int], ...]:
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

    def _take_push_slices(self, job: PushJob, target: SendTransfer) -> None:
        """Producer, push: slice digests of the blocks registered by ``target`` (every
        layer is final), before its remaining WRITEs are posted."""
        reg = target.register
        slicer = self._slicer(reg.algorithm)
        assert slicer is not None and job.digests
        consumer = self._consumers.get(target.peer.name)
        plan = self._slice_plan(consumer.meta.topology) if consumer is not None else None
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
            logger.warning("nixl: producer engine=%s rank=%d request=%s: no slice digests: %s",
                           self.ctx.engine_id, self.rank_index, job.request_id, exc)
            return
        self._count_slices(started, plan, ids, "slice_digests_at_hold")

    def _push_slice_digests(self, job: PushJob, target: SendTransfer
                            ) -> tuple[bytes, ...] | str:
        """Producer: slice digests of every block written for ``target``, or why none."""
        if not target.slice_digests:
            return f"no {target.register.algorithm} digests on producer rank {self.rank_index}"
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

    def _drop_push_job(self, rid: str) -> None:
        """Forget a push request (its lists belong to the consumer peer and stay)."""
        self._push_jobs.pop(rid, None)
