"""Lanes (``backends.nixl.lanes``): one transfer cut across several NIXL agents of a rank.

The cut is pure (ranges of descriptors); the transport tests run against a real
NIXL peer in a second process: laned READ and WRITE byte for byte, a transfer
with a notification never cut, a stalled peer over TCP (every part in flight:
TIMED_OUT, zombie, settled after resume), a killed peer (FAILED), and every
registration, list, handle, peer and lane thread gone after close.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest

from kvbridge.backends.nixl.lanes import MIN_LANE_PART_BYTES, cut, lane_threads_alive
from tests.conftest import require, sigstop

MIB = 1 << 20


def _covers(ranges: list[tuple[int, int]], count: int) -> bool:
    return ranges[0][0] == 0 and ranges[-1][1] == count and all(
        a < b and b == c for (a, b), (c, _) in zip(ranges, ranges[1:] + [(ranges[-1][1], 0)],
                                                   strict=True))


def test_cut_uniform_parts_are_contiguous_and_equal() -> None:
    assert cut(None, 2 * MIB, 64, 2) == [(0, 32), (32, 64)]
    assert cut(None, 16 << 10, 4096, 3) == [(0, 1365), (1365, 2730), (2730, 4096)]
    for count, lanes in ((7, 2), (9, 4), (64, 16)):
        ranges = cut(None, 2 * MIB, count, lanes)
        assert _covers(ranges, count) and len(ranges) == min(lanes, count)


def test_cut_keeps_small_transfers_whole() -> None:
    assert cut(None, 2 * MIB, 64, 1) == [(0, 64)]               # one lane
    assert cut(None, 2 * MIB, 1, 4) == [(0, 1)]                 # one descriptor
    assert cut(None, 512 << 10, 2, 2) == [(0, 2)]               # 1 MiB: one part's worth
    assert cut(None, MIN_LANE_PART_BYTES, 2, 2) == [(0, 1), (1, 2)]
    assert len(cut(None, 64 << 10, 48, 4)) == 3                 # 3 MiB: three parts, not four


def test_cut_mixed_lengths_balances_bytes() -> None:
    lengths = np.array([4 * MIB] + [MIB // 4] * 16 + [2 * MIB], dtype=np.uint64)
    ranges = cut(lengths, None, lengths.size, 2)
    assert _covers(ranges, lengths.size) and len(ranges) == 2
    sums = [int(lengths[a:b].sum()) for a, b in ranges]
    assert sum(sums) == int(lengths.sum()) and min(sums) >= MIN_LANE_PART_BYTES


torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl import NixlTransport, NixlTransportError, XferState, block_descs  # noqa: E402
from kvbridge.tools.bench.nixl_peer import PeerProcess  # noqa: E402
from kvbridge.tools.bench.nixl_peer import pattern as np_pattern  # noqa: E402

NB, BB = 8, 2 * MIB
SEED = 11
WAIT_S = 10.0


def _name(tag: str) -> str:
    return f"test-lanes-{tag}-{uuid.uuid4().hex[:8]}"


def _connect(peer: PeerProcess, nb: int, bb: int, lanes: int = 2):
    t = NixlTransport(_name("local"), lanes=lanes)
    local = torch.zeros(nb * bb, dtype=torch.uint8)
    t.register_regions([local])
    ldl = t.prepare_local(0, bb, nb)
    ph = t.add_peer(peer.name, peer.metadata)
    rdl = t.prepare_remote(ph, block_descs(peer.addr, bb, nb))
    return t, local, ldl, ph, rdl


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess(_name("peer"), NB * BB, seed=SEED)
    yield p
    final = p.close()
    assert final is not None and final["registrations"] == 0 and final["peers"] == 0


@pytest.fixture
def side(peer):
    t, local, ldl, ph, rdl = _connect(peer, NB, BB)
    yield t, local, ldl, ph, rdl
    final = t.close(strict=False)
    assert final.live == 0, final


def test_laned_read_lands_every_byte_and_leaves_nothing(side) -> None:
    t, local, ldl, ph, rdl = side
    remote_idx = np.array([7, 0, 5, 3, 3, 1])
    local_idx = np.array([0, 1, 2, 3, 6, 7])
    x = t.post("READ", ldl, local_idx, rdl, remote_idx, deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    src = torch.from_numpy(np_pattern(NB * BB, SEED))
    for li, ri in zip(local_idx, remote_idx, strict=True):
        assert torch.equal(local[li * BB:(li + 1) * BB], src[ri * BB:(ri + 1) * BB]), (li, ri)
    for untouched in (4, 5):
        assert int(local[untouched * BB:(untouched + 1) * BB].count_nonzero()) == 0
    assert (x.nbytes, x.num_descs, x.quiesced) == (6 * BB, 6, True)
    assert x.library_xfer_s is not None and 0 < x.library_xfer_s <= x.duration_s
    c = t.counters()
    assert (c.cut_transfers, c.posted, c.done, c.xfer_handles, c.bytes_done) == (1, 1, 1, 0,
                                                                                6 * BB)


def test_laned_write_lands_every_byte(side, peer) -> None:
    t, local, ldl, ph, rdl = side
    local.copy_(torch.from_numpy(np_pattern(NB * BB, 77)))
    try:
        idx = np.arange(NB)
        x = t.post("WRITE", ldl, idx, rdl, idx[::-1].copy(), deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        assert t.counters().cut_transfers == 1
        for li in range(NB):
            ri = NB - 1 - li
            assert peer.read(ri * BB, BB) == local[li * BB:(li + 1) * BB].numpy().tobytes()
    finally:
        peer.call("fill", seed=SEED)


def test_a_transfer_with_a_notification_is_not_cut(side, peer) -> None:
    t, local, ldl, ph, rdl = side
    idx = np.arange(NB)
    x = t.post("READ", ldl, idx, rdl, idx, notif=b"after-all-bytes", deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    assert t.counters().cut_transfers == 0
    deadline = time.monotonic() + WAIT_S
    got: list[bytes] = []
    while not got and time.monotonic() < deadline:
        got = [m for msgs in peer.notifs().values() for m in msgs]
    assert got == [b"after-all-bytes"]
    # the lanes never talk to the peer: only this transport's agent is a sender
    assert torch.equal(local, torch.from_numpy(np_pattern(NB * BB, SEED)))


def test_one_lane_and_small_transfers_are_not_cut(side, peer) -> None:
    t, local, ldl, ph, rdl = side
    x = t.post("READ", ldl, [0], rdl, [1], deadline_s=WAIT_S)  # 2 MiB: one part's worth... x2
    assert t.wait(x) is XferState.DONE and t.counters().cut_transfers == 0
    single = NixlTransport(_name("one"), lanes=1)
    try:
        buf = torch.zeros(NB * BB, dtype=torch.uint8)
        single.register_regions([buf])
        sl = single.prepare_local(0, BB, NB)
        sp = single.add_peer(peer.name, peer.metadata)
        sr = single.prepare_remote(sp, block_descs(peer.addr, BB, NB))
        x = single.post("READ", sl, np.arange(NB), sr, np.arange(NB), deadline_s=WAIT_S)
        assert single.wait(x) is XferState.DONE and single.counters().cut_transfers == 0
        assert torch.equal(buf, torch.from_numpy(np_pattern(NB * BB, SEED)))
    finally:
        assert single.close().live == 0


def test_lanes_are_bounded() -> None:
    for bad in (0, 17, True, 2.0):
        with pytest.raises(NixlTransportError, match="lanes"):
            NixlTransport(_name("bad"), lanes=bad)  # type: ignore[arg-type]


FB, FN = MIB, 8  # 8 MiB: over TCP every part stays in PROC while the peer is stopped


def test_stalled_peer_over_tcp_times_out_and_every_part_settles(monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")  # the peer must answer: parts stay in flight
    p = PeerProcess(_name("fpeer"), FN * FB, seed=SEED)
    t, local, ldl, ph, rdl = _connect(p, FN, FB)
    try:
        idx = np.arange(FN)
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=WAIT_S)  # connect every lane
        assert t.wait(x) is XferState.DONE, x.error
        sigstop(p.pid, WAIT_S)
        local.zero_()
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=0.3)
        assert t.counters().cut_transfers == 2
        assert t.wait(x, 0.001) is XferState.TIMED_OUT, x.error
        assert not x.quiesced and t.counters().zombies == 1
        os.kill(p.pid, signal.SIGCONT)
        deadline = time.monotonic() + WAIT_S
        while t.reap() and time.monotonic() < deadline:
            t.get_notifs()
        c = t.counters()
        assert (c.zombies, c.xfer_handles, c.forced_releases) == (0, 0, 0) and x.quiesced
    finally:
        if p.proc.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
        p.close()
        final = t.close(strict=False)
    assert final.live == 0, final


def test_killed_peer_fails_a_laned_read_and_leaves_nothing() -> None:
    p = PeerProcess(_name("kpeer"), NB * BB, seed=SEED)
    t, local, ldl, ph, rdl = _connect(p, NB, BB)
    try:
        idx = np.arange(NB)
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        p.proc.kill()
        p.proc.wait(5)
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=5.0)
        assert t.wait(x, 0.001) is XferState.FAILED, x.error
        assert "Disconnect" in (x.error or ""), x.error
        assert t.counters().timed_out == 0
    finally:
        p.kill()
        final = t.close(strict=False)
    assert final.live == 0 and final.failed == 1, final


def test_close_leaves_no_lane_thread(peer) -> None:
    t, local, ldl, ph, rdl = _connect(peer, NB, BB, lanes=3)
    x = t.post("READ", ldl, np.arange(NB), rdl, np.arange(NB), deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    assert lane_threads_alive(t.name) >= 1
    assert t.close().live == 0
    deadline = time.monotonic() + WAIT_S
    while lane_threads_alive(t.name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane_threads_alive(t.name) == 0


def test_a_lane_call_that_does_not_return_breaks_the_lanes_not_the_transfer(peer) -> None:
    """Fault injection around the real lane agent: its ``transfer()`` is held until
    released. The post returns at the deadline (TIMED_OUT, the part a zombie), later
    transfers are not cut, and once the held call ran everything settles."""
    import threading

    t, local, ldl, ph, rdl = _connect(peer, NB, BB)
    gate = threading.Event()
    try:
        lanes = t._lanes
        assert lanes is not None
        agent = lanes.agents[0]
        real = agent.transfer

        def held(handle):
            gate.wait(WAIT_S)
            return real(handle)

        agent.transfer = held
        idx = np.arange(NB)
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=0.3)
        # the post waited for the lane up to the deadline: the transfer is past it
        assert lanes.broken and x.state is XferState.TIMED_OUT and not x.quiesced
        y = t.post("READ", ldl, idx, rdl, idx, deadline_s=WAIT_S)  # one lane from now on
        assert t.wait(y) is XferState.DONE and t.counters().cut_transfers == 1
        gate.set()
        deadline = time.monotonic() + WAIT_S
        while t.reap() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert x.quiesced and t.counters().zombies == 0
        assert torch.equal(local, torch.from_numpy(np_pattern(NB * BB, SEED)))
    finally:
        gate.set()
        final = t.close(strict=False)
    assert final.live == 0 and final.forced_releases == 0, final


def test_laned_read_and_write_over_tcp(monkeypatch) -> None:
    """The cross-host case: RMA over TCP, where the peer's worker serves each lane's
    endpoint (the lanes are in no handshake; the peer never heard of them)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    p = PeerProcess(_name("tpeer"), FN * FB, seed=SEED)
    t, local, ldl, ph, rdl = _connect(p, FN, FB)
    try:
        idx = np.arange(FN)
        x = t.post("READ", ldl, idx, rdl, idx[::-1].copy(), deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        src = torch.from_numpy(np_pattern(FN * FB, SEED))
        for li in range(FN):
            ri = FN - 1 - li
            assert torch.equal(local[li * FB:(li + 1) * FB], src[ri * FB:(ri + 1) * FB])
        local.copy_(torch.from_numpy(np_pattern(FN * FB, 78)))
        y = t.post("WRITE", ldl, idx, rdl, idx, deadline_s=WAIT_S)
        assert t.wait(y) is XferState.DONE, y.error
        assert p.read(0, FN * FB) == local.numpy().tobytes()
        assert t.counters().cut_transfers == 2
    finally:
        p.close()
        final = t.close(strict=False)
    assert final.live == 0, final
