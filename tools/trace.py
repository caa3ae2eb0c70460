"""The life of one request through the NIXL connector, as an ordered list of events.

:class:`TraceRecorder` collects :class:`TraceEvent` records; :func:`instrument_engine`
attaches it to an engine's NIXL workers by wrapping the real objects they call
(the handshake client, the NIXL transport, the lease table, the notification
handler), and a logging handler turns the connector's structured failure lines
into events. Nothing is replaced: every wrapped call runs the real one and only
observes arguments and results, so a traced request moves exactly the bytes an
untraced one moves.

The wrapped names are the worker's internals (``_client``, ``transport``,
``_leases``, ``_on_notif``, ``_fail``); :func:`instrument_engine` checks them and
raises :class:`TraceError` naming the one that is missing, so a refactor of the
connector fails the trace test rather than silently tracing nothing.

Event kinds (``TraceEvent.kind``) and their ``detail`` fields:

=================  ==============================================================
``plan``           consumer_rank, sources, bytes_per_block, descriptors
``route``          what the router sent where (transfer params summary)
``scheduler``      hook (lookup, allocated, request_finished) and its answer
``handshake``      address, rtt_ms, metadata_bytes, ranks, attempts, cached
``transfer``       op, peer, bytes, descriptors (posted)
``transfer_done``  op, bytes, descriptors, ms, state, error
``notif_sent``     type, to, fields of the message
``notif_received`` type, from, fields of the message
``lease``          action (hold, renew, notify, expire, guarantee), verdicts, promise
``freed``          blocks released by the producer (done sending)
``loaded``         request finished loading on the consumer rank (done recving)
``verify``         per checked block: region, block, producer rank, the producer's
                   digest and the landed bytes' digest, ok, slice (a head slice:
                   the part from that rank, once per rank); and the counts
                   (verified, mismatched, unverified) of the load
``failure``        reason (the connector's own words)
``log``            level, message (warnings of the nixl connector)
``result``         state, output tokens, verified/mismatched bytes
=================  ==============================================================
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, cast


class TraceError(RuntimeError):
    """The engine cannot be traced (not a NIXL worker, or its internals moved)."""


@dataclass(frozen=True)
class TraceEvent:
    """One thing that happened. ``t_ms`` is milliseconds since the trace started."""

    t_ms: float
    side: str  # "producer", "consumer" or "router"
    rank: int | None
    kind: str
    request_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TraceRecorder:
    """Thread-safe, append-only event list (handshakes run on a worker's thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []

    def add(self, side: str, rank: int | None, kind: str, request_id: str | None = None, /,
            **detail: Any) -> TraceEvent:
        event = TraceEvent(round((self._clock() - self._start) * 1e3, 3), side, rank, kind,
                           request_id, detail)
        with self._lock:
            self.events.append(event)
        return event

    def snapshot(self) -> list[TraceEvent]:
        with self._lock:
            return sorted(self.events, key=lambda e: e.t_ms)

    def of_kind(self, kind: str) -> list[TraceEvent]:
        return [e for e in self.snapshot() if e.kind == kind]


# ---------------------------------------------------------------- instrumentation

_WORKER_ATTRS = ("_client", "transport", "_leases", "_on_notif", "_fail", "get_finished",
                 "_verify")


def _notif_fields(data: bytes) -> tuple[str, dict[str, Any]]:
    from kvbridge.connectors.nixl import messages

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


def _verify_detail(worker: Any, recv: Any, bad: set[tuple[int, int]]) -> dict[str, Any]:
    """Each checked block of a finished load: the producer's digest against the digest
    of the bytes that landed (taken again here: the trace pays for it, not the load)."""
    from kvbridge.layouts.digests import ALGORITHM, SLICE_ALGORITHM, unpack

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
            # when either side's KV is in GPU memory; XXH3-64 for head slices)
            sliced = r in getattr(ask, "slices", ())  # head slices: the part from p
            alg = recv.digest_algorithms.get(p)
            digester = worker._digesters.get(ALGORITHM if sliced or alg == SLICE_ALGORITHM
                                             else alg, worker._digester)
            have = (cast(Any, digester).slice_digests(ask.slice_ranges[r], ids) if sliced
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


def _instrument_worker(worker: Any, side: str, rank: int, rec: TraceRecorder) -> None:
    from kvbridge.handshake import encode_engine

    def fetch(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(address: str, *args: Any, **kwargs: Any) -> Any:
            try:
                result = original(address, *args, **kwargs)
            except Exception as exc:
                rec.add(side, rank, "failure", None, stage="handshake", address=address,
                        reason=f"{type(exc).__name__}: {exc}")
                raise
            meta = result.metadata
            rec.add(side, rank, "handshake", None, address=address,
                    engine_id=meta.engine_id, rtt_ms=round(result.rtt_s * 1e3, 3),
                    metadata_bytes=len(encode_engine(meta)), ranks=len(meta.ranks),
                    attempts=result.attempts, cached=result.cached,
                    topology=meta.topology.describe())
            return result
        return call

    _wrap(worker._client, "fetch", fetch)
    transport = worker.transport
    posted: dict[int, Any] = {}

    def post(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(op: Any, *args: Any, **kwargs: Any) -> Any:
            xfer = original(op, *args, **kwargs)
            kind, fields = _notif_fields(xfer.notif) if xfer.notif else ("", {})
            posted[xfer.transfer_id] = xfer
            rec.add(side, rank, "transfer", _rid(fields), op=str(getattr(op, "value", op)),
                    peer=xfer.peer.name, bytes=xfer.nbytes, descriptors=xfer.num_descs,
                    notif=kind or None)
            return xfer
        return call

    def poll(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(xfer: Any) -> Any:
            state = original(xfer)
            if xfer.transfer_id in posted and getattr(state, "value", state) != "PENDING":
                del posted[xfer.transfer_id]
                kind, fields = _notif_fields(xfer.notif) if xfer.notif else ("", {})
                end = xfer.finished_at if xfer.finished_at is not None else time.monotonic()
                rec.add(side, rank, "transfer_done", _rid(fields),
                        op=str(getattr(xfer.op, "value", xfer.op)), bytes=xfer.nbytes,
                        descriptors=xfer.num_descs,
                        ms=round((end - xfer.posted_at) * 1e3, 3),
                        state=str(getattr(state, "value", state)), error=xfer.error)
            return state
        return call

    def send_notif(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(peer: Any, msg: bytes) -> Any:
            kind, fields = _notif_fields(msg)
            try:
                return original(peer, msg)
            except Exception as exc:
                fields["error"] = str(exc)
                raise
            finally:
                rec.add(side, rank, "notif_sent", _rid(fields), type=kind,
                        to=getattr(peer, "name", str(peer)), **fields)
        return call

    _wrap(transport, "post", post)
    _wrap(transport, "poll", poll)
    _wrap(transport, "send_notif", send_notif)

    def on_notif(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(sender: str, msg: Any, now: float) -> Any:
            kind, fields = _msg_fields(msg)
            rec.add(side, rank, "notif_received", _rid(fields), type=kind,
                    **{"from": sender}, **fields)
            return original(sender, msg, now)
        return call

    _wrap(worker, "_on_notif", on_notif)

    def fail(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(recv: Any, reason: str, now: float, **kwargs: Any) -> Any:
            if recv.request_id in worker._recv:
                rec.add(side, rank, "failure", recv.request_id, stage="load", reason=reason,
                        blocks=recv.num_blocks, state=recv.state.value)
            return original(recv, reason, now, **kwargs)
        return call

    _wrap(worker, "_fail", fail)

    def verify(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(recv: Any) -> Any:
            bad = original(recv)
            if recv.digest_asks or recv.unverified:
                rec.add(side, rank, "verify", recv.request_id, **_verify_detail(worker, recv, bad))
            return bad
        return call

    _wrap(worker, "_verify", verify)

    def finished(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            sending, recving = original(*args, **kwargs)
            for rid in sorted(sending):
                rec.add(side, rank, "freed", rid)
            for rid in sorted(recving):
                rec.add(side, rank, "loaded", rid)
            return sending, recving
        return call

    _wrap(worker, "get_finished", finished)
    leases = worker._leases

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
                           logger_name: str = "kvbridge.connectors.nixl") -> Iterator[None]:
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


# ---------------------------------------------------------------- running one request


@dataclass(frozen=True)
class TraceOptions:
    model: str = "tiny-gqa"
    mode: str = "pull"
    producer: str = "tp=1"
    consumer: str = "tp=1"
    prompt_tokens: int = 64
    num_blocks: int = 64
    producer_addr: str | None = None
    producer_control_port: int | None = None
    timeout_s: float = 60.0
    inject_failure: bool = False
    connector_extra: dict[str, Any] = field(default_factory=dict)


def _plan_events(rec: TraceRecorder, spec: Any, producer: Any, consumer: Any) -> None:
    from kvbridge.layouts import plan_transfer

    plan = plan_transfer(spec, producer, consumer).to_dict()
    for rank in plan["ranks"]:
        rec.add("consumer", None, "plan", None, consumer_rank=rank["consumer"]["name"],
                sources=[s["name"] for s in rank["sources"]],
                bytes_per_block=rank["bytes_per_block"],
                descriptors_per_block=rank["descriptors"],
                descriptors_before_coalescing=rank["descriptors_before_coalescing"])


def _params_summary(params: Any) -> dict[str, Any]:
    return {"mode": params.mode.value, "producer_engine_id": params.producer_engine_id,
            "producer": f"{params.producer_host}:{params.producer_port}",
            "blocks_per_region": [len(g) for g in params.block_ids],
            "num_tokens": params.num_tokens}


def _result_event(rec: TraceRecorder, side: str, result: Any) -> None:
    rec.add(side, None, "result", result.request_id, state=result.state.value,
            output_tokens=len(result.output), external_tokens=result.num_external_tokens,
            recomputed_tokens=result.num_recomputed_tokens,
            verified_bytes=result.verified_bytes, mismatched_bytes=result.mismatched_bytes)


def run_trace(opts: TraceOptions, recorder: TraceRecorder | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one request and return ``{"request_id", "ok", "events", "summary"}``.

    In-process (default): a producer and a consumer engine with the NIXL
    connector in this process, both traced. With ``producer_addr``: only the
    consumer runs here (traced); the producer is a live ``kvbridge serve``
    reached through its control socket (its side of the life is not visible,
    apart from its counters before and after).
    """
    import kvbridge.backends  # noqa: F401  (UCX_MODULES=^ib before the first agent)
    from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole, TransferMode
    from kvbridge.engine.core import Engine, EngineConfig
    from kvbridge.engine.request import RequestState
    from kvbridge.engine.workload import make_requests
    from kvbridge.layouts import ParallelTopology, load_spec

    rec = recorder or TraceRecorder()
    say = progress or (lambda _line: None)
    spec = load_spec(opts.model)
    mode = TransferMode(opts.mode)
    producer_sizes = ParallelTopology.parse(opts.producer, "producer")
    consumer_sizes = ParallelTopology.parse(opts.consumer, "consumer")
    if not opts.prompt_tokens > 1:
        raise ConfigError("prompt_tokens", f"expected > 1, got {opts.prompt_tokens}")
    settings = {"mode": mode.value, "transfer_timeout_s": min(opts.timeout_s, 30.0),
                **opts.connector_extra}

    def config(role: KVRole, sizes: Any) -> EngineConfig:
        return EngineConfig(spec=spec, topology=sizes, num_blocks=opts.num_blocks,
                            max_num_batched_tokens=max(512, opts.prompt_tokens + 64),
                            max_num_seqs=4,
                            connector=ConnectorConfig("nixl", role, extra=dict(settings)),
                            remote_kv_timeout_s=opts.timeout_s)

    # a fresh id each run: a long-running `kvbridge serve` must never see one twice
    request = make_requests(1, prompt_tokens=opts.prompt_tokens, max_tokens=2,
                            prefix=f"trace-{uuid.uuid4().hex[:8]}")[0]
    deadline = time.monotonic() + opts.timeout_s
    engines: list[Any] = []
    remote: Any = None
    producer_stats_before: dict[str, Any] | None = None
    final: Any = None
    with capture_connector_logs(rec):
        try:
            say("starting engines")
            if opts.producer_addr is None:
                producer = Engine(config(KVRole.PRODUCER, producer_sizes))
                engines.append(producer)
                instrument_engine(producer, "producer", rec)
            else:
                from kvbridge.handshake import parse_address
                from kvbridge.tools.demo_nixl import RemoteEngine

                host, port = parse_address(opts.producer_addr)
                remote = RemoteEngine(host, opts.producer_control_port or port + 1,
                                      call_timeout_s=min(opts.timeout_s, 30.0))
                producer_sizes = remote.topology.sizes()
                producer_stats_before = remote.stats()
            consumer = Engine(config(KVRole.CONSUMER, consumer_sizes))
            engines.append(consumer)
            instrument_engine(consumer, "consumer", rec)
            _plan_events(rec, spec, producer_sizes, consumer_sizes)
            if opts.inject_failure:
                for holder in consumer.workers:
                    from kvbridge.connectors.nixl.faults import fail_next_loads

                    if not fail_next_loads(holder.connector):
                        raise TraceError("this NIXL worker has no fault injection")
            final = _drive(rec, request, mode, engines, remote, consumer, deadline, say,
                           RequestState)
        finally:
            say("shutting down")
            for engine in reversed(engines):
                engine.shutdown()
            producer_stats = None
            if remote is not None:
                try:
                    producer_stats = _settled_stats(remote)
                except Exception as exc:
                    rec.add("producer", None, "log", None, level="WARNING",
                            message=f"cannot read the producer's counters: {exc}")
                remote.close()
    events = [e.to_dict() for e in rec.snapshot()]
    ok = (final is not None and final.state is RequestState.FINISHED_LENGTH
          and final.mismatched_bytes == 0 and final.num_external_tokens > 0)
    transfers = [e for e in events if e["kind"] == "transfer_done"]
    handshakes = [e for e in events if e["kind"] == "handshake"]
    summary: dict[str, Any] = {
        "model": spec.model, "mode": mode.value, "producer": producer_sizes.describe(),
        "consumer": consumer_sizes.describe(),
        "live_producer": opts.producer_addr,
        "state": final.state.value if final is not None else None,
        "transfers": len(transfers),
        "bytes": sum(e["detail"]["bytes"] for e in transfers),
        "transfer_ms": round(sum(e["detail"]["ms"] for e in transfers), 3),
        "handshakes": len(handshakes),
        "notifications": sum(1 for e in events if e["kind"].startswith("notif")),
        "lease_events": sum(1 for e in events if e["kind"] == "lease"),
        "frees": sum(1 for e in events if e["kind"] == "freed"),
        "failures": [e["detail"].get("reason") for e in events if e["kind"] == "failure"],
        "verified_bytes": final.verified_bytes if final is not None else 0,
        "mismatched_bytes": final.mismatched_bytes if final is not None else 0,
    }
    if producer_stats_before is not None:
        summary["producer_stats_before"] = producer_stats_before
        summary["producer_stats_after"] = producer_stats
        summary["producer_counter_deltas"] = counter_deltas(producer_stats_before,
                                                            producer_stats)
    return {"request_id": request.request_id, "ok": ok, "summary": summary, "events": events}


def _drive(rec: TraceRecorder, request: Any, mode: Any, engines: list[Any], remote: Any,
           consumer: Any, deadline: float, say: Callable[[str], None],
           RequestState: Any) -> Any:
    from dataclasses import replace

    from kvbridge.connectors import TransferMode, TransferParams

    producer = engines[0] if remote is None else remote
    rid = request.request_id
    if mode is TransferMode.PUSH:
        if remote is not None:
            from kvbridge.tools.demo_nixl import push_params

            params = push_params(request, remote, cast(Any, _EndpointOf(consumer)),
                                 remote.topology,
                                 consumer.spec.fingerprint())
        else:
            p_at, c_at = engines[0].endpoint(), consumer.endpoint()
            params = TransferParams(
                mode=TransferMode.PUSH, producer_engine_id=engines[0].engine_id,
                producer_host=p_at[0], producer_port=p_at[1], producer_request_id=rid,
                block_ids=(), producer_topology=engines[0].sizes,
                num_tokens=len(request.prompt), consumer_engine_id=consumer.engine_id,
                consumer_host=c_at[0], consumer_port=c_at[1], consumer_request_id=rid,
                spec_fingerprint=consumer.spec.fingerprint())
        rec.add("router", None, "route", rid, to="both", **_params_summary(params))
        consumer.add_request(replace(request, transfer_params=params))
        _submit(producer, replace(request, remote_decode=True, max_tokens=1,
                                  transfer_params=params), remote)
    else:
        rec.add("router", None, "route", rid, mode="pull", to="producer",
                prompt_tokens=len(request.prompt))
        _submit(producer, replace(request, remote_decode=True, max_tokens=1,
                                  transfer_params=None), remote)
    prefilled = False
    final = None
    say("prefill")
    while final is None:
        if time.monotonic() > deadline:
            rec.add("router", None, "failure", rid, stage="router",
                    reason="trace timed out (see the last events for where it stopped)")
            return None
        if remote is None and engines[0].has_work():
            engines[0].step()
        for result in _results(producer, remote):
            prefilled = True
            _result_event(rec, "producer", result)
            if result.state is not RequestState.FINISHED_LENGTH:
                rec.add("producer", None, "failure", rid, stage="prefill",
                        reason=f"producer finished the prefill as {result.state.value}")
                return result
            if mode is TransferMode.PULL:
                params = result.transfer_params
                if params is None:
                    rec.add("producer", None, "failure", rid, stage="prefill",
                            reason="the producer returned no transfer params")
                    return result
                parsed = TransferParams.from_dict(params.to_dict())
                rec.add("router", None, "route", rid, to="consumer", **_params_summary(parsed))
                consumer.add_request(replace(request, transfer_params=parsed))
                say("transfer")
        if consumer.has_work():
            consumer.step()
        for result in consumer.pop_results():
            _result_event(rec, "consumer", result)
            final = result
        if remote is not None and not prefilled:
            time.sleep(0.002)
        elif not consumer.has_work() and (remote is not None or not engines[0].has_work()):
            time.sleep(0.0005)
    # let the producer see the last notifications and free its blocks
    settle = time.monotonic() + 2.0
    while remote is None and time.monotonic() < settle and engines[0].has_work():
        engines[0].step()
        if consumer.has_work():
            consumer.step()
        else:
            time.sleep(0.001)
    return final


def _settled_stats(remote: Any, timeout_s: float = 2.0) -> dict[str, Any]:
    """The live producer's stats once it has freed what it held (or after ``timeout_s``):
    its last ack can reach us before its next step reports the free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = remote.stats()
        if not stats.get("stats", {}).get("delayed_frees_pending") \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def counter_deltas(before: dict[str, Any] | None, after: dict[str, Any] | None,
                   ) -> dict[str, float]:
    """Numeric engine and worker counters of a live producer that changed, after - before."""
    if not before or not after:
        return {}
    out: dict[str, float] = {}
    for scope in ("stats", "worker_stats"):
        b = before.get("stats", {}) if scope == "stats" else \
            before.get("stats", {}).get("worker_stats", {})
        a = after.get("stats", {}) if scope == "stats" else \
            after.get("stats", {}).get("worker_stats", {})
        for key, value in a.items():
            old = b.get(key, 0)
            if isinstance(value, int | float) and not isinstance(value, bool) \
                    and isinstance(old, int | float) and value != old:
                out[key] = round(value - old, 6)
    return out


class _EndpointOf:
    """What ``push_params`` reads of an engine: its id and connector endpoint."""

    def __init__(self, engine: Any) -> None:
        self.engine_id = engine.engine_id
        self.endpoint = engine.endpoint()


def _submit(producer: Any, spec: Any, remote: Any) -> None:
    if remote is not None:
        remote.submit([spec])
    else:
        producer.add_request(spec)


def _results(producer: Any, remote: Any) -> list[Any]:
    return list(remote.results()) if remote is not None else producer.pop_results()
