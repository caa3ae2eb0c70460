"""`kvbridge bench NAME`: one entry point for kvbridge's benchmarks.

Each benchmark is an entry of :data:`BENCHES`: name -> (help, runner). A
runner takes the parsed namespace and returns a JSON-able dict; a new bench
plugs in by adding one entry (its module is imported only when it runs).
Every number is measured in this run, against the raw library doing the same
bytes and against ``memcpy`` where that applies.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

EPILOG = """\
examples:
  kvbridge bench nixl                    # 64 x 2 MiB and 4096 x 16 KiB: raw NIXL, kvbridge, torch copy
  kvbridge bench nixl --iters 9 --json
  kvbridge bench nixl --pattern 256x1MiB
  kvbridge bench mooncake --json         # mooncake_store connector vs raw batch put/get
  kvbridge bench events                  # KV events published/received per second
  kvbridge bench offload                 # fs tier vs plain file I/O

exit codes: 0 ok, 1 a run failed or moved wrong bytes, 2 usage error
"""

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}


def parse_pattern(text: str) -> tuple[int, int]:
    """``"64x2MiB"`` -> ``(64, 2097152)``."""
    count, sep, size = text.partition("x")
    if not sep:
        raise ValueError(f"pattern {text!r}: expected NUMxSIZE, e.g. 64x2MiB")
    for unit, factor in _UNITS.items():
        if size.endswith(unit):
            return int(count), int(float(size[: -len(unit)]) * factor)
    return int(count), int(size)


def _nixl(args: argparse.Namespace) -> dict[str, Any]:
    module = importlib.import_module("kvbridge.tools.bench_nixl")
    patterns = tuple(parse_pattern(p) for p in args.pattern) if args.pattern \
        else module.DEFAULT_PATTERNS
    return dict(module.run_nixl_bench(patterns, iters=args.iters))


def _mooncake(args: argparse.Namespace) -> dict[str, Any]:
    # the mooncake_store connector's put/get vs raw batch put/get of the same blocks
    # (the client-only comparison is `kvbridge mooncake bench`)
    module = importlib.import_module("kvbridge.connectors.mooncake_store.bench")
    patterns = tuple(parse_pattern(p) for p in args.pattern) if args.pattern \
        else module.DEFAULT_PATTERNS
    result = dict(module.run_bench(patterns, rounds=max(args.iters, 1)))
    if not args.json:
        print(module.format_report(result))
    return result


def _events(args: argparse.Namespace) -> dict[str, Any]:
    return dict(importlib.import_module("kvbridge.events.bench").run_events_bench())


def _offload(args: argparse.Namespace) -> dict[str, Any]:
    return dict(importlib.import_module("kvbridge.offload.bench").run_offload_bench())


#: name -> (help line, runner)
BENCHES: dict[str, tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "nixl": ("raw NIXL vs the kvbridge nixl connector end to end vs torch copy", _nixl),
    "mooncake": ("mooncake_store connector put/get vs raw Mooncake batch put/get", _mooncake),
    "events": ("KV events through the ZMQ publisher and subscriber", _events),
    "offload": ("offload fs tier vs plain file I/O, lookup latency", _offload),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: kvbridge against the raw library and memcpy",
        description="Run one benchmark; every ratio is measured in this run on this machine.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(BENCHES),
                        help="; ".join(f"{k}: {v[0]}" for k, v in sorted(BENCHES.items())))
    parser.add_argument("--pattern", action="append", metavar="NUMxSIZE",
                        help="block pattern, e.g. 64x2MiB (repeatable; nixl, mooncake)")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed iterations (nixl), timed rounds (mooncake)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        result = BENCHES[args.name][1](args)
    except ValueError as exc:
        print(f"kvbridge bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvbridge bench {args.name}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.name == "nixl":
        print(format_nixl(result))
    elif args.name != "mooncake":  # the mooncake runner printed its table
        print(json.dumps(result, indent=2, sort_keys=True))
    bad = any(row.get("mismatched_bytes") for row in result.get("patterns", [])
              if isinstance(row, dict))
    return EXIT_FAILURE if bad else EXIT_OK


def format_nixl(result: dict[str, Any]) -> str:
    head = (f"{'pattern':>16} {'raw NIXL':>9} {'raw->KV':>9} {'kvbridge':>9} {'torch cp':>9} "
            f"{'kvb/raw':>8} {'kvb/rawKV':>9} {'raw/mcpy':>9}  (GB/s, READ)")
    lines = [head]
    for row in result["patterns"]:
        size = row["block_bytes"]
        label = f"{row['num_blocks']}x{size >> 20}MiB" if size >= 1 << 20 \
            else f"{row['num_blocks']}x{size >> 10}KiB"
        lines.append(f"{label:>16} {row['raw_nixl_gbps']:9.3f} "
                     f"{row['raw_nixl_into_kv_cache_gbps']:9.3f} {row['kvbridge_gbps']:9.3f} "
                     f"{row['torch_copy_gbps']:9.3f} {row['kvbridge_over_raw']:8.3f} "
                     f"{row['kvbridge_over_raw_same_destination']:9.3f} "
                     f"{row['raw_over_memcpy']:9.3f}")
    lines.append(f"target: kvbridge/raw >= {result.get('target_kvbridge_over_raw', 0.9)}; "
                 "verified bytes: " + ", ".join(str(r["verified_bytes"])
                                                for r in result["patterns"]))
    return "\n".join(lines)
