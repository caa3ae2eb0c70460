"""Workloads for the reference engine: request generation, an in-process PD router, results.

``run_workload`` runs either one engine (colocated, or with an offload/store
connector) or a producer/consumer pair in this process, with a router that
does what a PD proxy does:

* pull: send the request to the producer with ``remote_decode`` and
  ``max_tokens=1``; when it finishes, forward its ``TransferParams`` (as a
  dict, parsed again, as over HTTP) with the original prompt to the consumer;
* push: build ``TransferParams(mode=push)`` from both engines' connector
  endpoints and send the request to both at once.

Every output is compared with :func:`reference_output` and every loaded byte
is verified by the engines (``verified_bytes`` / ``mismatched_bytes``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvbridge.connectors import ConfigError, SchedulerStep, TransferMode, TransferParams
from kvbridge.engine.content import VOCAB_SIZE, reference_output
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState


def make_requests(num_requests: int, *, prompt_tokens: int = 64, shared_prefix_tokens: int = 0,
                  max_tokens: int = 4, seed: int = 0, prefix: str = "req") -> list[RequestSpec]:
    """Deterministic prompts; the first ``shared_prefix_tokens`` are common to all."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(shared_prefix_tokens)]
    requests = []
    for index in range(num_requests):
        own = max(1, prompt_tokens - shared_prefix_tokens)
        prompt = shared + [rng.randrange(VOCAB_SIZE) for _ in range(own)]
        requests.append(RequestSpec(f"{prefix}-{index}", tuple(prompt), max_tokens=max_tokens))
    return requests


@dataclass
class WorkloadResult:
    """Outcome of a workload. ``results`` are the final (consumer's, in PD) results."""

    results: list[RequestResult]
    producer_results: list[RequestResult] = field(default_factory=list)
    wrong_outputs: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    engine_stats: dict[str, Any] = field(default_factory=dict)
    producer_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.results)

    @property
    def failed_requests(self) -> int:
        return sum(1 for r in self.results if r.state is not RequestState.FINISHED_LENGTH
                   or r.request_id in self.wrong_outputs)

    @property
    def verified_bytes(self) -> int:
        return sum(r.verified_bytes for r in self.results)

    @property
    def mismatched_bytes(self) -> int:
        return sum(r.mismatched_bytes for r in self.results)

    @property
    def external_tokens(self) -> int:
        return sum(r.num_external_tokens for r in self.results)

    @property
    def recomputed_tokens(self) -> int:
        return sum(r.num_recomputed_tokens for r in self.results)

    def summary(self) -> dict[str, Any]:
        seconds = max(self.elapsed_s, 1e-9)
        return {
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "wrong_outputs": len(self.wrong_outputs),
            "external_tokens": self.external_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "verified_bytes": self.verified_bytes,
            "mismatched_bytes": self.mismatched_bytes,
            "elapsed_s": round(self.elapsed_s, 4),
            "throughput_gbps": round(self.verified_bytes / seconds / 1e9, 4),
        }


class InProcessRouter:
    """A PD proxy between two in-process engines. Sans-I/O apart from stepping them."""

    def __init__(self, producer: Engine, consumer: Engine,
                 mode: TransferMode = TransferMode.PULL) -> None:
        self.producer = producer
        self.consumer = consumer
        self.mode = mode
        self._specs: dict[str, RequestSpec] = {}
        self.producer_results: list[RequestResult] = []
        self.results: list[RequestResult] = []
        self.failed_at_producer: list[str] = []

    def submit(self, spec: RequestSpec) -> None:
        self._specs[spec.request_id] = spec
        if self.mode is TransferMode.PULL:
            self.producer.add_request(replace(spec, remote_decode=True, max_tokens=1,
                                              transfer_params=None))
            return
        producer_at = self.producer.endpoint()
        consumer_at = self.consumer.endpoint()
        if producer_at is None or consumer_at is None:
            raise ConfigError("mode", "push mode needs both connectors to expose endpoint()")
        params = TransferParams(
            mode=TransferMode.PUSH, producer_engine_id=self.producer.engine_id,
            producer_host=producer_at[0], producer_port=producer_at[1],
            producer_request_id=spec.request_id, block_ids=(),
            producer_topology=self.producer.sizes, num_tokens=len(spec.prompt),
            consumer_engine_id=self.consumer.engine_id, consumer_host=consumer_at[0],
            consumer_port=consumer_at[1], consumer_request_id=spec.request_id,
            spec_fingerprint=self.producer.spec.fingerprint())
        self.consumer.add_request(replace(spec, transfer_params=params))
        self.producer.add_request(replace(spec, remote_decode=True, max_tokens=1,
                                          transfer_params=params))

    def poll(self) -> int:
        """One step of each engine; forwards finished prefills. Returns tokens computed."""
        tokens = 0
        if self.producer.has_work():
            tokens += self.producer.step().num_tokens
        for result in self.producer.pop_results():
            self.producer_results.append(result)
            if self.mode is not TransferMode.PULL:
                continue
            spec = self._specs[result.request_id]
            if result.state is not RequestState.FINISHED_LENGTH:
                self.failed_at_producer.append(result.request_id)
                self.results.append(result)
                continue
            params = result.transfer_params
            # through the wire form, as a real router would forward it
            parsed = TransferParams.from_dict(params.to_dict()) if params else None
            self.consumer.add_request(replace(spec, transfer_params=parsed))
        if self.consumer.has_work():
            tokens += self.consumer.step().num_tokens
        self.results.extend(self.consumer.pop_results())
        return tokens

    @property
    def busy(self) -> bool:
        return (self.producer.has_work() or self.consumer.has_work()
                or len(self.results) < len(self._specs))


def check_outputs(results: Sequence[RequestResult], specs: Sequence[RequestSpec]) -> list[str]:
    """Ids of finished requests whose output differs from :func:`reference_output`."""
    by_id = {s.request_id: s for s in specs}
    wrong = []
    for result in results:
        spec = by_id.get(result.request_id)
        if spec is None or result.state is not RequestState.FINISHED_LENGTH:
            continue
        if list(result.output) != reference_output(spec.prompt, spec.max_tokens):
            wrong.append(result.request_id)
    return wrong


def run_workload(requests: Sequence[RequestSpec], *, engine: EngineConfig | Engine,
                 consumer: EngineConfig | Engine | None = None,
                 mode: TransferMode = TransferMode.PULL, timeout_s: float = 120.0,
                 max_steps: int = 200_000, shutdown: bool = True,
                 consumer_step_hook: Callable[[Engine, SchedulerStep], None] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 ) -> WorkloadResult:
    """Run ``requests`` to completion on one engine, or through a producer/consumer pair.

    ``engine``/``consumer`` may be configs (engines are created and, with
    ``shutdown``, shut down here) or live engines (left running).
    ``consumer_step_hook`` is added to the loading engine's ``step_hooks``.
    ``on_progress(done, total)`` is called whenever more requests finished.
    Raises ``TimeoutError`` if the workload does not drain in time.
    """
    created: list[Engine] = []

    def build(item: EngineConfig | Engine) -> Engine:
        if isinstance(item, Engine):
            return item
        built = Engine(item)
        created.append(built)
        return built

    try:
        first = build(engine)
        second = build(consumer) if consumer is not None else None
        loader = second if second is not None else first
        if consumer_step_hook is not None:
            loader.step_hooks.append(consumer_step_hook)
        start = time.monotonic()
        deadline = start + timeout_s
        if second is None:
            for spec in requests:
                first.add_request(spec)
            results: list[RequestResult] = []
            steps = 0
            while first.has_work():
                if time.monotonic() > deadline or steps >= max_steps:
                    raise TimeoutError(f"workload still busy after {steps} steps: "
                                       f"{len(results)}/{len(requests)} done; {first.stats()}")
                if first.step().num_scheduled == 0:
                    time.sleep(0.0005)
                steps += 1
                finished = first.pop_results()
                if finished:
                    results.extend(finished)
                    if on_progress is not None:
                        on_progress(len(results), len(requests))
            elapsed = time.monotonic() - start
            return WorkloadResult(results=results, wrong_outputs=check_outputs(results, requests),
                                  elapsed_s=elapsed, engine_stats=first.stats())
        router = InProcessRouter(first, second, mode)
        for spec in requests:
            router.submit(spec)
        steps = 0
        while router.busy:
            if time.monotonic() > deadline or steps >= max_steps:
                raise TimeoutError(f"PD workload still busy after {steps} steps: "
                                   f"{len(router.results)}/{len(requests)} done; producer "
                                   f"{first.stats()}, consumer {second.stats()}")
            before = len(router.results)
            if router.poll() == 0:
                time.sleep(0.0005)
            steps += 1
            if on_progress is not None and len(router.results) != before:
                on_progress(len(router.results), len(requests))
        elapsed = time.monotonic() - start
        return WorkloadResult(results=router.results, producer_results=router.producer_results,
                              wrong_outputs=check_outputs(router.results, requests),
                              elapsed_s=elapsed, engine_stats=second.stats(),
                              producer_stats=first.stats())
    finally:
        if shutdown:
            for item in created:
                item.shutdown()
