"""`kvbridge offload fsck|bench`: check an fs-tier store directory or the obj tier's
objects in Mooncake; benchmark the tiers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import require_subcommand
from kvbridge.tools.progress import Progress

EPILOG = """\
examples:
  kvbridge offload fsck /var/cache/kvbridge
  kvbridge offload fsck /var/cache/kvbridge --repair --json
  kvbridge offload fsck /var/cache/kvbridge --fingerprint 0123456789abcdef
  kvbridge offload fsck --obj --master 127.0.0.1:50051 \
      --metadata http://127.0.0.1:8080/metadata --master-http 127.0.0.1:9003 --repair
  kvbridge offload bench --json
  kvbridge offload bench --dir /mnt/nvme --blocks 256 --block-kib 2048
  kvbridge offload bench --verify off,sample,full --layers 32

fsck verifies every block file: its block header (format 2: the layer
digests its writer took, written atomically with the bytes) and, unless
--no-digests, its bytes against those digests, one layer at a time. Without
--repair it only reports (a dry run). --repair removes only what is provably
broken: block files whose bytes do not match their digests (digest_mismatch,
naming the layer), whose block header is torn or names another key
(corrupt_header), whose size differs from header + block_bytes, temp files
older than --min-temp-age seconds, and a directory, FIFO, device or symlink
under a block file's name (a symlink is unlinked, never its target; a
directory only if empty); a file replaced since the scan is kept. Everything
else is reported and left alone, among it format-1 block files without a
header (legacy_block), a fan-out directory that cannot be listed or is a
symlink. fsck never blocks on a FIFO, reads at most 64 KiB of a header and
one layer span of a block at a time.

--obj checks the obj tier (blocks in the Mooncake store) instead of a
directory: the master's HTTP port (--master-http: mooncake_master's
--metrics_port, printed as metrics_url by `kvbridge mooncake master`) lists
the keys; each block object is read with its digest object (.dg) and checked
against it. --repair removes both objects of a provably broken pair (bytes
that do not match their digests, a torn digest object or another key's, a
block of the wrong size) and a digest object whose block was evicted
(orphan_digest). Objects outside kvbridge/offload/ are counted and left alone.
The key list is bounded: the master must send all of it within --list-deadline
seconds (default 60, for the whole list, however slowly it trickles) and list
at most --max-keys keys (default 1000000) and 256 MiB; past a bound fsck stops
reading, checks nothing, names the bound and exits 1.

--json: fsck prints {"root", "layouts", "blocks_ok", "blocks_verified",
"blocks_unverified", "ok", "findings": [{"kind",
"path", "detail", "broken", "repaired"}], ...}; bench prints {"bytes",
"num_blocks", "block_bytes", "io_mode", "store": {"tier_gbps", "plain_gbps",
"ratio"}, "load": {...}, "lookup": {...}, "verified", "failed_jobs", ...}; with
--verify also "verify": {"modes", "gbps": {mode: {"fs_store", "fs_load",
"cpu_store", "cpu_load"}}, "ratio_of_off": {mode: {...}},
"cpu_lookup_us_per_block": {mode: us}, "verified", ...}.

--verify MODES: the cost of verified KV. For each mode (off is always run, as
the baseline), the fs tier's store and load jobs (digests taken on store,
checked on load) and the CPU tier's store and load paths through the manager
(copy into a slot + complete_store, which digests it; lookup, which checks it,
+ the copy out), in one run; ratio_of_off = GB/s with the mode / GB/s with
verification off. The store/load rows above use the tiers' default (full).

exit codes: 0 ok, 1 problems found (fsck), a --list-deadline or --max-keys bound
hit (fsck --obj: nothing checked), or failed jobs / mismatched bytes (bench), 2
usage error (among them a PATH that is missing, not a directory or cannot be
read: nothing checked)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "offload", help="tiered offload store: fsck a store directory, benchmark",
        description="Tools for the tiered offload store.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="offload_command", metavar="SUBCOMMAND")

    check = sub.add_parser(
        "fsck", help="check (and repair) an fs-tier store directory",
        description="Scan a store directory and verify each block file's digests: corrupt "
                    "blocks (bytes that do not match their digests, torn headers), short or "
                    "oversize block files, orphaned temp files, files of another or unknown "
                    "layout fingerprint, misplaced and unknown files. Reports only, unless "
                    "--repair (which removes the provably broken ones).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("path", metavar="PATH", nargs="?",
                       help="store directory (the fs tier's root); not with --obj")
    check.add_argument("--obj", action="store_true",
                       help="check the obj tier's objects in a Mooncake store instead "
                            "(needs --master, --metadata and --master-http)")
    check.add_argument("--master", metavar="HOST:PORT",
                       help="--obj: the mooncake_master RPC address")
    check.add_argument("--metadata", metavar="URL",
                       help="--obj: its HTTP metadata server, e.g. "
                            "http://127.0.0.1:8080/metadata")
    check.add_argument("--master-http", metavar="HOST:PORT",
                       help="--obj: the master's HTTP (metrics) port, which lists the keys")
    check.add_argument("--list-deadline", type=float, default=60.0, metavar="S",
                       help="--obj: the master must list its keys within S seconds in all, "
                            "else fsck stops, checks nothing and exits 1 (default 60)")
    check.add_argument("--max-keys", type=int, default=1_000_000, metavar="N",
                       help="--obj: a master that lists more than N keys is refused: fsck "
                            "stops reading, checks nothing and exits 1 (default 1000000: "
                            "two objects per block)")
    check.add_argument("--repair", action="store_true",
                       help="delete provably broken files (blocks failing their digests, torn "
                            "headers, short/oversize blocks, old temp files); without it, "
                            "fsck only reports")
    check.add_argument("--no-digests", action="store_true",
                       help="check headers and sizes only; do not read the blocks' bytes")
    check.add_argument("--fingerprint", metavar="HEX",
                       help="the layout fingerprint expected; other layouts are reported")
    check.add_argument("--min-temp-age", type=float, default=60.0, metavar="S",
                       help="temp files younger than this may belong to a running store "
                            "(default 60)")
    check.add_argument("--json", action="store_true", help="print JSON")
    check.set_defaults(func=run_fsck)

    bench = sub.add_parser(
        "bench", help="fs tier vs plain file I/O, and lookup latency under load",
        description="Store/load throughput of the fs tier against plain sequential file "
                    "I/O of the same bytes in the same run, and scheduler-thread lookup "
                    "latency per key while the fs tier is busy.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--dir", default=None, help="where to create the temp store "
                       "(default: the system temp dir)")
    bench.add_argument("--blocks", type=int, default=64, help="number of blocks (default 64)")
    bench.add_argument("--block-kib", type=int, default=1024,
                       help="block size in KiB (default 1024)")
    bench.add_argument("--batch", type=int, default=8, help="blocks per tier job (default 8)")
    bench.add_argument("--rounds", "--iters", dest="rounds", type=int, default=3,
                       help="alternating plain/tier rounds; medians are reported (default 3)")
    bench.add_argument("--lookups", type=int, default=400,
                       help="lookups timed per phase (idle, busy) (default 400)")
    bench.add_argument("--buffered", action="store_true", help="do not use O_DIRECT")
    bench.add_argument("--io-engine", choices=("auto", "uring", "python"), default="auto",
                       help="how the fs tier reads its block files: auto (batched io_uring "
                            "reads of block files up to 1 MiB), uring, python (one by one); "
                            "run twice to compare (default auto)")
    bench.add_argument("--verify", metavar="MODES", default=None,
                       help="also measure verification: comma-separated modes among off, "
                            "sample, full (off is always run as the baseline); prints GB/s "
                            "and the ratio of off per path")
    bench.add_argument("--layers", type=int, default=32,
                       help="layer spans per block for --verify (one digest each; default 32)")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.add_argument("--progress", action="store_true",
                       help="progress on stderr even when it is not a terminal")
    bench.set_defaults(func=run_bench)
    require_subcommand(parser)


def _usage(message: str) -> int:
    print(f"kvbridge offload fsck: {message}", file=sys.stderr)
    return EXIT_USAGE


def _fsck_obj(args: argparse.Namespace) -> Any:
    """The obj tier's report (``kvbridge.offload.fsck_obj``), or an int exit code."""
    import kvbridge.backends  # noqa: F401  (Mooncake env defaults before any client)
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeError, MooncakeStoreClient
    from kvbridge.offload.fsck_obj import fsck_obj
    from kvbridge.offload.types import OffloadError

    missing = [flag for flag, value in (("--master", args.master), ("--metadata",
               args.metadata), ("--master-http", args.master_http)) if not value]
    if missing:
        return _usage(f"--obj needs {', '.join(missing)}")
    if args.path is not None:
        return _usage("--obj checks the Mooncake store: give no PATH")
    if not args.list_deadline > 0 or args.max_keys < 1:
        return _usage("--list-deadline and --max-keys must be > 0")
    try:
        config = MooncakeConfig(args.master, args.metadata)
    except (TypeError, ValueError) as exc:
        return _usage(f"--master/--metadata: {exc}")
    progress = Progress("offload fsck")
    try:
        with MooncakeStoreClient(config) as client:
            return fsck_obj(client, args.master_http, repair=args.repair,
                            fingerprint=args.fingerprint, digests=not args.no_digests,
                            progress=progress.update, list_deadline_s=args.list_deadline,
                            max_keys=args.max_keys)
    except OffloadError as exc:
        print(f"kvbridge offload fsck: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except MooncakeError as exc:
        print(f"kvbridge offload fsck: the Mooncake store at {args.master}: {exc}",
              file=sys.stderr)
        return EXIT_FAILURE
    finally:
        progress.done()


def run_fsck(args: argparse.Namespace) -> int:
    from kvbridge.offload.fs_layout import FINGERPRINT_RE
    from kvbridge.offload.fsck import StoreUnreadableError, fsck

    if args.fingerprint is not None and not FINGERPRINT_RE.match(args.fingerprint):
        return _usage(f"--fingerprint: expected 8-64 lowercase hex digits, "
                      f"got {args.fingerprint!r}")
    if args.obj:
        report = _fsck_obj(args)
        if isinstance(report, int):
            return report
    elif args.path is None:
        return _usage("give the store directory PATH (or --obj for the Mooncake store)")
    else:
        try:
            report = fsck(args.path, repair=args.repair, fingerprint=args.fingerprint,
                          min_temp_age_s=args.min_temp_age, digests=not args.no_digests)
        except StoreUnreadableError as exc:
            return _usage(f"PATH: {exc.strerror}")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        layouts = ", ".join(f"{fp} ({n} B)" for fp, n in sorted(report.layouts.items())) or "none"
        other = getattr(report, "other_objects", None)
        if other:
            layouts += f"; {other} objects of other users left alone"
        print(f"store {report.root}: layouts {layouts}; {report.blocks_ok} blocks ok "
              f"({report.blocks_verified} verified against their digests, "
              f"{report.blocks_unverified} stored without digests)")
        for f in report.findings:
            state = "repaired" if f.repaired else ("BROKEN" if f.broken else "note")
            print(f"  {f.kind.value:<17} {state:<8} {f.path}: {f.detail}")
        if report.ok:
            print("ok")
        else:
            broken = sum(f.broken for f in report.problems)
            hint = " (run with --repair to delete them)" if broken and not args.repair else ""
            print(f"{len(report.problems)} problem(s), {broken} provably broken{hint}")
    return EXIT_OK if report.ok else EXIT_FAILURE


def run_bench(args: argparse.Namespace) -> int:
    from kvbridge.offload.types import OffloadError
    from kvbridge.tools.bench.offload import run_offload_bench, run_verify_bench

    modes: tuple[str, ...] = ()
    if args.verify is not None:
        modes = tuple(m.strip() for m in args.verify.split(",") if m.strip())
        bad = [m for m in modes if m not in ("off", "sample", "full")]
        if bad or not modes:
            print(f"kvbridge offload bench: --verify: expected modes among off, sample, full, "
                  f"got {args.verify!r}", file=sys.stderr)
            return EXIT_USAGE
    try:
        progress = Progress("offload bench", force=args.progress)
        with progress.ticking("fs tier vs plain I/O"):
            result = run_offload_bench(args.dir, num_blocks=args.blocks,
                                       block_bytes=args.block_kib * 1024,
                                       batch_blocks=args.batch, rounds=args.rounds,
                                       lookup_iterations=args.lookups,
                                       use_o_direct=not args.buffered,
                                       io_engine=args.io_engine)
        if modes:
            with progress.ticking("verification off/sample/full"):
                result["verify"] = run_verify_bench(
                    args.dir, modes=modes, num_blocks=args.blocks,
                    block_bytes=args.block_kib * 1024, num_layers=args.layers,
                    batch_blocks=args.batch, rounds=args.rounds,
                    use_o_direct=not args.buffered)
    except OffloadError as exc:
        print(f"kvbridge offload bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        nbytes, block_bytes = result["bytes"], result["block_bytes"]
        assert isinstance(nbytes, int) and isinstance(block_bytes, int)
        print(f"fs tier vs plain sequential file I/O, {nbytes / (1 << 20):.0f} MiB, "
              f"{result['num_blocks']} blocks x {block_bytes // 1024} KiB, {result['io_mode']}, "
              f"tier reads {result['tier_reads']}")
        for name in ("store", "load"):
            row = result[name]
            assert isinstance(row, dict)
            print(f"  {name:<5} tier {row['tier_gbps']:7.3f} GB/s   plain {row['plain_gbps']:7.3f}"
                  f" GB/s   ratio {row['ratio']:.2f}")
        lookup = result["lookup"]
        assert isinstance(lookup, dict)
        for phase in ("idle", "busy"):
            lat = lookup[f"{phase}_per_key_us"]
            print(f"  lookup per key, tier {phase}: median {lat['median']:.2f} us, "
                  f"p99 {lat['p99']:.2f} us, max {lat['max']:.2f} us")
        print(f"  verified: {result['verified']}, failed jobs: {result['failed_jobs']}")
        verify = result.get("verify")
        if isinstance(verify, dict):
            print(f"verification cost, {verify['num_layers']} layer digests per block, "
                  f"GB/s (ratio of off), {verify['io_mode']}:")
            print(f"  {'mode':<7}" + "".join(f"{p:>22}" for p in
                                             ("fs_store", "fs_load", "cpu_store", "cpu_load")))
            for mode in verify["modes"]:
                gbps, ratio = verify["gbps"][mode], verify["ratio_of_off"][mode]
                cells = "".join(f"{gbps[p]:>15.3f} ({ratio[p]:.2f})"
                                for p in ("fs_store", "fs_load", "cpu_store", "cpu_load"))
                print(f"  {mode:<7}{cells}   lookup {verify['cpu_lookup_us_per_block'][mode]:.1f}"
                      " us/block")
            print(f"  verified: {verify['verified']}, failed jobs: {verify['failed_jobs']}")
    ok = result["verified"] and not result["failed_jobs"]
    verify = result.get("verify")
    if isinstance(verify, dict):
        ok = ok and bool(verify["verified"]) and not verify["failed_jobs"]
    return EXIT_OK if ok else EXIT_FAILURE
