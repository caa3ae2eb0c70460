"""Side by side: vLLM's own NixlConnector and kvbridge's NIXL connector in real vLLM.

Both run the same prompts on this machine, alternating request by request
(builtin then kvbridge for one prompt, kvbridge then builtin for the next:
neither always runs right after the other), each prompt fresh for each pair
so every consumer really transfers (no prefix-cache hit). Per request it
records:

* ``pd_s``: end-to-end disaggregated latency seen by a router (producer
  prefill with ``max_tokens=1``, then the consumer's whole decode request);
* ``prefill_s``: the producer request alone (prefill, one token, the blocks held);
* ``decode_s``: the consumer request alone (transfer + decode);
* ``ttft_s``: the consumer's time to first token, from vLLM's own
  ``vllm:time_to_first_token_seconds`` histogram (the same code measures both);
* ``read_s``: NIXL's own telemetry of the READ (``xferDuration``: post to
  completion), for both connectors: ``vllm:nixl_xfer_time_seconds`` for
  vLLM's, ``vllm:kvbridge_nixl_xfer_time_seconds`` for kvbridge's (the same
  NIXL call, ``get_xfer_telemetry``, read when the transfer is seen done);
* ``load_s``: kvbridge's whole load (order to the producer's acknowledgement,
  a notification round trip included), ``vllm:kvbridge_xfer_time_seconds``;
  vLLM's connector has no such record.

A request's sample counts only when its histogram moved by exactly one
observation (one transfer per request). Medians per connector are reported,
and for each measurement the kvbridge/vLLM ratio of the two requests of each
prompt (paired: they ran back to back), with its median, quartiles and range
over the prompts: the spread says how much of a difference is noise.

On a 2-core machine the end-to-end numbers are dominated by CPU contention;
each server is pinned to its own core (producers on core 0, consumers on
core 1) and the report says so.

Run: ``python -m kvbridge.tools.bench.vllm_pd --json`` inside the vLLM venv
(``make test-vllm`` sets it up); it builds the tiny model, starts four servers,
and stops them all at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.integrations.vllm import harness as h
from kvbridge.integrations.vllm.configs import builtin_nixl_config, kvbridge_nixl_config, pair_specs

#: per-request samples; the histograms (sum/count deltas) behind the server-side ones
MEASURES = ("pd_s", "prefill_s", "decode_s", "ttft_s", "read_s", "load_s", "xfer_bytes")
_TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class PairUnderTest:
    name: str
    producer: h.VllmServer
    consumer: h.VllmServer
    metric_prefix: str  # "vllm:nixl" or "vllm:kvbridge"

    @property
    def histograms(self) -> dict[str, str]:
        """measure -> the consumer's histogram it is read from (without _sum/_count)."""
        if self.metric_prefix == "vllm:kvbridge":
            return {"ttft_s": _TTFT, "read_s": "vllm:kvbridge_nixl_xfer_time_seconds",
                    "load_s": "vllm:kvbridge_xfer_time_seconds",
                    "xfer_bytes": "vllm:kvbridge_bytes_transferred"}
        return {"ttft_s": _TTFT, "read_s": f"{self.metric_prefix}_xfer_time_seconds",
                "xfer_bytes": f"{self.metric_prefix}_bytes_transferred"}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: Sequence[float]) -> dict[str, float | int] | None:
    """Median, quartiles and range of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    quartiles = (statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1
                 else [ordered[0]] * 3)
    return {"median": round(quartiles[1], 3), "p25": round(quartiles[0], 3),
            "p75": round(quartiles[2], 3), "min": round(ordered[0], 3),
            "max": round(ordered[-1], 3), "n": len(ordered)}


def idle_cpu(pairs: Sequence[PairUnderTest], seconds: float = 2.0) -> dict[str, float]:
    """CPU cores each server uses while no request runs (all of them running)."""
    servers = {f"{p.name}-{side}": server for p in pairs
               for side, server in (("producer", p.producer), ("consumer", p.consumer))}
    before = {name: server.cpu_seconds() for name, server in servers.items()}
    time.sleep(seconds)
    return {name: round((server.cpu_seconds() - before[name]) / seconds, 3)
            for name, server in servers.items()}


def run_side_by_side(pairs: Sequence[PairUnderTest], *, num_prompts: int = 30,
                     prompt_tokens: int = 256, max_tokens: int = 4, seed: int = 99,
                     warmup: int = 1, pause_others: bool = True) -> dict[str, Any]:
    """Alternate requests over ``pairs``; returns per-pair samples, medians and ratios.

    ``warmup`` requests per pair run first and are not counted (the first
    transfer to a new peer pays the handshake). ``pause_others``: while one pair
    serves its request the other pairs' processes are stopped (SIGSTOP), so an
    idle server's own work (vLLM's NixlConnector keeps a core busy while idle:
    ``idle_cpu_cores`` in the report) does not land on the clock of the pair
    measured on the same core.
    """
    samples: dict[str, dict[str, list[float | None]]] = {
        p.name: {m: [] for m in MEASURES} for p in pairs}
    outputs: dict[str, list[tuple[int, ...]]] = {p.name: [] for p in pairs}
    prompts = h.make_prompts(num_prompts + warmup, prompt_tokens, seed=seed)
    idle = idle_cpu(pairs)
    try:
        for index, prompt in enumerate(prompts):
            # ABBA: which connector goes first alternates, so neither always follows
            # the other's leftovers
            for pair in (pairs if index % 2 == 0 else list(reversed(pairs))):
                if pause_others:
                    _only_running(pairs, pair)
                _one_request(pair, prompt, max_tokens, samples[pair.name],
                             outputs[pair.name], counted=index >= warmup)
    finally:
        for pair in pairs:
            pair.producer.resume()
            pair.consumer.resume()
    report: dict[str, Any] = {
        "setup": {"prompt_tokens": prompt_tokens, "requests_per_connector": num_prompts,
                  "max_tokens": max_tokens,
                  "order": "alternating per request, which goes first alternating per prompt",
                  "others_paused": pause_others, "idle_cpu_cores": idle,
                  "pinning": "producers on core 0, consumers on core 1 (taskset); "
                             "2-core machine: latency is dominated by CPU contention"},
        "connectors": {},
    }
    return _summarise(report, pairs, samples, outputs)


def _only_running(pairs: Sequence[PairUnderTest], running: PairUnderTest) -> None:
    for pair in pairs:
        for server in (pair.producer, pair.consumer):
            if pair is running:
                server.resume()
            else:
                server.pause()


def _one_request(pair: PairUnderTest, prompt: Sequence[int], max_tokens: int,
                 got: dict[str, list[float | None]], outputs: list[tuple[int, ...]],
                 counted: bool) -> None:
    """One disaggregated request of ``pair``; its samples when ``counted``."""
    before = pair.consumer.metrics()
    start = time.perf_counter()
    first, second = h.disaggregated(pair.producer, pair.consumer, prompt, max_tokens)
    pd_s = time.perf_counter() - start
    after = pair.consumer.metrics()
    if not counted:
        return
    outputs.append(second.token_ids)
    got["pd_s"].append(pd_s)
    got["prefill_s"].append(first.latency_s)
    got["decode_s"].append(second.latency_s)
    histograms = pair.histograms
    for measure in ("ttft_s", "read_s", "load_s", "xfer_bytes"):
        name = histograms.get(measure)
        got[measure].append(None if name is None else _one_sample(before, after, name))


def _summarise(report: dict[str, Any], pairs: Sequence[PairUnderTest],
               samples: dict[str, dict[str, list[float | None]]],
               outputs: dict[str, list[tuple[int, ...]]]) -> dict[str, Any]:
    """Medians per connector, paired ratios with their spread, the tokens."""
    for pair in pairs:
        got = samples[pair.name]
        present = {m: [v for v in vals if v is not None] for m, vals in got.items()}
        report["connectors"][pair.name] = {
            **{f"median_{m[:-2]}_ms": _ms(_median(present[m]))
               for m in MEASURES if m.endswith("_s")},
            "median_xfer_bytes": _median(present["xfer_bytes"]),
            "read_samples": len(present["read_s"]),
            "samples": {m: [None if v is None else round(v, 6) for v in vals]
                        for m, vals in got.items()},
        }
    if len(pairs) == 2:
        base, other = (samples[p.name] for p in pairs)
        report["ratio_kvbridge_over_vllm"] = {
            m: spread([o / b for o, b in zip(other[m], base[m], strict=True)
                       if o is not None and b])
            for m in ("pd_s", "prefill_s", "decode_s", "ttft_s", "read_s")}
        report["same_tokens"] = outputs[pairs[0].name] == outputs[pairs[1].name]
    report["outputs"] = {name: [list(o) for o in outs] for name, outs in outputs.items()}
    return report


def _one_sample(before: Mapping[str, float], after: Mapping[str, float],
                histogram: str) -> float | None:
    """The one observation a request added to ``histogram`` (None: not exactly one)."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    if delta(f"{histogram}_count") != 1:
        return None
    return delta(f"{histogram}_sum")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def format_table(report: Mapping[str, Any]) -> str:
    lines = [f"{'connector':<10} {'pd ms':>9} {'prefill ms':>10} {'decode ms':>10} "
             f"{'ttft ms':>9} {'read ms':>9} {'load ms':>9} {'bytes':>9} {'n':>3}"]
    for name, row in report["connectors"].items():
        lines.append(f"{name:<10} {row['median_pd_ms']!s:>9} {row['median_prefill_ms']!s:>10} "
                     f"{row['median_decode_ms']!s:>10} "
                     f"{row['median_ttft_ms']!s:>9} {row['median_read_ms']!s:>9} "
                     f"{row['median_load_ms']!s:>9} {row['median_xfer_bytes']!s:>9} "
                     f"{row['read_samples']:>3}")
    ratios = report.get("ratio_kvbridge_over_vllm")
    if ratios:
        lines.append("kvbridge/vllm per prompt (median [p25, p75], min-max, n):")
        for measure, s in ratios.items():
            lines.append(f"  {measure[:-2]:<7} " + ("-" if s is None else
                         f"{s['median']} [{s['p25']}, {s['p75']}], {s['min']}-{s['max']}, "
                         f"n={s['n']}"))
    setup = report["setup"]
    lines.append(setup["pinning"])
    lines.append("idle CPU (cores, all running): " + ", ".join(
        f"{name} {cores}" for name, cores in setup["idle_cpu_cores"].items()))
    lines.append("the pair not measured is paused (SIGSTOP) during each request"
                 if setup["others_paused"] else "every server runs during every request")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="vLLM's NixlConnector vs kvbridge's NIXL connector, in real vLLM on CPU.",
        epilog="example: python -m kvbridge.tools.bench.vllm_pd --prompts 30 --json")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="tiny model directory (built if missing; default: a temp dir)")
    parser.add_argument("--prompts", type=int, default=30,
                        help="requests per connector, alternating (default 30)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--kvbridge-config", type=json.loads, default={}, metavar="JSON",
                        help="kv_connector_extra_config of kvbridge's pair, e.g. "
                             "'{\"busy_progress_ms\": 0.05}'")
    parser.add_argument("--no-pause", action="store_true",
                        help="keep the pair not measured running during each request "
                             "(default: paused, so its idle work is not on the clock)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from kvbridge.integrations.vllm.tiny_model import ensure_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-bench-") as tmp:
        model = str(ensure_tiny_llama(args.model_dir or Path(tmp) / "tiny-llama"))
        logs = args.logs or Path(tmp) / "logs"
        builtin = pair_specs(model, "vllm", builtin_nixl_config("kv_producer"),
                             builtin_nixl_config("kv_consumer"), builtin_side_channel=True)
        extra = args.kvbridge_config
        kvb = pair_specs(model, "kvbridge", kvbridge_nixl_config("kv_producer", extra=extra),
                         kvbridge_nixl_config("kv_consumer", extra=extra))
        with h.server_group(logs) as group:
            servers = group.start(*builtin, *kvb, timeout_s=600)
            pairs = [PairUnderTest("vllm", servers[0], servers[1], "vllm:nixl"),
                     PairUnderTest("kvbridge", servers[2], servers[3], "vllm:kvbridge")]
            report = run_side_by_side(pairs, num_prompts=args.prompts,
                                      prompt_tokens=args.prompt_tokens,
                                      max_tokens=args.max_tokens,
                                      pause_others=not args.no_pause)
    print(json.dumps(report, indent=2) if args.json else format_table(report))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
