"""The life of one request through the NIXL connector, as an ordered list of events.

:class:`TraceRecorder` collects :class:`TraceEvent` records; :func:`instrument_engine`
attaches it to an engine's NIXL workers as their observer (the worker's parts
tell it of handshakes, transfers, notifications, failures and verification)
and to their lease tables, and a logging handler turns the connector's
structured failure lines into events. Nothing is replaced: an observer only
looks at arguments and results, so a traced request moves exactly the bytes an
untraced one moves.

This module owns running one traced request (:class:`TraceOptions`,
:func:`run_trace`) and the table of event kinds below. The records live in
:mod:`kvbridge.tools.trace.events`, the wrappers that produce them in
:mod:`kvbridge.tools.trace.instrument` (the observer it attaches to each
worker); every name they held when they were part of this file is still
importable from here. May not touch: the connector's internals (the request
is driven through the engines' public calls; ``--inject-failure`` only installs
the faulty transport of :mod:`kvbridge.connectors.pd.faults` in each consumer
worker).

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

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from kvbridge.tools.trace.events import TraceError, TraceEvent, TraceRecorder
from kvbridge.tools.trace.instrument import capture_connector_logs, instrument_engine

# what this module offered before the split stays importable from here
__all__ = ["TraceError", "TraceEvent", "TraceOptions", "TraceRecorder", "capture_connector_logs",
           "counter_deltas", "instrument_engine", "run_trace"]


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
                from kvbridge.tools.demo.nixl import RemoteEngine

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
                    from kvbridge.connectors.pd.faults import fail_next_loads

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
            from kvbridge.tools.demo.nixl import push_params

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
