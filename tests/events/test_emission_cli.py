"""`kvbridge serve` and `kvbridge demo` with --events-endpoint publish their engines' events.

Real processes (bounded, killed on failure), real NIXL engines, a real
subscriber on 127.0.0.1.
"""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvbridge.auth import resolve_auth
from kvbridge.engine import make_requests
from kvbridge.engine.harness import control_exchange
from kvbridge.events import (
    BlockStored,
    KVEvent,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
    encode_batch,
)
from kvbridge.layouts import hash_blocks
from tests.conftest import free_port_run, require

CLI = [sys.executable, "-m", "kvbridge.tools.cli"]


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _ready_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode} before ready")
            if selector.select(timeout=0.5):
                line = proc.stdout.readline()
                if line.startswith("{"):
                    data: dict[str, Any] = json.loads(line)
                    return data
        raise AssertionError(f"no ready line within {timeout_s} s")
    finally:
        selector.close()


def _gpu_stored(events: list[KVEvent]) -> list[Any]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
            for h in e.block_hashes]


def _distinct_ports(count: int) -> list[int]:
    """``count`` free ports with port + 1 free too (each engine adds its index), apart
    from each other and outside the ephemeral range (``free_port_run``)."""
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port_run(2, ports))
    return ports


def test_serve_publishes_its_engine_events(tmp_path: Path) -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    side, control, events_port, replay_port = _distinct_ports(4)
    endpoint, replay = f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [*CLI, "serve", "--role", "producer", "--port", str(side), "--control-port",
             str(control), "--num-blocks", "32", "--events-endpoint", endpoint,
             "--events-replay-endpoint", replay, "--json"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)

    def call(op: str, **fields: Any) -> dict[str, Any]:
        reply: dict[str, Any] = control_exchange(sock, resolve_auth(), op, fields)
        assert reply["ok"], reply
        return reply

    requests = make_requests(2, prompt_tokens=40, max_tokens=1, seed=11)
    try:
        ready = _ready_line(proc, 120)
        assert ready["control"].endswith(f":{control}")
        with KVEventSubscriber(SubscriberConfig(endpoint, replay, start_seq=0),
                               auth=resolve_auth()) as sub:
            sock.connect(f"tcp://127.0.0.1:{control}")
            token = call("submit", requests=[r.to_dict() for r in requests])["token"]
            done: list[Any] = []
            deadline = time.monotonic() + 60
            while len(done) < len(requests):
                assert time.monotonic() < deadline, "requests did not finish"
                done += call("results", token=token)["results"]
                time.sleep(0.05)
            events: list[KVEvent] = []
            expected = sorted(h for r in requests for h in hash_blocks(r.prompt, 16))
            for item in sub.items(idle_timeout_s=10.0):
                assert isinstance(item, ReceivedBatch), item
                events += item.batch.events
                if sorted(_gpu_stored(events)) == expected:
                    break
        assert sorted(_gpu_stored(events)) == expected
        call("shutdown")
        assert proc.wait(timeout=30) == 0
    finally:
        sock.close(linger=0)
        context.term()
        _stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
    assert "KV events of producer" in (tmp_path / "stderr").read_text()


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.plaintext  # vLLM's plain replay requests, below the seal
def test_serve_replay_router_stays_bounded_under_unread_requests(tmp_path: Path) -> None:
    """The served engine's replay ROUTER had SNDHWM 0: a client sending 3,000
    replay requests and reading none made `serve` queue every reply. Now its
    memory stays bounded, it keeps answering its control port, and an honest
    subscriber still replays the whole ring."""
    require("nixl_cu12", "NIXL (nixl-cu12)")
    side, control, events_port, replay_port = _distinct_ports(4)
    endpoint, replay = f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [*CLI, "serve", "--role", "producer", "--port", str(side), "--control-port",
             str(control), "--num-blocks", "800", "--events-endpoint", endpoint,
             "--events-replay-endpoint", replay, "--json"],
            stdout=subprocess.PIPE, stderr=err, text=True)
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    greedy = context.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.SNDTIMEO, 30_000)

    def call(op: str, **fields: Any) -> dict[str, Any]:
        sock.send(msgpack.packb({"op": op, **fields}, use_bin_type=True))
        reply: dict[str, Any] = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["ok"], reply
        return reply

    requests = make_requests(24, prompt_tokens=512, max_tokens=1, seed=5)
    try:
        _ready_line(proc, 120)
        sock.connect(f"tcp://127.0.0.1:{control}")
        token = call("submit", requests=[r.to_dict() for r in requests])["token"]
        done: list[Any] = []
        deadline = time.monotonic() + 120
        while len(done) < len(requests):
            assert time.monotonic() < deadline, "requests did not finish"
            done += call("results", token=token)["results"]
            time.sleep(0.05)
        with KVEventSubscriber(SubscriberConfig(endpoint, replay, start_seq=0,
                                                idle_resync_s=None)) as sub:
            ring = [item for item in sub.items(idle_timeout_s=5.0)
                    if isinstance(item, ReceivedBatch)]
        assert ring and [b.seq for b in ring] == list(range(len(ring)))
        assert len([h for b in ring for h in _gpu_stored(list(b.batch.events))]) == 24 * 32
        # What 3,000 full replies of this ring would queue: far above the bound below.
        ring_bytes = sum(len(encode_batch(b.batch)) for b in ring)
        assert 3000 * ring_bytes > 4 * (32 << 20), ring_bytes

        start_rss = _rss_of(proc.pid)
        peak = start_rss
        greedy.connect(replay)
        for _ in range(3000):
            greedy.send_multipart((b"", (0).to_bytes(8, "big")))
        # Until serve has dealt with them: its RSS steady for 1 s (20 samples).
        steady = 0
        last = start_rss
        deadline = time.monotonic() + 120
        while steady < 20:
            assert time.monotonic() < deadline, "serve's memory never settled"
            time.sleep(0.05)
            rss = _rss_of(proc.pid)
            peak = max(peak, rss)
            steady = steady + 1 if abs(rss - last) < (1 << 20) else 0
            last = rss
        assert peak - start_rss < 32 << 20, (
            f"serve grew by {(peak - start_rss) >> 20} MiB on 3,000 unread replay requests")
        assert call("info")["engine_id"]  # still serving
        with KVEventSubscriber(SubscriberConfig(endpoint, replay, start_seq=0,
                                                idle_resync_s=None)) as sub:
            again = [item for item in sub.items(idle_timeout_s=5.0)
                     if isinstance(item, ReceivedBatch)]
        assert [b.seq for b in again] == [b.seq for b in ring]
        call("shutdown")
        assert proc.wait(timeout=30) == 0
    finally:
        greedy.close(linger=0)
        sock.close(linger=0)
        context.term()
        _stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow  # two engine processes with NIXL: 20-40 s here; serve covers the flags
def test_demo_publishes_both_engines_events(tmp_path: Path) -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    events_port, replay_port = _distinct_ports(2)
    subs = [KVEventSubscriber(SubscriberConfig(f"tcp://127.0.0.1:{events_port + i}",
                                               f"tcp://127.0.0.1:{replay_port + i}"))
            for i in range(2)]  # producer, consumer: connected before the engines bind
    received: list[list[KVEvent]] = [[], []]
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                [*CLI, "demo", "--requests", "1", "--prompt-tokens", "40", "--num-blocks", "32",
                 "--events-endpoint", f"tcp://127.0.0.1:{events_port}",
                 "--events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--json"],
                stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 240
            drain_until: float | None = None
            while drain_until is None or time.monotonic() < drain_until:
                assert time.monotonic() < deadline, "demo did not finish in time"
                if drain_until is None and proc.poll() is not None:
                    drain_until = time.monotonic() + 1.0
                for index, sub in enumerate(subs):
                    item = sub.get(0.05)
                    if isinstance(item, ReceivedBatch):
                        received[index] += item.batch.events
        finally:
            _stop(proc)
    finally:
        for sub in subs:
            sub.close()
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads(out_path.read_text())
    assert summary["failed_requests"] == 0 and summary["mismatched_bytes"] == 0
    assert "KV events of producer" in stderr and "KV events of consumer" in stderr
    producer, consumer = (_gpu_stored(events) for events in received)
    assert producer and consumer  # each engine's own stream carries its block pool
