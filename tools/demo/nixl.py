"""The NIXL demo runner: a producer and a consumer engine in separate processes, routed.

Used by ``kvbridge demo --connector nixl`` (the default, what ``make demo``
runs), by ``--connector mooncake_te`` (:mod:`.mooncake_te`: the same PD core over
another transport, ``DemoOptions.connector``) and by the NIXL connector's
multi-process tests. The producer engine
either runs here as a child process, or is a ``kvbridge serve`` on another
machine (``--producer-addr HOST:PORT``: its handshake side channel; the
control socket is on PORT+1 unless ``--producer-control-port`` says otherwise).

The router does what a PD proxy does (see :mod:`kvbridge.engine.harness`):
pull -- prefill on the producer with ``remote_decode``, forward its transfer
params to the consumer; push -- send push params built from both engines'
endpoints to both at once. Every loaded byte is verified by the consumer
engine against the content function.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import zmq

from kvbridge.auth import resolve_auth
from kvbridge.connectors import ConnectorConfig, KVRole, TransferMode, TransferParams
from kvbridge.connectors.pd.worker import histogram_percentile
from kvbridge.engine.core import EngineConfig
from kvbridge.engine.harness import (
    ControlCalls,
    EngineProcess,
    EngineProcessError,
    connect_control,
    control_exchange,
)
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.handshake import parse_address
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.tools.demo.pd_report import (
    check_connector_settings,
    idle_problems,
    request_fields,
    route_all,
)

CONNECTOR = "nixl"


@dataclass(frozen=True)
class DemoOptions:
    mode: TransferMode = TransferMode.PULL
    model: str = "tiny-gqa"
    producer: ParallelTopology = field(default_factory=ParallelTopology)
    consumer: ParallelTopology = field(default_factory=ParallelTopology)
    requests: int = 16
    prompt_tokens: int = 64
    max_tokens: int = 2
    num_blocks: int = 256
    producer_addr: str | None = None
    producer_control_port: int | None = None
    timeout_s: float = 300.0
    seed: int = 0
    connector_extra: dict[str, Any] = field(default_factory=dict)
    verify: bool = True
    #: the engines' KV device (``cpu``, ``cuda``, ``cuda:N``): EngineConfig.device
    device: str = "cpu"
    #: the PD connector the engines use: this runner serves every adapter of the PD core
    connector: str = CONNECTOR


class _Engine(Protocol):
    engine_id: str
    endpoint: tuple[str, int] | None

    def submit(self, specs: list[RequestSpec]) -> None: ...
    def results(self) -> list[RequestResult]: ...
    def stats(self) -> dict[str, Any]: ...
    def transfer_records(self) -> list[dict[str, Any]]: ...
    def close(self, timeout_s: float = 15.0) -> int | None: ...


class RemoteEngine(ControlCalls):
    """Client of an engine control socket (``kvbridge.engine.server``) on another host."""

    def __init__(self, host: str, port: int, *, call_timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        self.call_timeout_s = call_timeout_s
        self.auth = resolve_auth()  # the cluster secret of this host's environment
        self._context = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._connect()
        info = self.call("info")
        self.engine_id = str(info["engine_id"])
        self.endpoint = (info["endpoint"][0], int(info["endpoint"][1])) \
            if info.get("endpoint") else None
        self.topology = ParallelTopology.from_dict(info["topology"])

    def _connect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = connect_control(self._context, self.host, self.port, self.call_timeout_s)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self._sock is not None
        try:
            reply = control_exchange(self._sock, self.auth, op, fields)
        except zmq.Again:
            self._connect()
            raise EngineProcessError(f"producer control {self.host}:{self.port}: no reply to "
                                     f"{op!r} within {self.call_timeout_s} s") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise EngineProcessError(f"producer: {op} failed: {reply!r:.300}")
        return reply

    def close(self, timeout_s: float = 15.0) -> int | None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._context.term()
        return None


def engine_config(opts: DemoOptions, role: KVRole, topology: ParallelTopology,
                  extra: dict[str, Any] | None = None) -> EngineConfig:
    settings = {"mode": opts.mode.value, **opts.connector_extra, **(extra or {})}
    return EngineConfig(spec=load_spec(opts.model), topology=topology,
                        num_blocks=opts.num_blocks, max_num_batched_tokens=4096,
                        max_num_seqs=64,
                        connector=ConnectorConfig(opts.connector, role, extra=settings),
                        verify_loads=opts.verify, remote_kv_timeout_s=opts.timeout_s,
                        device=opts.device)


def push_params(spec: RequestSpec, producer: _Engine, consumer: _Engine,
                producer_topology: ParallelTopology, fingerprint: str) -> TransferParams:
    if producer.endpoint is None or consumer.endpoint is None:
        raise EngineProcessError("push mode needs both engines' connector endpoints")
    return TransferParams(
        mode=TransferMode.PUSH, producer_engine_id=producer.engine_id,
        producer_host=producer.endpoint[0], producer_port=producer.endpoint[1],
        producer_request_id=spec.request_id, block_ids=(),
        producer_topology=producer_topology.sizes(), num_tokens=len(spec.prompt),
        consumer_engine_id=consumer.engine_id, consumer_host=consumer.endpoint[0],
        consumer_port=consumer.endpoint[1], consumer_request_id=spec.request_id,
        spec_fingerprint=fingerprint)


class Router:
    """Routes requests between a producer and a consumer engine (pull or push)."""

    def __init__(self, producer: _Engine, consumer: _Engine, mode: TransferMode,
                 producer_topology: ParallelTopology, fingerprint: str) -> None:
        self.producer, self.consumer, self.mode = producer, consumer, mode
        self.producer_topology = producer_topology
        self.fingerprint = fingerprint
        self.specs: dict[str, RequestSpec] = {}
        self.results: dict[str, RequestResult] = {}
        self.producer_results: list[RequestResult] = []

    def submit(self, specs: list[RequestSpec]) -> None:
        for s in specs:
            self.specs[s.request_id] = s
        if self.mode is TransferMode.PULL:
            self.producer.submit([replace(s, remote_decode=True, max_tokens=1,
                                          transfer_params=None) for s in specs])
            return
        params = [push_params(s, self.producer, self.consumer, self.producer_topology,
                              self.fingerprint) for s in specs]
        self.consumer.submit([replace(s, transfer_params=p)
                              for s, p in zip(specs, params, strict=True)])
        self.producer.submit([replace(s, remote_decode=True, max_tokens=1, transfer_params=p)
                              for s, p in zip(specs, params, strict=True)])

    def poll(self) -> int:
        """Forward finished prefills and collect results; returns how many moved."""
        return (self.on_producer_results(self.producer.results())
                + self.on_consumer_results(self.consumer.results()))

    def on_producer_results(self, results: list[RequestResult]) -> int:
        """Producer results of this router's requests: forward pull params to the consumer."""
        forward = []
        for result in results:
            self.producer_results.append(result)
            if result.state is not RequestState.FINISHED_LENGTH:
                self.results.setdefault(result.request_id, result)
            elif self.mode is TransferMode.PULL:
                out = result.transfer_params
                forward.append(replace(self.specs[result.request_id], transfer_params=(
                    TransferParams.from_dict(out.to_dict()) if out else None)))
        if forward:
            self.consumer.submit(forward)
        return len(forward)

    def on_consumer_results(self, results: list[RequestResult]) -> int:
        for result in results:
            self.results.setdefault(result.request_id, result)
        return len(results)

    @property
    def done(self) -> bool:
        return len(self.results) >= len(self.specs)


def _drain(engines: list[_Engine], deadline: float) -> list[dict[str, Any]]:
    while True:
        stats = [e.stats() for e in engines]
        if all(not s.get("idle_problems") for s in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def run_demo(opts: DemoOptions, progress: Callable[[str], None] | None = None,
             ) -> dict[str, Any]:
    """Run the demo; returns the summary dict (see ``kvbridge demo --help``).

    Raises ConfigError (a usage error) for a bad ``--kv-config`` setting before any
    engine process starts."""
    check_connector_settings(lambda role: engine_config(opts, role, ParallelTopology()))
    spec = load_spec(opts.model)
    requests = make_requests(opts.requests, prompt_tokens=opts.prompt_tokens,
                             max_tokens=opts.max_tokens, seed=opts.seed, prefix="demo")
    engines: list[_Engine] = []
    try:
        if opts.producer_addr:
            host, port = parse_address(opts.producer_addr)
            control = opts.producer_control_port or port + 1
            remote = RemoteEngine(host, control)
            producer: _Engine = remote
            producer_topology = remote.topology
        else:
            producer_topology = opts.producer
            producer = EngineProcess(engine_config(opts, KVRole.PRODUCER, opts.producer),
                                     name="producer")
        engines.append(producer)
        consumer = EngineProcess(engine_config(opts, KVRole.CONSUMER, opts.consumer),
                                 name="consumer")
        engines.append(consumer)
        router = Router(producer, consumer, opts.mode, producer_topology, spec.fingerprint())
        elapsed = route_all(router, requests, opts.timeout_s, progress)
        producer_stats, consumer_stats = _drain([producer, consumer], time.monotonic() + 30)
        records = _records(producer if opts.mode is TransferMode.PUSH else consumer)
    finally:
        for engine in reversed(engines):
            with contextlib.suppress(Exception):
                engine.close()
    results = [router.results[s.request_id] for s in requests]
    wrong = check_outputs(results, requests)
    return summarize(opts, results, wrong, elapsed, producer_stats, consumer_stats, records)


def _records(engine: _Engine) -> list[dict[str, Any]] | None:
    """The moving side's per-transfer records; None from a server without the op."""
    try:
        return engine.transfer_records()
    except EngineProcessError:
        return None


def exact_percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank ``q``-quantile (0..1): the smallest sample with at least a
    ``q`` fraction of samples at or below it (always an observed value); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals: the wall time during
    which at least one transfer was in flight (overlaps counted once)."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def summarize(opts: DemoOptions, results: list[RequestResult], wrong: list[str],
              elapsed: float, producer_stats: dict[str, Any],
              consumer_stats: dict[str, Any],
              records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The demo summary. With the moving side's ``records`` (one per finished
    transfer), ``latency_ms`` holds exact nearest-rank percentiles of the
    successful transfers' durations (load start -- handshake wait included -- to
    completion) and ``transfer_gbps`` is bytes over the union of their intervals
    (wall time with at least one transfer in flight); without records, the
    percentiles are histogram bucket upper bounds and the busy time the sum of
    durations (``latency_exact`` says which)."""
    cons = consumer_stats["stats"]
    prod = producer_stats["stats"]
    cw = cons.get("worker_stats", {})
    pw = prod.get("worker_stats", {})
    moving = pw if opts.mode is TransferMode.PUSH else cw  # the side that posts transfers
    nbytes = int(moving.get("transfer_bytes", 0))
    transfers = int(moving.get("transfers", 0))
    quantiles = (0.5, 0.9, 0.99)
    ok = [r for r in records or [] if r.get("ok")]
    if records is not None:
        durations_ms = [float(r["duration_s"]) * 1000.0 for r in ok]
        latency = {f"p{int(q * 100)}": _round_ms(exact_percentile(durations_ms, q))
                   for q in quantiles}
        busy_s = busy_seconds([(float(r["started_at"]),
                                float(r["started_at"]) + float(r["duration_s"])) for r in ok])
        # the first transfer pays the cold peer: its handshake, the first agent
        # connection and, on a GPU, the first CUDA IPC mapping
        first = min(ok, key=lambda r: float(r["started_at"]), default=None)
        first_ms = _round_ms(float(first["duration_s"]) * 1000.0) if first else None
    else:
        latency = {f"p{int(q * 100)}": histogram_percentile(moving, q) for q in quantiles}
        busy_s = float(moving.get("transfer_time_s", 0.0))
        first_ms = None
    counters = ("handshakes", "handshake_failures", "transfer_failures", "loads_failed",
                "pushes_failed", "lease_expiries", "late_notifs", "unknown_notifs",
                "sessions_dropped", "heartbeats_sent", "releases_sent", "loads_done_on_promise",
                "promises_contradicted", "holds_promised")
    return {
        "connector": opts.connector,
        "mode": opts.mode.value,
        "model": opts.model,
        "producer": (opts.producer.describe() if not opts.producer_addr
                     else f"remote {opts.producer_addr}"),
        "consumer": opts.consumer.describe(),
        **request_fields(results, wrong, elapsed, nbytes, busy_s),
        "blocks": int(cons.get("connector_stats", {}).get("blocks_ordered", 0)),
        "transfers": transfers,
        "bytes": nbytes,
        "descriptors": int(moving.get("transfer_descs", 0)),
        "descriptor_runs": int(moving.get("transfer_runs", 0)),
        "latency_ms": latency,
        "latency_exact": records is not None,
        "first_transfer_ms": first_ms,
        "busy_s": round(busy_s, 4),
        "consumer_counters": {k: cw.get(k, 0) for k in counters},
        "producer_counters": {k: pw.get(k, 0) for k in counters},
        "idle_problems": idle_problems(producer_stats, consumer_stats),
    }


def _round_ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
