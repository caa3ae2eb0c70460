"""`kvbridge probe HOST:PORT`: fetch and print a live engine's handshake metadata."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from kvbridge.auth import resolve_auth
from kvbridge.handshake import (
    FetchResult,
    HandshakeClient,
    HandshakeError,
    encode_engine,
    parse_address,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

EPILOG = """\
examples:
  kvbridge probe 127.0.0.1:5600                 # every rank, round trip, clock offset
  kvbridge probe 127.0.0.1:5600 --json
  kvbridge probe 127.0.0.1:5600 --save a.kvmeta # for `kvbridge diff a.kvmeta HOST:PORT`

--json prints {"address", "rtt_s", "clock_offset_s", "clock_uncertainty_s",
"attempts", "engine": {engine_id, incarnation, generation, spec, topology,
ranks: [{..., mem_type, device_id, exposed_bytes, regions}], ...}}.
exposed_bytes: the KV blocks a rank advertises, which is all a peer holding
its metadata can read or write over NIXL.

exit codes: 0 fetched, 1 unreachable / refused / malformed reply, 2 usage error
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe", help="fetch a live engine's handshake metadata (all ranks)",
        description="Fetch and print the handshake metadata of every rank of the engine "
                    "serving at HOST:PORT, with the round-trip time and the estimated clock "
                    "offset (peer minus local, +- half the round trip).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", metavar="HOST:PORT", help="the engine's handshake server")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="seconds per attempt (default 2)")
    parser.add_argument("--retries", type=int, default=1, help="retries after a timeout "
                                                               "(default 1)")
    parser.add_argument("--save", metavar="FILE", help="also write the metadata document "
                                                       "(msgpack) to FILE")
    parser.set_defaults(func=run)


def save_document(path: str, data: bytes) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a document."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".kvmeta-", dir=target.parent or Path("."))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def result_to_json(address: str, result: FetchResult) -> dict[str, object]:
    return {"address": address, "rtt_s": result.rtt_s,
            "clock_offset_s": result.clock.offset_s,
            "clock_uncertainty_s": result.clock.uncertainty_s,
            "attempts": result.attempts, "engine": result.metadata.to_json()}


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def format_result(address: str, result: FetchResult) -> str:
    meta = result.metadata
    lines = [
        f"engine      {meta.engine_id}  (incarnation {meta.incarnation}, "
        f"generation {meta.generation})",
        f"address     {address}",
        f"model       {meta.spec.model}  fingerprint {meta.fingerprint}  "
        f"mode {meta.transfer_mode.value}  protocol v{meta.header.protocol_version}",
        f"topology    {meta.topology.describe()}",
        f"round trip  {result.rtt_s * 1e3:.2f} ms   clock offset "
        f"{result.clock.offset_s * 1e3:+.2f} ms (+- {result.clock.uncertainty_s * 1e3:.2f} ms)",
        "regions     " + "; ".join(
            f"{r.name}: {r.layout.value} {r.dtype} heads={r.num_kv_heads} "
            f"head_dim={r.head_dim} block={r.block_size} {r.memory_order.value}"
            f"{' key-only' if r.key_only else ''}" for r in meta.spec.regions),
        "",
        f"{'RANK':<16} {'AGENT':<28} {'GEN':>4} {'BLOB':>6}  EXPOSED  MEMORY",
    ]
    for rank in meta.ranks:
        memory = "; ".join(
            f"{r.name}: {len(r.base_addrs)} layers x {r.num_blocks} blocks x "
            f"{r.block_bytes_per_layer} B" for r in rank.regions if r.base_addrs)
        where = rank.mem_type + (f":{rank.device_id}" if rank.mem_type == "VRAM" else "")
        lines.append(f"{rank.rank.describe():<16} {rank.agent_name[:28]:<28} "
                     f"{rank.generation:>4} {len(rank.agent_blob):>6}  "
                     f"{_size(rank.exposed_bytes())} {where}  {memory}")
    lines.append("exposed: the KV blocks each rank advertises, all a peer holding its "
                 "metadata can read or write over NIXL")
    missing = meta.missing_ranks()
    if missing:
        lines.append(f"missing ranks: {', '.join(k.describe() for k in missing)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_address(args.address)
    except HandshakeError as exc:
        print(f"kvbridge probe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.timeout > 0 or args.retries < 0:
        print("kvbridge probe: --timeout must be > 0 and --retries >= 0", file=sys.stderr)
        return EXIT_USAGE
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    # sealed with the cluster secret of the environment (KVBRIDGE_SECRET_FILE), if any
    client = HandshakeClient(timeout_s=args.timeout, retries=args.retries, auth=resolve_auth())
    try:
        result = client.fetch(address)
    except HandshakeError as exc:
        print(f"kvbridge probe: {address}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.save:
        try:
            save_document(args.save, encode_engine(result.metadata))
        except OSError as exc:
            print(f"kvbridge probe: cannot save to {args.save}: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    if args.json:
        print(json.dumps(result_to_json(address, result), indent=2))
    else:
        print(format_result(address, result))
        if args.save:
            print(f"saved to {args.save}")
    return EXIT_OK
