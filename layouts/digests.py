"""Block digests: what a reader checks KV bytes against before it calls a block loaded.

Silent wrong KV (a flipped byte, a torn file of the right size, another key's
bytes under this key) is worse than a failed load: the engine serves a wrong
answer and nobody is told. So the side that writes KV takes a digest of every
block it hands out, the digest travels with the bytes, and every reader
checks the bytes that landed against it before it reports the block loaded. A
mismatch is a failed load of exactly those blocks (the engine recomputes
them), never an exception in the engine.

Unit: one digest per (region, block) on one rank, over that block's bytes in
every layer of the region, in layer order. The layer digests are XXH3-64 of
the block's contiguous span in one layer tensor; the block digest is XXH3-64
of the packed little-endian layer digests. Readers that can afford it (the
offload tiers) keep the layer digests too, so a mismatch names the layer.
XXH3-64 (seed 0) was chosen by measurement: ~16 GiB/s on one core of this
machine from a buffer, against ~10 GB/s for memcpy and 2.4-7 GB/s for a NIXL
READ; a C implementation released by the ``xxhash`` package that hashes a
memoryview in place (no copy, no per-byte Python).

A digest compares one rank's block with a block of the same geometry (the
same heads, the same bytes per layer): the offload tiers and the Mooncake
store always read back what the same rank wrote; NIXL pairs of equal
per-rank geometry (equal TP, or a replicated region) compare directly.

Pure: no sockets, no threads, nothing else of kvbridge. Digests of GPU memory
are not taken here (a host pointer is required).
"""

from __future__ import annotations

import ctypes
import enum
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvbridge.layouts.errors import LayoutError

#: the one algorithm this version computes; the name travels on the wire
ALGORITHM = "xxh3-64"
ALGORITHMS: tuple[str, ...] = (ALGORITHM,)
DIGEST_BYTES = 8
#: version of the digest definition (unit, order, packing); golden vectors pin it
DIGEST_VERSION = 1


class DigestMode(str, enum.Enum):
    """How much a reader verifies: nothing, a deterministic fraction, every block."""

    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"


#: The defaults, chosen by measurement (``kvbridge bench nixl|mooncake``, ``kvbridge
#: offload bench --verify``; numbers in docs/verified-kv.md): checking every block costs 30-50 %
#: of a host-memory NIXL READ or Mooncake get here (hashing runs at about memcpy speed),
#: so readers check a deterministic 1/16 of each request's blocks (a few % at 16 KiB
#: blocks, ~1 % at 2 MiB), which finds a systematic fault (wrong blocks, a reused block,
#: a layout mix-up: many blocks at once) in the first requests it touches. The fs tier
#: is disk-bound and checks every block by default (cost within noise with O_DIRECT).
DEFAULT_MODE = DigestMode.SAMPLE
DEFAULT_SAMPLE = 1 / 16


@dataclass(frozen=True)
class VerifyPolicy:
    """A reader's verification policy, parsed once from config.

    ``sample_fraction``: in ``sample`` mode, the fraction of a request's blocks
    checked, chosen deterministically from (request id, region, block index)
    so that a rerun checks the same blocks. ``allow_unverified``: a peer that
    sends no digests (an older version, or GPU memory) is still served, and
    counted as unverified; False fails such loads instead.
    """

    mode: DigestMode = DEFAULT_MODE
    sample_fraction: float = DEFAULT_SAMPLE
    allow_unverified: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_fraction <= 1.0:
            raise LayoutError("verify_sample", f"expected a fraction in (0, 1], got "
                                               f"{self.sample_fraction!r}")

    @property
    def enabled(self) -> bool:
        return self.mode is not DigestMode.OFF

    def chosen(self, request_id: str, region: int, count: int) -> list[int]:
        """Positions ``0..count-1`` of a request's blocks of ``region`` that are checked."""
        if self.mode is DigestMode.FULL:
            return list(range(count))
        if self.mode is DigestMode.OFF:
            return []
        mask = sample_mask(request_id, region, count, self.sample_fraction)
        return np.flatnonzero(mask).tolist()

    def wants(self, request_id: str, region: int, block_index: int) -> bool:
        """Is block ``block_index`` (position in the request) of ``region`` checked?"""
        if self.mode is DigestMode.FULL:
            return True
        if self.mode is DigestMode.OFF:
            return False
        return sample_selected(request_id, region, block_index, self.sample_fraction)


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer on one 64-bit value (the scalar twin of :func:`sample_mask`)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seed(request_id: str, region: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{region}:{request_id}".encode())


def sample_selected(request_id: str, region: int, block_index: int, fraction: float) -> bool:
    """Deterministic (every process, every run) choice of ``fraction`` of the blocks."""
    x = _mix((block_index * _GOLDEN + _seed(request_id, region)) & _MASK64)
    return x < int(fraction * (1 << 64))


def sample_mask(request_id: str, region: int, count: int, fraction: float) -> np.ndarray:
    """:func:`sample_selected` of block indices ``0..count-1`` at once (numpy, no loop)."""
    with np.errstate(over="ignore"):
        x = np.arange(count, dtype=np.uint64) * np.uint64(_GOLDEN) \
            + np.uint64(_seed(request_id, region))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x < np.uint64(min(int(fraction * (1 << 64)), _MASK64))


def digest_bytes(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 (seed 0) of ``data``, unsigned."""
    return xxhash.xxh3_64_intdigest(data)


def combine(layer_digests: Sequence[int] | np.ndarray) -> int:
    """The block digest from its layer digests (in layer order)."""
    packed = np.asarray(layer_digests, dtype="<u8").tobytes()
    return xxhash.xxh3_64_intdigest(packed)


def pack(digests: Sequence[int] | np.ndarray) -> bytes:
    """Digests as little-endian u64s: their wire and file form."""
    return np.asarray(digests, dtype="<u8").tobytes()


def unpack(data: bytes, count: int, field: str = "digests") -> tuple[int, ...]:
    """``count`` digests from :func:`pack`'s bytes; raises LayoutError on a wrong size."""
    if not isinstance(data, bytes | bytearray) or len(data) != count * DIGEST_BYTES:
        size = len(data) if isinstance(data, bytes | bytearray) else type(data).__name__
        raise LayoutError(field, f"expected {count * DIGEST_BYTES} bytes ({count} digests), "
                                 f"got {size}")
    return struct.unpack(f"<{count}Q", data) if count else ()


def host_view(addr: int, nbytes: int) -> memoryview:
    """Read-only view of ``nbytes`` of host memory at ``addr`` (memory this process owns)."""
    if addr <= 0 or nbytes < 0:
        raise LayoutError("addr", f"expected a host pointer and a size, got {addr:#x}/{nbytes}")
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B").toreadonly()


@dataclass(frozen=True)
class LayerSpan:
    """Where block ``b`` of one layer sits: ``base_addr + b * block_stride``, ``block_bytes``."""

    base_addr: int
    block_stride: int
    block_bytes: int
    num_blocks: int


class BlockDigester:
    """Digests of one rank's blocks in host memory, straight from its KV tensors.

    ``layers`` maps layer id to its span; ``regions`` lists each region's layer
    ids (in layer order); ``owner`` is whatever owns that memory (kept alive
    with the digester). Reads the memory in place: a digest taken while a
    writer is still writing the block is a digest of whatever was there.
    """

    def __init__(self, layers: Mapping[int, LayerSpan], regions: Sequence[Sequence[int]],
                 owner: object = None) -> None:
        #: what owns the memory (tensors, arrays): kept alive as long as the views
        self._owner = owner
        self.regions = tuple(tuple(ids) for ids in regions)
        self._views: dict[int, tuple[memoryview, int, int, int]] = {}
        for layer, span in layers.items():
            size = (span.num_blocks - 1) * span.block_stride + span.block_bytes \
                if span.num_blocks else 0
            view = host_view(span.base_addr, size) if size else memoryview(b"")
            self._views[layer] = (view, span.block_stride, span.block_bytes, span.num_blocks)
        for index, ids in enumerate(self.regions):
            missing = [layer for layer in ids if layer not in self._views]
            if missing:
                raise LayoutError(f"regions[{index}]", f"no span for layers {missing}")
        # per region: its layers' spans, the fewest blocks of any of them, and the packer
        # of its layer digests (the hot loop below does nothing else per block)
        self._regions = tuple(
            (tuple((v[0], v[1], v[2]) for v in (self._views[layer] for layer in ids)),
             min((self._views[layer][3] for layer in ids), default=0),
             struct.Struct(f"<{len(ids)}Q").pack)
            for ids in self.regions)

    def block_bytes(self, region: int) -> int:
        """Bytes one block of ``region`` spans over all its layers (what one digest reads)."""
        return sum(self._views[layer][2] for layer in self.regions[region])

    def _check(self, region: int, block_ids: Sequence[int]) -> None:
        num_blocks = self._regions[region][1]
        if block_ids and not (min(block_ids) >= 0 and max(block_ids) < num_blocks):
            bad = next(b for b in block_ids if not 0 <= b < num_blocks)
            raise LayoutError("block_id", f"block {bad} outside [0, {num_blocks}) of region "
                                          f"{region}")

    def layer_digests(self, region: int, block_id: int) -> tuple[int, ...]:
        """XXH3-64 of ``block_id``'s span in each layer of ``region``, in layer order."""
        self._check(region, (block_id,))
        digest = xxhash.xxh3_64_intdigest
        return tuple(digest(view[block_id * stride:block_id * stride + nbytes])
                     for view, stride, nbytes in self._regions[region][0])

    def block_digest(self, region: int, block_id: int) -> int:
        return combine(self.layer_digests(region, block_id))

    def block_digests(self, region: int, block_ids: Sequence[int]) -> list[int]:
        """The block digest of each of ``block_ids`` (the same as :meth:`block_digest`)."""
        self._check(region, block_ids)
        spans, _num_blocks, pack = self._regions[region]
        digest = xxhash.xxh3_64_intdigest
        return [digest(pack(*[digest(view[b * stride:b * stride + nbytes])
                              for view, stride, nbytes in spans]))
                for b in block_ids]


def mismatched(expected: Sequence[int], actual: Sequence[int]) -> list[int]:
    """Positions where two digest lists differ (they must have the same length)."""
    if len(expected) != len(actual):
        raise LayoutError("digests", f"{len(actual)} digests to compare with {len(expected)}")
    return [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
