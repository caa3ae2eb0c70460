"""The connector conformance suite: the contract a serving engine relies on, checked for real.

For a :class:`kvbridge.connectors.testing.ConformanceCase` and a scenario,
:func:`run_case` builds reference engines with the case's connector configs,
runs a workload, and returns the list of violations (empty = conformant):

``transfer``
    Requests go through the connector (producer -> router -> consumer, or
    store -> prefix-cache reset -> load on one engine). Every output equals the
    reference, KV really came through the connector (external tokens > 0) and
    every loaded byte verifies (0 mismatched).
``failed_load``
    The case's ``break_loads`` runs on the loading engine in the first step in
    which loads start. Each affected request must be reported: its blocks in
    ``invalid_block_ids`` (and, for async loads, the request in
    ``failed_recving``, which also finishes it); the engine recomputes; every
    output is still right; nothing is left waiting.
``abort``
    Requests are aborted before scheduling, while loading (async lookups and
    WAITING_FOR_REMOTE_KVS), and on the producer while running. Everything
    still drains: delayed frees are released, no receive is left pending.

In every scenario: hooks are called in the documented order (checked from the
engine's hook log), no request is left waiting, every delayed free is
released, no stray or double report reaches the engine, the engine never had
to time a transfer out itself, shutdown is called once per half and releases
every thread the connector started.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.connectors import SchedulerStep
from kvbridge.connectors.testing import CaseEnv, CaseKind, ConformanceCase
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestSpec, RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.layouts import load_spec

SCENARIOS = ("transfer", "failed_load", "abort")

_WORKER_STEP = ("bind_connector_metadata", "start_load_kv")
_WORKER_END = ("wait_for_save", "get_finished", "clear_connector_metadata")


@dataclass
class ConformanceReport:
    case: str
    scenario: str
    problems: list[str] = field(default_factory=list)
    skipped: str = ""
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_hook_order(engine: Engine) -> list[str]:
    """Violations of the documented hook order in ``engine.hook_log``."""
    problems: list[str] = []
    name = engine.engine_id
    log = engine.hook_log
    by_step: dict[int, list[int]] = defaultdict(list)
    for index, call in enumerate(log):
        by_step[call.step].append(index)
    layers = {w.worker_index: len(w.layer_order) for w in engine.workers}
    registered: set[int] = set()
    finished_once: set[str] = set()
    shut: set[tuple[str, int | None]] = set()
    for call in log:
        key = (call.side, call.worker)
        if key in shut:
            problems.append(f"{name}: {call.side}[{call.worker}] {call.hook} after its shutdown")
        if call.hook == "shutdown":
            shut.add(key)
        if call.hook == "register_kv_caches":
            registered.add(call.worker or 0)
        if call.hook == "bind_connector_metadata" and (call.worker or 0) not in registered:
            problems.append(f"{name}: worker {call.worker} bound metadata before "
                            f"register_kv_caches")
        if call.hook == "request_finished":
            assert call.request_id is not None
            if call.request_id in finished_once:
                problems.append(f"{name}: request_finished twice for {call.request_id}")
            finished_once.add(call.request_id)
    for step, indices in by_step.items():
        if step == 0:
            continue
        calls = [log[i] for i in indices]
        metas = [i for i in indices if log[i].hook == "build_connector_meta"]
        if len(metas) != 1:
            problems.append(f"{name}: step {step}: build_connector_meta called {len(metas)} times")
            continue
        asked: set[str] = set()
        for i in indices:
            call = log[i]
            if call.side == "scheduler" and call.hook == "get_num_new_matched_tokens":
                asked.add(call.request_id or "")
            if call.side == "scheduler" and call.hook == "update_state_after_alloc" \
                    and call.request_id not in asked:
                problems.append(f"{name}: step {step}: update_state_after_alloc for "
                                f"{call.request_id} without a lookup in the same step")
            if call.side == "worker" and call.hook != "shutdown" and i < metas[0]:
                problems.append(f"{name}: step {step}: worker hook {call.hook} before "
                                f"build_connector_meta")
        per_worker: dict[int, list[str]] = defaultdict(list)
        for call in calls:
            if call.side == "worker" and call.hook not in ("shutdown", "register_kv_caches",
                                                           "create_worker"):
                per_worker[call.worker or 0].append(call.hook)
        for worker, hooks in per_worker.items():
            n = layers.get(worker, 0)
            expected = [*_WORKER_STEP, *(["wait_for_layer_load", "save_kv_layer"] * n),
                        *_WORKER_END]
            if hooks != expected:
                problems.append(f"{name}: step {step}: worker {worker} hooks {hooks}, "
                                f"expected {expected}")
    return problems


def _engine_problems(engine: Engine) -> list[str]:
    problems = [f"{engine.engine_id}: {p}" for p in engine.idle_problems()]
    stats = engine.stats()
    for key in ("stray_finished_sending", "stray_finished_recving", "stray_invalid_blocks",
                "remote_kv_timeouts", "lookup_timeouts", "mismatched_bytes"):
        if stats[key]:
            problems.append(f"{engine.engine_id}: {key} = {stats[key]}")
    return problems


class _LoadBreaker:
    """Calls ``break_loads`` once: in the first step in which a load starts."""

    def __init__(self, break_loads: Callable[[Any, Any], None]) -> None:
        self.break_loads = break_loads
        self.affected: set[str] = set()
        self.fired = False

    def __call__(self, engine: Engine, step: SchedulerStep) -> None:
        if self.fired or not engine.loads_started:
            return
        self.fired = True
        self.affected = set(engine.loads_started)
        self.break_loads(engine, step)


def _configs(case: ConformanceCase, env: CaseEnv) -> tuple[EngineConfig | None, EngineConfig]:
    spec = load_spec(case.model)
    consumer = EngineConfig(spec, case.consumer_topology, num_blocks=case.num_blocks,
                            connector=env.consumer, record_hooks=True, remote_kv_timeout_s=60.0)
    producer = None
    if case.kind is CaseKind.PD:
        if env.producer is None:
            raise ValueError(f"case {case.name}: a PD case needs a producer config")
        producer = EngineConfig(spec, case.producer_topology, num_blocks=case.num_blocks,
                                connector=env.producer, record_hooks=True)
    return producer, consumer


def _drain(engines: list[Engine], step_fn: Callable[[], int], busy: Callable[[], bool],
           timeout_s: float, problems: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while busy():
        if time.monotonic() > deadline:
            problems.append(f"not drained within {timeout_s} s: "
                            + "; ".join(f"{e.engine_id}: {len(e.waiting)} waiting, "
                                        f"{len(e.running)} running, "
                                        f"{e.stats()['delayed_frees_pending']} delayed frees"
                                        for e in engines))
            return
        if step_fn() == 0:
            time.sleep(0.001)


def run_case(case: ConformanceCase, tmp_path: Path, scenario: str, *,
             num_requests: int = 6, timeout_s: float = 90.0) -> ConformanceReport:
    """Run one scenario of one case; the report lists every violation found."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario: expected one of {SCENARIOS}, got {scenario!r}")
    report = ConformanceReport(case.name, scenario)
    threads_before = set(threading.enumerate())
    engines: list[Engine] = []
    with case.setup(tmp_path) as env:
        if scenario == "failed_load" and env.break_loads is None:
            report.skipped = env.skip_reason or "case provides no break_loads"
            return report
        producer_cfg, consumer_cfg = _configs(case, env)
        try:
            consumer = Engine(consumer_cfg)
            engines.append(consumer)
            producer = Engine(producer_cfg) if producer_cfg is not None else None
            if producer is not None:
                engines.append(producer)
            breaker = None
            if scenario == "failed_load":
                assert env.break_loads is not None
                breaker = _LoadBreaker(env.break_loads)
                consumer.step_hooks.append(breaker)
            requests = make_requests(num_requests, prompt_tokens=80, shared_prefix_tokens=32,
                                     max_tokens=3, seed=zlib.crc32(case.name.encode()))
            if producer is not None:
                _run_pd(case, producer, consumer, requests, scenario, report, timeout_s)
            else:
                _run_single(consumer, requests, scenario, report, timeout_s)
            if breaker is not None:
                _check_failed_loads(consumer, breaker, env, report)
            for engine in engines:
                report.problems += check_hook_order(engine)
                report.problems += _engine_problems(engine)
        finally:
            for engine in engines:
                engine.shutdown()
        if env.check_released is not None:
            report.problems += [f"after shutdown: {p}" for p in env.check_released()]
        for engine in engines:
            shutdowns = [c for c in engine.hook_log if c.hook == "shutdown"]
            if len(shutdowns) != len(engine.workers) + 1:
                report.problems.append(f"{engine.engine_id}: {len(shutdowns)} shutdown calls, "
                                       f"expected {len(engine.workers) + 1}")
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if extra:
        report.problems.append(f"threads left after shutdown: {[t.name for t in extra]}")
    return report


def _check_results(results: list[Any], requests: list[RequestSpec], aborted: set[str],
                   report: ConformanceReport, *, expect_external: bool) -> None:
    by_id = {r.request_id: r for r in results}
    for spec in requests:
        result = by_id.get(spec.request_id)
        if result is None:
            report.problems.append(f"request {spec.request_id} never finished")
            continue
        if spec.request_id in aborted:
            if result.state is not RequestState.FINISHED_ABORTED:
                report.problems.append(f"aborted request {spec.request_id} finished as "
                                       f"{result.state.value}")
            continue
        if result.state is not RequestState.FINISHED_LENGTH:
            report.problems.append(f"request {spec.request_id} finished as {result.state.value}"
                                   f" ({result.error})")
    wrong = check_outputs([r for r in results if r.request_id not in aborted], requests)
    if wrong:
        report.problems.append(f"wrong outputs for {wrong}")
    external = sum(r.num_external_tokens for r in results)
    verified = sum(r.verified_bytes for r in results)
    mismatched = sum(r.mismatched_bytes for r in results)
    report.summary.update(external_tokens=external, verified_bytes=verified,
                          mismatched_bytes=mismatched, requests=len(results))
    if mismatched:
        report.problems.append(f"{mismatched} mismatched bytes in loaded KV")
    if expect_external and external == 0:
        report.problems.append("no token came through the connector (external_tokens == 0)")
    if expect_external and external and not verified:
        report.problems.append("external tokens were loaded but no byte was verified")


def _run_pd(case: ConformanceCase, producer: Engine, consumer: Engine,
            requests: list[RequestSpec], scenario: str, report: ConformanceReport,
            timeout_s: float) -> None:
    router = InProcessRouter(producer, consumer, case.mode)
    aborted: set[str] = set()
    abort_plan = {"consumer_before_schedule": requests[0].request_id,
                  "producer_running": requests[1].request_id} if scenario == "abort" else {}
    for spec in requests:
        router.submit(spec)

    def step() -> int:
        tokens = 0
        if producer.has_work():
            target = abort_plan.get("producer_running")
            if target and producer.requests.get(target) is not None and \
                    not producer.requests[target].state.finished:
                producer.abort(target)
                consumer.abort(target)  # push mode: the consumer half waits too
                aborted.add(target)
                abort_plan.pop("producer_running")
            tokens += producer.step().num_tokens
        for result in producer.pop_results():
            router.producer_results.append(result)
            if case.mode.value != "pull" or result.state is not RequestState.FINISHED_LENGTH:
                continue
            spec = next(s for s in requests if s.request_id == result.request_id)
            consumer.add_request(replace(spec, transfer_params=result.transfer_params))
            if abort_plan.get("consumer_before_schedule") == spec.request_id:
                consumer.abort(spec.request_id)
                aborted.add(spec.request_id)
                abort_plan.pop("consumer_before_schedule")
        if scenario == "abort" and "consumer_loading" not in abort_plan:
            for req in list(consumer.requests.values()):
                if req.state in (RequestState.WAITING_FOR_REMOTE_KVS,
                                 RequestState.WAITING_FOR_LOOKUP) and \
                        req.request_id not in aborted:
                    consumer.abort(req.request_id)
                    aborted.add(req.request_id)
                    abort_plan["consumer_loading"] = req.request_id
                    break
        if consumer.has_work():
            tokens += consumer.step().num_tokens
        router.results.extend(consumer.pop_results())
        return tokens

    def busy() -> bool:
        done = {r.request_id for r in router.results}
        # a request aborted at the producer never reaches the consumer
        done |= {r.request_id for r in router.producer_results
                 if r.state is not RequestState.FINISHED_LENGTH}
        return producer.has_work() or consumer.has_work() or len(done) < len(requests)

    _drain([producer, consumer], step, busy, timeout_s, report.problems)
    results = list(router.results) + [r for r in router.producer_results
                                      if r.state is not RequestState.FINISHED_LENGTH]
    seen: dict[str, Any] = {}
    for result in results:
        seen.setdefault(result.request_id, result)
    _check_results(list(seen.values()), requests, aborted, report,
                   expect_external=scenario == "transfer")
    report.summary["aborted"] = sorted(aborted)


def _run_single(engine: Engine, requests: list[RequestSpec], scenario: str,
                report: ConformanceReport, timeout_s: float) -> None:
    # round 1 stores through the connector; round 2 must load it back
    for spec in requests:
        engine.add_request(spec)
    problems: list[str] = []
    _drain([engine], lambda: engine.step().num_tokens, engine.has_work, timeout_s, problems)
    first = engine.pop_results()
    engine.reset_prefix_cache()
    second_round = [replace(s, request_id=s.request_id + "-again") for s in requests]
    aborted: set[str] = set()
    for spec in second_round:
        engine.add_request(spec)
    if scenario == "abort":
        engine.abort(second_round[0].request_id)  # before scheduling
        aborted.add(second_round[0].request_id)

    def step() -> int:
        if scenario == "abort" and len(aborted) < 3:
            for req in list(engine.requests.values()):
                if req.request_id not in aborted and req.state in (
                        RequestState.WAITING_FOR_REMOTE_KVS, RequestState.WAITING_FOR_LOOKUP,
                        RequestState.RUNNING):
                    engine.abort(req.request_id)
                    aborted.add(req.request_id)
                    break
        return engine.step().num_tokens

    _drain([engine], step, engine.has_work, timeout_s, problems)
    report.problems += problems
    second = engine.pop_results()
    _check_results(first, requests, set(), report, expect_external=False)
    _check_results(second, second_round, aborted, report,
                   expect_external=scenario == "transfer")
    report.summary["aborted"] = sorted(aborted)


def _check_failed_loads(engine: Engine, breaker: _LoadBreaker, env: CaseEnv,
                        report: ConformanceReport) -> None:
    if not breaker.fired:
        report.problems.append("no load ever started on the loading engine, so the failure "
                               "could not be injected")
        return
    stats = engine.stats()
    report.summary["failed_loads"] = stats["failed_loads"]
    report.summary["affected"] = sorted(breaker.affected)
    if not stats["failed_loads"]:
        report.problems.append(f"break_loads ran while loading {sorted(breaker.affected)} but "
                               f"no load failure was reported (invalid_block_ids empty)")
    reported_blocks = set().union(*(o.invalid_block_ids for o in engine.output_log)) \
        if engine.output_log else set()
    if not reported_blocks:
        report.problems.append("no invalid block id was ever reported")
    if env.async_loads:
        failed = set().union(*(o.failed_recving for o in engine.output_log))
        finished = set().union(*(o.finished_recving for o in engine.output_log))
        if not failed & breaker.affected:
            report.problems.append(f"async loads of {sorted(breaker.affected)} were broken but "
                                   f"none was reported in failed_recving")
        if not failed <= finished:
            report.problems.append(f"failed receives not finished: {sorted(failed - finished)}")
