"""`kvbridge events`: tail a KV event stream (vLLM's or kvbridge's), benchmark it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvbridge.auth import resolve_auth
from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EndpointError,
    GapDetected,
    GapLost,
    KVEvent,
    KVEventSubscriber,
    MalformedFrame,
    PublisherRestarted,
    ReceivedBatch,
    StreamItem,
    SubscriberConfig,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.flags import require_subcommand
from kvbridge.tools.progress import Progress

_TAIL_EPILOG = """\
examples:
  kvbridge events tail tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --topic kv-events
  kvbridge events tail tcp://10.0.0.7:5557 --replay tcp://10.0.0.7:5558 --from-seq 0 --json --count 100

Lines starting with '!!' mark gaps (and the replay that fills them), batches
that could not be replayed, publisher restarts and malformed frames. With
--json every line is one JSON object with a "kind" field
(batch, gap, lost, restart, malformed). Exit 1 when --count batches did not
arrive before --timeout.

exit codes: 0 ok (or stopped by --timeout without --count), 1 --count batches did
not arrive in time, 2 usage error (among them an ENDPOINT or --replay that ZeroMQ
cannot connect to: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)
"""

_BENCH_EPILOG = """\
example:
  kvbridge events bench --events 50000 --batch-sizes 16,64 --json

Publishes engine-like batches through KVEventPublisher to a KVEventSubscriber in
another process, and the same encoded frames through raw pyzmq PUB/SUB, on
loopback in the same run; reports events/s of both and their ratio.

--json prints {"num_events", "batch_sizes", "results": {"16": {"encode_events_per_s",
"decode_events_per_s", "raw": {"events_per_s", ...}, "kvbridge": {"events_per_s",
"lost_batches", ...}, "ratio"}}, "machine"}. `kvbridge bench events` runs the
same measurement as part of the suite.

exit codes: 0 ok, 2 usage error
"""

_EPILOG = """\
examples:
  kvbridge events tail tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
  kvbridge events bench --json
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "events",
        help="tail or benchmark a KV event stream (vLLM-compatible)",
        description="KV cache events: tail a publisher, benchmark the pipeline.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="events_command", metavar="SUBCOMMAND")
    require_subcommand(parser)

    tail = sub.add_parser(
        "tail",
        help="print events as they arrive, marking gaps, replays and restarts",
        epilog=_TAIL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tail.add_argument("endpoint", metavar="ENDPOINT",
                      help="the publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    tail.add_argument("--replay", metavar="ENDPOINT", help="the publisher's replay ROUTER endpoint")
    tail.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    tail.add_argument(
        "--from-seq",
        type=int,
        default=None,
        metavar="N",
        help="first replay buffered batches from seq N (needs --replay)",
    )
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    tail.add_argument("--count", type=int, default=None, metavar="N", help="stop after N batches")
    tail.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop after S seconds"
    )
    tail.add_argument(
        "--replay-timeout", type=float, default=2.0, metavar="S", help="per replay request"
    )
    tail.set_defaults(func=_tail)

    bench = sub.add_parser(
        "bench",
        help="events/s on loopback, kvbridge against raw pyzmq",
        epilog=_BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--events", type=int, default=50_000, help="events per batch size")
    bench.add_argument(
        "--batch-sizes", default="16,64", help="comma-separated events per batch (default 16,64)"
    )
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--progress", action="store_true",
                       help="progress on stderr even when it is not a terminal")
    bench.set_defaults(func=_bench)


# ---------------------------------------------------------------- rendering


def _hash_json(value: int | bytes | None) -> int | str | None:
    return value.hex() if isinstance(value, bytes) else value


def event_to_json(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [_hash_json(h) for h in event.block_hashes],
            "parent_block_hash": _hash_json(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "medium": event.medium,
        }
        for name in ("lora_id", "lora_name", "group_idx", "kv_cache_spec_kind",
                     "kv_cache_spec_sliding_window", "locality", "ownership"):
            value = getattr(event, name)
            if value is not None:
                out[name] = value
        if event.extra_keys is not None:
            out["extra_keys"] = repr(event.extra_keys)
        return out
    if isinstance(event, BlockRemoved):
        out = {
            "type": "BlockRemoved",
            "block_hashes": [_hash_json(h) for h in event.block_hashes],
            "medium": event.medium,
        }
        for name in ("group_idx", "locality", "ownership"):
            value = getattr(event, name)
            if value is not None:
                out[name] = value
        return out
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def item_to_json(item: StreamItem) -> dict[str, Any]:
    if isinstance(item, ReceivedBatch):
        return {
            "kind": "batch",
            "seq": item.seq,
            "replayed": item.replayed,
            "topic": item.topic.decode("utf-8", "replace"),
            "ts": item.batch.ts,
            "data_parallel_rank": item.batch.data_parallel_rank,
            "events": [event_to_json(e) for e in item.batch.events],
        }
    if isinstance(item, GapDetected):
        return {"kind": "gap", "start_seq": item.start_seq, "end_seq": item.end_seq}
    if isinstance(item, GapLost):
        return {"kind": "lost", "start_seq": item.start_seq, "end_seq": item.end_seq,
                "reason": item.reason}
    if isinstance(item, PublisherRestarted):
        return {"kind": "restart", "previous_incarnation": item.previous_incarnation,
                "incarnation": item.incarnation, "last_seq": item.last_seq, "seq": item.seq,
                "reason": item.reason}
    assert isinstance(item, MalformedFrame)
    return {"kind": "malformed", "source": item.source, "seq": item.seq, "reason": item.reason}


def _short(values: tuple[Any, ...], limit: int = 4) -> str:
    shown = ", ".join(str(_hash_json(v)) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}] ({len(values)})"


def _event_text(event: KVEvent) -> str:
    if isinstance(event, BlockStored):
        extra = "".join(
            f" {name}={getattr(event, name)}"
            for name in ("group_idx", "locality", "lora_name", "ownership")
            if getattr(event, name) is not None
        )
        return (f"BlockStored medium={event.medium}{extra} blocks={_short(event.block_hashes)} "
                f"parent={_hash_json(event.parent_block_hash)} block_size={event.block_size} "
                f"tokens={len(event.token_ids)}")
    if isinstance(event, BlockRemoved):
        extra = "".join(
            f" {name}={getattr(event, name)}"
            for name in ("group_idx", "locality", "ownership")
            if getattr(event, name) is not None
        )
        return f"BlockRemoved medium={event.medium}{extra} blocks={_short(event.block_hashes)}"
    return "AllBlocksCleared"


def item_to_text(item: StreamItem) -> list[str]:
    if isinstance(item, ReceivedBatch):
        mark = " (replayed)" if item.replayed else ""
        head = (f"seq={item.seq}{mark} ts={item.batch.ts:.6f} "
                f"dp_rank={item.batch.data_parallel_rank} events={len(item.batch.events)}")
        return [head] + [f"  {_event_text(e)}" for e in item.batch.events]
    if isinstance(item, GapDetected):
        return [f"!! gap: batches {item.start_seq}..{item.end_seq - 1} missing, replaying"]
    if isinstance(item, GapLost):
        return [f"!! lost: batches {item.start_seq}..{item.end_seq - 1} ({item.reason})"]
    if isinstance(item, PublisherRestarted):
        return [f"!! publisher restarted ({item.reason}): incarnation {item.previous_incarnation}"
                f" -> {item.incarnation}, last seq {item.last_seq}, now seq {item.seq}"]
    assert isinstance(item, MalformedFrame)
    return [f"!! malformed {item.source} frame (seq {item.seq}): {item.reason}"]


# ---------------------------------------------------------------- commands


def _tail(args: argparse.Namespace) -> int:
    if args.from_seq is not None and not args.replay:
        print("kvbridge events tail: --from-seq needs --replay ENDPOINT", file=sys.stderr)
        return EXIT_USAGE
    if args.count is not None and args.count <= 0:
        print("kvbridge events tail: --count must be positive", file=sys.stderr)
        return EXIT_USAGE
    if (args.timeout is not None and not args.timeout > 0) or not args.replay_timeout > 0:
        print("kvbridge events tail: --timeout and --replay-timeout must be > 0",
              file=sys.stderr)
        return EXIT_USAGE
    config = SubscriberConfig(
        endpoint=args.endpoint,
        replay_endpoint=args.replay,
        topic=args.topic,
        start_seq=args.from_seq,
        replay_timeout_s=args.replay_timeout,
    )
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    batches = 0
    try:  # replay requests are sealed with the cluster secret of the environment
        auth = resolve_auth()
    except ValueError as exc:
        print(f"kvbridge events tail: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        subscriber = KVEventSubscriber(config, auth=auth)
    except EndpointError as exc:
        argument = "ENDPOINT" if exc.field == "endpoint" else "--replay"
        print(f"kvbridge events tail: {argument}: cannot connect to {exc.endpoint[:200]!r} "
              f"({exc.reason}); expected tcp://HOST:PORT, ipc://PATH or inproc://NAME",
              file=sys.stderr)
        return EXIT_USAGE
    with subscriber:
        while args.count is None or batches < args.count:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            item = subscriber.get(remaining)
            if item is None:
                continue
            if isinstance(item, ReceivedBatch):
                batches += 1
            if args.json:
                print(json.dumps(item_to_json(item)), flush=True)
            else:
                for line in item_to_text(item):
                    print(line, flush=True)
        stats = subscriber.stats
    if not args.json:
        print(f"-- {stats.received_batches} batches, {stats.received_events} events, "
              f"{stats.gaps} gaps, {stats.replayed_batches} replayed, {stats.lost_batches} lost, "
              f"{stats.restarts} restarts, {stats.malformed_frames} malformed", file=sys.stderr)
    if args.count is not None and batches < args.count:
        return EXIT_FAILURE
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    except ValueError:
        print("kvbridge events bench: --batch-sizes must be comma-separated integers",
              file=sys.stderr)
        return EXIT_USAGE
    if not sizes or min(sizes) <= 0 or args.events <= 0:
        print("kvbridge events bench: sizes and --events must be positive", file=sys.stderr)
        return EXIT_USAGE
    from kvbridge.tools.bench.events import run_events_bench

    with Progress("events bench", force=args.progress).ticking("publishing"):
        result = run_events_bench(args.events, sizes)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    print(f"KV events on loopback, {result['num_events']} events per row "
          f"(events/s; ratio = kvbridge / raw pyzmq, same frames, same run)")
    print(f"{'batch':>6} {'encode':>10} {'decode':>10} {'raw e2e':>11} {'kvbridge e2e':>13} "
          f"{'ratio':>6} {'lost':>5}")
    for size, row in result["results"].items():
        print(f"{size:>6} {row['encode_events_per_s']:>10.0f} {row['decode_events_per_s']:>10.0f} "
              f"{row['raw']['events_per_s']:>11.0f} {row['kvbridge']['events_per_s']:>13.0f} "
              f"{row['ratio']:>6.2f} {row['kvbridge']['lost_batches']:>5}")
    return EXIT_OK
