"""`kvbridge demo`: a producer and a consumer engine in separate processes, KV moved and verified.

Connectors plug in through ``tools/demo_<name>.py`` modules (found here
automatically) that define ``CONNECTOR = "<name>"`` and either the NIXL-style
``run_demo(DemoOptions, progress) -> dict`` or their own
``run_cli(args, progress) -> dict``; optional ``add_arguments(parser)`` adds
connector-specific flags (distinct names). The summary dict must hold at least
``requests``, ``failed_requests``, ``verified_bytes``, ``mismatched_bytes``,
``throughput_gbps``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from types import ModuleType
from typing import Any

import kvbridge.tools.demo as _demo_pkg
from kvbridge.connectors import ConfigError, TransferMode
from kvbridge.layouts import LayoutError, ParallelTopology, preset_names
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import add_device_argument, device_from_args

EPILOG = """\
examples:
  kvbridge demo                                   # NIXL pull, tiny-gqa, TP 1 -> 1, 16 requests
  kvbridge demo --mode push --model tiny-hybrid --producer tp=2 --consumer tp=1
  kvbridge demo --producer tp=2,pp=2 --consumer tp=4 --requests 64 --json
  kvbridge demo --producer-addr 10.0.0.5:5600     # consumer only, against `kvbridge serve`

--json prints the summary: {"connector", "mode", "model", "producer", "consumer",
"requests", "failed_requests", "blocks", "bytes", "descriptors", "descriptor_runs"
(nixl: after NIXL merged contiguous descriptors), "verified_bytes",
"mismatched_bytes", "throughput_gbps", "transfer_gbps", "latency_ms", ...}.

exit codes: 0 every request verified, 1 a failed request, a mismatched byte or no byte
verified (nothing moved), 2 usage error
"""


def demo_modules() -> dict[str, ModuleType]:
    """Connector name -> its demo runner module (``tools/demo/<name>.py``)."""
    out: dict[str, ModuleType] = {}
    for name in demo_names():
        module = importlib.import_module(f"kvbridge.tools.demo.{name}")
        out[str(getattr(module, "CONNECTOR", name))] = module
    return out


def demo_names() -> list[str]:
    """Connector names of the demo runners, from their file names (``demo/<name>.py``,
    whose ``CONNECTOR`` is ``<name>``) without importing them: they import the engine."""
    return sorted(info.name for info in pkgutil.iter_modules(_demo_pkg.__path__)
                  if info.name != "pd_report")


def _add_connector_arguments(parser: argparse.ArgumentParser) -> None:
    for module in demo_modules().values():
        add = getattr(module, "add_arguments", None)
        if add is not None:
            add(parser)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvbridge.tools.deferred import defer_arguments

    parser = subparsers.add_parser(
        "demo", help="run a producer and a consumer engine and verify every moved byte",
        description="Start a producer (prefill) engine and a consumer (decode) engine as "
                    "separate processes on this machine, route a batch of requests through "
                    "them with the chosen connector, verify every received byte against the "
                    "content function, and print a summary (requests, blocks, bytes, "
                    "mismatched bytes, throughput, per-transfer latency percentiles). A "
                    "progress line goes to stderr while it runs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connector", default="nixl", choices=demo_names() or ["nixl"],
                        help="which connector moves the KV (default: nixl)")
    parser.add_argument("--mode", default="pull", choices=["pull", "push"],
                        help="pull: consumer reads; push: producer writes (default pull)")
    parser.add_argument("--model", default="tiny-gqa", metavar="PRESET|FILE",
                        help=f"model preset ({', '.join(preset_names())}) or spec JSON file")
    parser.add_argument("--producer", default="tp=1", metavar="tp=..,pp=..",
                        help="producer parallel sizes (default tp=1)")
    parser.add_argument("--consumer", default="tp=1", metavar="tp=..,pp=..",
                        help="consumer parallel sizes (default tp=1)")
    parser.add_argument("--requests", type=int, default=16, metavar="N")
    parser.add_argument("--prompt-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--num-blocks", type=int, default=256, metavar="N",
                        help="blocks per region in each engine")
    parser.add_argument("--producer-addr", metavar="HOST:PORT",
                        help="use a running `kvbridge serve` producer (its side channel); "
                             "only the consumer runs here")
    parser.add_argument("--producer-control-port", type=int, metavar="PORT",
                        help="the served producer's control port (default PORT+1)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S")
    parser.add_argument("--kv-config", metavar="JSON",
                        help="extra connector settings (nixl, mooncake), checked before "
                             "anything starts, e.g. '{\"lease_s\": 10}'")
    add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    # connector flags: added when `demo` itself is parsed or its help printed, so that
    # `kvbridge --help` does not import the demo runners (they import torch)
    defer_arguments(parser, _add_connector_arguments)
    from kvbridge.tools.events_flags import add_events_arguments, with_engine_events

    add_events_arguments(parser)  # --events-endpoint / --events-replay-endpoint
    parser.set_defaults(func=with_engine_events(run))


def _progress(line: str) -> None:
    sys.stderr.write(f"\r[demo] {line}\033[K")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    modules = demo_modules()
    module = modules.get(args.connector)
    if module is None:
        print(f"kvbridge demo: no demo runner for connector {args.connector!r}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args.device = device_from_args(args)  # a GPU this host lacks: usage error, at once
    except ConfigError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if hasattr(module, "run_cli"):
            summary: dict[str, Any] = module.run_cli(args, _progress)
        else:
            extra = json.loads(args.kv_config) if args.kv_config else {}
            if not isinstance(extra, dict):
                raise ConfigError("kv_config", "expected a JSON object")
            opts = module.DemoOptions(
                mode=TransferMode(args.mode), model=args.model,
                producer=ParallelTopology.parse(args.producer, "producer"),
                consumer=ParallelTopology.parse(args.consumer, "consumer"),
                requests=args.requests, prompt_tokens=args.prompt_tokens,
                num_blocks=args.num_blocks, producer_addr=args.producer_addr,
                producer_control_port=args.producer_control_port, timeout_s=args.timeout,
                connector_extra=extra, device=args.device)
            summary = module.run_demo(opts, _progress)
    except (ConfigError, LayoutError, ValueError) as exc:
        sys.stderr.write("\n")
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (TimeoutError, RuntimeError) as exc:
        sys.stderr.write("\n")
        print(f"kvbridge demo: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    sys.stderr.write("\n")
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_summary(summary))
    # a run that moved nothing verified nothing (every load failed and was recomputed)
    ok = summary["failed_requests"] == 0 and summary["mismatched_bytes"] == 0 \
        and summary["verified_bytes"] > 0
    return EXIT_OK if ok else EXIT_FAILURE


def format_summary(summary: dict[str, Any]) -> str:
    lat = summary.get("latency_ms") or {}
    # exact percentiles of recorded transfers, or histogram bucket bounds (older engines)
    relation = "" if summary.get("latency_exact") else "<= "
    lines = [
        f"kvbridge demo: {summary.get('connector')} {summary.get('mode')}, model "
        f"{summary.get('model')}, producer {summary.get('producer')} -> consumer "
        f"{summary.get('consumer')}",
        f"  requests        {summary['requests']} ({summary['failed_requests']} failed)",
        f"  blocks          {summary.get('blocks', '-')}",
        f"  bytes moved     {summary.get('bytes', 0):,} in {summary.get('transfers', 0)} "
        f"transfers ({summary.get('descriptors', 0):,} descriptors"
        + (f", merged into {summary['descriptor_runs']:,} runs"
           if summary.get("descriptor_runs") else "") + ")",
        f"  verified bytes  {summary['verified_bytes']:,}",
        f"  mismatched      {summary['mismatched_bytes']:,}",
        f"  elapsed         {summary.get('elapsed_s', 0):.2f} s",
        f"  throughput      {summary['throughput_gbps']:.4f} GB/s end to end"
        + (f", {summary['transfer_gbps']:.3f} GB/s while transferring"
           if summary.get("transfer_gbps") else ""),
        "  latency (ms)    " + ", ".join(f"{k} {relation}{v:g}" if v is not None else f"{k} -"
                                          for k, v in lat.items()),
    ]
    if summary.get("first_transfer_ms") is not None:  # the cold peer's transfer
        lines.append(f"  first transfer  {summary['first_transfer_ms']:g} ms")
    return "\n".join(lines)
