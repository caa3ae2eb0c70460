"""Tracing by observation: an observer on each NIXL worker, wrappers on the scheduler half.

Owns: :func:`instrument_engine` (the scheduler half's hooks and an observer
on every NIXL worker of an engine) and :func:`capture_connector_logs` (the connector's
structured warning lines as ``log`` events). Each wrapper runs the real call
and only records its arguments and result on a
:class:`~kvbridge.tools.trace.events.TraceRecorder`, so a traced request moves
exactly the bytes an untraced one moves.

A NIXL worker is traced through its observer protocol
(:class:`~kvbridge.connectors.pd.observe.WorkerObserver`, attached with
``PdWorker.observe``: handshakes, transfers, notifications, failures,
verification, finished requests) and its lease table's public calls;
:func:`instrument_engine` checks the worker has them (``observe``,
``transport``, ``leases``) and raises
:class:`~kvbridge.tools.trace.events.TraceError` naming the one that is
missing, so a refactor of the connector fails the trace test rather than
silently tracing nothing. May not touch: the arguments or results of a wrapped
call (observe only), fault injection, or running the request
(:mod:`kvbridge.tools.trace`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvbridge.tools.trace.events import TraceError, TraceRecorder

_WORKER_ATTRS = ("observe", "transport", "leases")


def _notif_fields(data: bytes) -> tuple[str, dict[str, Any]]:
    from kvbridge.connectors.pd import messages

    try:
        msg = messages.decode(data)
    except Exception as exc:  # a malformed message is itself worth showing
        return "malformed", {"error": str(exc)}
    return _msg_fields(msg)


def _msg_fields(msg: Any) -> tuple[str, dict[str, Any]]:
    fields: dict[str, Any] = {}
    for name in ("request_id", "request_ids", "consumer_rank", "producer_rank", "expected",
                 "read", "ok", "reason", "cancel", "block_ids", "lease_s"):
        if hasattr(msg, name):
            value = getattr(msg, name)
            if name == "block_ids":
                value = [len(g) for g in value]
                name = "blocks_per_region"
            elif isinstance(value, tuple):
                value = list(value)
            fields[name] = value
    if hasattr(msg, "agent"):
        fields["agent_bytes"] = len(msg.agent)
    if getattr(msg, "digest_ids", ()):  # begin: what the consumer will check
        fields["digests_asked"] = sum(len(g) for g in msg.digest_ids)
    if getattr(msg, "digests", ()):  # held, pushed: the producer's digests
        fields["digests"] = sum(len(d) // 8 for d in msg.digests)
    if getattr(msg, "algorithm", ""):
        fields["algorithm"] = msg.algorithm
    return type(msg).__name__, fields


def _verify_detail(digesters: Any, recv: Any, bad: set[tuple[int, int]]) -> dict[str, Any]:
    """Each checked block of a finished load: the producer's digest against the digest
    of the bytes that landed (taken again here: the trace pays for it, not the load)."""
    from kvbridge.layouts.digests import block_algorithm_of, unpack

    blocks = []
    for p, ask in sorted(recv.digest_asks.items()):
        packed = recv.digests.get(p)
        for r, ids in enumerate(ask.consumer_ids):
            if not ids:
                continue
            want: list[int | None] = [None] * len(ids)
            if packed is not None and r < len(packed):
                try:
                    if recv.params.mode.value == "push":  # every block of the load
                        every = unpack(bytes(packed[r]), ask.totals[r])
                        want = [every[i] for i in ask.positions[r]]
                    else:
                        want = list(unpack(bytes(packed[r]), len(ids)))
                except Exception:
                    pass  # malformed: shown as no digest (the load failed these blocks)
            # the digester of the algorithm asked of that producer rank (torch-mix64-v1
            # when either side's KV is in GPU memory; a slice algorithm's block algorithm
            # for head slices and the whole regions of a slice ask)
            sliced = r in getattr(ask, "slices", ())  # head slices: the part from p
            alg = recv.digest_algorithms.get(p)
            digester = digesters.get(block_algorithm_of(alg) if alg else alg,
                                     next(iter(digesters.values()), None))
            have = (digester.slice_digests(ask.slice_ranges[r], ids) if sliced
                    else digester.block_digests(r, ids))
            for block, expected, actual in zip(ids, want, have, strict=True):
                blocks.append({"region": r, "block": block, "producer_rank": p,
                               "expected": None if expected is None else f"{expected:016x}",
                               "actual": f"{actual:016x}", "ok": (r, block) not in bad,
                               "slice": sliced})
    # a block assembled from several producer ranks' slices is listed once per rank
    # and counted once
    return {"blocks": blocks, "verified": len({(b["region"], b["block"]) for b in blocks
                                               if b["ok"] and b["expected"] is not None}),
            "mismatched": len(bad), "unverified": recv.unverified}


def _rid(fields: dict[str, Any]) -> str | None:
    rid = fields.get("request_id")
    if rid is None and fields.get("request_ids"):
        rid = fields["request_ids"][0]
    return str(rid) if rid is not None else None


def instrument_engine(engine: Any, side: str, recorder: TraceRecorder) -> None:
    """Attach ``recorder`` to the scheduler half and every NIXL worker of ``engine``."""
    if engine.scheduler_connector is not None:
        _instrument_scheduler(engine.scheduler_connector, side, recorder)
    for worker_holder in engine.workers:
        worker = worker_holder.connector
        missing = [a for a in _WORKER_ATTRS if not hasattr(worker, a)]
        if worker is None or missing or getattr(worker, "transport", None) is None:
            raise TraceError(f"{side} worker {worker_holder.worker_index} is not a registered "
                             f"NIXL worker (missing: {', '.join(missing) or 'transport'})")
        _instrument_worker(worker, side, int(worker.rank_index), recorder)


def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(obj, name)
    setattr(obj, name, functools.wraps(original)(make(original)))


def _blocks(block_ids: Any) -> list[int]:
    return [len(g) for g in block_ids]


def _instrument_scheduler(sched: Any, side: str, rec: TraceRecorder) -> None:
    """The scheduler half's public hooks: lookup answer, allocation, finish (delay_free)."""

    def matched(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, num_computed_tokens: int) -> Any:
            tokens, load_async = original(request, num_computed_tokens)
            if tokens or request.transfer_params is not None:
                rec.add(side, None, "scheduler", request.request_id, hook="lookup",
                        local_tokens=num_computed_tokens, external_tokens=tokens,
                        load_async=load_async)
            return tokens, load_async
        return call

    def allocated(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, block_ids: Any, num_external_tokens: int) -> Any:
            if num_external_tokens or request.transfer_params is not None:
                rec.add(side, None, "scheduler", request.request_id, hook="allocated",
                        blocks_per_region=_blocks(block_ids),
                        external_tokens=num_external_tokens)
            return original(request, block_ids, num_external_tokens)
        return call

    def finished(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, block_ids: Any) -> Any:
            delay_free, params = original(request, block_ids)
            rec.add(side, None, "scheduler", request.request_id, hook="request_finished",
                    blocks_per_region=_blocks(block_ids), delay_free=delay_free,
                    transfer_params=params is not None)
            return delay_free, params
        return call

    _wrap(sched, "get_num_new_matched_tokens", matched)
    _wrap(sched, "update_state_after_alloc", allocated)
    _wrap(sched, "request_finished", finished)


class _TraceObserver:
    """A :class:`~kvbridge.connectors.pd.observe.WorkerObserver` that records each
    event of one worker rank on the recorder."""

    def __init__(self, side: str, rank: int, rec: TraceRecorder) -> None:
        self.side = side
        self.rank = rank
        self.rec = rec
        self._pending: dict[int, Any] = {}  # transfers posted, not seen settled yet

    def loads_ordered(self, orders: Any) -> None:
        pass  # each load shows by its own events (its handshake, notifications, transfers)

    def handshake(self, address: str, result: Any) -> None:
        from kvbridge.handshake import encode_engine

        meta = result.metadata
        self.rec.add(self.side, self.rank, "handshake", None, address=address,
                     engine_id=meta.engine_id, rtt_ms=round(result.rtt_s * 1e3, 3),
                     metadata_bytes=len(encode_engine(meta)), ranks=len(meta.ranks),
                     attempts=result.attempts, cached=result.cached,
                     topology=meta.topology.describe())

    def handshake_failed(self, address: str, error: Exception) -> None:
        self.rec.add(self.side, self.rank, "failure", None, stage="handshake", address=address,
                     reason=f"{type(error).__name__}: {error}")

    def posted(self, xfer: Any) -> None:
        kind, fields = _notif_fields(xfer.notif) if xfer.notif else ("", {})
        self._pending[xfer.transfer_id] = xfer
        self.rec.add(self.side, self.rank, "transfer", _rid(fields),
                     op=str(getattr(xfer.op, "value", xfer.op)), peer=xfer.peer.name,
                     bytes=xfer.nbytes, descriptors=xfer.num_descs, notif=kind or None)

    def polled(self, xfer: Any, state: Any) -> None:
        if xfer.transfer_id not in self._pending or getattr(state, "value", state) == "PENDING":
            return
        del self._pending[xfer.transfer_id]
        kind, fields = _notif_fields(xfer.notif) if xfer.notif else ("", {})
        end = xfer.finished_at if xfer.finished_at is not None else time.monotonic()
        self.rec.add(self.side, self.rank, "transfer_done", _rid(fields),
                     op=str(getattr(xfer.op, "value", xfer.op)), bytes=xfer.nbytes,
                     descriptors=xfer.num_descs, ms=round((end - xfer.posted_at) * 1e3, 3),
                     state=str(getattr(state, "value", state)), error=xfer.error)

    def notif_sent(self, peer: Any, msg: bytes, error: str | None) -> None:
        kind, fields = _notif_fields(msg)
        if error is not None:
            fields["error"] = error
        self.rec.add(self.side, self.rank, "notif_sent", _rid(fields), type=kind,
                     to=getattr(peer, "name", str(peer)), **fields)

    def notif_received(self, sender: str, msg: Any) -> None:
        kind, fields = _msg_fields(msg)
        self.rec.add(self.side, self.rank, "notif_received", _rid(fields), type=kind,
                     **{"from": sender}, **fields)

    def failure(self, recv: Any, reason: str) -> None:
        self.rec.add(self.side, self.rank, "failure", recv.request_id, stage="load",
                     reason=reason, blocks=recv.num_blocks, state=recv.state.value)

    def verified(self, recv: Any, bad: set[tuple[int, int]], digesters: Any) -> None:
        if recv.digest_asks or recv.unverified:
            self.rec.add(self.side, self.rank, "verify", recv.request_id,
                         **_verify_detail(digesters, recv, bad))

    def finished(self, sending: set[str], recving: set[str]) -> None:
        for rid in sorted(sending):
            self.rec.add(self.side, self.rank, "freed", rid)
        for rid in sorted(recving):
            self.rec.add(self.side, self.rank, "loaded", rid)


def _instrument_worker(worker: Any, side: str, rank: int, rec: TraceRecorder) -> None:
    worker.observe(_TraceObserver(side, rank, rec))
    leases = worker.leases

    def lease(action: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                verdicts = result if isinstance(result, list) else []
                if action == "expire" and not verdicts:
                    return result  # called every step: only expiries are events
                rid = str(args[0]) if args and action != "expire" else None
                detail: dict[str, Any] = {"action": action}
                if action == "renew":
                    detail["renewed"] = bool(result)
                if action == "guarantee":
                    detail["promised_s"], detail["refused"] = result
                if action == "notify" and len(args) >= 2:
                    detail["consumer_rank"] = args[1]
                if verdicts:
                    detail["verdicts"] = [f"{v.request_id}:{v.kind.value}" for v in verdicts]
                    rid = rid or str(verdicts[0].request_id)
                rec.add(side, rank, "lease", rid, **detail)
                return result
            return call
        return make

    for action in ("hold", "renew", "notify", "expire", "guarantee"):
        _wrap(leases, action, lease(action))


class _LogCapture(logging.Handler):
    """Warnings of the NIXL connector (its one structured line per failure) as events."""

    def __init__(self, recorder: TraceRecorder) -> None:
        super().__init__(logging.INFO)
        self.recorder = recorder

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string must not break the traced request
            message = str(record.msg)
        self.recorder.add("log", None, "log", None, level=record.levelname, message=message,
                          logger=record.name)


@contextmanager
def capture_connector_logs(recorder: TraceRecorder,
                           logger_name: str = "kvbridge.connectors.pd") -> Iterator[None]:
    handler = _LogCapture(recorder)
    log = logging.getLogger(logger_name)
    previous = log.level
    log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)
