"""`kvbridge demo --connector offload`: one engine, the tiered offload store, shared prefixes.

Rounds of the same prompts (fresh request ids) run through one engine with the
``offloading`` connector. Between rounds the engine's prefix cache is reset and
the store's cascades are finished, so every round after the first must take its
prefixes from the store; the CPU tier is kept smaller than the working set, so
blocks also come back from the ``fs`` tier (promoted into CPU first). With
``--inject-faults RATE`` a share of the fs tier's block opens fail for real
(torn block, ELOOP, EIO): those blocks are recomputed, every request still
finishes, and every loaded byte is verified against the content function. The
faults come from a ``FaultyFsIO`` the demo hands each fs tier as its I/O
(``kvbridge.connectors.offloading.io_hook``), never from a connector setting.

``run_offload_workload`` is the library call behind it (tests use it too).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole
from kvbridge.connectors.offloading import OffloadingScheduler, build_part_table
from kvbridge.connectors.offloading.io_hook import fs_io_factory
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.events import BlockRemoved, BlockStored
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.offload.faults import FaultInjectors, FaultKind, FaultPlan

CONNECTOR = "offload"

#: the fault kinds that make a load fail (a close error after a full read does not;
#: "corrupt", a changed byte inside a full-size file, is caught by the digest check)
LOAD_FAULT_KINDS = ("short_read", "eloop", "eio", "corrupt")

Progress = Callable[[str], None]


def make_prompts(num_requests: int, *, groups: int, prompt_tokens: int,
                 shared_prefix_tokens: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    """``num_requests`` prompts in ``groups`` families, each family sharing a prefix."""
    if groups < 1 or num_requests < 1:
        raise ConfigError("requests", "expected at least one request and one group")
    out: list[RequestSpec] = []
    per_group = -(-num_requests // groups)
    for group in range(groups):
        count = min(per_group, num_requests - len(out))
        if count <= 0:
            break
        out.extend(make_requests(count, prompt_tokens=prompt_tokens,
                                 shared_prefix_tokens=shared_prefix_tokens,
                                 max_tokens=max_tokens, seed=seed * 1000 + group,
                                 prefix=f"g{group}"))
    return out


def run_offload_workload(*, model: str = "tiny-gqa",
                         topology: ParallelTopology | None = None,
                         requests: int = 64, rounds: int = 3, groups: int = 4,
                         prompt_tokens: int = 96, shared_prefix_tokens: int = 48,
                         max_tokens: int = 2, cpu_blocks: int = 16, num_blocks: int = 256,
                         offload_dir: str | None = None, fault_rate: float = 0.0,
                         fault_kinds: tuple[str, ...] = LOAD_FAULT_KINDS, seed: int = 0,
                         policy: str = "lru", o_direct: bool = True,
                         timeout_s: float = 300.0, max_steps: int = 1_000_000,
                         progress: Progress | None = None,
                         record_failed_loads: bool = False,
                         device: str = "cpu") -> dict[str, Any]:
    """Run the rounds; returns the summary (see the module docstring).

    ``max_steps`` bounds every round (a livelock would show up as a TimeoutError).
    With ``record_failed_loads`` the summary carries ``failed_load_log``
    (``OffloadingScheduler.failed_load_log``) and per-request ``results``.
    """
    if rounds < 1:
        raise ConfigError("rounds", f"expected >= 1, got {rounds}")
    spec = load_spec(model)
    topology = topology or ParallelTopology()
    with contextlib.ExitStack() as stack:
        directory = offload_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvbridge-offload-demo-"))
        # a block has one part per namespace: size the CPU tier in blocks, not parts
        table = build_part_table(spec, topology)
        parts_per_block = max(len(table.pool_region_parts(pool, r))
                              for pool in range(len(table.pool_bytes))
                              for r in range(len(spec.regions)))
        extra: dict[str, Any] = {"cpu_blocks": cpu_blocks * parts_per_block, "policy": policy,
                                 "fs_dir": directory, "fs_o_direct": o_direct}
        injectors: FaultInjectors | None = None
        if fault_rate > 0:
            try:
                kinds = tuple(FaultKind(kind) for kind in fault_kinds)
            except ValueError as exc:
                raise ConfigError("fault_kinds", str(exc)) from None
            injectors = FaultInjectors(FaultPlan(rate=fault_rate, kinds=kinds, seed=seed))
            stack.callback(injectors.close)   # after the engine (its tiers) shut down
        config = EngineConfig(spec, topology, num_blocks=num_blocks,
                              connector=ConnectorConfig("offloading", KVRole.BOTH, extra=extra),
                              remote_kv_timeout_s=timeout_s, device=device)
        if injectors is None:
            engine = stack.enter_context(Engine(config))
        else:
            with fs_io_factory(injectors):
                engine = stack.enter_context(Engine(config))
        scheduler = engine.scheduler_connector
        assert isinstance(scheduler, OffloadingScheduler)
        if record_failed_loads:
            scheduler.failed_load_log = []
        prompts = make_prompts(requests, groups=groups, prompt_tokens=prompt_tokens,
                               shared_prefix_tokens=shared_prefix_tokens,
                               max_tokens=max_tokens, seed=seed)
        results: list[RequestResult] = []
        specs: list[RequestSpec] = []
        steps_per_round: list[int] = []
        start = time.monotonic()
        deadline = start + timeout_s
        for round_index in range(rounds):
            batch = [RequestSpec(f"r{round_index}-{p.request_id}", p.prompt,
                                 max_tokens=p.max_tokens) for p in prompts]
            specs.extend(batch)
            for item in batch:
                engine.add_request(item)
            steps = 0
            while engine.has_work():
                if steps >= max_steps or time.monotonic() > deadline:
                    raise TimeoutError(f"round {round_index}: still busy after {steps} steps "
                                       f"({len(engine.waiting)} waiting, "
                                       f"{len(engine.running)} running)")
                if engine.step().num_scheduled == 0:
                    time.sleep(0.0005)  # only promotions/probes in flight
                steps += 1
                done = engine.pop_results()
                if done:
                    results.extend(done)
                    if progress is not None:
                        progress(f"round {round_index + 1}/{rounds}: "
                                 f"{len(results)}/{len(prompts) * rounds} requests")
            steps_per_round.append(steps)
            # the next round must come from the store: forget the engine's own cache and
            # let the cascades to fs finish (blocks evicted from CPU come back from fs)
            engine.reset_prefix_cache()
            scheduler.wait_idle(timeout_s=max(1.0, deadline - time.monotonic()))
        elapsed = time.monotonic() - start
        injected = {} if injectors is None else {
            kind.value: count for kind, count in injectors.injected_kinds().items()}
        summary = _summary(engine, scheduler, results, specs, elapsed, steps_per_round,
                           injected)
        sizes = topology.sizes()
        summary.update(model=model, rounds=rounds,
                       topology=f"tp={sizes.tp_size},pp={sizes.pp_size},dcp={sizes.dcp_size},"
                                f"pcp={sizes.pcp_size}",
                       cpu_blocks=cpu_blocks, fault_rate=fault_rate,
                       offload_dir=offload_dir)
        if record_failed_loads:
            summary["failed_load_log"] = list(scheduler.failed_load_log or ())
            summary["results"] = results
        return summary


def _summary(engine: Engine, scheduler: OffloadingScheduler, results: list[RequestResult],
             specs: list[RequestSpec], elapsed: float, steps_per_round: list[int],
             injected: dict[str, int]) -> dict[str, Any]:
    stats = engine.stats()
    cstats = scheduler.get_stats()
    wrong = check_outputs(results, specs)
    failed = sum(1 for r in results if r.state is not RequestState.FINISHED_LENGTH
                 or r.request_id in wrong)
    tiers = ["cpu"] + [t.name for t in scheduler.managers[0].secondaries]
    events: dict[str, dict[str, int]] = {}
    for event in engine.events:
        if isinstance(event, BlockStored | BlockRemoved):
            medium = f"{event.medium}/{event.locality}" if event.locality else str(event.medium)
            kind = "stored" if isinstance(event, BlockStored) else "removed"
            row = events.setdefault(medium, {"stored": 0, "removed": 0})
            row[kind] += len(event.block_hashes)
    block_tokens = min(engine.tokens_per_block)
    engine_recomputed = int(stats["recomputed_tokens"])  # type: ignore[call-overload]
    verified = int(stats["verified_bytes"])  # type: ignore[call-overload]
    return {
        "connector": "offloading", "mode": "tiered",
        "requests": len(results), "failed_requests": failed, "wrong_outputs": len(wrong),
        "steps": sum(steps_per_round), "max_steps_per_round": max(steps_per_round),
        "hit_blocks_by_tier": {t: int(cstats.get(f"hits_{t}", 0)) for t in tiers},
        "external_tokens": stats["external_tokens"],
        "failed_loads": int(cstats.get("promotions_failed", 0)),
        "recomputed_blocks": int(cstats.get("failed_load_blocks", 0))
        + engine_recomputed // block_tokens,
        "engine_failed_loads": stats["failed_loads"],
        "injected_faults": injected,
        "fs_files_deleted": int(cstats.get("fs_files_deleted", 0)),
        "cpu_evictions": int(cstats.get("cpu_evictions", 0)),
        "stored_parts": int(cstats.get("store_parts", 0)),
        "max_lookups_per_request": int(cstats.get("max_lookups_per_request", 0)),
        "lookup_invariant_violations": sum(int(v) for k, v in cstats.items()
                                           if k.endswith("_lookup_invariant_violations")),
        "events": events,
        "verified_bytes": verified,
        "mismatched_bytes": stats["mismatched_bytes"],
        "preemptions": stats["preemptions"],
        "tokens_computed": stats["tokens_computed"],
        "elapsed_s": round(elapsed, 3),
        "bytes": verified,
        "blocks": int(cstats.get("load_blocks", 0)),
        "transfers": sum(1 for r in results if r.num_external_tokens),
        "throughput_gbps": round(verified / max(elapsed, 1e-9) / 1e9, 4),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offload demo (--connector offload)")
    group.add_argument("--offload-dir", metavar="DIR",
                       help="fs tier directory (default: a temp dir, removed afterwards)")
    group.add_argument("--inject-faults", type=float, default=0.0, metavar="RATE",
                       help="share of fs block opens that fail (torn block, ELOOP, EIO)")
    group.add_argument("--rounds", type=int, default=3, metavar="N",
                       help="rounds of the same prompts (default 3)")
    group.add_argument("--cpu-blocks", type=int, default=16, metavar="N",
                       help="CPU tier slots (default 16: smaller than the working set)")
    group.add_argument("--seed", type=int, default=0, metavar="N")


def format_details(summary: dict[str, Any]) -> str:
    hits = ", ".join(f"{k} {v}" for k, v in summary["hit_blocks_by_tier"].items())
    events = ", ".join(f"{m}: +{v['stored']} -{v['removed']}"
                       for m, v in sorted(summary["events"].items()))
    faults = ", ".join(f"{k} {v}" for k, v in sorted(summary["injected_faults"].items()))
    return "\n".join([
        f"  rounds          {summary['rounds']} (CPU tier {summary['cpu_blocks']} blocks, "
        f"{summary['cpu_evictions']} evictions)",
        f"  hits by tier    {hits} (block parts loaded, one per key namespace; fs hits "
        f"were promoted into CPU first)",
        f"  failed loads    {summary['failed_loads']} (injected: {faults or 'none'}); "
        f"recomputed blocks {summary['recomputed_blocks']}",
        f"  KV events       {events or 'none'}",
    ])


def run_cli(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    if getattr(args, "kv_config", None):
        raise ConfigError("kv_config", "the offload demo builds its own connector settings; "
                                       "use --cpu-blocks, --offload-dir and --inject-faults")
    if not 0.0 <= args.inject_faults <= 1.0:
        raise ConfigError("inject_faults", f"expected a rate in [0, 1], got {args.inject_faults}")
    summary = run_offload_workload(
        model=args.model, topology=ParallelTopology.parse(args.consumer, "consumer"),
        requests=args.requests, rounds=args.rounds, prompt_tokens=max(args.prompt_tokens, 2),
        shared_prefix_tokens=args.prompt_tokens // 2, cpu_blocks=args.cpu_blocks,
        num_blocks=args.num_blocks, offload_dir=args.offload_dir,
        fault_rate=args.inject_faults, seed=args.seed, timeout_s=args.timeout,
        progress=progress, device=args.device)
    summary["producer"] = summary["consumer"] = summary["topology"]
    if not args.json:
        print(format_details(summary))
    return summary
