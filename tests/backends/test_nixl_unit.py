"""NixlTransport in one process: descriptor helpers, argument checks, counters, close.

Real NIXL (one agent, no peer); the two-process behaviour is in test_nixl_transport.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require

torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl import (  # noqa: E402
    NixlTransport,
    NixlTransportError,
    XferState,
    block_descs,
    sub_block_descs,
)


def test_block_descs_rows() -> None:
    d = block_descs(0x1000, 256, 4)
    assert d.dtype == np.uint64 and d.shape == (4, 3)
    assert d[:, 0].tolist() == [0x1000, 0x1100, 0x1200, 0x1300]
    assert d[:, 1].tolist() == [256] * 4 and d[:, 2].tolist() == [0] * 4


def test_sub_block_descs_is_a_slice_of_every_block() -> None:
    d = sub_block_descs(0x1000, 256, 3, offset=64, length=32)
    assert d[:, 0].tolist() == [0x1040, 0x1140, 0x1240]
    assert d[:, 1].tolist() == [32, 32, 32]


@pytest.mark.parametrize("offset,length", [(-1, 8), (0, 0), (250, 8), (0, 257)])
def test_sub_block_descs_rejects_slices_outside_block(offset: int, length: int) -> None:
    with pytest.raises(NixlTransportError, match="inside block_bytes=256"):
        sub_block_descs(0x1000, 256, 3, offset, length)


@pytest.fixture
def transport():
    t = NixlTransport()
    buf = torch.zeros(8 * 1024, dtype=torch.uint8)
    t.register_regions([buf])
    yield t, buf
    t.close(strict=False)


def test_register_and_prepare_counts_and_close_releases(transport) -> None:
    t, buf = transport
    t.prepare_local(0, 1024, 8)
    t.prepare_local_descs(np.array([[buf.data_ptr() + 16, 32]], dtype=np.uint64))
    c = t.counters()
    assert (c.registrations, c.dlists, c.peers, c.xfer_handles) == (1, 2, 0, 0)
    assert len(t.agent_metadata()) > 100
    final = t.close()
    assert final.live == 0 and final.registrations == 0 and final.dlists == 0
    assert t.close().live == 0  # idempotent
    with pytest.raises(NixlTransportError, match="closed"):
        t.agent_metadata()


def test_prepare_local_rejects_blocks_beyond_region(transport) -> None:
    t, _ = transport
    with pytest.raises(NixlTransportError, match="exceed"):
        t.prepare_local(0, 1024, 9)
    with pytest.raises(NixlTransportError, match="region_id"):
        t.prepare_local(1, 1024, 1)


def test_prepare_local_descs_rejects_rows_outside_regions(transport) -> None:
    t, buf = transport
    rows = np.array([[buf.data_ptr(), 64], [buf.data_ptr() + 8 * 1024 - 8, 16]], dtype=np.uint64)
    with pytest.raises(NixlTransportError, match="row 1"):
        t.prepare_local_descs(rows)
    with pytest.raises(NixlTransportError, match="shape"):
        t.prepare_local_descs(np.zeros((0, 2), dtype=np.uint64))
    with pytest.raises(NixlTransportError, match="length must be > 0"):
        t.prepare_local_descs(np.array([[buf.data_ptr(), 0]], dtype=np.uint64))
    assert t.counters().dlists == 0


def test_register_rejects_bad_regions(transport) -> None:
    t, _ = transport
    with pytest.raises(NixlTransportError, match=r"regions\[0\]"):
        t.register_regions([torch.zeros(4, 4)[:, 1]])
    with pytest.raises(NixlTransportError, match=r"regions\[0\]"):
        t.register_regions([(0, 16)])
    assert t.counters().registrations == 1


def test_post_needs_a_remote_list(transport) -> None:
    t, _ = transport
    local = t.prepare_local(0, 1024, 8)
    with pytest.raises(NixlTransportError, match="prepare_remote"):
        t.post("READ", local, [0], local, [1])
    assert t.counters().posted == 0


def test_state_terminality() -> None:
    assert not XferState.PENDING.terminal
    assert all(s.terminal for s in (XferState.DONE, XferState.FAILED, XferState.TIMED_OUT))


def test_as_indices_int32_fast_path_checks_like_the_general_one() -> None:
    """A flat int32 array is returned as is (no copies), but still bounds-checked."""
    from kvbridge.backends.nixl.descs import as_indices

    idx = np.arange(8, dtype=np.int32)
    assert as_indices(idx, 8, "x") is idx
    assert as_indices(idx.astype(np.int64), 8, "x").dtype == np.int32
    for bad in (np.array([0, 8], dtype=np.int32), np.array([-1, 0], dtype=np.int32)):
        with pytest.raises(NixlTransportError, match=r"indices must lie in \[0, 8\)"):
            as_indices(bad, 8, "x")
    with pytest.raises(NixlTransportError, match="at least one index"):
        as_indices(np.zeros(0, dtype=np.int32), 8, "x")
    strided = np.arange(16, dtype=np.int32)[::2]  # not contiguous: the general path
    assert as_indices(strided, 16, "x").tolist() == list(range(0, 16, 2))


@pytest.mark.parametrize("count", [1, 32, 33, 4096])  # the Python and the numpy check
def test_as_indices_rejects_out_of_range_in_one_pass(count: int) -> None:
    """Negative indices read as unsigned exceed any bound: one pass checks both ends,
    for short arrays (checked in Python) and long ones (one numpy reduction)."""
    from kvbridge.backends.nixl.descs import as_indices

    for dtype in (np.int32, np.int64):
        good = np.arange(count, dtype=dtype)
        assert as_indices(good, count, "x").tolist() == list(range(count))
        for bad_value in (-1, count, -(2**31)):
            bad = good.copy()
            bad[count // 2] = bad_value
            with pytest.raises(NixlTransportError, match=rf"indices must lie in \[0, {count}\)"):
                as_indices(bad, count, "x")
    huge = np.full(count, 2**63 + 5, dtype=np.uint64)  # wraps negative as int64
    with pytest.raises(NixlTransportError, match="indices must lie"):
        as_indices(huge, count, "x")
    with pytest.raises(NixlTransportError, match="indices must lie"):
        as_indices([count] * count, count, "x")


def test_dlist_entry_uniform_length() -> None:
    from kvbridge.backends.nixl.descs import DListEntry

    same = DListEntry(None, np.array([64, 64], dtype=np.uint64), np.array([3, 5]), None)
    mixed = DListEntry(None, np.array([64, 32], dtype=np.uint64), np.array([3, 5]), None)
    assert same.uniform_length == 64 and mixed.uniform_length is None
    assert mixed.lengths(np.array([0, 2, 3, 4])).tolist() == [64, 64, 32, 32]

