"""The word sums ``S`` of ``torch-mix64-v1`` in one fused Triton kernel, in place.

``layouts.torch_digests`` computes the digests with a handful of torch ops per
tile (a gather, two shifts, a multiply, a row sum): every op a pass over the
bytes, so it runs at a few % of a GPU's memory bandwidth. Here one kernel reads
each word of the KV once, where it lies (block ``b`` of a layer at ``b *
block_stride`` bytes, no gather copy), does the per-word mix of the definition
in registers, and reduces: each program sums one *item* (a run of at most
``chunk`` consecutive words of the hashed byte sequence) of one block and
writes that partial sum; a row sum of the partials per block gives ``S``,
the same whatever the chunking because the sum is mod 2^64. Only ``S`` is
computed here: the finaliser and the combination of layer digests into a block
digest stay in ``layouts.torch_digests`` (``_finish``, ``_combined``), shared
by both engines.

Arithmetic: the words are loaded as int64 and bitcast to uint64, on which Triton's
``*`` wraps mod 2^64 and ``>>`` is a logical shift, exactly the definition
(``layouts.digests``). The multiplier ``c_i`` of position ``i`` is computed in
registers (splitmix64 of ``(i + 1) * G``, ``| 1``) instead of read from a table:
four 64-bit multiplies a word in all, no second stream of loads (a choice by
arithmetic, ~40 integer instructions a word against an H200's budget at its memory
bandwidth, not yet measured against a table on a GPU).
A masked-off word is loaded as 0, and a zero word mixes to 0, so the zero padding
of a partial last word is the definition's padding.

What is hashed is the concatenation of byte ranges of each block (a whole
block is one range), planned once per geometry (:func:`plan_ranges`) into
launches of four kinds:

* words, affine: ranges that start on an 8-byte boundary of an aligned layer,
  read as int64 words (the hot path: whole blocks, HND head slices);
* bytes, affine: a range of an unaligned layer (or a partial last word), read
  as bytes and assembled into little-endian words;
* words, indexed: many word-aligned ranges (NHD rows of a head slice), each
  position's word offset from a small table;
* bytes, indexed: ranges that cut words (a byte offset per byte of the
  concatenation; rare, small).

No atomics: every program writes its own partial, and one row sum per launch
(none when a block is one item) adds them. What a batch pays besides the kernel
is fixed: the block ids to the device, the shared finaliser and combination
(a few dozen small torch kernels, whatever the bytes), the digests to the host;
a batch of few or small blocks of one layer is dominated by it, which is why
``kvbridge bench digests`` reports the kernel's sums alone too.

On a CUDA tensor the kernel is compiled by ``triton.jit``; on a CPU tensor it runs
only under Triton's interpreter (numpy semantics, slow: tests only), which is a
mode of the whole process: ``TRITON_INTERPRET=1`` set before triton is first
imported (triton's own library functions are decorated then). triton is imported
on first use of this engine, never by importing this module. The kernel runs on
the current stream of the tensor's device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: ``triton`` and ``triton.language``, imported on first use (:func:`_import`): a
#: process that never asks for the Triton engine never imports triton, and the kernel
#: body reads ``tl`` from this module's globals when it is compiled or interpreted
triton: Any = None
tl: Any = None
_IMPORT_ERROR: str | None = None

#: the widest tile: words a program loads per iteration (4 warps: 8 words a thread)
TILE_WORDS = 1024
#: the narrowest tile (4 warps: one word a thread)
_MIN_TILE_WORDS = 128
#: most words one program sums (64 KiB); fewer when a batch is small, so that enough
#: programs run to keep every SM's loads in flight
MAX_CHUNK_WORDS = 8192
#: the fewest programs a launch aims for before it stops halving its chunk: ptxas gives
#: the whole-word kernel 80 registers a thread (sm_90), so about 6 programs of 4 warps
#: are resident per SM, ~800 on an H200's 132 SMs: 4096 programs are ~5 waves, a short
#: last wave (64 x 2 MiB blocks: 32 KiB a program)
_MIN_PROGRAMS = 4096
#: a slice layer with more ranges than this is read through a per-position table
#: (the torch engine's threshold for a gather index: ``torch_digests._VIEW_RANGES``)
AFFINE_RANGES = 16
#: most programs in one launch (a 1-D grid's limit is 2^31 - 1); more rows are launched
#: in batches
_MAX_PROGRAMS = 1 << 30
#: plans a digester keeps (geometries: one per layer shape and slice), and the device
#: bytes their tables may hold (an indexed byte plan holds 8 bytes per hashed byte)
_PLAN_CACHE = 256
_PLAN_CACHE_BYTES = 64 << 20
INTERPRET_HINT = ("set TRITON_INTERPRET=1 before triton is first imported in the process "
                  "(Triton's interpreter, for tests)")


def _import() -> str | None:
    """Import triton once; the reason it does not import, or None."""
    global triton, tl, _IMPORT_ERROR
    if triton is None and _IMPORT_ERROR is None:
        try:
            import triton as triton_module
            import triton.language as language
        except Exception as exc:  # ImportError, or a wheel whose libraries fail to load
            _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        else:
            triton, tl = triton_module, language
    return None if _IMPORT_ERROR is None else f"triton does not import ({_IMPORT_ERROR})"


def _interpreted_function() -> Any:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # a triton without it
        return None
    return InterpretedFunction


def interpreter_active() -> bool:
    """Was triton imported under its interpreter (``TRITON_INTERPRET=1`` at import)?
    Its own library functions (``tl.zeros``, ``tl.sum``...) are then interpreted, and so
    must this kernel be: the mode is the process's, fixed when triton is imported."""
    if _import() is not None:
        return False
    interpreted = _interpreted_function()
    probe = getattr(getattr(triton.language, "standard", None), "zeros", None)
    return interpreted is not None and isinstance(probe, interpreted)


def unavailable(device: torch.device) -> str | None:
    """Why the Triton engine cannot run on ``device`` (None: it can). CUDA tensors run
    the compiled kernel (or the interpreter, when triton was imported under it); CPU
    tensors only the interpreter: a test of the kernel, never a production path."""
    reason = _import()
    if reason is not None:
        return reason
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        return None if interpreter_active() else \
            f"on CPU tensors the Triton kernel runs only under Triton's interpreter: {INTERPRET_HINT}"
    return f"no Triton backend for {device.type} tensors"


def _mix_sums_kernel(src, ids, items, index, out, num_items, stride, total_bytes,
                     BYTES: tl.constexpr, INDEXED: tl.constexpr, ALIGN: tl.constexpr,
                     TILE: tl.constexpr):
    """One program: the partial ``S`` of item ``pid % num_items`` of row ``pid //
    num_items`` (block ``ids[row]``, whose first element is ``src + ids[row] * stride``;
    ``src`` is int64 words, or bytes when ``BYTES``). ``items`` is ``[3, num_items]``
    int64: per item its first source offset (words or bytes from the block's start;
    for an indexed launch, its first position), its length (words; bytes for an affine
    byte item) and the position of its first word. The mix is written out twice (the
    unmasked loop and the general one): the interpreter cannot call a nested
    ``triton.jit`` helper, and the kernel must run under both."""
    pid = tl.program_id(0)
    item = pid % num_items
    row = pid // num_items
    base = tl.load(ids + row) * stride
    first = tl.load(items + item)
    count = tl.load(items + num_items + item)
    pos0 = tl.load(items + 2 * num_items + item)
    lanes = tl.arange(0, TILE)
    acc = tl.zeros([TILE], dtype=tl.uint64)
    words = count
    full = count * 0
    if BYTES and not INDEXED:
        words = (count + 7) // 8
    if not BYTES and not INDEXED:
        # whole tiles without a mask: with ALIGN = 2 (16-byte aligned words) the loads
        # are 16-byte vectors
        full = count - count % TILE
        for k in range(0, full, TILE):
            start = tl.multiple_of(base + first + k, ALIGN)
            w = tl.load(src + start + lanes).to(tl.uint64, bitcast=True)
            z = (pos0 + k + lanes).to(tl.uint64) + 1
            z = z * 0x9E3779B97F4A7C15
            z = z ^ (z >> 30)
            z = z * 0xBF58476D1CE4E5B9
            z = z ^ (z >> 27)
            z = z * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            x = w ^ (w >> 32)
            x = x * (z | 1)
            acc += x ^ (x >> 29)
    for k in range(full, words, TILE):
        lane = k + lanes
        live = lane < words
        if BYTES:
            j = tl.arange(0, 8)
            if INDEXED:
                q = (first + lane)[:, None] * 8 + j[None, :]
                ok = q < total_bytes
                offset = tl.load(index + q, mask=ok, other=0)
            else:
                q = lane[:, None] * 8 + j[None, :]
                ok = q < count
                offset = first + q
            b = tl.load(src + base + offset, mask=ok, other=0).to(tl.uint64)
            w = tl.sum(b << (j[None, :] * 8).to(tl.uint64), axis=1)
        else:
            if INDEXED:  # noqa: SIM108 (one branch is compiled: INDEXED is a constexpr)
                offset = tl.load(index + first + lane, mask=live, other=0)
            else:
                offset = first + lane
            w = tl.load(src + base + offset, mask=live, other=0).to(tl.uint64, bitcast=True)
        z = (pos0 + lane).to(tl.uint64) + 1
        z = z * 0x9E3779B97F4A7C15
        z = z ^ (z >> 30)
        z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27)
        z = z * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        x = w ^ (w >> 32)
        x = x * (z | 1)
        acc += x ^ (x >> 29)
    tl.store(out + pid, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


_KERNELS: dict[bool, Any] = {}


def _kernel(interpreted: bool) -> Any:
    """The kernel, decorated once in the process's mode (compiled or interpreted)."""
    if interpreted not in _KERNELS:
        _KERNELS[interpreted] = _interpreted_function()(_mix_sums_kernel) if interpreted \
            else triton.jit(_mix_sums_kernel)
    return _KERNELS[interpreted]


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: its kind and its item table (host arrays)."""

    byte_mode: bool
    indexed: bool
    #: ``[3, items]`` int64: first source offset (or position), length, first position
    items: np.ndarray
    #: per-position word offsets (words) or per-byte byte offsets (bytes); indexed only
    index: np.ndarray | None = None
    #: bytes of the whole concatenation (the limit of an indexed byte launch)
    total_bytes: int = 0


def plan_ranges(ranges: Sequence[tuple[int, int]], words_ok: bool, chunk: int
                ) -> list[Launch]:
    """The launches that sum the concatenation of ``ranges`` (merged, non-empty byte
    ranges of a block, in hashing order; positions from the concatenation's first
    byte). ``words_ok``: the layer's blocks start on 8-byte boundaries (int64 views
    exist). ``chunk``: most words per item."""
    ranges = [(int(o), int(n)) for o, n in ranges if n > 0]
    if not ranges:
        return []
    total = sum(n for _o, n in ranges)
    # each range starts a word of the concatenation when every one before it is whole words
    word_starts = all(n % 8 == 0 for _o, n in ranges[:-1])
    if word_starts and len(ranges) <= AFFINE_RANGES:
        word_items: list[tuple[int, int, int]] = []
        byte_items: list[tuple[int, int, int]] = []
        position = 0
        for offset, length in ranges:
            whole = length // 8
            if words_ok and offset % 8 == 0:
                word_items += [(offset // 8 + c, min(chunk, whole - c), position + c)
                               for c in range(0, whole, chunk)]
                if length % 8:  # the partial last word, zero-padded
                    byte_items.append((offset + whole * 8, length % 8, position + whole))
            else:
                step = chunk * 8
                byte_items += [(offset + c, min(step, length - c), position + c // 8)
                               for c in range(0, length, step)]
            position += whole
        return [Launch(byte_mode, False, np.array(items, dtype=np.int64).T.copy())
                for byte_mode, items in ((False, word_items), (True, byte_items)) if items]
    if words_ok and all(o % 8 == 0 and n % 8 == 0 for o, n in ranges):
        index = np.concatenate([np.arange(o // 8, (o + n) // 8, dtype=np.int64)
                                for o, n in ranges])
        return [Launch(False, True, _position_items(len(index), chunk), index)]
    index = np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in ranges])
    return [Launch(True, True, _position_items(math.ceil(total / 8), chunk), index, total)]


def _position_items(words: int, chunk: int) -> np.ndarray:
    starts = np.arange(0, words, chunk, dtype=np.int64)
    return np.stack([starts, np.minimum(chunk, words - starts), starts])


def chunk_words(rows: int, words: int) -> int:
    """Words per item for ``rows`` blocks of ``words`` hashed words each: the largest
    power of two up to :data:`MAX_CHUNK_WORDS` that still gives about
    :data:`_MIN_PROGRAMS` programs (never under one tile)."""
    chunk = MAX_CHUNK_WORDS
    while chunk > TILE_WORDS and rows * math.ceil(max(words, 1) / chunk) < _MIN_PROGRAMS:
        chunk //= 2
    return chunk


class TritonSums:
    """The Triton engine of one digester: word sums of byte ranges of blocks on
    ``device`` (plans cached per geometry, as device tensors)."""

    def __init__(self, device: torch.device) -> None:
        reason = unavailable(device)
        if reason is not None:
            raise RuntimeError(reason)
        self.device = device
        #: the kernel runs under Triton's interpreter (CPU tensors in tests), not compiled
        self.interpreted = interpreter_active()
        self._kernel = _kernel(self.interpreted)
        self._plans: dict[tuple[Any, ...], list[tuple[Launch, torch.Tensor,
                                                      torch.Tensor | None]]] = {}
        self._plan_bytes = 0
        #: kernel launches so far (what a bench or a GPU check reports as proof it ran)
        self.launches = 0

    def sums(self, words: torch.Tensor | None, raw: torch.Tensor, block_stride: int,
             ranges: Sequence[tuple[int, int]], ids: torch.Tensor) -> torch.Tensor:
        """``S`` (int64 ``[len(ids)]`` on the device) of the concatenated ``ranges`` of
        each block ``ids`` of one layer. ``raw``: the layer's bytes from its first
        block's first byte (uint8); ``words``: the same as int64 when every block starts
        on an 8-byte boundary, else None."""
        rows = int(ids.numel())
        total = sum(n for _o, n in ranges)
        if not rows or not total:
            return torch.zeros(rows, dtype=torch.int64, device=self.device)
        chunk = chunk_words(rows, math.ceil(total / 8))
        align = 2 if words is not None and words.data_ptr() % 16 == 0 and \
            block_stride % 16 == 0 else 1
        pieces: list[tuple[int, torch.Tensor]] = []  # (first row, S of those rows)
        for launch, items, index in self._plan(tuple(ranges), words is not None, align, chunk):
            source = raw if launch.byte_mode else words
            assert source is not None
            stride = block_stride if launch.byte_mode else block_stride // 8
            num_items = int(launch.items.shape[1])
            # ALIGN 2 only when every affine word item starts on a 16-byte boundary
            item_align = align if not launch.byte_mode and not launch.indexed and \
                bool((launch.items[0] % 2 == 0).all()) else 1
            # a tile no wider than the longest item (HND halves, NHD rows of a few words):
            # fewer idle lanes; a few compiled variants at most (powers of two)
            longest = int(launch.items[1].max())
            if launch.byte_mode and not launch.indexed:
                longest = math.ceil(longest / 8)
            tile = min(TILE_WORDS, max(_MIN_TILE_WORDS, 1 << (longest - 1).bit_length()))
            per_launch = max(1, _MAX_PROGRAMS // num_items)
            for r0 in range(0, rows, per_launch):
                part = ids[r0:r0 + per_launch]
                partials = torch.empty((int(part.numel()), num_items), dtype=torch.int64,
                                       device=self.device)
                with self._on_device():
                    self._kernel[(partials.numel(),)](
                        source, part, items, index if index is not None else items,
                        partials, num_items, stride, launch.total_bytes,
                        BYTES=launch.byte_mode, INDEXED=launch.indexed, ALIGN=item_align,
                        TILE=tile, **({} if self.interpreted else {"num_warps": 4}))
                self.launches += 1
                pieces.append((r0, partials.sum(dim=1, dtype=torch.int64) if num_items > 1
                               else partials[:, 0]))
        if len(pieces) == 1:  # the usual case: one launch, no more small ops
            return pieces[0][1]
        out = torch.zeros(rows, dtype=torch.int64, device=self.device)
        for r0, piece in pieces:
            out[r0:r0 + piece.numel()] += piece
        return out

    def _plan(self, ranges: tuple[tuple[int, int], ...], words_ok: bool, align: int,
              chunk: int) -> list[tuple[Launch, torch.Tensor, torch.Tensor | None]]:
        key = (ranges, words_ok, align, chunk)
        plan = self._plans.get(key)
        if plan is None:
            launches = plan_ranges(ranges, words_ok, chunk)
            nbytes = sum(launch.items.nbytes + (launch.index.nbytes if launch.index is not None
                                                else 0) for launch in launches)
            if len(self._plans) >= _PLAN_CACHE or self._plan_bytes + nbytes > _PLAN_CACHE_BYTES:
                self._plans.clear()
                self._plan_bytes = 0
            plan = [(launch, torch.from_numpy(launch.items).to(self.device),
                     torch.from_numpy(launch.index).to(self.device)
                     if launch.index is not None else None)
                    for launch in launches]
            if nbytes <= _PLAN_CACHE_BYTES:  # a larger one is used once, not kept
                self._plans[key] = plan
                self._plan_bytes += nbytes
        return plan

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Triton launches on the current CUDA device: make it the tensors' (a rank's KV
        on ``cuda:r`` while the thread's current device is another)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                yield
        else:
            yield


__all__ = ["AFFINE_RANGES", "INTERPRET_HINT", "MAX_CHUNK_WORDS", "TILE_WORDS", "Launch",
           "TritonSums", "chunk_words", "interpreter_active", "plan_ranges", "unavailable"]
