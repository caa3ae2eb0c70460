"""`kvbridge plan`: show the transfer plan between two engine topologies."""

from __future__ import annotations

import argparse
import json
import sys

from kvbridge.layouts import (
    KVCacheSpec,
    LayoutError,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
    load_spec,
    plan_transfer,
    preset_names,
)
from kvbridge.layouts.plan import TransferPlan
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

EPILOG = f"""\
MODEL is a preset ({", ".join(preset_names())}) or a spec JSON file.
A topology is comma-separated sizes: tp=N,pp=N,dcp=N,pcp=N (missing ones are 1).

examples:
  kvbridge plan --model tiny-gqa --producer tp=4,pp=1 --consumer tp=2,pp=1
  kvbridge plan --model tiny-hybrid --producer tp=8,pp=2 --consumer tp=2 --json
  kvbridge plan --model my-model.json --producer tp=4,dcp=2 --consumer tp=2,dcp=2

--json prints {{"model", "fingerprint", "producer", "consumer", "ranks": [{{"consumer",
"sources", "bytes_per_block", "descriptors_before_coalescing", "descriptors", ...}}],
"total_bytes_per_block", "descriptors_before_coalescing", "descriptors", "note"?}}.

exit codes: 0 a plan exists, 1 the pair is refused (reason on stderr), 2 usage error
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="show the KV transfer plan from a producer to a consumer topology",
        description="Per consumer rank: which producer ranks it reads, bytes per block, and "
                    "descriptor counts before and after coalescing.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="PRESET|FILE",
                        help="model preset name or spec JSON file")
    parser.add_argument("--producer", required=True, metavar="TOPOLOGY",
                        help="producer (prefill) sizes, e.g. tp=4,pp=1")
    parser.add_argument("--consumer", required=True, metavar="TOPOLOGY",
                        help="consumer (decode) sizes, e.g. tp=2,pp=1")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _nhd_note(spec: KVCacheSpec, plan: TransferPlan) -> str | None:
    hetero = plan.producer.num_head_groups != plan.consumer.num_head_groups
    regions = [r.name for r in spec.regions if r.memory_order is MemoryOrder.NHD
               and r.layout is RegionLayout.SPLIT]
    if hetero and regions:
        return (f"note: region(s) {', '.join(regions)} use NHD order with heterogeneous TP: "
                f"one descriptor per token and K|V; HND order coalesces to one per head slice")
    return None


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.model)
        producer = ParallelTopology.parse(args.producer, "producer")
        consumer = ParallelTopology.parse(args.consumer, "consumer")
    except LayoutError as exc:
        print(f"kvbridge plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        plan = plan_transfer(spec, producer, consumer)
    except LayoutError as exc:
        print(f"kvbridge plan: refused: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    data = plan.to_dict()
    note = _nhd_note(spec, plan)
    if args.json:
        if note:
            data["note"] = note
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"model {spec.model} (layout {data['fingerprint']}): producer "
          f"{data['producer']} -> consumer {data['consumer']}")
    rows = [("consumer rank", "sources", "bytes/block", "descriptors raw -> coalesced")]
    for rank in data["ranks"]:
        rows.append((rank["consumer"]["name"],
                     ", ".join(s["name"] for s in rank["sources"]) or "-",
                     str(rank["bytes_per_block"]),
                     f"{rank['descriptors_before_coalescing']} -> {rank['descriptors']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
              + "  " + row[3])
    total = data["total_bytes_per_block"]
    print(f"total per block index: {total} bytes ({_fmt_bytes(total)}), descriptors "
          f"{data['descriptors_before_coalescing']} -> {data['descriptors']}")
    if note:
        print(note)
    return EXIT_OK
