"""`kvbridge mooncake master|bench`: run a local Mooncake master (or only its metadata server);
raw store vs kvbridge's client."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
from typing import Any

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import require_subcommand
from kvbridge.tools.progress import Progress

EPILOG = """\
examples:
  kvbridge mooncake master                       # free ports on 127.0.0.1, until Ctrl-C
  kvbridge mooncake master --port 50051 --http-port 8080 --json
  kvbridge mooncake master --host 10.0.0.5         # every port on 10.0.0.5 only
  kvbridge mooncake master --metadata-only --http-port 8080   # the metadata server alone
  kvbridge mooncake bench                        # 64 x 2 MiB and 4096 x 16 KiB
  kvbridge mooncake bench --pattern 256x64KiB --rounds 9 --json
"""

MASTER_EPILOG = """\
Runs mooncake_master (from the Mooncake wheel) with its RPC service and
metrics, and kvbridge's HTTP metadata server, every port on --host only
(default 127.0.0.1); prints the two addresses a client needs, and stops both
cleanly on Ctrl-C / SIGTERM (or after --duration).

Mooncake's embedded HTTP metadata server listens on every interface whatever
host it is given, so it is turned off (--enable_http_metadata_server=false)
and kvbridge serves the same protocol, bounded (key 4 KiB, value 16 MiB, 256
MiB and 65536 keys in all, 64 connections, 10 s per request), from a child
process bound to --host. `kvbridge doctor` shows where the ports listen. The
clients' own transfer-engine ports still listen on every interface: firewall
them on shared networks.

--metadata-only serves the metadata protocol alone (in this process), for a
mooncake_master you run yourself with --enable_http_metadata_server=false;
its clients use http://HOST:HTTP_PORT/metadata.

examples:
  kvbridge mooncake master
  kvbridge mooncake master --port 50051 --http-port 8080 --json
  kvbridge mooncake master --host 10.0.0.5
  kvbridge mooncake master --metadata-only --host 10.0.0.5 --http-port 8080

--json prints one line {"host", "rpc_address", "metadata_url", "metrics_url", "pid",
"metadata_pid", "log"}; with --metadata-only {"host", "metadata_url", "pid"}.

exit codes: 0 stopped cleanly, 1 the master failed to start or died, 2 usage error
"""

BENCH_EPILOG = """\
Puts and gets the same blocks with Mooncake's own batch_put_from /
batch_get_into and with kvbridge's MooncakeStoreClient, alternating in each
round on one store, and prints GB/s (median over rounds), the client/raw
ratio (median of per-round paired ratios; best rounds alongside) and memcpy of
the same bytes. Every round's get is verified byte for byte;
exit code 1 if any round failed. Starts a local master unless --master is given.

examples:
  kvbridge mooncake bench
  kvbridge mooncake bench --pattern 64x2MiB --pattern 4096x16KiB --rounds 9 --json
  kvbridge mooncake bench --master 127.0.0.1:50051 --metadata http://127.0.0.1:8080/metadata

--json prints {"master", "local_master", "rounds", "segment_bytes", "patterns":
[{"num_blocks", "block_bytes", "raw": {"put_gbps", "get_gbps"}, "client": {...},
"ratio": {"put", "get", "put_best", "get_best"}, "memcpy_gbps", "verified"}]}.

exit codes: 0 ok, 1 a round failed or the store is unusable, 2 usage error
"""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}
_PATTERN = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_pattern(text: str) -> tuple[int, int]:
    """``"64x2MiB"`` -> ``(64, 2097152)``; raises ValueError naming the expected form."""
    match = _PATTERN.match(text)
    unit = match.group(3).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"pattern must look like 64x2MiB or 4096x16384 (blocks x bytes), got {text!r}")
    num_blocks, block_bytes = int(match.group(1)), int(match.group(2)) * _UNITS[unit]
    if num_blocks < 1 or block_bytes < 1:
        raise ValueError(f"pattern needs at least one block of at least one byte, got {text!r}")
    return num_blocks, block_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "mooncake", help="run a local Mooncake master; benchmark the Mooncake store client",
        description="Mooncake store utilities.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mooncake_command", metavar="COMMAND")

    master = sub.add_parser(
        "master", help="run mooncake_master on 127.0.0.1 until interrupted",
        description="Run a local mooncake_master with kvbridge's HTTP metadata server, "
                    "every port on one host.",
        epilog=MASTER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    master.add_argument("--host", default="127.0.0.1",
                        help="the one address every port listens on (default 127.0.0.1)")
    master.add_argument("--port", type=int, default=None, help="RPC port (default: a free one)")
    master.add_argument("--http-port", type=int, default=None,
                        help="HTTP metadata server port (default: a free one)")
    master.add_argument("--metrics-port", type=int, default=None,
                        help="metrics port (default: a free one)")
    master.add_argument("--lease-ttl-ms", type=int, default=None,
                        help="lease a read puts on an object, ms (Mooncake default 10000)")
    master.add_argument("--log", default=None, metavar="FILE",
                        help="write the master's log here (default: a temporary file)")
    master.add_argument("--duration", type=float, default=None, metavar="S",
                        help="stop after S seconds (default: until interrupted)")
    master.add_argument("--max-value-bytes", type=int, default=None, metavar="N",
                        help="largest metadata value accepted (default 16 MiB)")
    master.add_argument("--max-total-bytes", type=int, default=None, metavar="N",
                        help="metadata bytes stored in all (default 256 MiB)")
    master.add_argument("--metadata-only", action="store_true",
                        help="serve only the HTTP metadata server (for a mooncake_master run "
                             "by hand with --enable_http_metadata_server=false)")
    master.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    master.set_defaults(func=run_master)


    bench = sub.add_parser(
        "bench", help="raw Mooncake batch put/get vs kvbridge's client, same bytes, same run",
        description="Benchmark kvbridge's MooncakeStoreClient against the raw Mooncake store.",
        epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--pattern", action="append", default=None, metavar="NxSIZE",
                       help="blocks x block size, e.g. 64x2MiB (repeatable; "
                            "default 64x2MiB and 4096x16KiB)")
    bench.add_argument("--rounds", "--iters", dest="rounds", type=int, default=7, help="timed rounds per side (default 7)")
    bench.add_argument("--master", default=None, metavar="HOST:PORT",
                       help="use this master instead of starting one (needs --metadata)")
    bench.add_argument("--metadata", default=None, metavar="URL",
                       help="metadata server URL, e.g. http://127.0.0.1:8080/metadata")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--progress", action="store_true",
                       help="progress on stderr even when it is not a terminal")
    bench.set_defaults(func=run_bench)

    require_subcommand(parser)


def _metadata_limits(args: argparse.Namespace) -> Any:
    import dataclasses

    from kvbridge.backends.mooncake.metadata import MetadataLimits

    changes = {k: v for k, v in (("max_value_bytes", args.max_value_bytes),
                                 ("max_total_bytes", args.max_total_bytes)) if v is not None}
    return dataclasses.replace(MetadataLimits(), **changes)


def run_master(args: argparse.Namespace) -> int:
    from kvbridge.backends.mooncake.master import MooncakeMaster, MooncakeMasterError

    for name in ("port", "http_port", "metrics_port"):
        value = getattr(args, name)
        if value is not None and not 0 < value < 65536:
            print(f"kvbridge mooncake master: --{name.replace('_', '-')} must be 1..65535, "
                  f"got {value}", file=sys.stderr)
            return EXIT_USAGE
    if args.metadata_only:
        extra = [f for f, v in (("--port", args.port), ("--metrics-port", args.metrics_port),
                                ("--lease-ttl-ms", args.lease_ttl_ms), ("--log", args.log))
                 if v is not None]
        if extra:
            print(f"kvbridge mooncake master: {', '.join(extra)} mean nothing with "
                  "--metadata-only (no mooncake_master is started)", file=sys.stderr)
            return EXIT_USAGE
        return run_metadata(args)
    try:
        limits = _metadata_limits(args)
        master = MooncakeMaster(
            host=args.host, metadata_limits=limits, rpc_port=args.port, http_port=args.http_port, metrics_port=args.metrics_port,
            log_path=args.log, lease_ttl_ms=args.lease_ttl_ms,
        )
    except ValueError as exc:
        print(f"kvbridge mooncake master: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            master.start()
        except MooncakeMasterError as exc:
            print(f"kvbridge mooncake master: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        info = {"host": master.host, "rpc_address": master.rpc_address,
                "metadata_url": master.metadata_url, "metrics_url": master.metrics_url,
                "pid": master.pid, "metadata_pid": master.metadata_pid,
                "log": str(master.log_path)}
        if args.json:
            print(json.dumps(info), flush=True)
        else:
            print(f"mooncake_master pid {master.pid} (metadata server pid {master.metadata_pid}), "
                  f"listening on {master.host} only\n"
                  f"  master address   {master.rpc_address}\n"
                  f"  metadata server  {master.metadata_url}\n"
                  f"  metrics          {master.metrics_url}\n"
                  f"  log              {master.log_path}\n"
                  "Ctrl-C to stop.", flush=True)
        waited = 0.0
        while not stop.wait(0.5):
            waited += 0.5
            if not master.is_running:
                print(f"kvbridge mooncake master: mooncake_master exited unexpectedly; log:\n"
                      f"{master.log_tail()}", file=sys.stderr)
                return EXIT_FAILURE
            if args.duration is not None and waited >= args.duration:
                break
        return EXIT_OK
    finally:
        master.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_metadata(args: argparse.Namespace) -> int:
    """``--metadata-only``: the bounded metadata server alone, on ``--host:--http-port``."""
    import os

    from kvbridge.backends.mooncake.master import check_host, url_host
    from kvbridge.backends.mooncake.metadata import MetadataHTTPServer, bind_listener

    try:
        check_host(args.host)
        limits = _metadata_limits(args)
    except ValueError as exc:
        print(f"kvbridge mooncake master: {exc}", file=sys.stderr)
        return EXIT_USAGE
    port = args.http_port or 0
    try:
        listener = bind_listener(args.host, port)
    except OSError as exc:
        print(f"kvbridge mooncake master: cannot listen on {url_host(args.host)}:{port}: "
              f"{exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    # This process has no Mooncake client, so a thread is safe here (a client's setup()
    # holds the GIL while it talks to the metadata server: never serve it in-thread there).
    server = MetadataHTTPServer(listener, limits).start()
    try:
        url = f"http://{url_host(args.host)}:{server.server_address[1]}/metadata"
        if args.json:
            print(json.dumps({"host": args.host, "metadata_url": url, "pid": os.getpid()}),
                  flush=True)
        else:
            print(f"Mooncake HTTP metadata server on {url} ({args.host} only); Ctrl-C to stop.",
                  flush=True)
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.wait(0.5):  # short waits: the signal handler runs promptly
            if deadline is not None and time.monotonic() >= deadline:
                break
        return EXIT_OK
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_bench(args: argparse.Namespace) -> int:
    try:
        patterns = [parse_pattern(p) for p in (args.pattern or ["64x2MiB", "4096x16KiB"])]
    except ValueError as exc:
        print(f"kvbridge mooncake bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.rounds < 1:
        print(f"kvbridge mooncake bench: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return EXIT_USAGE
    if (args.master is None) != (args.metadata is None):
        print("kvbridge mooncake bench: --master and --metadata go together", file=sys.stderr)
        return EXIT_USAGE
    from kvbridge.backends.mooncake import MooncakeError
    from kvbridge.backends.mooncake.master import MooncakeMasterError
    from kvbridge.tools.bench.mooncake_client import format_report, run_mooncake_bench

    try:
        with Progress("mooncake bench", force=args.progress).ticking("raw store vs client"):
            report = run_mooncake_bench(tuple(patterns), rounds=args.rounds,
                                        master_address=args.master,
                                        metadata_server=args.metadata)
    except (MooncakeError, MooncakeMasterError) as exc:
        print(f"kvbridge mooncake bench: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    ok = all(p["verified"] for p in report["patterns"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return EXIT_OK if ok else EXIT_FAILURE
