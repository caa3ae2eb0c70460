"""Side by side: vLLM's own NixlConnector and kvbridge's NIXL connector in real vLLM.

Both run the same prompts on this machine, alternating request by request
(builtin, kvbridge, builtin, ...), each prompt fresh for each pair so every
consumer really transfers (no prefix-cache hit). Per request it records:

* ``pd_s``: end-to-end disaggregated latency seen by a router (producer
  prefill with ``max_tokens=1``, then the consumer's whole decode request);
* ``decode_s``: the consumer request alone (transfer + decode);
* per-transfer time and bytes from each connector's own stats, read as
  deltas of the consumer's Prometheus histograms (``vllm:nixl_*`` for vLLM's
  connector, ``vllm:kvbridge_*`` for kvbridge's). The two times are not the
  same measurement: vLLM reports NIXL's telemetry (post to completion of the
  READ); kvbridge reports its whole load (order to the producer's
  acknowledgement, so it includes a notification round trip).

Medians and the kvbridge/vLLM ratio are reported. On a 2-core machine the
end-to-end numbers are dominated by CPU contention; each server is pinned to
its own core (producers on core 0, consumers on core 1) and the report says so.

Run: ``python -m kvbridge.integrations.vllm.bench --json`` inside the vLLM venv
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


@dataclass(frozen=True)
class PairUnderTest:
    name: str
    producer: h.VllmServer
    consumer: h.VllmServer
    metric_prefix: str  # "vllm:nixl" or "vllm:kvbridge"


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def run_side_by_side(pairs: Sequence[PairUnderTest], *, num_prompts: int = 8,
                     prompt_tokens: int = 256, max_tokens: int = 4, seed: int = 99,
                     warmup: int = 1) -> dict[str, Any]:
    """Alternate requests over ``pairs``; returns per-pair samples, medians and ratios.

    ``warmup`` requests per pair run first and are not counted (the first
    transfer to a new peer pays the handshake).
    """
    samples: dict[str, dict[str, list[float]]] = {
        p.name: {"pd_s": [], "decode_s": [], "xfer_s": [], "xfer_bytes": []} for p in pairs}
    outputs: dict[str, list[tuple[int, ...]]] = {p.name: [] for p in pairs}
    prompts = h.make_prompts(num_prompts + warmup, prompt_tokens, seed=seed)
    for index, prompt in enumerate(prompts):
        for pair in pairs:
            before = pair.consumer.metrics()
            start = time.perf_counter()
            _first, second = h.disaggregated(pair.producer, pair.consumer, prompt, max_tokens)
            pd_s = time.perf_counter() - start
            after = pair.consumer.metrics()
            if index < warmup:
                continue
            outputs[pair.name].append(second.token_ids)
            got = samples[pair.name]
            got["pd_s"].append(pd_s)
            got["decode_s"].append(second.latency_s)
            prefix = pair.metric_prefix

            def delta(key: str, before: Mapping[str, float] = before,
                      after: Mapping[str, float] = after) -> float:
                return after.get(key, 0.0) - before.get(key, 0.0)

            if delta(f"{prefix}_xfer_time_seconds_count") == 1:
                got["xfer_s"].append(delta(f"{prefix}_xfer_time_seconds_sum"))
            if delta(f"{prefix}_bytes_transferred_count") == 1:
                got["xfer_bytes"].append(delta(f"{prefix}_bytes_transferred_sum"))
    report: dict[str, Any] = {
        "setup": {"prompt_tokens": prompt_tokens, "requests_per_connector": num_prompts,
                  "max_tokens": max_tokens, "order": "alternating per request",
                  "pinning": "producers on core 0, consumers on core 1 (taskset); "
                             "2-core machine: latency is dominated by CPU contention"},
        "connectors": {},
    }
    for pair in pairs:
        got = samples[pair.name]
        report["connectors"][pair.name] = {
            "median_pd_ms": _ms(_median(got["pd_s"])),
            "median_decode_ms": _ms(_median(got["decode_s"])),
            "median_xfer_ms": _ms(_median(got["xfer_s"])),
            "median_xfer_bytes": _median(got["xfer_bytes"]),
            "xfer_samples": len(got["xfer_s"]),
            "samples": {k: [round(v, 6) for v in vals] for k, vals in got.items()},
        }
    if len(pairs) == 2:
        base, other = (report["connectors"][p.name] for p in pairs)
        report["ratio_kvbridge_over_vllm"] = {
            key: _ratio(other[key], base[key])
            for key in ("median_pd_ms", "median_decode_ms", "median_xfer_ms")}
        report["same_tokens"] = outputs[pairs[0].name] == outputs[pairs[1].name]
    report["outputs"] = {name: [list(o) for o in outs] for name, outs in outputs.items()}
    return report


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def builtin_nixl_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def kvbridge_nixl_config(role: str, *, module_path: bool = False,
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"kv_connector": "KVBridgeNixlConnector", "kv_role": role,
                              "kv_connector_extra_config": dict(extra or {})}
    if module_path:
        config["kv_connector_module_path"] = "kvbridge.integrations.vllm.connector"
    return config


def pair_specs(model: str, name: str, producer_config: Mapping[str, Any],
               consumer_config: Mapping[str, Any],
               builtin_side_channel: bool = False) -> tuple[h.ServerSpec, h.ServerSpec]:
    """Producer pinned to core 0, consumer to core 1, fresh ports for everything."""
    def env() -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())} if builtin_side_channel else {}
    return (h.ServerSpec(f"{name}-producer", model, h.free_port(), core=0,
                         kv_transfer_config=producer_config, env=env()),
            h.ServerSpec(f"{name}-consumer", model, h.free_port(), core=1,
                         kv_transfer_config=consumer_config, env=env()))


def format_table(report: Mapping[str, Any]) -> str:
    lines = [f"{'connector':<10} {'pd ms':>9} {'decode ms':>10} {'xfer ms':>9} "
             f"{'xfer bytes':>11} {'n':>3}"]
    for name, row in report["connectors"].items():
        lines.append(f"{name:<10} {row['median_pd_ms']!s:>9} {row['median_decode_ms']!s:>10} "
                     f"{row['median_xfer_ms']!s:>9} {row['median_xfer_bytes']!s:>11} "
                     f"{row['xfer_samples']:>3}")
    ratio = report.get("ratio_kvbridge_over_vllm")
    if ratio:
        lines.append("kvbridge/vllm: " + ", ".join(f"{k}={v}" for k, v in ratio.items()))
    lines.append(report["setup"]["pinning"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="vLLM's NixlConnector vs kvbridge's NIXL connector, in real vLLM on CPU.",
        epilog="example: python -m kvbridge.integrations.vllm.bench --prompts 8 --json")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="tiny model directory (built if missing; default: a temp dir)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from kvbridge.integrations.vllm.tiny_model import ensure_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-bench-") as tmp:
        model = str(ensure_tiny_llama(args.model_dir or Path(tmp) / "tiny-llama"))
        logs = args.logs or Path(tmp) / "logs"
        builtin = pair_specs(model, "vllm", builtin_nixl_config("kv_producer"),
                             builtin_nixl_config("kv_consumer"), builtin_side_channel=True)
        kvb = pair_specs(model, "kvbridge", kvbridge_nixl_config("kv_producer"),
                         kvbridge_nixl_config("kv_consumer"))
        with h.server_group(logs) as group:
            servers = group.start(*builtin, *kvb, timeout_s=600)
            pairs = [PairUnderTest("vllm", servers[0], servers[1], "vllm:nixl"),
                     PairUnderTest("kvbridge", servers[2], servers[3], "vllm:kvbridge")]
            report = run_side_by_side(pairs, num_prompts=args.prompts,
                                      prompt_tokens=args.prompt_tokens,
                                      max_tokens=args.max_tokens)
    print(json.dumps(report, indent=2) if args.json else format_table(report))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
