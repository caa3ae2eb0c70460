"""Client: two processes, timeouts against a silent peer, retries, cache invalidation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import zmq

from kvbridge.handshake import (
    ClockEstimate,
    HandshakeClient,
    HandshakeError,
    HandshakeTimeout,
    ServerClock,
    TransferMode,
)
from kvbridge.handshake.example import FAKE_BLOB_PREFIX, example_rank
from kvbridge.layouts import ParallelTopology


@pytest.fixture
def server_process() -> Iterator[tuple[str, dict]]:
    """`kvbridge handshake serve-example` in its own process; yields (address, info)."""
    cmd = [sys.executable, "-m", "kvbridge.tools.cli", "handshake", "serve-example",
           "--model", "tiny-hybrid", "--tp", "2", "--pp", "2", "--engine-id", "prefill-0",
           "--port", "0", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)  # bounded: interpreter start + imports on a busy 2-core machine
    try:
        assert lines and lines[0], f"server did not start: {proc.poll()!r}"
        info = json.loads(lines[0])
        yield info["address"], info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            code = None
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert code == 0, "serve-example did not stop cleanly on SIGTERM"


def test_two_processes_exchange_metadata(server_process):
    address, info = server_process
    with HandshakeClient(timeout_s=5.0, retries=2) as client:
        result = client.fetch(address)
        meta = result.metadata
        assert meta.engine_id == "prefill-0" and meta.incarnation == info["incarnation"]
        assert meta.fingerprint == info["fingerprint"]
        assert len(meta.ranks) == 4 and meta.missing_ranks() == []
        assert all(r.agent_blob.startswith(FAKE_BLOB_PREFIX) for r in meta.ranks)
        assert result.rtt_s > 0 and abs(result.clock.offset_s) < 60  # same host clock
        stages = client.fetch(address, tp_rank=0).metadata  # PP-aware aggregation
        assert [m.topology.pp_rank for m in stages.ranks] == [0, 1]
        again = client.fetch(address)
        assert again.cached and again.metadata is meta
        assert client.stats.cache_hits == 1


def test_silent_peer_makes_the_client_fail_within_its_timeout():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # bound, connected to, never answers
    silent.setsockopt(zmq.LINGER, 0)
    try:
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        client = HandshakeClient(timeout_s=0.3, retries=1, backoff_s=0.05, max_backoff_s=0.1)
        with pytest.raises(HandshakeTimeout) as info:
            client.fetch(f"127.0.0.1:{port}")
        assert info.value.field == "timeout"
        # bounded, by outcome: two attempts, each ended by the client's own deadline
        # (counted), then the error; pytest-timeout is the guard against a hang
        assert client.stats.attempts == 2 and client.stats.timeouts == 2
        arrived = []  # the requests did arrive, one per attempt; nobody answered
        while len(arrived) < 2 and silent.poll(5000):
            arrived.append(silent.recv_multipart())
        assert len(arrived) == 2 and arrived[0][0] != arrived[1][0]  # a fresh socket each
    finally:
        silent.close(linger=0)


def test_retryable_error_is_retried_until_the_rank_registers(make_store, serve):
    store = make_store(tp=2)
    store.withdraw(tp_rank=1)
    server = serve(store)
    timer = threading.Timer(0.2, lambda: store.publish(
        example_rank(store.spec, ParallelTopology(tp_size=2, tp_rank=1), store.engine_id)))
    timer.start()
    try:
        client = HandshakeClient(timeout_s=2.0, retries=8, backoff_s=0.1, max_backoff_s=0.2)
        result = client.fetch(server.address)
        assert len(result.metadata.ranks) == 2 and result.attempts > 1
    finally:
        timer.cancel()
    with pytest.raises(HandshakeError) as info:
        HandshakeClient(timeout_s=2.0, retries=0).fetch(server.address, tp_rank=5)
    assert info.value.field == "tp_rank"


def test_generation_bump_and_restart_invalidate_the_cache(make_store, serve):
    store = make_store(tp=2, engine_id="decode-7", incarnation="first")
    server = serve(store)
    client = HandshakeClient(timeout_s=2.0, retries=1)
    first = client.fetch(server.address)
    assert not first.cached and first.metadata.generation == 2
    assert client.fetch(server.address).cached

    store.publish(example_rank(store.spec, ParallelTopology(tp_size=2, tp_rank=0),
                               "decode-7", num_blocks=256))  # rank 0 re-registers
    bumped = client.fetch(server.address)
    assert not bumped.cached and bumped.metadata.generation == 3
    assert bumped.metadata.rank(tp_rank=0).regions[0].num_blocks == 256
    assert client.stats.invalidated_generation == 1
    assert client.cached(server.address) is bumped.metadata

    port = server.port
    server.stop()
    restarted = make_store(tp=2, engine_id="decode-7", incarnation="second")
    serve(restarted, port=port)  # same engine id, same address, new process
    after = client.fetch(f"127.0.0.1:{port}")
    assert not after.cached and after.metadata.incarnation == "second"
    assert client.stats.invalidated_restart == 1
    assert client.invalidate() == 1 and client.cached(f"127.0.0.1:{port}") is None


def test_expected_header_refuses_an_incompatible_peer(make_store, serve):
    local = make_store(mode=TransferMode.PULL)
    server = serve(make_store(mode=TransferMode.PUSH, engine_id="remote"))
    client = HandshakeClient(timeout_s=2.0, retries=0, expected=local.header)
    with pytest.raises(HandshakeError) as info:
        client.fetch(server.address)
    assert info.value.field == "fingerprint.transfer_mode"
    assert client.cached(server.address) is None


def test_clock_estimate_is_midpoint_based():
    estimate = ClockEstimate.from_exchange(100.0, 100.2, 0.2, ServerClock(150.1, 3.0))
    assert estimate.offset_s == pytest.approx(50.0)
    assert estimate.uncertainty_s == pytest.approx(0.1)
    assert estimate.to_local(160.0) == pytest.approx(110.0)
    assert estimate.to_remote(110.0) == pytest.approx(160.0)


def test_bad_addresses_are_refused_before_any_io():
    client = HandshakeClient()
    for bad in ("nohost", "host:0", "host:99999", "::1:5", "host:abc"):
        with pytest.raises(HandshakeError) as info:
            client.fetch(bad)
        assert info.value.field == "address"
    assert client.stats.attempts == 0
