"""Descriptor rows: building, validating and expanding the rows NIXL lists are made of.

Descriptor rows are ``(addr, len[, dev])`` -- one row per descriptor -- or
NIXL's strided form ``(addr, len, dev, stride, count)`` (NIXL >= 1.5): one row
stands for ``count`` descriptors of ``len`` bytes, ``stride`` bytes apart, and
index ``sum(count of the rows before) + k`` names the ``k``-th of them. A
layer's per-block list of a real cache (~10^5 blocks) is then one row to build
and prepare instead of 10^5 (:func:`strided_descs`).

Owns the row builders (:func:`strided_descs`, :func:`block_descs`,
:func:`sub_block_descs`, :func:`expand_descs`), the checks every row and index
array passes before NIXL sees it (:func:`as_desc_array`, :func:`as_indices`)
and :class:`DListEntry`, the transport's record of one prepared list (row
lengths per group, so the lengths of posted indices cost no per-descriptor
memory). Pure numpy: nothing here prepares a list or calls NIXL.

May not touch: the NIXL agent, the transport's lock or tables. Imports only
:mod:`.records` of kvbridge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.backends.nixl.records import DRAM, NixlTransportError, PeerHandle

#: Transfers name rows by int32 index (NIXL's index arrays): a list holds at most this many.
MAX_LIST_DESCS = (1 << 31) - 1


def strided_descs(addr: int, length: int, stride: int, count: int,
                  device_id: int = 0) -> np.ndarray:
    """One strided row ``(addr, length, device_id, stride, count)`` (uint64[1,5]):
    ``count`` descriptors of ``length`` bytes at ``addr + k * stride``."""
    if length <= 0 or count <= 0 or stride < length or device_id < 0:
        raise NixlTransportError(f"strided descriptor: need length > 0, count > 0, stride >= "
                                 f"length, device_id >= 0; got length={length} count={count} "
                                 f"stride={stride} device_id={device_id}")
    return np.array([[addr, length, device_id, stride, count]], dtype=np.uint64)


def expand_descs(descs: Any) -> np.ndarray:
    """Any accepted rows as one ``(addr, len, dev)`` row per descriptor (uint64[N,3]),
    in index order: the per-block list a strided one stands for."""
    groups = as_groups(descs, "descs")
    counts = groups[:, 4].astype(np.int64)
    group = np.repeat(np.arange(groups.shape[0]), counts)
    first = np.zeros(groups.shape[0], dtype=np.int64)
    first[1:] = np.cumsum(counts)[:-1]
    k = (np.arange(group.shape[0], dtype=np.int64) - first[group]).astype(np.uint64)
    out = np.empty((group.shape[0], 3), dtype=np.uint64)
    out[:, 0] = groups[group, 0] + k * groups[group, 3]
    out[:, 1] = groups[group, 1]
    out[:, 2] = groups[group, 2]
    return out


def block_descs(addr: int, block_bytes: int, num_blocks: int) -> np.ndarray:
    """Rows ``(addr + i*block_bytes, block_bytes, 0)`` for ``i < num_blocks`` (uint64[N,3])."""
    return sub_block_descs(addr, block_bytes, num_blocks, 0, block_bytes)


def sub_block_descs(
    addr: int, block_bytes: int, num_blocks: int, offset: int, length: int
) -> np.ndarray:
    """Rows for a slice ``[offset, offset+length)`` of every block (uint64[N,3]).

    Heterogeneous-TP plans read a head slice of each remote block; the
    connector prepares one such list per slice and indexes it by block id.
    """
    if block_bytes <= 0 or num_blocks < 0:
        raise NixlTransportError(
            f"block_bytes must be > 0 and num_blocks >= 0, got {block_bytes}, {num_blocks}"
        )
    if offset < 0 or length <= 0 or offset + length > block_bytes:
        raise NixlTransportError(
            f"slice offset={offset} length={length} must lie inside block_bytes={block_bytes}"
        )
    out = np.zeros((num_blocks, 3), dtype=np.uint64)
    out[:, 0] = addr + offset + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    out[:, 1] = length
    return out


def as_desc_array(descs: Any, what: str) -> np.ndarray:
    """Validate ``descs`` as (addr, len), (addr, len, dev) or strided (addr, len, dev,
    stride, count) rows -> uint64[N,3] or uint64[N,5] (the strided form kept)."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3, 5) or arr.shape[0] == 0:
        raise NixlTransportError(
            f"{what}: expected a non-empty array of shape (N, 2), (N, 3) or strided (N, 5), "
            f"got {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise NixlTransportError(f"{what}: expected integer rows, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise NixlTransportError(f"{what}: addresses and lengths must be >= 0")
    out = np.zeros((arr.shape[0], 5 if arr.shape[1] == 5 else 3), dtype=np.uint64)
    out[:, : arr.shape[1]] = arr.astype(np.uint64)
    if (out[:, 1] == 0).any():
        raise NixlTransportError(f"{what}: every descriptor length must be > 0")
    if out.shape[1] == 5:
        stride, count = out[:, 3], out[:, 4]
        if (count == 0).any() or ((stride < out[:, 1]) & (count > 1)).any():
            k = int(np.flatnonzero((count == 0) | ((stride < out[:, 1]) & (count > 1)))[0])
            raise NixlTransportError(f"{what}: strided row {k}: count must be > 0 and stride "
                                     f">= len (rows may not overlap), got {out[k].tolist()}")
        span = stride.astype(np.float64) * (count.astype(np.float64) - 1) + out[:, 1]
        if (out[:, 0].astype(np.float64) + span >= 2.0**63).any():
            raise NixlTransportError(f"{what}: a strided row runs past the address space")
        if float(count.astype(np.float64).sum()) > MAX_LIST_DESCS:
            raise NixlTransportError(f"{what}: {int(count.sum())} descriptors exceed "
                                     f"{MAX_LIST_DESCS} (transfers index rows with int32)")
    elif out.shape[0] > MAX_LIST_DESCS:
        raise NixlTransportError(f"{what}: {out.shape[0]} rows exceed {MAX_LIST_DESCS}")
    return out


def as_groups(descs: Any, what: str) -> np.ndarray:
    """Any accepted rows as strided groups uint64[M,5] (a plain row is a group of one)."""
    arr = as_desc_array(descs, what)
    if arr.shape[1] == 5:
        return arr
    out = np.empty((arr.shape[0], 5), dtype=np.uint64)
    out[:, :3] = arr
    out[:, 3] = arr[:, 1]
    out[:, 4] = 1
    return out


#: index arrays up to this size are bounds-checked in Python: a numpy reduction costs
#: ~1.3 µs however short the array, a list's max a fraction of that
_SMALL_INDEX_COUNT = 32


def as_indices(idx: Any, bound: int, what: str) -> np.ndarray:
    """``idx`` as a flat int32 array of row indices, each checked against ``bound``.

    A flat, contiguous int32 array (what the connectors build) is checked and
    returned as is, not copied twice: NIXL copies the indices into its request.
    The check is one pass: read as unsigned, a negative index is larger than any
    bound (``bound`` <= :data:`MAX_LIST_DESCS` < 2**31)."""
    if isinstance(idx, np.ndarray) and idx.dtype == np.int32 and idx.ndim == 1 \
            and idx.flags.c_contiguous:
        arr, unsigned = idx, idx.view(np.uint32)
    else:
        arr = np.ascontiguousarray(np.asarray(idx, dtype=np.int64).reshape(-1))
        unsigned = arr.view(np.uint64)
    if arr.size == 0:
        raise NixlTransportError(f"{what}: expected at least one index")
    high = max(unsigned.tolist()) if arr.size <= _SMALL_INDEX_COUNT else int(unsigned.max())
    if high >= bound:
        raise NixlTransportError(
            f"{what}: indices must lie in [0, {bound}), got min {int(arr.min())} max "
            f"{int(arr.max())}")
    return arr if arr.dtype == np.int32 else arr.astype(np.int32)


@dataclass
class DListEntry:
    """A prepared list. Row lengths are kept per group (a strided row is one group),
    so looking up the lengths of posted indices costs no per-descriptor memory."""

    handle: Any
    group_lengths: np.ndarray  # uint64[M]
    group_ends: np.ndarray | None  # int64[M] cumulative counts; None: every group is one row
    peer: PeerHandle | None
    mem_type: str = DRAM
    #: the same list prepared on each lane agent (``nixl_lanes``; empty: not laned)
    lane_handles: list[Any] = field(default_factory=list)
    #: the length of every row when all are equal (else None): a transfer's byte count
    #: and its length check then need no per-index lookup
    uniform_length: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        lengths = self.group_lengths
        if lengths.size and bool((lengths == lengths[0]).all()):
            self.uniform_length = int(lengths[0])

    def release(self) -> None:
        """Release the list on its agent and on every lane."""
        handles, self.lane_handles = self.lane_handles, []
        try:
            self.handle.release()
        finally:
            for handle in handles:
                handle.release()

    def lengths(self, idx: np.ndarray) -> np.ndarray:
        if self.group_ends is None:
            return self.group_lengths[idx]
        return self.group_lengths[np.searchsorted(self.group_ends, idx, side="right")]
