"""`kvbridge handshake serve-example`: serve FAKE handshake metadata (tests, demos)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import replace

from kvbridge.auth import insecure_from_env, resolve_auth
from kvbridge.handshake import HandshakeError, HandshakeServer, TransferMode
from kvbridge.handshake.example import example_store
from kvbridge.layouts import KVCacheSpec, LayoutError, load_spec
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import add_topology_arguments, require_subcommand, topology_from_args

EPILOG = """\
The metadata is FAKE: well-formed and self-consistent, but its addresses
describe no real memory and its agent blobs are not NIXL metadata. It exists
to try `kvbridge probe` and `kvbridge diff` without a serving engine.

examples:
  kvbridge handshake serve-example --model tiny-gqa --tp 2 --port 5600
  kvbridge handshake serve-example --model tiny-gqa --tp 4 --port 0 --json  # prints the port
  kvbridge handshake serve-example --topology tp=4,dcp=2 --duration 60

--json prints one line {"address", "port", "engine_id", "incarnation",
"fingerprint", "fake": true} once the server listens.

exit codes: 0 stopped (signal or --duration), 1 cannot listen, 2 usage error
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "handshake", help="handshake side-channel utilities (serve FAKE example metadata)",
        description="Handshake side-channel utilities. To inspect a live engine use "
                    "`kvbridge probe`; to compare two, `kvbridge diff`.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="handshake_command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve-example", help="serve FAKE but well-formed metadata of a model",
        description="Serve FAKE handshake metadata for every rank of a model preset until "
                    "interrupted (or --duration).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", default="tiny-gqa", help="preset name or spec JSON file")
    add_topology_arguments(serve)
    serve.add_argument("--block-size", type=int, default=None,
                       help="override every region's block size (tokens)")
    serve.add_argument("--mode", choices=[m.value for m in TransferMode],
                       default=TransferMode.PULL.value)
    serve.add_argument("--engine-id", default="example-engine")
    serve.add_argument("--num-blocks", type=int, default=64)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
    serve.add_argument("--duration", type=float, default=None, metavar="S",
                       help="stop after S seconds (default: until interrupted)")
    serve.add_argument("--json", action="store_true",
                       help="print the bound address as one JSON line")
    serve.set_defaults(func=run_serve_example)
    require_subcommand(parser)


def run_serve_example(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.model)
        if args.block_size is not None:
            spec = KVCacheSpec(spec.model, tuple(replace(r, block_size=args.block_size)
                                                 for r in spec.regions))
        topology = topology_from_args(args)
        spec.validate_topology(topology)
        store = example_store(spec, topology, args.engine_id, TransferMode(args.mode),
                              num_blocks=args.num_blocks)
        store.auth = resolve_auth()  # the cluster secret of the environment, as an engine's
        server = HandshakeServer(store, args.host, args.port,
                                 insecure_no_auth=insecure_from_env()).start()
    except (LayoutError, HandshakeError, ValueError) as exc:
        print(f"kvbridge handshake serve-example: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, LayoutError) else EXIT_FAILURE
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.json:
            print(json.dumps({"address": server.address, "port": server.port,
                              "engine_id": store.engine_id, "incarnation": store.incarnation,
                              "fingerprint": store.fingerprint, "fake": True}), flush=True)
        else:
            print(f"serving FAKE example metadata of engine {store.engine_id!r} "
                  f"({spec.model}, {topology.describe()}, {args.mode}) on {server.address}",
                  flush=True)
        stop.wait(args.duration)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK
