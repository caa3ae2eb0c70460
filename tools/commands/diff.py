"""`kvbridge diff A B`: can these two engines exchange KV? Every mismatch, and why."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvbridge.auth import resolve_auth
from kvbridge.handshake import (
    MAX_MESSAGE_BYTES,
    CompatibilityReport,
    EngineMetadata,
    HandshakeClient,
    HandshakeError,
    Role,
    decode_engine,
    diff_engines,
    parse_address,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

EPILOG = """\
A and B are each a live engine (HOST:PORT of its handshake server) or a file
written by `kvbridge probe HOST:PORT --save FILE`. A is the local side; by
default A is the consumer (decode) and B the producer (prefill).

examples:
  kvbridge diff 127.0.0.1:5600 127.0.0.1:5601
  kvbridge diff decode.kvmeta 10.0.0.7:5600 --json
  kvbridge diff prefill.kvmeta decode.kvmeta --role producer

--json prints {"local_engine", "remote_engine", "local_role", "compatible",
"mismatches": [{"field", "local",
"remote", "severity", "why"}], "plan_exists", "plan_reason", "plan_field", ...}.

exit codes: 0 compatible, 1 they cannot exchange KV (or a peer is unreachable), 2 usage error
"""


class _Usage(Exception):
    pass


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diff", help="compatibility diff of two engines (live or saved metadata)",
        description="Compare two engines' handshake metadata: print every mismatch (field, "
                    "both values, why it matters) and whether a transfer plan exists.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", help="HOST:PORT or saved metadata file (local side)")
    parser.add_argument("b", metavar="B", help="HOST:PORT or saved metadata file (remote side)")
    parser.add_argument("--role", choices=[r.value for r in Role], default=Role.CONSUMER.value,
                        help="A's role in the transfer (default consumer)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="seconds per attempt for a live engine (default 2)")
    parser.set_defaults(func=run)


def load_metadata(source: str, client: HandshakeClient) -> EngineMetadata:
    """A saved document if ``source`` is a file, else a live fetch of every rank."""
    if os.path.isfile(source):
        size = os.path.getsize(source)
        if size > MAX_MESSAGE_BYTES:
            raise HandshakeError("file", f"{source}: {size} bytes exceeds {MAX_MESSAGE_BYTES}")
        with open(source, "rb") as handle:
            data = handle.read(MAX_MESSAGE_BYTES + 1)
        try:
            return decode_engine(data)
        except HandshakeError as exc:
            raise HandshakeError(exc.field, f"{source}: {exc.reason}") from None
    try:
        parse_address(source)
    except HandshakeError as exc:
        raise _Usage(f"{source!r} is neither a file nor HOST:PORT ({exc.reason})") from None
    return client.fetch(source).metadata


def format_report(report: CompatibilityReport, a: EngineMetadata, b: EngineMetadata) -> str:
    other = "producer" if report.local_role is Role.CONSUMER else "consumer"
    lines = [
        f"A (local, {report.local_role.value}): {a.engine_id}  {a.spec.model}  "
        f"{a.topology.describe()}  {a.transfer_mode.value}  fingerprint {a.fingerprint}",
        f"B (remote, {other}): {b.engine_id}  {b.spec.model}  "
        f"{b.topology.describe()}  {b.transfer_mode.value}  fingerprint {b.fingerprint}",
        "",
    ]
    if report.mismatches:
        width = max(24, *(len(m.field) for m in report.mismatches))
        lines.append(f"{'FIELD':<{width}}  {'A':<14} {'B':<14} {'SEVERITY':<9} WHY")
        for m in report.mismatches:
            lines.append(f"{m.field:<{width}}  {_cell(m.local):<14} {_cell(m.remote):<14} "
                         f"{m.severity.value:<9} {m.why}")
    else:
        lines.append("no differences")
    lines.append("")
    if report.plan_exists:
        lines.append(f"transfer plan: yes ({report.plan_reason})")
    else:
        where = f" [{report.plan_field}]" if report.plan_field else ""
        lines.append(f"transfer plan: none{where}: {report.plan_reason}")
    lines.append("verdict: " + ("compatible" if report.compatible
                                else "INCOMPATIBLE: these engines cannot exchange KV"))
    return "\n".join(lines)


def _cell(value: object) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= 14 else text[:11] + "..."


def run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        print("kvbridge diff: --timeout must be > 0", file=sys.stderr)
        return EXIT_USAGE
    client = HandshakeClient(timeout_s=args.timeout, retries=1, auth=resolve_auth())
    try:
        a = load_metadata(args.a, client)
        b = load_metadata(args.b, client)
    except _Usage as exc:
        print(f"kvbridge diff: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except HandshakeError as exc:
        print(f"kvbridge diff: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    report = diff_engines(a, b, Role(args.role))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, a, b))
    return EXIT_OK if report.compatible else EXIT_FAILURE
