"""`kvbridge trace`: one request through a NIXL producer/consumer pair, event by event."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.progress import Progress

EPILOG = """\
examples:
  kvbridge trace                                     # tiny-gqa, pull, TP 1 -> 1, in this process
  kvbridge trace --model tiny-hybrid --producer tp=2 --consumer tp=1 --mode push
  kvbridge trace --json > life.json                  # the event list (see below)
  kvbridge trace --inject-failure                    # the consumer's peer vanishes before its READ
  kvbridge trace --producer-addr 10.0.0.5:5600       # consumer here, against `kvbridge serve`

--json prints {"request_id", "ok", "summary": {...}, "events": [{"t_ms", "side",
"rank", "kind", "request_id", "detail"}, ...]}; kinds: plan, route, handshake,
scheduler, transfer, transfer_done, notif_sent, notif_received, lease, freed,
loaded, verify (each checked block's digests), failure, log, result (fields of
each: kvbridge/tools/trace.py).

In-process both engines share this thread: a transfer's time includes waiting
for the passive producer to progress (its step or idle pump, 5 ms). Use
--producer-addr against `kvbridge serve` to time a real link.

exit codes: 0 the request's KV arrived and verified, 1 it failed (cause in the
trace), 2 usage error
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace", help="trace one request's KV transfer through the NIXL connector",
        description="Run one request through a producer/consumer pair with the NIXL connector "
                    "(both in this process, or a live `kvbridge serve` producer with "
                    "--producer-addr) and print its life: plan, handshake (round trip, "
                    "metadata size), every transfer (bytes, time), notifications, lease "
                    "renewals, frees, and any failure with its cause.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-gqa", metavar="PRESET|FILE",
                        help="model preset or spec JSON file (default tiny-gqa)")
    parser.add_argument("--mode", default="pull", choices=["pull", "push"],
                        help="pull: consumer reads; push: producer writes (default pull)")
    parser.add_argument("--producer", default="tp=1", metavar="TOPOLOGY",
                        help="producer sizes, e.g. tp=2,pp=1 (default tp=1)")
    parser.add_argument("--consumer", default="tp=1", metavar="TOPOLOGY",
                        help="consumer sizes (default tp=1)")
    parser.add_argument("--prompt-tokens", type=int, default=64, metavar="N",
                        help="prompt length (default 64)")
    parser.add_argument("--num-blocks", type=int, default=64, metavar="N",
                        help="blocks per region in each engine (default 64)")
    parser.add_argument("--producer-addr", metavar="HOST:PORT",
                        help="a running `kvbridge serve` producer's side channel; only the "
                             "consumer runs here")
    parser.add_argument("--producer-control-port", type=int, metavar="PORT",
                        help="the served producer's control port (default PORT+1)")
    parser.add_argument("--kv-config", metavar="JSON",
                        help="extra NIXL connector settings, e.g. '{\"lease_s\": 10}'")
    parser.add_argument("--inject-failure", action="store_true",
                        help="drop the consumer's NIXL peer just before its transfer (shows "
                             "what a failure looks like)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="bound on the whole request (default 60)")
    parser.add_argument("--json", action="store_true", help="print the event list as JSON")
    parser.add_argument("--progress", action="store_true",
                        help="progress on stderr even when it is not a terminal")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.connectors import ConfigError
    from kvbridge.handshake import HandshakeError
    from kvbridge.layouts import LayoutError
    from kvbridge.tools.trace import TraceError, TraceOptions, run_trace

    if not args.timeout > 0 or args.num_blocks < 1:
        print("kvbridge trace: --timeout must be > 0 and --num-blocks >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        extra = json.loads(args.kv_config) if args.kv_config else {}
    except json.JSONDecodeError as exc:
        print(f"kvbridge trace: --kv-config is not JSON: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not isinstance(extra, dict):
        print("kvbridge trace: --kv-config must be a JSON object", file=sys.stderr)
        return EXIT_USAGE
    opts = TraceOptions(model=args.model, mode=args.mode, producer=args.producer,
                        consumer=args.consumer, prompt_tokens=args.prompt_tokens,
                        num_blocks=args.num_blocks, producer_addr=args.producer_addr,
                        producer_control_port=args.producer_control_port,
                        timeout_s=args.timeout, inject_failure=args.inject_failure,
                        connector_extra=extra)
    progress = Progress("trace", force=args.progress)
    try:
        report = run_trace(opts, progress=progress.update)
    except (ConfigError, LayoutError, ValueError) as exc:
        progress.done()
        print(f"kvbridge trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (HandshakeError, TraceError, RuntimeError, TimeoutError, OSError) as exc:
        progress.done()
        print(f"kvbridge trace: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    progress.done()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_trace(report))
    return EXIT_OK if report["ok"] else EXIT_FAILURE


def _fields(detail: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    parts = []
    for key, value in detail.items():
        if key in skip or value is None or value == [] or value == "":
            continue
        if isinstance(value, list):
            value = ",".join(map(str, value))
        parts.append(f"{key}={value}")
    return " ".join(parts)


def describe(event: dict[str, Any]) -> str:
    """One line of text for an event (the table's last column)."""
    kind, d = event["kind"], event["detail"]
    if kind == "plan":
        return (f"consumer rank {d['consumer_rank']} reads {', '.join(d['sources']) or '-'}: "
                f"{d['bytes_per_block']} B/block, {d['descriptors_before_coalescing']} -> "
                f"{d['descriptors_per_block']} descriptors/block")
    if kind == "handshake":
        return (f"{d['address']} engine {d['engine_id']} ({d['topology']}): rtt "
                f"{d['rtt_ms']:.2f} ms, metadata {d['metadata_bytes']} B, {d['ranks']} ranks"
                f"{', cached' if d.get('cached') else ''}")
    if kind == "transfer":
        return (f"{d['op']} posted to {d['peer']}: {d['bytes']:,} B in "
                f"{d['descriptors']} descriptors")
    if kind == "transfer_done":
        rate = d["bytes"] / (d["ms"] / 1e3) / 1e9 if d["ms"] > 0 else 0.0
        err = f" error={d['error']}" if d.get("error") else ""
        return (f"{d['op']} {d['state']}: {d['bytes']:,} B in {d['ms']:.3f} ms "
                f"({rate:.2f} GB/s){err}")
    if kind in ("notif_sent", "notif_received"):
        arrow = f"-> {d.get('to')}" if kind == "notif_sent" else f"<- {d.get('from')}"
        return f"{d['type']} {arrow} {_fields(d, ('type', 'to', 'from', 'request_id'))}"
    if kind == "verify":
        shown = [f"r{b['region']}/b{b['block']} {b['actual']}"
                 + ("" if b["ok"] else f" != {b['expected'] or 'no digest'}")
                 for b in d["blocks"][:8]]
        more = f" (+{len(d['blocks']) - 8} more)" if len(d["blocks"]) > 8 else ""
        return (f"digests: {d['verified']} verified, {d['mismatched']} mismatched, "
                f"{d['unverified']} unverified: {'; '.join(shown)}{more}")
    if kind == "failure":
        return f"FAILED ({d.get('stage')}): {d.get('reason')}"
    if kind == "log":
        return f"{d.get('level')}: {d.get('message')}"
    if kind == "freed":
        return "producer freed the request's blocks (done sending)"
    if kind == "loaded":
        return "consumer rank done receiving (failed if a failure is listed above)"
    return _fields(d)


def format_trace(report: dict[str, Any]) -> str:
    s = report["summary"]
    where = f"live producer {s['live_producer']}" if s.get("live_producer") else "in-process"
    lines = [f"trace of {report['request_id']}: {s['model']}, {s['mode']}, producer "
             f"{s['producer']} -> consumer {s['consumer']} ({where})",
             f"{'t (ms)':>10}  {'side':<8} {'rank':>4}  {'event':<14} what"]
    for event in report["events"]:
        rank = "-" if event["rank"] is None else str(event["rank"])
        lines.append(f"{event['t_ms']:>10.3f}  {event['side']:<8} {rank:>4}  "
                     f"{event['kind']:<14} {describe(event)}")
    lines.append("")
    lines.append(f"{s['transfers']} transfers, {s['bytes']:,} B in {s['transfer_ms']:.3f} ms; "
                 f"{s['handshakes']} handshakes, {s['notifications']} notifications, "
                 f"{s['lease_events']} lease events, {s['frees']} frees; verified "
                 f"{s['verified_bytes']:,} B, mismatched {s['mismatched_bytes']:,} B")
    deltas = s.get("producer_counter_deltas")
    if deltas:
        lines.append("live producer counters: " + ", ".join(
            f"{k} {v:+g}" for k, v in sorted(deltas.items())))
    if s["failures"]:
        lines.append("failures: " + "; ".join(str(f) for f in s["failures"]))
    lines.append(f"result: {s['state']} -> " + ("OK" if report["ok"] else "FAILED"))
    return "\n".join(lines)
