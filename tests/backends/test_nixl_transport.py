"""NixlTransport against a real NIXL peer in a second (spawned) process.

Covers READ/WRITE byte-for-byte, sub-block (head-slice) descriptors,
notifications both ways, a peer killed mid-transfer (FAILED), a stalled peer
(SIGSTOP: TIMED_OUT, handle released, nothing lands afterwards), a restarted
peer re-added with new metadata, and counters back to zero after close.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest

from tests.conftest import require, sigstop

torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl import (  # noqa: E402
    NixlTransport,
    NixlTransportError,
    XferState,
    block_descs,
    sub_block_descs,
)
from kvbridge.tools.bench.nixl_peer import PeerProcess  # noqa: E402
from kvbridge.tools.bench.nixl_peer import pattern as np_pattern  # noqa: E402

NB, BB = 16, 64 << 10  # shared peer: 16 blocks of 64 KiB
SEED = 5
WAIT_S = 10.0


def _name(tag: str) -> str:
    return f"test-{tag}-{uuid.uuid4().hex[:8]}"


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess(_name("peer"), NB * BB, seed=SEED)
    yield p
    final = p.close()
    assert final is not None and final["registrations"] == 0 and final["peers"] == 0


@pytest.fixture
def side(peer):
    """A local transport connected to the shared peer, with both block lists prepared."""
    t = NixlTransport(_name("local"))
    local = torch.zeros(NB * BB, dtype=torch.uint8)
    t.register_regions([local])
    ldl = t.prepare_local(0, BB, NB)
    ph = t.add_peer(peer.name, peer.metadata)
    rdl = t.prepare_remote(ph, block_descs(peer.addr, BB, NB))
    yield t, local, ldl, ph, rdl
    final = t.close(strict=False)
    assert final.live == 0, final


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np_pattern(nbytes, seed))


def _poll_until(fn, timeout_s: float = WAIT_S):
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        out = fn()
        if out:
            return out
        time.sleep(0.005)
    return fn()


def test_read_blocks_permuted_byte_for_byte(side) -> None:
    t, local, ldl, ph, rdl = side
    remote_idx = np.array([3, 0, 15, 7, 7])
    local_idx = np.array([0, 1, 2, 3, 9])
    x = t.post("READ", ldl, local_idx, rdl, remote_idx, deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    src = pattern(NB * BB, SEED)
    for li, ri in zip(local_idx, remote_idx, strict=True):
        assert torch.equal(local[li * BB : (li + 1) * BB], src[ri * BB : (ri + 1) * BB])
    untouched = [i for i in range(NB) if i not in set(local_idx.tolist())]
    assert all(int(local[i * BB : (i + 1) * BB].count_nonzero()) == 0 for i in untouched)
    assert (x.nbytes, x.num_descs) == (5 * BB, 5)
    assert x.duration_s is not None and x.duration_s > 0
    # NIXL's own telemetry of the READ (what vLLM's NixlConnector reports), within ours
    assert x.library_xfer_s is not None and 0 < x.library_xfer_s <= x.duration_s
    assert t.poll(x) is XferState.DONE  # terminal states are sticky
    c = t.counters()
    assert (c.xfer_handles, c.done, c.bytes_done) == (0, 1, 5 * BB)


def test_write_blocks_byte_for_byte(side, peer) -> None:
    t, local, ldl, ph, rdl = side
    local.copy_(pattern(NB * BB, 99))
    try:
        x = t.post("WRITE", ldl, [2, 5, 11], rdl, [0, 1, 14], deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        for li, ri in ((2, 0), (5, 1), (11, 14)):
            assert peer.read(ri * BB, BB) == _bytes(local[li * BB : (li + 1) * BB])
        untouched = pattern(NB * BB, SEED)[2 * BB : 3 * BB]
        assert peer.read(2 * BB, BB) == _bytes(untouched)
    finally:
        peer.call("fill", seed=SEED)


def test_sub_block_head_slices(side, peer) -> None:
    """Read bytes [BB/4, BB/2) of every remote block into packed local slices."""
    t, local, ldl, ph, rdl = side
    off, ln = BB // 4, BB // 4
    rslices = t.prepare_remote(ph, sub_block_descs(peer.addr, BB, NB, off, ln))
    lslices = t.prepare_local_descs(block_descs(local.data_ptr(), ln, NB)[:, :2])
    idx = np.arange(NB)[::-1].copy()
    x = t.post("READ", lslices, np.arange(NB), rslices, idx, deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    src = pattern(NB * BB, SEED)
    for k, ri in enumerate(idx):
        assert torch.equal(local[k * ln : (k + 1) * ln], src[ri * BB + off : ri * BB + off + ln])
    assert int(local[NB * ln :].count_nonzero()) == 0
    with pytest.raises(NixlTransportError, match="local length"):
        t.post("READ", ldl, [0], rslices, [0])


def test_post_counts_bytes_of_uniform_and_mixed_lists(side, peer) -> None:
    """A transfer's bytes: index count x length when both lists have one length (int32
    indices, as the connector posts them), the sum of the rows' lengths otherwise; and
    the bytes land where the indices say."""
    t, local, ldl, ph, rdl = side
    x = t.post("READ", ldl, np.array([0, 2], dtype=np.int32), rdl,
               np.array([3, 1], dtype=np.int32), deadline_s=WAIT_S)
    assert x.nbytes == 2 * BB and x.num_descs == 2
    assert t.wait(x) is XferState.DONE, x.error
    base, src = local.data_ptr(), pattern(NB * BB, SEED)
    assert torch.equal(local[:BB], src[3 * BB : 4 * BB])
    assert torch.equal(local[2 * BB : 3 * BB], src[BB : 2 * BB])
    mixed = t.prepare_local_descs(np.array([[base + 4 * BB, BB], [base + 5 * BB, BB // 2],
                                            [base + 6 * BB, BB // 4]]))
    rmixed = t.prepare_remote(ph, np.array([[peer.addr, BB // 4], [peer.addr + BB, BB],
                                            [peer.addr + 2 * BB, BB // 2]]))
    y = t.post("READ", mixed, [1, 2, 0], rmixed, [2, 0, 1], deadline_s=WAIT_S)
    assert y.nbytes == BB + BB // 2 + BB // 4
    assert t.wait(y) is XferState.DONE, y.error
    assert torch.equal(local[5 * BB : 5 * BB + BB // 2], src[2 * BB : 2 * BB + BB // 2])
    assert torch.equal(local[6 * BB : 6 * BB + BB // 4], src[: BB // 4])
    with pytest.raises(NixlTransportError, match="descriptor 1: local length"):
        t.post("READ", mixed, [1, 0], rmixed, [2, 0])


def test_notifications_both_ways(side, peer) -> None:
    t, local, ldl, ph, rdl = side
    x = t.post("READ", ldl, [0], rdl, [1], notif=b"req-1:rank0", deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE
    t.send_notif(ph, b"standalone")
    got: list[bytes] = []
    _poll_until(lambda: got.extend(peer.notifs().get(t.name, [])) or len(got) >= 2)
    assert sorted(got) == [b"req-1:rank0", b"standalone"]
    peer.call("add_peer", name=t.name, md=t.agent_metadata())
    peer.call("send_notif", name=t.name, msg=b"hello-back")
    got_back = _poll_until(lambda: t.get_notifs().get(peer.name))
    assert got_back == [b"hello-back"]


def test_poll_all_returns_newly_finished(side) -> None:
    t, local, ldl, ph, rdl = side
    xs = [t.post("READ", ldl, [i], rdl, [i], deadline_s=WAIT_S) for i in range(4)]
    finished: list = [x for x in xs if x.state.terminal]
    t_end = time.monotonic() + WAIT_S
    while len(finished) < 4 and time.monotonic() < t_end:
        finished += t.poll_all()
    assert sorted(x.transfer_id for x in finished) == sorted(x.transfer_id for x in xs)
    assert all(x.state is XferState.DONE and x.quiesced for x in xs)
    assert t.poll_all() == [] and t.pending() == []


def test_argument_errors(side) -> None:
    t, local, ldl, ph, rdl = side
    with pytest.raises(NixlTransportError, match="deadline_s"):
        t.post("READ", ldl, [0], rdl, [0], deadline_s=0)
    with pytest.raises(NixlTransportError, match="remote_idx"):
        t.post("READ", ldl, [0], rdl, [NB])
    with pytest.raises(NixlTransportError, match="equal length"):
        t.post("READ", ldl, [0, 1], rdl, [0])
    with pytest.raises(NixlTransportError, match="local:"):
        t.post("READ", rdl, [0], rdl, [0])
    with pytest.raises(ValueError):
        t.post("COPY", ldl, [0], rdl, [0])
    assert t.counters().posted == 0


def test_one_index_array_for_both_sides_is_checked_against_each_list(side, peer) -> None:
    """A caller may pass the same array as local and remote indices: it is checked
    once only when the remote list is at least as long as the local one."""
    t, local, ldl, ph, rdl = side
    short = t.prepare_remote(ph, block_descs(peer.addr, BB, NB // 2))
    idx = np.array([0, NB - 1], dtype=np.int32)
    with pytest.raises(NixlTransportError, match=r"remote_idx: indices must lie in \[0, 8\)"):
        t.post("READ", ldl, idx, short, idx)
    assert t.counters().posted == 0
    x = t.post("READ", ldl, idx, rdl, idx)
    assert t.wait(x) is XferState.DONE and x.nbytes == 2 * BB
    want = pattern(NB * BB, SEED)
    for b in (0, NB - 1):
        assert _bytes(local[b * BB:(b + 1) * BB]) == _bytes(want[b * BB:(b + 1) * BB])
    t.release_dlist(short)


# ------------------------------------------------------------ failures

FB, FN = 1 << 20, 8  # 8 MiB: over TCP any of these stays in PROC while the peer is stopped


@pytest.fixture
def fault_side(monkeypatch):
    # RMA over TCP on both sides (the cross-host case). Over loopback `cma` the
    # initiator copies with process_vm_readv, so a READ from a stopped peer
    # sometimes completes anyway; over TCP the stopped peer must answer, so the
    # transfer deterministically stays in flight. The spawned peer inherits this.
    monkeypatch.setenv("UCX_TLS", "tcp")
    p = PeerProcess(_name("fpeer"), FN * FB, seed=SEED)
    t = NixlTransport(_name("flocal"))
    local = torch.zeros(FN * FB, dtype=torch.uint8)
    t.register_regions([local])
    ldl = t.prepare_local(0, FB, FN)
    ph = t.add_peer(p.name, p.metadata)
    rdl = t.prepare_remote(ph, block_descs(p.addr, FB, FN))
    x = t.post("READ", ldl, [0], rdl, [0], deadline_s=WAIT_S)  # connect
    assert t.wait(x) is XferState.DONE, x.error
    try:
        yield p, t, local, ldl, ph, rdl
    finally:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
        p.close()
        final = t.close(strict=False)
        assert final.live == 0, final


def test_peer_killed_mid_transfer_fails_within_deadline(fault_side) -> None:
    p, t, local, ldl, ph, rdl = fault_side
    idx = np.arange(FN)
    sigstop(p.pid, WAIT_S)  # hold the transfer in flight ...
    x = t.post("READ", ldl, idx, rdl, idx, notif=b"doomed", deadline_s=5.0)
    assert t.poll(x) is XferState.PENDING
    p.proc.kill()  # ... then kill the peer under it
    p.proc.wait(5)
    assert t.wait(x, 0.001) is XferState.FAILED
    # NIXL reported the disconnect: FAILED, not TIMED_OUT (the 5 s deadline never fired)
    assert "Disconnect" in (x.error or ""), x.error
    c = t.counters()
    assert (c.xfer_handles, c.zombies, c.failed, c.timed_out) == (0, 0, 1, 0)
    with pytest.raises(NixlTransportError, match="send_notif"):
        t.send_notif(ph, b"anyone?")
    t.remove_peer(ph)
    assert t.counters().peers == 0 and t.counters().dlists == 1


def test_stalled_peer_times_out_and_zombie_settles_after_resume(fault_side) -> None:
    p, t, local, ldl, ph, rdl = fault_side
    idx = np.arange(FN)
    sigstop(p.pid, WAIT_S)
    try:
        x = t.post("READ", ldl, idx, rdl, idx, notif=b"timed-out", deadline_s=0.5)
        assert t.wait(x, 0.001) is XferState.TIMED_OUT
        # reported by its deadline, not before it (both times on the transport's clock)
        assert x.finished_at is not None and x.finished_at >= x.deadline
        assert "deadline" in (x.error or "")
        # Reported at the deadline, but the handle is kept until NIXL settles it.
        c = t.counters()
        assert (c.xfer_handles, c.zombies, c.timed_out) == (1, 1, 1)
        assert not x.quiesced
        assert t.reap() == 1
    finally:
        os.kill(p.pid, signal.SIGCONT)
    # get_notifs progresses the worker and reaps: the zombie settles once the peer runs.
    assert _poll_until(lambda: t.get_notifs() is not None and t.counters().zombies == 0)
    assert x.quiesced and x.state is XferState.TIMED_OUT  # terminal state is sticky
    assert t.counters().xfer_handles == 0 and t.counters().forced_releases == 0
    # The late READ did complete and its notification did reach the peer: a consumer
    # that timed out must expect the producer to see it.
    assert torch.equal(local, pattern(FN * FB, SEED))
    assert _poll_until(lambda: p.notifs().get(t.name)) == [b"timed-out"]
    local.zero_()
    x = t.post("READ", ldl, idx, rdl, idx, notif=b"after", deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error
    assert torch.equal(local, pattern(FN * FB, SEED))


def test_release_in_flight_does_not_cancel_nixl_behaviour(fault_side) -> None:
    """Why zombies exist (NIXL 1.5.1, UCX over TCP): NIXL accepts removing the peer
    and releasing a handle that is in PROC, yet the stalled peer's bytes still land
    in local memory when it resumes. The transport counts such a release as forced
    and leaves ``quiesced`` False so the connector quarantines those blocks."""
    p, t, local, ldl, ph, rdl = fault_side
    idx = np.arange(FN)
    sigstop(p.pid, WAIT_S)
    try:
        x = t.post("READ", ldl, idx, rdl, idx, deadline_s=0.3)
        assert t.wait(x, 0.001) is XferState.TIMED_OUT
        t.remove_peer(ph)
        c = t.counters()
        assert (c.xfer_handles, c.zombies, c.forced_releases, c.peers) == (0, 0, 1, 0)
        assert not x.quiesced
        local.zero_()
    finally:
        os.kill(p.pid, signal.SIGCONT)
    landed = _poll_until(lambda: t.get_notifs() is not None and int(local.count_nonzero()) > 0, 3.0)
    assert landed, "NIXL now cancels released transfers: zombies could be simplified"


def test_close_force_releases_unsettled_zombies(fault_side) -> None:
    p, t, local, ldl, ph, rdl = fault_side
    idx = np.arange(FN)
    sigstop(p.pid, WAIT_S)
    try:
        x = t.post("WRITE", ldl, idx, rdl, idx, deadline_s=0.3)
        y = t.post("READ", ldl, [0], rdl, [1], deadline_s=30.0)  # still pending at close
        assert t.wait(x, 0.001) is XferState.TIMED_OUT
        assert t.counters().zombies == 1
        final = t.close()  # strict: nothing may be left live
        assert final.live == 0 and final.forced_releases == 2
        assert y.state is XferState.FAILED and y.error == "transport closed"
        assert t.close() == final  # idempotent
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_restarted_peer_is_re_added_with_new_metadata(fault_side) -> None:
    p, t, local, ldl, ph, rdl = fault_side
    name = p.name
    p.proc.kill()  # crash, then restart under the same agent name
    p.kill()
    p2 = PeerProcess(name, FN * FB, seed=SEED + 1)
    try:
        assert p2.metadata != p.metadata
        ph2 = t.add_peer(name, p2.metadata)
        assert ph2.name == name and ph2.generation == ph.generation + 1
        assert t.add_peer(name, p2.metadata) == ph2  # same metadata: no-op
        with pytest.raises(NixlTransportError, match="not current"):
            t.post("READ", ldl, [0], rdl, [0])  # the old incarnation's list is refused
        c = t.counters()
        assert (c.peers, c.dlists) == (1, 1)  # old remote list released with the old peer
        rdl2 = t.prepare_remote(ph2, block_descs(p2.addr, FB, FN))
        idx = np.arange(FN)
        x = t.post("READ", ldl, idx, rdl2, idx, deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        assert torch.equal(local, pattern(FN * FB, SEED + 1))
    finally:
        final = p2.close()
    assert final is not None and final["registrations"] == 0


def test_add_peer_name_must_match_metadata(fault_side) -> None:
    p, t, local, ldl, ph, rdl = fault_side
    with pytest.raises(NixlTransportError, match="does not match|add_remote_agent"):
        t.add_peer("someone-else", p.metadata)
    assert t.counters().peers == 1
    # The real peer is still usable after the refused add.
    x = t.post("READ", ldl, [1], rdl, [1], deadline_s=WAIT_S)
    assert t.wait(x) is XferState.DONE, x.error


def test_killed_peer_on_default_transports_fails_fast() -> None:
    """Loopback defaults (cma + tcp): a dead peer is FAILED at post, well within the deadline."""
    p = PeerProcess(_name("kpeer"), 4 * BB, seed=SEED)
    t = NixlTransport(_name("klocal"))
    try:
        local = torch.zeros(4 * BB, dtype=torch.uint8)
        t.register_regions([local])
        ldl = t.prepare_local(0, BB, 4)
        ph = t.add_peer(p.name, p.metadata)
        rdl = t.prepare_remote(ph, block_descs(p.addr, BB, 4))
        x = t.post("READ", ldl, [0, 1], rdl, [2, 3], deadline_s=WAIT_S)
        assert t.wait(x) is XferState.DONE, x.error
        p.proc.kill()
        p.proc.wait(5)
        x = t.post("READ", ldl, [0, 1, 2, 3], rdl, [0, 1, 2, 3], deadline_s=5.0)
        assert t.wait(x, 0.001) is XferState.FAILED, x.error
        # NIXL reported the dead peer: FAILED, not TIMED_OUT (the deadline never fired)
        assert x.quiesced and t.counters().timed_out == 0
        assert "Disconnect" in (x.error or ""), x.error
    finally:
        p.kill()
        final = t.close()
    assert final.live == 0 and final.failed == 1 and final.timed_out == 0
