"""`kvbridge bench` as one suite: every path, kvbridge against the raw library, same run.

Paths (``PATHS``):

* ``nixl``     -- the NIXL connector's pull load vs a raw NIXL READ of the same held
  blocks (:mod:`kvbridge.tools.bench.nixl`); limit: torch copy of the same bytes.
* ``nixl-cost`` -- the NIXL transport's cost per transfer: kvbridge's ``post``/``wait``
  vs raw NIXL making, posting, waiting on and releasing a handle per transfer (and
  re-posting one handle), READ and WRITE, block patterns and a 4k-/32k-token request of a
  70B-class model; GB/s and the fixed cost in µs (:mod:`kvbridge.tools.bench.nixl_cost`).
* ``nixl-scale`` -- set-up at a real cache size (default 64 layers x 100,000 blocks):
  register, handshake document, both sides' lists, first transfer to a new peer, each
  timed with its peak memory, vs raw NIXL doing the same
  (:mod:`kvbridge.tools.bench.nixl_scale`).
* ``mooncake`` -- the mooncake_store connector's put/get vs Mooncake's own
  ``batch_put_from``/``batch_get_into`` (:mod:`kvbridge.tools.bench.mooncake`).
* ``offload``  -- the fs tier's store/load vs plain sequential file I/O
  (:mod:`kvbridge.tools.bench.offload`); limit: memcpy of the same bytes.
* ``events``   -- KV events through kvbridge's publisher/subscriber vs raw pyzmq PUB/SUB
  of the same frames (:mod:`kvbridge.tools.bench.events`); limit: memcpy of the payload bytes.
* ``lookup``   -- scheduler-side lookup latency: the offload manager's lookup per key
  (fs tier idle and busy) vs a plain ``os.stat`` probe of as many block files; the
  async path's round trip (lookup -> probes on the worker pool -> MISS verdict) vs the
  synchronous ``os.stat`` it replaces; the Mooncake client's ``batch_exists`` vs the
  raw ``batch_is_exist`` of the same keys.
* ``auth``     -- the cluster secret's cost (:mod:`kvbridge.tools.bench.auth`): here
  "kvbridge" is with a secret and "raw" without, same run: a side-channel fetch
  (full and conditional) and the NIXL connector's load with both engines sealed.
* ``digests``  -- ``torch-mix64-v1`` block digests (tensor reductions on the KV's own
  device: what GPU memory is verified with) vs ``xxh3-64`` (the C hash of host memory)
  on the same bytes (:mod:`kvbridge.tools.bench.digests`); limit: torch copy. With
  ``--device cuda`` and triton, the fused Triton kernel's rows against the torch ops
  and a device copy of the same bytes.

Every path returns rows of one shape (:func:`row`), so the table, the JSON file
and the plot treat them alike::

    {"path", "case", "op", "unit", "num_blocks", "block_bytes", "total_bytes",
     "kvbridge", "raw", "raw_name", "ratio", "limit", "limit_name", "verified"}

``ratio`` is kvbridge / raw for throughputs (higher is better, 1.0 = as fast as
the library) and raw / kvbridge for latencies (so it reads the same way); nixl
and mooncake report their own interleaved/paired-per-round ratio, which is more
robust on a busy machine than the ratio of the two medians. A path
whose backend is not installed is reported as skipped with the reason; a path
that raised is reported as failed (exit code 1).

This module owns the suite: ``PATHS``, :func:`run_suite` (each path in turn, its
status and time; one path's failure never hides the others' numbers),
:func:`suite_ok` (the exit code) and the ``bench`` command's flags. The row
shape and patterns live in :mod:`kvbridge.tools.bench.rows`, each path's
runner in :mod:`kvbridge.tools.bench.paths`, the tables and the plot in
:mod:`kvbridge.tools.bench.render`; every name they held when they were part of
this file is still importable from here. May not touch: how one path measures
(its own module) or how a report is rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.connectors.errors import ConfigError
from kvbridge.tools.bench.paths import (
    SCALE_STEPS,
    bench_auth,
    bench_digests,
    bench_events,
    bench_lookup,
    bench_mooncake,
    bench_nixl,
    bench_nixl_cost,
    bench_nixl_scale,
    bench_offload,
)
from kvbridge.tools.bench.render import (
    format_details,
    format_markdown,
    format_nixl_detail,
    format_offload_verify,
    format_scale_detail,
    format_table,
    plot,
    slim_report,
)
from kvbridge.tools.bench.rows import (
    DEFAULT_PATTERNS,
    GB,
    QUICK_PATTERNS,
    Skipped,
    memcpy_gbps,
    parse_pattern,
    row,
    size_label,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import device_from_args
from kvbridge.tools.progress import Progress

# what this module offered before the split stays importable from here
__all__ = [
    "DEFAULT_PATTERNS", "EPILOG", "GB", "PATHS", "QUICK_PATTERNS", "SCALE_STEPS", "Skipped",
    "add_arguments", "bench_auth", "bench_digests", "bench_events", "bench_lookup",
    "bench_mooncake", "bench_nixl", "bench_nixl_cost", "bench_nixl_scale", "bench_offload", "format_details",
    "format_markdown", "format_nixl_detail", "format_offload_verify", "format_scale_detail",
    "format_table", "machine_info", "memcpy_gbps", "parse_pattern", "plot", "register", "row",
    "run", "run_suite", "size_label", "slim_report", "suite_ok",
]


PATHS = ("nixl", "nixl-cost", "nixl-scale", "mooncake", "offload", "events", "lookup", "auth", "digests")


def run_suite(names: Sequence[str], *, patterns: Sequence[tuple[int, int]] | None = None,
              iters: int = 5, quick: bool = False, events: int | None = None,
              batch_sizes: Sequence[int] = (16, 64), master: str | None = None,
              metadata: str | None = None, directory: str | None = None,
              block_order: str = "sorted", layers: int | None = None,
              per_block: bool = False, device: str = "cpu",
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the named paths; returns ``{"machine", "paths": {name: {...}}, "rows": [...]}``.

    Each ``paths[name]`` is ``{"status": "ok"|"skipped"|"failed", "seconds", "rows",
    "detail"|"reason"}``; ``rows`` of every ok path are also concatenated at the top.
    With one path, the fields of its own report (``detail``) are copied to the top
    level too (e.g. ``patterns`` of the nixl bench), without overriding the suite's.
    """
    say = progress or (lambda _text: None)
    out: dict[str, Any] = {"machine": machine_info(), "quick": quick, "iters": iters,
                           "paths": {}, "rows": []}
    for index, name in enumerate(names):
        say(f"{name} ({index + 1}/{len(names)})")
        chosen = tuple(patterns) if patterns else (QUICK_PATTERNS if quick
                                                   else DEFAULT_PATTERNS).get(name, ())
        started = time.monotonic()
        try:
            if name == "nixl":
                result = bench_nixl(chosen, iters, quick, block_order)
            elif name == "nixl-cost":
                result = bench_nixl_cost(patterns or (), iters, quick, layers, device=device)
            elif name == "nixl-scale":
                result = bench_nixl_scale(chosen, quick, layers, per_block)
            elif name == "mooncake":
                result = bench_mooncake(chosen, iters, quick, master, metadata, device=device)
            elif name == "offload":
                result = bench_offload(chosen, iters, quick, directory)
            elif name == "events":
                result = bench_events(events or (2000 if quick else 50_000), batch_sizes)
            elif name == "lookup":
                result = bench_lookup(quick, master, metadata)
            elif name == "auth":
                result = bench_auth(chosen, iters, quick)
            elif name == "digests":
                result = bench_digests(chosen, iters, device)
            else:
                raise ValueError(f"unknown bench path {name!r}; expected one of {PATHS}")
            entry: dict[str, Any] = {"status": "ok", **result}
            out["rows"].extend(result["rows"])
        except Skipped as exc:
            entry = {"status": "skipped", "reason": str(exc), "rows": []}
        except Exception as exc:  # one path's failure must not hide the others' numbers
            entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "rows": []}
        entry["seconds"] = round(time.monotonic() - started, 2)
        out["paths"][name] = entry
    if len(names) == 1 and isinstance(out["paths"][names[0]].get("detail"), dict):
        # one path: its own report's fields also at the top level, as the per-path
        # benches printed them before the suite (scripts reading "patterns" keep working)
        for key, value in out["paths"][names[0]]["detail"].items():
            out.setdefault(key, value)
    return out


def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime())}


def suite_ok(report: dict[str, Any]) -> bool:
    return (all(p["status"] != "failed" for p in report["paths"].values())
            and all(r["verified"] for r in report["rows"]))


# ---------------------------------------------------------------- CLI


EPILOG = """\
examples:
  kvbridge bench all --json results.json --plot results.png   # every path, one file
  kvbridge bench nixl                    # NIXL connector vs raw NIXL READ vs torch copy
  kvbridge bench nixl --block-order vllm # the same with vLLM's block order
  kvbridge bench nixl-cost               # transport per transfer vs raw NIXL, READ+WRITE
  kvbridge bench nixl-cost --layers 8    # its 4k/32k-token requests at 8 of 80 layers
  kvbridge bench nixl-scale              # set-up at 64 layers x 100,000 blocks vs raw NIXL
  kvbridge bench nixl-scale --layers 32 --pattern 50000x64 --per-block
  kvbridge bench mooncake --pattern 64x2MiB --iters 9 --json
  kvbridge bench offload --dir /mnt/nvme # fs tier vs plain file I/O
  kvbridge bench events                  # KV events/s vs raw pyzmq
  kvbridge bench lookup                  # scheduler-side lookup latency per key
  kvbridge bench all --quick             # small sizes: a smoke run in seconds
  kvbridge bench all --report docs/bench.json --markdown   # the README's table, rendered

--json [FILE] prints (or writes to FILE) {"machine", "quick", "iters", "paths":
{NAME: {"status": ok|skipped|failed, "seconds", "rows", "detail"|"reason"}},
"rows": [{"path", "case", "op", "unit", "num_blocks", "block_bytes",
"total_bytes", "kvbridge", "raw", "raw_name", "ratio", "limit", "limit_name",
"verified"}]}. --plot needs matplotlib (pip install 'kvbridge[plot]').

exit codes: 0 ok (skipped paths included), 1 a path failed or moved wrong
bytes, 2 usage error
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=("all", *PATHS), metavar="PATH",
                        help=f"all, or one of: {', '.join(PATHS)}")
    parser.add_argument("--pattern", action="append", metavar="NUMxSIZE",
                        help="blocks x block size, e.g. 64x2MiB (repeatable; nixl, nixl-cost, mooncake, "
                             "offload, digests; default: a few block sizes)")
    parser.add_argument("--iters", type=int, default=5, metavar="N",
                        help="timed iterations / rounds per case (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few iterations (smoke run)")
    parser.add_argument("--events", type=int, default=None, metavar="N",
                        help="events per batch size (events; default 50000, --quick 2000)")
    parser.add_argument("--batch-sizes", default="16,64", metavar="N,N",
                        help="events per batch (events; default 16,64)")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="a running mooncake_master (default: start one; needs --metadata)")
    parser.add_argument("--metadata", metavar="URL",
                        help="its HTTP metadata server, e.g. http://127.0.0.1:8080/metadata")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="where the offload path creates its temp store")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print JSON (or write it to FILE)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw GB/s against block size for each path (needs matplotlib)")
    parser.add_argument("--block-order", choices=("sorted", "vllm"), default="sorted",
                        help="nixl: how both engines hand out blocks: sorted (ascending per "
                             "request, the reference engine's default) or vllm (free-queue "
                             "order, which runs downwards after frees)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="nixl-scale: layers per rank (default 64, --quick 8); --pattern "
                             "gives blocks per layer x bytes of one layer's block. nixl-cost: "
                             "layers of its 4k- and 32k-token requests (default 80, the "
                             "model's; --quick 1)")
    parser.add_argument("--per-block", action="store_true",
                        help="nixl-scale: also prepare per-block lists (one row per block and "
                             "layer: slow and memory-hungry at real sizes)")
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                        help="where the KV of the digests, nixl-cost and mooncake paths "
                             "lives (default cpu); cuda[:N]: digests on the device (with "
                             "triton, the fused Triton kernel's rows too), nixl-cost VRAM to "
                             "VRAM, mooncake through the connector's staging buffer")
    parser.add_argument("--progress", action="store_true",
                        help="progress on stderr even when it is not a terminal")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as markdown, headed by the machine and date")
    parser.add_argument("--report", metavar="FILE.json",
                        help="render a report saved with --json instead of running (PATH "
                             "all: every path in it; a name: that path's rows)")


def run(args: argparse.Namespace) -> int:
    try:
        patterns = [parse_pattern(p) for p in args.pattern] if args.pattern else None
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError("--batch-sizes: expected positive integers")
    except ValueError as exc:
        print(f"kvbridge bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.iters < 1 or (args.events is not None and args.events < 1):
        print("kvbridge bench: --iters and --events must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.layers is not None and args.layers < 1:
        print("kvbridge bench: --layers must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if (args.master is None) != (args.metadata is None):
        print("kvbridge bench: --master and --metadata go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        args.device = device_from_args(args)
    except ConfigError as exc:
        print(f"kvbridge bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvbridge bench: --plot needs matplotlib: pip install 'kvbridge[plot]' "
                  "(or pip install matplotlib)", file=sys.stderr)
            return EXIT_USAGE
    names = PATHS if args.name == "all" else (args.name,)
    if args.report:
        try:
            with open(args.report) as handle:
                saved = json.load(handle)
            saved["rows"] = [r for r in saved["rows"] if r["path"] in names]
            saved["paths"] = {k: v for k, v in saved["paths"].items() if k in names}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvbridge bench: --report {args.report}: not a saved bench report: {exc}",
                  file=sys.stderr)
            return EXIT_USAGE
        print(format_markdown(saved) if args.markdown else format_table(saved))
        return EXIT_OK if suite_ok(saved) else EXIT_FAILURE
    progress = Progress("bench", force=args.progress)
    report = run_suite(names, patterns=patterns, iters=args.iters, quick=args.quick,
                       events=args.events, batch_sizes=sizes, master=args.master,
                       metadata=args.metadata, directory=args.dir,
                       block_order=args.block_order, layers=args.layers,
                       per_block=args.per_block, device=args.device,
                       progress=progress.update)
    progress.done()
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.markdown:
        print(format_markdown(report))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
    else:
        print(format_table(report))
        details = format_details(report)
        if details:
            print()
            print(details)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
            print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plotted {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    for name, entry in report["paths"].items():
        if entry["status"] == "failed":
            print(f"kvbridge bench {name}: failed: {entry['reason']}", file=sys.stderr)
    return EXIT_OK if suite_ok(report) else EXIT_FAILURE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark suite: kvbridge against the raw library and memcpy",
        description="Run one path of the suite, or all: kvbridge against the raw library "
                    "doing the same bytes in the same run, plus the memory-copy limit.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
