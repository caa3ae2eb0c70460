"""Consumer side of the netns test: runs inside the consumer's network namespace.

``python netns_driver.py --producer HOST:PORT --host MY_ADDR``. Talks JSON lines:
it prints ``{"event": ...}`` lines on stdout and reads one command per line on
stdin (``go``). Sequence: one warm-up request (must succeed); prefill of the
second request, then ``{"event": "ready"}`` and wait for ``go`` (the test takes
the link down meanwhile); load it (must fail by its deadline: the failure's logged
reason is printed with the outcome); wait for ``go`` again (link back up), then two more requests that must
succeed. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import sys
import time
from dataclasses import replace
from typing import Any

import kvbridge.backends  # noqa: F401
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import make_requests
from kvbridge.handshake import parse_address
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.tools.demo.nixl import RemoteEngine


class LoadFailures(logging.Handler):
    """The reasons the real NIXL worker logs for failed loads (which path failed them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("pd load failed"):
            self.reasons.append(message)


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def wait_go(timeout_s: float = 60) -> None:
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready or sys.stdin.readline().strip() != "go":
        raise SystemExit("no 'go' from the test")


def prefill(producer: RemoteEngine, spec: RequestSpec, timeout_s: float = 30) -> RequestResult:
    producer.submit([replace(spec, remote_decode=True, max_tokens=1)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in producer.results():
            return result
        time.sleep(0.01)
    raise SystemExit(f"prefill of {spec.request_id} timed out")


def load(consumer: Engine, spec: RequestSpec, params: Any, timeout_s: float = 30
         ) -> tuple[RequestResult, bool, float]:
    consumer.add_request(replace(spec, transfer_params=params))
    start = time.monotonic()
    failed = False
    failed_at = 0.0
    while time.monotonic() - start < timeout_s:
        report = consumer.step()
        if report.output is not None and spec.request_id in report.output.failed_recving:
            failed, failed_at = True, time.monotonic() - start
        for result in consumer.pop_results():
            return result, failed, failed_at
        time.sleep(0.002)
    raise SystemExit(f"load of {spec.request_id} timed out")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--producer", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--deadline", type=float, default=3.0)
    args = parser.parse_args()
    host, port = parse_address(args.producer)
    producer = RemoteEngine(host, port + 1, call_timeout_s=10)
    consumer = Engine(EngineConfig(
        spec=load_spec("tiny-gqa"), topology=ParallelTopology(), num_blocks=64,
        connector=ConnectorConfig("nixl", KVRole.CONSUMER, extra={
            "host": args.host, "transfer_timeout_s": args.deadline,
            "handshake_timeout_s": 1.0, "revalidate_s": 0.5})))
    specs = make_requests(4, prompt_tokens=48, max_tokens=2, seed=21, prefix="netns")
    failures = LoadFailures()
    logging.getLogger("kvbridge.connectors.pd.worker").addHandler(failures)
    try:
        for index, spec in enumerate(specs):
            if index == 1:
                result = prefill(producer, spec)
                emit(event="ready")
                wait_go()  # the link is down now
                final, failed, failed_at = load(consumer, spec, result.transfer_params)
                reasons = [r.rsplit(" reason=", 1)[-1] for r in failures.reasons
                           if f" request={spec.request_id} " in r]
                emit(event="cut", request=spec.request_id, failed=failed,
                     failed_after_s=failed_at, state=final.state.value,
                     recomputed=final.num_recomputed_tokens,
                     mismatched=final.mismatched_bytes, reasons=reasons)
                wait_go()  # the link is back
                continue
            result = prefill(producer, spec)
            final, failed, _ = load(consumer, spec, result.transfer_params)
            emit(event="loaded", request=spec.request_id, failed=failed,
                 ok=final.state is RequestState.FINISHED_LENGTH and not failed
                 and final.num_external_tokens > 0 and final.mismatched_bytes == 0)
        totals = [w.connector.totals() for w in consumer.workers]  # type: ignore[union-attr]
        emit(event="done", totals=totals)
    finally:
        consumer.shutdown()
        producer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
