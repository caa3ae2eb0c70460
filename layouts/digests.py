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
per-rank geometry (equal TP, or a replicated region) compare directly; head
slices read at another TP are compared with *slice digests*, over exactly the
bytes one consumer rank reads from one producer rank
(:meth:`BlockDigester.slice_digests`, :data:`SLICE_ALGORITHM`).

A second algorithm, ``torch-mix64-v1`` (:data:`TORCH_ALGORITHM`), is computed
by integer tensor reductions on whatever device the KV tensor lives on (GPU
memory included: no host copy of the bytes), in ``layouts.torch_digests``;
this module defines it (:func:`mix64_digest`, a numpy reference of the same
function over host bytes). Its unit and layering are the same as above: a
layer digest of each block's span in one layer tensor, and a block digest of
the packed little-endian layer digests, both with the same function. A rank
offers the algorithms it can compute (XXH3-64 needs host memory): a host
rank offers both, preferring XXH3-64 (faster on a CPU core), a GPU rank only
the torch one; a consumer picks the first of its own preference list that
the producer offers. Each has its slice digests (head slices at another TP):
``xxh3-64-slices`` and ``torch-mix64-v1-slices`` (:data:`SLICE_ALGORITHMS`), the
same ranges and the same combination with the block algorithm's function.

``torch-mix64-v1`` of bytes ``B`` (``n = len(B)``), all arithmetic mod 2^64
on unsigned 64-bit values, ``>>`` a logical shift:

- ``B`` zero-padded to ``W = ceil(n / 8)`` little-endian words ``w_0..w_{W-1}``
  (positions counted from the first byte of the span);
- per word: ``x = w_i ^ (w_i >> 32)``; ``x = x * c_i`` with the odd,
  position-dependent multiplier ``c_i = splitmix64((i + 1) * G) | 1``
  (``G = 0x9E3779B97F4A7C15``, splitmix64 = its finalizer :func:`_mix`);
  ``x = x ^ (x >> 29)``;
- ``S = sum of x over i``; the digest is ``splitmix64(S + (n + 1) * G)``.

Each per-word step is a bijection of the word (an xor-shift, a multiplication
by an odd number), so any change confined to one aligned 8-byte word (every
single flipped bit among them) changes ``S`` and so the digest, with
certainty; the multiplier differs per position, so words swapped or moved
change it too (with probability ~1 - 2^-64, not certainty), and ``n`` enters
the finaliser, so zero padding is not mistaken for data. Only integer
operations, and the reduction is an integer sum mod 2^64, which is
associative and commutative: any order, tiling or thread split of the sum
(CPU threads, a CUDA tree reduction, the column chunks of
``layouts.torch_digests``) gives the same ``S``, so the same bytes give the
same digest on every device by construction. Golden vectors:
``tests/golden/vectors/block_digests_torch_mix64.txt``.

Pure: no sockets, no threads, nothing else of kvbridge. Digests of GPU memory
are taken by ``layouts.torch_digests`` (the XXH3-64 digester here needs a host
pointer).
"""

from __future__ import annotations

import ctypes
import enum
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from kvbridge.layouts.errors import LayoutError

#: the host-memory algorithm (and the only one before ``torch-mix64-v1``); the name
#: travels on the wire
ALGORITHM = "xxh3-64"
#: the algorithm computed by tensor reductions on the KV tensor's own device
TORCH_ALGORITHM = "torch-mix64-v1"
#: every algorithm this version knows; index + 1 is the id of the Mooncake records
ALGORITHMS: tuple[str, ...] = (ALGORITHM, TORCH_ALGORITHM)
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


#: :func:`digest_bytes` itself, the C function: a hot loop binds it once and calls it
#: without a Python frame per block
digest_fast: Callable[[bytes | bytearray | memoryview], int] = xxhash.xxh3_64_intdigest


def digest_texts(texts: Iterable[str]) -> list[int]:
    """:func:`digest_bytes` of each text's UTF-8 bytes, in one comprehension."""
    digest = xxhash.xxh3_64_intdigest
    return [digest(text.encode()) for text in texts]


def combine(layer_digests: Sequence[int] | np.ndarray) -> int:
    """The block digest from its layer digests (in layer order)."""
    packed = np.asarray(layer_digests, dtype="<u8").tobytes()
    return xxhash.xxh3_64_intdigest(packed)


def mix64_keys(start: int, count: int) -> np.ndarray:
    """The multipliers ``c_start .. c_{start+count-1}`` of ``torch-mix64-v1`` (uint64, odd)."""
    with np.errstate(over="ignore"):
        x = (np.arange(start, start + count, dtype=np.uint64) + np.uint64(1)) \
            * np.uint64(_GOLDEN)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x | np.uint64(1)


def mix64_finish(total: int, nbytes: int) -> int:
    """``torch-mix64-v1``'s finaliser: the digest from the word sum ``S`` of ``nbytes``."""
    return _mix((total + (nbytes + 1) * _GOLDEN) & _MASK64)


def mix64_sum(words: np.ndarray, start: int = 0) -> int:
    """``S`` of ``torch-mix64-v1`` over ``words`` (uint64) at positions ``start..``."""
    with np.errstate(over="ignore"):
        x = words.astype(np.uint64, copy=True)
        x ^= x >> np.uint64(32)
        x *= mix64_keys(start, len(words))
        x ^= x >> np.uint64(29)
        return int(x.sum(dtype=np.uint64))


def mix64_digest(data: bytes | bytearray | memoryview) -> int:
    """``torch-mix64-v1`` of host bytes (the module docstring defines it): the numpy
    reference of ``layouts.torch_digests``, which computes the same on a tensor's device."""
    raw = bytes(data)
    padded = raw + b"\0" * (-len(raw) % 8)
    return mix64_finish(mix64_sum(np.frombuffer(padded, dtype="<u8")), len(raw))


def mix64_combine(layer_digests: Sequence[int] | np.ndarray) -> int:
    """The ``torch-mix64-v1`` block digest from its layer digests (in layer order)."""
    return mix64_digest(pack(layer_digests))


def digest_algorithms(host_memory: bool, preference: Sequence[str] = ()) -> tuple[str, ...]:
    """The algorithms a rank offers, in its preference order: ``preference`` (default:
    XXH3-64 then ``torch-mix64-v1``) less those it cannot compute (XXH3-64 reads host
    memory; the torch one runs on any device)."""
    for name in preference:
        if name not in ALGORITHMS:
            raise LayoutError("verify_algorithms", f"unknown digest algorithm {name!r}; "
                                                   f"expected some of {list(ALGORITHMS)}")
    wanted = tuple(dict.fromkeys(preference)) if preference else ALGORITHMS
    return tuple(name for name in wanted if host_memory or name != ALGORITHM)


def pick_algorithm(preference: Sequence[str], offered: Sequence[str]) -> str | None:
    """The consumer's choice: the first of its own ``preference`` the producer ``offered``
    (None: no common algorithm, the loads are unverified)."""
    return next((name for name in preference if name in offered), None)


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


class Digester(Protocol):
    """What a reader or writer of digests needs of one rank's digester, whatever the
    algorithm: :class:`BlockDigester` (XXH3-64, host memory) or
    ``layouts.torch_digests.TorchBlockDigester`` (``torch-mix64-v1``, any device)."""

    @property
    def algorithm(self) -> str: ...

    def block_bytes(self, region: int) -> int: ...

    def block_digests(self, region: int, block_ids: Sequence[int]) -> list[int]: ...

    def slice_digests(self, layers: Sequence[SliceLayer], block_ids: Sequence[int]
                      ) -> list[int]: ...


class BlockDigester:
    """Digests of one rank's blocks in host memory, straight from its KV tensors.

    ``layers`` maps layer id to its span; ``regions`` lists each region's layer
    ids (in layer order); ``owner`` is whatever owns that memory (kept alive
    with the digester). Reads the memory in place: a digest taken while a
    writer is still writing the block is a digest of whatever was there.
    """

    algorithm = ALGORITHM

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

    def slice_digests(self, layers: Sequence[SliceLayer], block_ids: Sequence[int]
                      ) -> list[int]:
        """The slice digest of each of ``block_ids`` over the byte ranges ``layers`` names.

        Definition (version :data:`SLICE_DIGEST_VERSION`): for each layer of ``layers``
        in ascending layer id, its *layer slice digest* is XXH3-64 (seed 0) of the
        concatenation of the block's bytes ``[offset, offset + length)`` of that layer,
        in the order the ranges are given; the block's slice digest is XXH3-64 of the
        packed little-endian layer slice digests (as :func:`combine`). How the ranges
        are cut does not matter, only the byte sequence: adjacent ranges are merged, so a
        layer whose single range is its whole block has its layer digest, and a slice of
        every layer of a region, each whole, is the block digest. NIXL slices (see
        ``connectors.pd.verify``) list the bytes a consumer rank reads from one
        producer rank in ascending order of their offset in the *consumer's* block, the
        producer with its source offsets, the consumer with its destination offsets:
        both hash the same bytes in the same order when they arrived intact.
        """
        return _slice_digests(self, layers, block_ids)


#: Slice digests (heterogeneous TP): one block's digest over exactly the bytes
#: one consumer rank reads of it from one producer rank, so that a block assembled from
#: head slices of several producer ranks, or a sub-slice of one producer rank's block, is
#: compared part by part. Negotiated under its own name (a peer that does not list it
#: is never asked for it).
SLICE_ALGORITHM = "xxh3-64-slices"
#: slice digests with ``torch-mix64-v1`` (``layouts.torch_digests.TorchBlockDigester.
#: slice_digests``): the same ranges and combination, for ranks whose KV is in GPU memory
TORCH_SLICE_ALGORITHM = "torch-mix64-v1-slices"
#: each slice algorithm and the block algorithm whose digester computes it (a region
#: read whole is answered with that algorithm's block digest: its slice digest)
SLICE_ALGORITHMS: Mapping[str, str] = {SLICE_ALGORITHM: ALGORITHM,
                                       TORCH_SLICE_ALGORITHM: TORCH_ALGORITHM}
#: version of the slice digest definition (:meth:`BlockDigester.slice_digests`)
SLICE_DIGEST_VERSION = 1


def slice_algorithm_of(block_algorithm: str) -> str | None:
    """The slice algorithm a block algorithm's digester computes (None: none)."""
    return next((s for s, b in SLICE_ALGORITHMS.items() if b == block_algorithm), None)


def block_algorithm_of(algorithm: str) -> str:
    """The block algorithm behind ``algorithm``: itself, or a slice algorithm's base."""
    return SLICE_ALGORITHMS.get(algorithm, algorithm)

#: one layer's part of a slice: ``(layer id, ((offset, length), ...))``, byte ranges
#: within that layer's block, in the order they are hashed
SliceLayer = tuple[int, tuple[tuple[int, int], ...]]


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` in the same order with each range that starts where the previous one
    ends merged into it, empty ones dropped: the same byte sequence in fewer pieces."""
    out: list[tuple[int, int]] = []
    for offset, length in ranges:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((int(offset), int(length)))
    return tuple(out)


#: a layer with at least this many ranges of one length at one step (NHD rows of a head
#: slice) is gathered with one strided copy per block and hashed at once: the same
#: bytes in the same order as streaming each range, without a Python call per range
_GATHER_RANGES = 8


def _progression(ranges: tuple[tuple[int, int], ...]) -> tuple[int, int, int, int] | None:
    """``(first offset, length, step, count)`` when ``ranges`` are evenly spaced ranges
    of one length (and enough of them to gather), else None."""
    if len(ranges) < _GATHER_RANGES:
        return None
    first, length = ranges[0]
    step = ranges[1][0] - first
    if step <= length or any(n != length or o != first + i * step
                             for i, (o, n) in enumerate(ranges)):
        return None
    return first, length, step, len(ranges)


def checked_slice(layers: Sequence[SliceLayer], block_ids: Sequence[int] | np.ndarray,
                  spans: Mapping[int, tuple[int, int]]
                  ) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """A slice's layers in ascending id, each with its ranges merged (:func:`merge_ranges`),
    after checking them against ``spans`` (layer id -> (bytes of one block, blocks)) and
    ``block_ids`` against the fewest blocks of those layers: what both digesters'
    ``slice_digests`` take. Raises :class:`LayoutError` naming what lies outside."""
    out = []
    num_blocks = None
    for layer, ranges in sorted(layers, key=lambda item: item[0]):
        span = spans.get(layer)
        if span is None:
            raise LayoutError("slice", f"no span for layer {layer}")
        nbytes, blocks = span
        merged = merge_ranges(ranges)
        bad = next(((o, n) for o, n in merged if o < 0 or o + n > nbytes), None)
        if bad is not None:
            raise LayoutError("slice", f"range {bad} of layer {layer} outside its "
                                       f"{nbytes}-byte block")
        num_blocks = blocks if num_blocks is None else min(num_blocks, blocks)
        out.append((layer, merged))
    if len(block_ids) and num_blocks is not None:
        # min and max first (vectorised for an array): the search only when one is out
        lo, hi = (int(block_ids.min()), int(block_ids.max())) \
            if isinstance(block_ids, np.ndarray) else (min(block_ids), max(block_ids))
        if lo < 0 or hi >= num_blocks:
            bad_id = next(int(b) for b in block_ids if not 0 <= b < num_blocks)
            raise LayoutError("block_id", f"block {bad_id} outside [0, {num_blocks})")
    return out


def _slice_digests(digester: BlockDigester, layers: Sequence[SliceLayer],
                   block_ids: Sequence[int]) -> list[int]:
    """:meth:`BlockDigester.slice_digests` (a function so the class body stays as it was)."""
    views = digester._views
    prepared = [(views[layer][0], views[layer][1], merged, _progression(merged))
                for layer, merged in checked_slice(
                    layers, block_ids, {layer: (v[2], v[3]) for layer, v in views.items()})]
    pack = struct.Struct(f"<{len(prepared)}Q").pack
    digest = xxhash.xxh3_64_intdigest
    stream = xxhash.xxh3_64()
    out = []
    arrays = {id(view): np.frombuffer(view, dtype=np.uint8) for view, _s, _m, p in prepared
              if p is not None}
    for b in block_ids:
        layer_digests = []
        for view, stride, merged, progression in prepared:
            base = b * stride
            if len(merged) == 1:
                offset, length = merged[0]
                layer_digests.append(digest(view[base + offset:base + offset + length]))
                continue
            if progression is not None:  # e.g. NHD rows: one strided copy, one hash
                first, length, step, count = progression
                rows = np.lib.stride_tricks.as_strided(
                    arrays[id(view)][base + first:], (count, length), (step, 1),
                    writeable=False)
                layer_digests.append(digest(np.ascontiguousarray(rows).reshape(-1).data))
                continue
            stream.reset()
            for offset, length in merged:  # memoryview slices: hashed in place, no copy
                stream.update(view[base + offset:base + offset + length])
            layer_digests.append(stream.intdigest())
        out.append(digest(pack(*layer_digests)))
    return out


def mismatched(expected: Sequence[int], actual: Sequence[int]) -> list[int]:
    """Positions where two digest lists differ (they must have the same length)."""
    if len(expected) != len(actual):
        raise LayoutError("digests", f"{len(actual)} digests to compare with {len(expected)}")
    return [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
