"""MooncakeTeTransport against real Mooncake transfer engines (tcp, loopback).

Covers READ and WRITE byte for byte (strided rows, pairs in any order),
notifications both ways (standalone and after a transfer), the bounds it
checks because TE does not (local rows) or checks late (remote rows), a peer
that is gone (FAILED at once), a stalled peer in a second process (SIGSTOP:
TIMED_OUT at the deadline, a counted zombie until TE settles it after SIGCONT),
a restarted peer (new generation, old lists refused), hostile metadata, GPU
memory refused, and counters back to zero after close.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from tests.conftest import require, sigstop

torch = require("torch")
require("mooncake.engine", "Mooncake (mooncake-transfer-engine-non-cuda)")

from kvbridge.backends.mooncake.te import (  # noqa: E402
    MooncakeTeError,
    MooncakeTeTransport,
)
from kvbridge.backends.transfer import TransportError, XferOp, XferState  # noqa: E402

WAIT_S = 10.0
NB, BB = 32, 4096  # blocks of the test buffers, bytes per block


def _strided(buf: np.ndarray, nb: int = NB, bb: int = BB) -> np.ndarray:
    """One strided row: ``nb`` blocks of ``bb`` bytes from the start of ``buf``."""
    return np.array([[buf.ctypes.data, bb, 0, bb, nb]], dtype=np.uint64)


def _wait(t: MooncakeTeTransport, xfer: Any) -> XferState:
    end = time.monotonic() + WAIT_S
    while t.poll(xfer) is XferState.PENDING:
        assert time.monotonic() < end, "transfer still pending"
        time.sleep(0.0005)
    return xfer.state


def _notifs(t: MooncakeTeTransport, want: int) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    end = time.monotonic() + WAIT_S
    while sum(map(len, got.values())) < want:
        assert time.monotonic() < end, f"only {got} arrived"
        for k, v in t.get_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


@pytest.fixture
def pair() -> Iterator[tuple[MooncakeTeTransport, MooncakeTeTransport]]:
    a, b = MooncakeTeTransport("te-a"), MooncakeTeTransport("te-b")
    try:
        yield a, b
    finally:
        a.close(strict=False)
        b.close(strict=False)


def test_read_and_write_move_the_bytes_and_notify(
        pair: tuple[MooncakeTeTransport, MooncakeTeTransport]) -> None:
    a, b = pair
    mine = np.zeros(NB * BB, dtype=np.uint8)
    theirs = np.random.default_rng(3).integers(0, 256, NB * BB, dtype=np.uint8)
    a.register_regions([(mine.ctypes.data, mine.nbytes)])
    b.register_regions([(theirs.ctypes.data, theirs.nbytes)])
    peer_b = a.add_peer("te-b", b.agent_metadata())
    peer_a = b.add_peer("te-a", a.agent_metadata())
    local = a.prepare_local_descs(_strided(mine))
    remote = a.prepare_remote(peer_b, _strided(theirs))
    # block i of ours <- block NB-1-i of theirs: pairs that do not merge into one run
    lidx = np.arange(NB, dtype=np.int32)
    ridx = lidx[::-1].copy()
    xfer = a.post(XferOp.READ, local, lidx, remote, ridx, notif=b"read-done", deadline_s=5.0)
    assert _wait(a, xfer) is XferState.DONE and xfer.quiesced
    assert xfer.nbytes == NB * BB and xfer.num_descs == NB
    want = theirs.reshape(NB, BB)[::-1].reshape(-1)
    assert np.array_equal(mine, want)
    assert _notifs(b, 1) == {"te-a": [b"read-done"]}  # sent once the READ was DONE

    mine[:] = 7
    xfer = a.post("WRITE", local, [0, 1, 2], remote, [5, 6, 7], deadline_s=5.0)
    assert _wait(a, xfer) is XferState.DONE
    assert (theirs[5 * BB:8 * BB] == 7).all() and not (theirs[:5 * BB] == 7).all()

    b.send_notif(peer_a, b"hello")
    assert _notifs(a, 1) == {"te-b": [b"hello"]}
    c = a.counters()
    assert (c.posted, c.done, c.failed, c.bytes_done) == (2, 2, 0, NB * BB + 3 * BB)


def test_rows_outside_registrations_are_refused_before_posting(
        pair: tuple[MooncakeTeTransport, MooncakeTeTransport]) -> None:
    a, b = pair
    mine = np.zeros(NB * BB, dtype=np.uint8)
    theirs = np.zeros(NB * BB, dtype=np.uint8)
    a.register_regions([(mine.ctypes.data, mine.nbytes)])
    b.register_regions([(theirs.ctypes.data, theirs.nbytes)])
    peer_b = a.add_peer("te-b", b.agent_metadata())
    with pytest.raises(MooncakeTeError, match="not inside a registered region"):
        a.prepare_local_descs(_strided(mine, NB + 1))
    with pytest.raises(MooncakeTeError, match="outside its registrations"):
        a.prepare_remote(peer_b, _strided(theirs, NB + 1))
    with pytest.raises(MooncakeTeError, match="host memory only"):
        a.prepare_remote(peer_b, _strided(theirs), "VRAM")
    local = a.prepare_local_descs(_strided(mine))
    remote = a.prepare_remote(peer_b, _strided(theirs))
    with pytest.raises(MooncakeTeError, match="indices must lie"):
        a.post(XferOp.READ, local, [NB], remote, [0])
    with pytest.raises(MooncakeTeError, match="local length"):
        short = a.prepare_local_descs(_strided(mine, 1, BB // 2))
        a.post(XferOp.READ, short, [0], remote, [0])
    assert isinstance(MooncakeTeError("x"), TransportError)


def test_a_peer_that_is_gone_fails_the_transfer_at_once(
        pair: tuple[MooncakeTeTransport, MooncakeTeTransport]) -> None:
    a, b = pair
    mine = np.zeros(NB * BB, dtype=np.uint8)
    theirs = np.zeros(NB * BB, dtype=np.uint8)
    a.register_regions([(mine.ctypes.data, mine.nbytes)])
    b.register_regions([(theirs.ctypes.data, theirs.nbytes)])
    metadata = b.agent_metadata()
    peer_b = a.add_peer("te-b", metadata)
    local = a.prepare_local_descs(_strided(mine))
    remote = a.prepare_remote(peer_b, _strided(theirs))
    b.close(strict=False)
    time.sleep(0.05)  # TE's listener of the closed engine is gone
    xfer = a.post(XferOp.READ, local, [0], remote, [0], deadline_s=5.0)
    assert _wait(a, xfer) is XferState.FAILED and xfer.error
    assert a.counters().failed == 1

    # a removed peer: its lists and sends are refused, its generation moves on
    a.remove_peer(peer_b)
    with pytest.raises(MooncakeTeError, match="not added"):
        a.send_notif(peer_b, b"x")
    with pytest.raises(MooncakeTeError, match="remote list .* was released"):
        a.post(XferOp.READ, local, [0], remote, [0])
    again = a.add_peer("te-b", metadata)
    assert again.generation == peer_b.generation + 1


@pytest.mark.parametrize("doc", [
    b"\xc1",
    msgpack.packb({"v": 2}),
    msgpack.packb({"v": 1, "session": "10.0.0.1:80", "notify": "tcp://127.0.0.1:1",
                   "regs": []}),
    msgpack.packb({"v": 1, "session": "127.0.0.1:80", "notify": "tcp://0.0.0.0:1",
                   "regs": []}),
    msgpack.packb({"v": 1, "session": "127.0.0.1:80", "notify": "tcp://127.0.0.1:1",
                   "regs": [[1, -1]]}),
    msgpack.packb({"v": 1, "session": "127.0.0.1:80", "notify": "tcp://127.0.0.1:1",
                   "regs": [[1, 2]] * 5000}),
    b"\x00" * ((1 << 20) + 1),
])
def test_hostile_metadata_is_refused(doc: bytes) -> None:
    t = MooncakeTeTransport("te-hostile")
    try:
        with pytest.raises(MooncakeTeError, match="metadata of peer"):
            t.add_peer("x", doc)
        assert t.counters().peers == 0
    finally:
        t.close()


def test_gpu_memory_is_refused_and_close_releases_everything() -> None:
    t = MooncakeTeTransport("te-close")
    with pytest.raises(MooncakeTeError, match="host memory only"):
        t.register_regions([torch.empty(16, device="meta")])
    kv = torch.zeros(NB * BB, dtype=torch.uint8)
    view = kv[BB:]
    regions = t.register_regions([kv, view])  # one storage: registered once
    assert [r.region_id for r in regions] == [0, 1] and regions[1].addr == kv.data_ptr() + BB
    assert t.counters().registrations == 1
    t.prepare_local_descs(np.array([[kv.data_ptr(), BB, 0, BB, NB]], dtype=np.uint64))
    with pytest.raises(MooncakeTeError, match="live"):
        t.close(strict=True)  # a list was still prepared
    assert t.counters().live == 0
    with pytest.raises(MooncakeTeError, match="closed"):
        t.agent_metadata()


def _stalled_peer(conn: Any, nbytes: int) -> None:
    """A second process's transport: sends its metadata, then waits to be told to end."""
    t = MooncakeTeTransport("te-peer")
    buf = np.full(nbytes, 9, dtype=np.uint8)
    t.register_regions([(buf.ctypes.data, buf.nbytes)])
    conn.send((t.agent_metadata(), buf.ctypes.data))
    conn.poll(120)
    t.close(strict=False)


def test_a_stalled_peer_times_out_and_its_batch_stays_a_zombie_until_settled() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stalled_peer, args=(child, NB * BB), daemon=True)
    proc.start()
    a = MooncakeTeTransport("te-a")
    try:
        assert parent.poll(60), "peer process did not start"
        metadata, addr = parent.recv()
        mine = np.zeros(NB * BB, dtype=np.uint8)
        a.register_regions([(mine.ctypes.data, mine.nbytes)])
        peer = a.add_peer("te-peer", metadata)
        local = a.prepare_local_descs(_strided(mine))
        remote = a.prepare_remote(peer, np.array([[addr, BB, 0, BB, NB]], dtype=np.uint64))
        # first contact (TE's handshake with the peer) while it runs
        assert _wait(a, a.post(XferOp.READ, local, [0], remote, [0], deadline_s=5.0)) \
            is XferState.DONE
        sigstop(proc.pid)
        try:
            t0 = time.monotonic()
            xfer = a.post(XferOp.READ, local, list(range(1, NB)), remote,
                          list(range(1, NB)), deadline_s=0.3)
            state = _wait(a, xfer)
            waited = time.monotonic() - t0
            assert state is XferState.TIMED_OUT and not xfer.quiesced
            assert waited < WAIT_S  # bounded by the deadline, not by the peer
            assert a.counters().zombies == 1
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        end = time.monotonic() + WAIT_S
        while not xfer.quiesced:
            assert time.monotonic() < end, "the zombie never settled"
            a.poll(xfer)
            time.sleep(0.001)
        assert a.counters().zombies == 0 and xfer.state is XferState.TIMED_OUT
    finally:
        parent.send("end")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        final = a.close(strict=False)
    assert final.live == 0 and final.timed_out == 1
