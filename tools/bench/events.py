"""Throughput of KV events on loopback, against raw pyzmq moving the same bytes.

``run_events_bench`` measures, per batch size (events per batch, as an engine
step batches them):

- ``encode_events_per_s`` / ``decode_events_per_s``: the codec alone;
- ``raw``: pyzmq PUB -> SUB of the *same encoded frames* (no encoding, no
  decoding, no sequencing), receiver in another process;
- ``kvbridge``: ``KVEventPublisher.publish`` -> ``KVEventSubscriber`` (encode,
  ring, sequence tracking, decode), receiver in another process;
- ``codec``: raw pyzmq PUB -> SUB again, but the sender encodes each batch
  (``encode_events``) just before sending it and the receiver decodes and
  validates each payload (``decode_batch``): the codec with no publisher or
  subscriber around it, i.e. the most any sender/receiver pair that encodes and
  decodes these events in Python can reach;
- ``ratio``: kvbridge end-to-end events/s divided by raw's, in the same run;
- ``codec_ratio``: ``codec`` events/s divided by raw's (the codec's share of the
  gap: kvbridge's ``ratio`` cannot exceed it by much), and
  ``ratio_vs_codec``: kvbridge's divided by ``codec``'s (what the publisher,
  its queue and thread, and the subscriber's sequencing cost on top);
- ``cpu_ratio``: raw's CPU time per batch (sender + receiver process, IO threads
  included) divided by kvbridge's. On a loaded machine the wall-clock ratio
  swings with the scheduler; CPU per batch is what the two sides cost.

End-to-end rates are events / (last receive - first send), both read from
CLOCK_MONOTONIC, which Linux shares between processes. The receiver runs as
``python -m kvbridge.tools.bench.events --receive ...`` so that publisher and
subscriber do not share a GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import zmq

from kvbridge.events.publisher import KVEventPublisher, PublisherConfig
from kvbridge.events.schema import BlockRemoved, BlockStored, KVEvent, Medium
from kvbridge.events.subscriber import KVEventSubscriber, ReceivedBatch, SubscriberConfig
from kvbridge.events.wire import EventWireFormat, decode_batch, encode_events, encode_seq

_TOPIC = "kv-bench"
_BLOCK_SIZE = 16


def engine_like_batches(num_events: int, batch_size: int) -> list[list[KVEvent]]:
    """Batches as a serving engine emits them: mostly stores of 2 chained blocks
    (32 token ids), one removal in four, hashes that look like 64-bit digests."""
    batches: list[list[KVEvent]] = []
    current: list[KVEvent] = []
    parent: int | None = None
    for i in range(num_events):
        h1 = (0x9E3779B97F4A7C15 * (2 * i + 1)) & ((1 << 64) - 1)
        h2 = (0x9E3779B97F4A7C15 * (2 * i + 2)) & ((1 << 64) - 1)
        if i % 4 == 3:
            current.append(BlockRemoved(block_hashes=(h1,), medium=Medium.GPU))
        else:
            current.append(
                BlockStored(
                    block_hashes=(h1, h2),
                    parent_block_hash=parent,
                    token_ids=tuple(range(i % 1000, i % 1000 + 2 * _BLOCK_SIZE)),
                    block_size=_BLOCK_SIZE,
                    medium=Medium.GPU,
                    group_idx=0,
                )
            )
            parent = h2
        if len(current) == batch_size:
            batches.append(current)
            current = []
    if current:
        batches.append(current)
    return batches


def _start_receiver(mode: str, endpoint: str, replay: str | None, num_events: int, num_batches: int) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "kvbridge.tools.bench.events",
        "--receive",
        mode,
        "--endpoint",
        endpoint,
        "--expect-events",
        str(num_events),
        "--expect-batches",
        str(num_batches),
    ]
    if replay:
        cmd += ["--replay", replay]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready" once subscribed
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=5)
        raise RuntimeError(f"bench receiver failed to start: {line!r} {err[-2000:]}")
    return proc


def _finish_receiver(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=5)
        raise RuntimeError(f"bench receiver timed out: {err[-2000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"bench receiver failed (rc {proc.returncode}): {err[-2000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _raw_run(
    payloads: Iterable[bytes], mode: str, num_events: int, num_batches: int, timeout_s: float
) -> tuple[dict[str, Any], float, float]:
    """Send ``payloads`` as ``[topic, seq, payload]`` on a raw XPUB (XPUB: we know
    the receiver subscribed) to a ``mode`` receiver process. Returns the
    receiver's result (with ``e2e_s``: first send to last receive), the send
    loop's wall seconds and the sender's CPU seconds (until the receiver ends)."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.SNDHWM, 0)
    xpub.setsockopt(zmq.LINGER, 1000)
    xpub.bind("tcp://127.0.0.1:*")
    endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
    proc = _start_receiver(mode, endpoint, None, num_events, num_batches)
    try:
        if not xpub.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"{mode} bench subscriber never subscribed")
        xpub.recv()
        topic = _TOPIC.encode()
        cpu = time.process_time()
        start = time.monotonic()
        for seq, payload in enumerate(payloads):
            xpub.send_multipart((topic, encode_seq(seq), payload), copy=False)
        send_s = time.monotonic() - start
        result = _finish_receiver(proc, timeout_s)
        send_cpu_s = time.process_time() - cpu
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        xpub.close()
    result["e2e_s"] = result["last_recv"] - start
    return result, send_s, send_cpu_s


def _bench_one(batches: list[list[KVEvent]], num_events: int, timeout_s: float) -> dict[str, Any]:
    ts = time.time()
    start = time.perf_counter()
    payloads = [encode_events(ts, batch, 0, EventWireFormat.MAP) for batch in batches]
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    for payload in payloads:
        decode_batch(payload)
    decode_s = time.perf_counter() - start

    # Raw pyzmq: the same frames, pre-encoded; then the codec alone.
    raw, raw_send_s, raw_send_cpu_s = _raw_run(payloads, "raw", num_events, len(batches), timeout_s)
    codec_frames = (encode_events(ts, batch, 0, EventWireFormat.MAP) for batch in batches)
    codec, _, codec_send_cpu_s = _raw_run(codec_frames, "codec", num_events, len(batches),
                                          timeout_s)
    # The raw receiver does not decode: count events from the batches it got.
    raw["events"] = (
        num_events if raw["batches"] == len(batches) else raw["batches"] * len(batches[0])
    )

    pub = KVEventPublisher(PublisherConfig(topic=_TOPIC, hwm=0, max_queue_batches=len(batches) + 1))
    try:
        proc = _start_receiver("kvbridge", pub.endpoint, pub.replay_endpoint, num_events, len(batches))
        try:
            # Readiness handshake: the receiver's subscription reached the publisher.
            if not pub.wait_for_subscribers(1, timeout_s):
                raise RuntimeError("kvbridge bench subscriber never subscribed")
            kvb_cpu = time.process_time()
            kvb_start = time.monotonic()
            for batch in batches:
                pub.publish(batch)
            publish_call_s = time.monotonic() - kvb_start
            pub.flush(timeout_s)
            kvb_sent_s = time.monotonic() - kvb_start
            kvb = _finish_receiver(proc, timeout_s)
            kvb_send_cpu_s = time.process_time() - kvb_cpu
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    finally:
        pub.close()
    kvb_e2e_s = kvb["last_recv"] - kvb_start

    raw_rate = _rate(raw["events"], raw["e2e_s"])
    codec_rate = _rate(codec["events"], codec["e2e_s"])
    kvb_rate = _rate(kvb["events"], kvb_e2e_s)
    per_batch = 1e6 / max(1, len(batches))
    raw_cpu_us = (raw_send_cpu_s + raw["cpu_s"]) * per_batch
    kvb_cpu_us = (kvb_send_cpu_s + kvb["cpu_s"]) * per_batch
    return {
        "batches": len(batches),
        "events": num_events,
        "payload_bytes_mean": sum(len(p) for p in payloads) / max(1, len(payloads)),
        "encode_events_per_s": _rate(num_events, encode_s),
        "decode_events_per_s": _rate(num_events, decode_s),
        "raw": {
            "send_events_per_s": _rate(num_events, raw_send_s),
            "events_per_s": raw_rate,
            "received_events": raw["events"],
            "received_batches": raw["batches"],
            "sender_cpu_us_per_batch": raw_send_cpu_s * per_batch,
            "receiver_cpu_us_per_batch": raw["cpu_s"] * per_batch,
        },
        "codec": {
            "events_per_s": codec_rate,
            "received_events": codec["events"],
            "received_batches": codec["batches"],
            "sender_cpu_us_per_batch": codec_send_cpu_s * per_batch,
            "receiver_cpu_us_per_batch": codec["cpu_s"] * per_batch,
        },
        "kvbridge": {
            "publish_call_events_per_s": _rate(num_events, publish_call_s),
            "published_events_per_s": _rate(num_events, kvb_sent_s),
            "events_per_s": kvb_rate,
            "received_events": kvb["events"],
            "received_batches": kvb["batches"],
            "gaps": kvb["gaps"],
            "lost_batches": kvb["lost"],
            "replayed_batches": kvb["replayed"],
            "sender_cpu_us_per_batch": kvb_send_cpu_s * per_batch,
            "receiver_cpu_us_per_batch": kvb["cpu_s"] * per_batch,
        },
        "ratio": kvb_rate / raw_rate if raw_rate > 0 else 0.0,
        "codec_ratio": codec_rate / raw_rate if raw_rate > 0 else 0.0,
        "ratio_vs_codec": kvb_rate / codec_rate if codec_rate > 0 else 0.0,
        "cpu_ratio": raw_cpu_us / kvb_cpu_us if kvb_cpu_us > 0 else 0.0,
    }


def run_events_bench(
    num_events: int = 50_000,
    batch_sizes: Sequence[int] = (16, 64),
    *,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Measure events/s published and received on loopback (see module doc).

    Returns ``{"num_events", "results": {batch_size: {...}}, "machine": {...}}``.
    """
    results: dict[str, Any] = {}
    for batch_size in batch_sizes:
        if batch_size <= 0:
            raise ValueError("batch_sizes: expected positive sizes")
        batches = engine_like_batches(num_events, batch_size)
        results[str(batch_size)] = _bench_one(batches, num_events, timeout_s)
    return {
        "num_events": num_events,
        "batch_sizes": list(batch_sizes),
        "results": results,
        "machine": {"cpus": os.cpu_count(), "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__},
    }


# ---------------------------------------------------------------- receiver process


def _receive_raw(endpoint: str, expect_batches: int, decode: bool = False) -> dict[str, Any]:
    """Receive ``expect_batches`` messages; with ``decode``, decode and validate
    each payload as the subscriber does (``decode_batch``) and count its events."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, _TOPIC.encode())
    sub.connect(endpoint)
    print("ready", flush=True)
    cpu = time.process_time()
    batches = events = 0
    last = time.monotonic()
    while batches < expect_batches and sub.poll(5000):
        if decode:
            # bytes frames, as the subscriber receives them
            events += len(decode_batch(sub.recv_multipart()[2]).events)
        else:
            frames = sub.recv_multipart(copy=False)
            del frames
        batches += 1
        last = time.monotonic()
    cpu_s = time.process_time() - cpu
    sub.close(linger=0)
    # Without decode, events are not counted (the sender knows the batch sizes).
    return {"batches": batches, "events": events, "last_recv": last, "cpu_s": cpu_s}


def _receive_kvbridge(endpoint: str, replay: str, expect_events: int) -> dict[str, Any]:
    sub = KVEventSubscriber(
        SubscriberConfig(endpoint, replay, topic=_TOPIC, start_seq=0, rcvhwm=0, replay_timeout_s=10)
    )
    print("ready", flush=True)
    cpu = time.process_time()
    events = batches = 0
    last = time.monotonic()
    try:
        for item in sub.items(idle_timeout_s=5.0):
            if isinstance(item, ReceivedBatch):
                events += len(item.batch.events)
                batches += 1
                last = time.monotonic()
                if events >= expect_events:
                    break
        stats = sub.stats
        cpu_s = time.process_time() - cpu
    finally:
        sub.close()
    return {
        "cpu_s": cpu_s,
        "events": events,
        "batches": batches,
        "last_recv": last,
        "gaps": stats.gaps,
        "lost": stats.lost_batches,
        "replayed": stats.replayed_batches,
    }


def _receiver_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.tools.bench.events")
    parser.add_argument("--receive", choices=("raw", "codec", "kvbridge"), required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay")
    parser.add_argument("--expect-events", type=int, required=True)
    parser.add_argument("--expect-batches", type=int, required=True)
    args = parser.parse_args(argv)
    if args.receive in ("raw", "codec"):
        result = _receive_raw(args.endpoint, args.expect_batches, decode=args.receive == "codec")
    else:
        result = _receive_kvbridge(args.endpoint, args.replay, args.expect_events)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_receiver_main(sys.argv[1:]))
