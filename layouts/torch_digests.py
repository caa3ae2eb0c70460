"""``torch-mix64-v1`` block digests on the KV tensor's own device, so a reader can check KV in GPU memory.

``layouts.digests`` defines the algorithm and gives a numpy reference over host
bytes; this module computes the same digests with integer tensor operations on
whatever device the KV tensors live on (CPU or CUDA), so GPU memory is
verified without copying its bytes to the host: only 8 bytes per block (the
word sums) leave the device.

How: a layer's blocks are one strided view of its storage, ``[num_blocks,
words]`` int64 (block ``b`` at ``b * block_stride`` bytes), so the blocks of a
request are hashed by a few kernels per layer (a gather of the rows, then the
word mix and a row sum over all of them at once), not a loop per block. The
work is tiled by rows and word columns to bound the scratch memory (two
tensors of at most :data:`CPU_CHUNK_WORDS` / :data:`DEVICE_CHUNK_WORDS`
words): the partial sums of the tiles add up to the same ``S`` because the sum
is mod 2^64 (associative, commutative). int64 arithmetic wraps mod 2^64 on
every torch device, and a logical right shift is an arithmetic one masked to
the low ``64 - s`` bits. A span whose start or stride is not a multiple of 8
bytes, or whose length is not, goes through a small zero-padded copy (on the
device) of just what does not fit the int64 view: the tail word.

Two engines compute the word sums ``S`` (the hot part): the torch ops above,
and a fused Triton kernel (``layouts.triton_digests``: one pass over the KV in
place, the mix in registers), bit-identical by construction and by test. The
finaliser and the combination of layer digests into a block digest are this
module's, shared by both. ``engine="auto"`` (the default) takes the Triton
kernel for CUDA tensors when triton imports, the torch ops otherwise (CPU
tensors always); ``"torch"`` or ``"triton"`` force one. The digester says which
ran: :attr:`TorchBlockDigester.engine` and ``engine_note``.

Reads the memory in place on the current stream of the calling thread; a
digest taken while another stream still writes the block is a digest of
whatever was there. ``.tolist()`` of the sums synchronises with that stream.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.layouts.digests import (
    TORCH_ALGORITHM,
    SliceLayer,
    checked_slice,
    mix64_combine,
    mix64_keys,
)
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.triton_digests import TritonSums, interpreter_active, unavailable

logger = logging.getLogger(__name__)

#: scratch words per tile on a CPU: two ~256 KiB tensors that stay in a core's cache, and
#: just under torch's intra-op grain size (32768 elements), so each op of a tile runs on
#: one thread; measured on this 2-core host: 1.1-1.4 GB/s, against 0.1-1.0 GB/s for tiles
#: of exactly 32768 words, where every op of a tile is split across threads
CPU_CHUNK_WORDS = (1 << 15) - 1
#: scratch words per tile on an accelerator (two 128 MiB tensors: a few launches per
#: layer, and never a temporary the size of the KV cache)
DEVICE_CHUNK_WORDS = 1 << 24
#: a slice layer with at most this many word-aligned ranges is summed as column views of
#: the layer's words (no gather index); more ranges (NHD rows) are gathered at once
_VIEW_RANGES = 16
_LOW32 = (1 << 32) - 1
_LOW35 = (1 << 35) - 1
#: what ``engine=`` accepts: the Triton kernel where it runs on CUDA tensors, or either
ENGINES = ("auto", "torch", "triton")


def _signed(values: np.ndarray) -> np.ndarray:
    return values.view(np.int64)


def _unsigned(value: int) -> int:
    return value & ((1 << 64) - 1)


@dataclass(frozen=True)
class TensorSpan:
    """Where block ``b`` of one layer sits in ``tensor``'s storage: ``block_stride``
    bytes apart from the tensor's first byte, ``block_bytes`` each (any dtype)."""

    tensor: torch.Tensor
    block_stride: int
    block_bytes: int
    num_blocks: int


class _Layer:
    """One layer's blocks as tensor views of its storage (no copy)."""

    def __init__(self, span: TensorSpan, where: str) -> None:
        tensor = span.tensor
        storage = tensor.untyped_storage()
        offset = int(tensor.storage_offset()) * int(tensor.element_size())
        if span.block_bytes < 0 or span.num_blocks < 0 or \
                (span.num_blocks > 1 and span.block_stride < span.block_bytes):
            raise LayoutError(where, f"blocks of {span.block_bytes} bytes every "
                                     f"{span.block_stride} bytes overlap")
        end = offset + ((span.num_blocks - 1) * span.block_stride + span.block_bytes
                        if span.num_blocks else 0)
        if end > storage.nbytes():
            raise LayoutError(where, f"{span.num_blocks} blocks end at byte {end}, past "
                                     f"the {storage.nbytes()} bytes of the tensor's storage")
        self.device = tensor.device
        self.num_blocks = span.num_blocks
        self.block_bytes = span.block_bytes
        self.block_stride = span.block_stride
        self.full_words = span.block_bytes // 8
        self.tail_bytes = span.block_bytes % 8
        rows = span.num_blocks
        self.raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            storage, offset, (rows, span.block_bytes), (span.block_stride, 1))
        aligned = (storage.data_ptr() + offset) % 8 == 0 and span.block_stride % 8 == 0
        #: the whole words of every block, int64 (None: not 8-byte aligned, copied)
        self.words: torch.Tensor | None = torch.empty(0, dtype=torch.int64,
                                                      device=self.device).set_(
            storage, offset // 8, (rows, self.full_words), (span.block_stride // 8, 1)) \
            if aligned else None


class TorchBlockDigester:
    """``torch-mix64-v1`` digests of one rank's blocks, on its KV tensors' device.

    ``layers`` maps layer id to its span; ``regions`` lists each region's layer
    ids (in layer order). The same results as :func:`layouts.digests.mix64_digest`
    of each span (layer digests) and :func:`~layouts.digests.mix64_combine` of
    them (block digests), the interface of ``layouts.digests.BlockDigester``.

    ``engine``: which computes the word sums, ``"auto"`` (the Triton kernel for CUDA
    tensors when triton imports and is not under its interpreter, else the torch ops),
    ``"torch"`` or ``"triton"`` (a :class:`LayoutError` naming ``engine`` where it cannot
    run; on CPU tensors only under Triton's interpreter, for tests). The choice is
    :attr:`engine`, and why, :attr:`engine_note`. Under ``"auto"``, a Triton kernel that
    fails on its first use (a triton this code does not compile with) is logged and
    the torch ops take over for good; a forced ``"triton"`` raises instead.
    """

    algorithm = TORCH_ALGORITHM

    def __init__(self, layers: Mapping[int, TensorSpan], regions: Sequence[Sequence[int]],
                 chunk_words: int | None = None, engine: str = "auto") -> None:
        self.regions = tuple(tuple(ids) for ids in regions)
        self._layers = {layer: _Layer(span, f"layers[{layer}]") for layer, span in layers.items()}
        for index, ids in enumerate(self.regions):
            missing = [layer for layer in ids if layer not in self._layers]
            if missing:
                raise LayoutError(f"regions[{index}]", f"no span for layers {missing}")
        devices = {layer.device for layer in self._layers.values()}
        if len(devices) > 1:
            raise LayoutError("layers", f"KV tensors on several devices {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._chunk = chunk_words or (CPU_CHUNK_WORDS if self.device.type == "cpu"
                                      else DEVICE_CHUNK_WORDS)
        if self._chunk < 1:
            raise LayoutError("chunk_words", f"expected >= 1, got {self._chunk}")
        widest = max((layer.full_words + 1 for layer in self._layers.values()), default=1)
        #: c_0 .. c_{widest-1} as int64 on the device (the tail word's too)
        self._keys = torch.from_numpy(_signed(mix64_keys(0, widest)).copy()).to(self.device)
        self._num_blocks = tuple(min((self._layers[layer].num_blocks for layer in ids),
                                     default=0) for ids in self.regions)
        self._asked = engine
        self._triton, self.engine_note = _engine(engine, self.device)
        #: the triton engine has computed sums once (a later failure is not a fallback)
        self._triton_ran = False

    @property
    def engine(self) -> str:
        """``"triton"`` or ``"torch"``: the engine that computes this digester's sums."""
        return "torch" if self._triton is None else "triton"

    @property
    def kernel_launches(self) -> int:
        """Triton kernel launches so far (0 on the torch engine)."""
        return 0 if self._triton is None else self._triton.launches

    def block_bytes(self, region: int) -> int:
        """Bytes one block of ``region`` spans over all its layers (what one digest reads)."""
        return sum(self._layers[layer].block_bytes for layer in self.regions[region])

    def _check(self, region: int, block_ids: Sequence[int]) -> np.ndarray:
        """``block_ids`` as int64 after checking them against ``region``'s blocks."""
        num_blocks = self._num_blocks[region]
        ids = _id_array(block_ids)
        if ids.size and not (ids.min() >= 0 and ids.max() < num_blocks):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise LayoutError("block_id", f"block {bad} outside [0, {num_blocks}) of region "
                                          f"{region}")
        return ids

    def _sums(self, layer: _Layer, ids: torch.Tensor, run: tuple[int, int] | None
              ) -> torch.Tensor:
        """``S`` of each block ``ids`` of one layer (int64 [len(ids)], on the device)."""
        fused = self._triton_sums(layer, ((0, layer.block_bytes),), ids)
        if fused is not None:
            return fused
        rows = int(ids.numel())
        if layer.words is None:  # not 8-byte aligned: a zero-padded copy of the blocks
            out = torch.zeros(rows, dtype=torch.int64, device=self.device)
            width = layer.full_words + (1 if layer.tail_bytes else 0)
            step = max(1, self._chunk // max(width, 1))
            for r0 in range(0, rows, step):
                padded = torch.zeros((min(step, rows - r0), width * 8), dtype=torch.uint8,
                                     device=self.device)
                padded[:, :layer.block_bytes] = layer.raw.index_select(0, ids[r0:r0 + step])
                out[r0:r0 + step] = self._mix_sum(padded.view(torch.int64), 0)
            return out
        words = layer.full_words
        out = self._word_sums(layer.words, ids, run, ((0, words, 0),))
        if layer.tail_bytes:  # the last, partial word: zero-padded, a few bytes per block
            tail = torch.zeros((rows, 8), dtype=torch.uint8, device=self.device)
            tail[:, :layer.tail_bytes] = layer.raw[:, words * 8:].index_select(0, ids)
            out += self._mix_sum(tail.view(torch.int64), words)
        return out

    def _triton_sums(self, layer: _Layer, ranges: tuple[tuple[int, int], ...],
                     ids: torch.Tensor) -> torch.Tensor | None:
        """``S`` of the concatenated ``ranges`` of each block ``ids`` by the Triton kernel,
        or None: the torch ops compute it (their engine, or auto's fallback when the
        kernel fails the first time it runs)."""
        if self._triton is None:
            return None
        try:
            out = self._triton.sums(layer.words, layer.raw, layer.block_stride, ranges, ids)
        except Exception as exc:
            if self._asked != "auto" or self._triton_ran:
                raise
            logger.warning("torch-mix64-v1 digests on %s: the Triton kernel failed on its "
                           "first use (%s: %s); the torch ops compute them from now on",
                           self.device, type(exc).__name__, exc)
            self._triton = None
            self.engine_note = f"auto: the Triton kernel failed ({type(exc).__name__}: {exc})"
            return None
        self._triton_ran = True
        return out

    def _word_sums(self, words: torch.Tensor, ids: torch.Tensor, run: tuple[int, int] | None,
                   spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """``S`` over column spans of the blocks ``ids`` of a layer's words ``[blocks,
        words]``: each span ``(first word, words, position of its first word)``; tiled by
        rows and columns (views of the storage when ``run`` says the ids are
        consecutive, else gathered rows)."""
        rows = int(ids.numel())
        out = torch.zeros(rows, dtype=torch.int64, device=self.device)
        widest = max((count for _first, count, _pos in spans), default=1)
        cols = min(max(widest, 1), self._chunk)
        step = max(1, self._chunk // cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            for first, count, position in spans:
                for c0 in range(0, count, cols):
                    view = words[:, first + c0:first + min(count, c0 + cols)]
                    tile = view[run[0] + r0:run[0] + r1] if run is not None \
                        else view.index_select(0, ids[r0:r1])
                    out[r0:r1] += self._mix_sum(tile, position + c0)
        return out

    def _mix_sum(self, tile: torch.Tensor, start: int) -> torch.Tensor:
        """Row sums of the mixed words of ``tile`` (int64 [rows, cols], words at
        positions ``start..``): the per-word steps of the definition, wrapping."""
        shifted = torch.bitwise_right_shift(tile, 32)
        shifted.bitwise_and_(_LOW32)  # logical shift: drop the sign copies
        mixed = torch.bitwise_xor(tile, shifted)
        mixed.mul_(self._keys[start:start + tile.shape[1]])
        torch.bitwise_right_shift(mixed, 29, out=shifted)
        shifted.bitwise_and_(_LOW35)
        mixed.bitwise_xor_(shifted)
        return mixed.sum(dim=1, dtype=torch.int64)

    def _layer_sums(self, region: int, block_ids: np.ndarray) -> torch.Tensor:
        """Word sums ``[len(block_ids), layers]`` of the region's layers (on the device)."""
        run = _run_of(block_ids) if self._triton is None else None
        ids = torch.from_numpy(block_ids).to(self.device)
        return _columns([self._sums(self._layers[layer], ids, run)
                         for layer in self.regions[region]])

    def _layer_digests(self, region: int, block_ids: np.ndarray) -> torch.Tensor:
        """Layer digests ``[len(block_ids), layers]`` (int64 bit patterns, on the device)."""
        sums = self._layer_sums(region, block_ids)
        return _finish(sums, [self._layers[layer].block_bytes for layer in self.regions[region]])

    def layer_digests_of(self, region: int, block_ids: Sequence[int]) -> np.ndarray:
        """``(len(block_ids), layers)`` uint64: the layer digests of many blocks at once
        (a few kernels per layer; 8 bytes per block and layer to the host)."""
        ids = self._check(region, block_ids)
        width = len(self.regions[region])
        if not len(ids):
            return np.zeros((0, width), dtype=np.uint64)
        digests = self._layer_digests(region, ids).cpu().numpy()
        return digests.view(np.uint64).reshape(len(block_ids), width)

    def layer_digests(self, region: int, block_id: int) -> tuple[int, ...]:
        """``torch-mix64-v1`` of ``block_id``'s span in each layer of ``region``."""
        ids = self._check(region, (block_id,))
        return tuple(_unsigned(v) for v in self._layer_digests(region, ids)[0].tolist())

    def block_digest(self, region: int, block_id: int) -> int:
        return self.block_digests(region, [block_id])[0]

    def block_digests(self, region: int, block_ids: Sequence[int]) -> list[int]:
        """The block digest of each of ``block_ids``: the layer digests of all of them
        per layer at once, combined on the device, 8 bytes per block to the host."""
        ids = self._check(region, block_ids)
        if not len(ids):
            return []
        return self._combined(self._layer_digests(region, ids))

    def _combined(self, layer_digests: torch.Tensor) -> list[int]:
        """Block digests from layer digests ``[blocks, layers]`` (int64 bit patterns, on
        the device): ``torch-mix64-v1`` of each row's packed digests, 8 bytes per block
        to the host."""
        width = layer_digests.shape[1]
        if width > self._keys.numel():
            keys = torch.from_numpy(_signed(mix64_keys(0, width)).copy()).to(self.device)
        else:
            keys = self._keys
        combined = _mix_rows(layer_digests, keys[:width])
        digests: list[int] = _finish(combined[:, None], [width * 8])[:, 0].cpu().numpy() \
            .view(np.uint64).tolist()
        return digests

    def slice_digests(self, layers: Sequence[SliceLayer], block_ids: Sequence[int]
                      ) -> list[int]:
        """The ``torch-mix64-v1-slices`` digest of each of ``block_ids`` over the byte
        ranges ``layers`` names: per layer (ascending id), ``torch-mix64-v1`` of the
        concatenation of the block's bytes ``[offset, offset + length)`` in the order the
        ranges are given, word positions counted from the first byte of that
        concatenation; the block's slice digest combines them as a block digest
        (:func:`~layouts.digests.mix64_combine`). The twin of
        ``layouts.digests.BlockDigester.slice_digests`` with this algorithm: a layer whose
        single range is its whole block has its layer digest, and whole ranges of every
        layer of a region give the block digest. The ranges' bytes of all the blocks are
        gathered on the device, tile by tile (bounded scratch), never to the host."""
        ids_array = _id_array(block_ids)
        prepared = [(self._layers[layer_id], merged) for layer_id, merged in checked_slice(
            layers, ids_array,
            {k: (v.block_bytes, v.num_blocks) for k, v in self._layers.items()})]
        if not len(ids_array):
            return []
        if not prepared:
            return [mix64_combine(())] * len(ids_array)
        ids = torch.from_numpy(ids_array).to(self.device)
        run = _run_of(ids_array) if self._triton is None else None
        sums = _columns([self._slice_sums(layer, merged, ids, run)
                         for layer, merged in prepared])
        return self._combined(_finish(sums, [sum(n for _o, n in merged)
                                             for _layer, merged in prepared]))

    def _slice_sums(self, layer: _Layer, merged: tuple[tuple[int, int], ...],
                    ids: torch.Tensor, run: tuple[int, int] | None) -> torch.Tensor:
        """``S`` of the concatenated ranges ``merged`` of each block ``ids`` of one layer
        (int64 [len(ids)], on the device). A few word-aligned ranges of an aligned layer
        (HND heads: one per K and V) are summed as column views of its words, like
        whole blocks; many (NHD rows) are gathered as int64 words in one index; any
        other range as bytes, zero-padded to whole words. (The Triton kernel, when it
        is the engine, reads all of them in place.)"""
        fused = self._triton_sums(layer, merged, ids)
        if fused is not None:
            return fused
        rows = int(ids.numel())
        out = torch.zeros(rows, dtype=torch.int64, device=self.device)
        total = sum(n for _o, n in merged)
        if not total:
            return out
        aligned = layer.words is not None and all(o % 8 == 0 and n % 8 == 0 for o, n in merged)
        if aligned and len(merged) <= _VIEW_RANGES:
            assert layer.words is not None
            spans, position = [], 0
            for offset, length in merged:
                spans.append((offset // 8, length // 8, position))
                position += length // 8
            return self._word_sums(layer.words, ids, run, spans)
        unit = 8 if aligned else 1  # gathered as int64 words, or as bytes
        source: torch.Tensor = layer.words if aligned and layer.words is not None else layer.raw
        index = torch.cat([torch.arange(o // unit, (o + n) // unit, dtype=torch.int64)
                           for o, n in merged]).to(self.device)
        width = total // unit
        cols = min(width, self._chunk * (8 // unit))  # bytes: a multiple of 8 or all of them
        step = max(1, self._chunk * (8 // unit) // cols)
        for r0 in range(0, rows, step):
            rows_ids = ids[r0:r0 + step, None]
            for c0 in range(0, width, cols):
                tile = source[rows_ids, index[None, c0:c0 + cols]]
                if unit == 1:  # zero-padded to whole words; c0 is a multiple of 8
                    pad = -tile.shape[1] % 8
                    if pad:
                        tile = torch.nn.functional.pad(tile, (0, pad))
                    tile = tile.contiguous().view(torch.int64)
                out[r0:r0 + step] += self._mix_sum(tile, c0 * unit // 8)
        return out


def _run_of(ids: np.ndarray) -> tuple[int, int] | None:
    """``(first, count)`` when ``ids`` are consecutive (their rows are one view), else None."""
    first = int(ids[0]) if len(ids) else 0
    consecutive = bool((ids == np.arange(first, first + len(ids))).all())
    return (first, len(ids)) if consecutive else None


def _id_array(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as a fresh int64 array (one conversion, not a Python int per id)."""
    try:
        if isinstance(block_ids, np.ndarray):
            return block_ids.astype(np.int64, copy=True).reshape(-1)
        return np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
    except (OverflowError, ValueError, TypeError) as exc:
        raise LayoutError("block_id", f"expected block ids (integers), got {exc}") from exc


def _engine(engine: str, device: torch.device) -> tuple[TritonSums | None, str]:
    """The Triton engine (None: the torch ops) for ``engine`` on ``device``, and why."""
    if engine not in ENGINES:
        raise LayoutError("engine", f"expected one of {list(ENGINES)}, got {engine!r}")
    if engine == "torch":
        return None, "torch: asked for"
    if engine == "auto" and device.type != "cuda":
        return None, f"auto: tensors on {device.type}; the Triton kernel is for CUDA tensors"
    reason = unavailable(device)
    if reason is not None:
        if engine == "triton":
            raise LayoutError("engine", f"the Triton kernel cannot run here: {reason}")
        return None, f"auto: {reason}"
    if engine == "auto" and interpreter_active():
        return None, ("auto: triton was imported under its interpreter (TRITON_INTERPRET=1), "
                      "slower than the torch ops")
    fused = TritonSums(device)
    mode = "interpreted" if fused.interpreted else "compiled"
    return fused, f"{engine}: the Triton kernel, {mode}, on {device}"


def _mix_rows(tile: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:meth:`TorchBlockDigester._mix_sum` of a small tile (the packed layer digests)."""
    shifted = torch.bitwise_right_shift(tile, 32).bitwise_and_(_LOW32)
    mixed = torch.bitwise_xor(tile, shifted).mul_(keys)
    mixed.bitwise_xor_(torch.bitwise_right_shift(mixed, 29).bitwise_and_(_LOW35))
    return mixed.sum(dim=1, dtype=torch.int64)


_GOLDEN_U = 0x9E3779B97F4A7C15
_M1_S = int(np.uint64(0xBF58476D1CE4E5B9).view(np.int64))
_M2_S = int(np.uint64(0x94D049BB133111EB).view(np.int64))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return torch.bitwise_right_shift(x, s).bitwise_and_((1 << (64 - s)) - 1)


def _finish(sums: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """:func:`layouts.digests.mix64_finish` elementwise: ``splitmix64(S + (n + 1) * G)``
    of word sums ``[rows, k]`` and the ``k`` byte lengths (int64 bit patterns, wrapping).
    ``(n + 1) * G`` is computed here on the host, a scalar when the lengths are equal
    (every layer of a region, as a rule): each op on a small tensor is a kernel launch
    on a GPU, what a batch of blocks pays however few bytes they have."""
    terms = [_signed_int((n + 1) * _GOLDEN_U) for n in lengths]
    x = sums + (terms[0] if len(set(terms)) == 1 else
                torch.tensor(terms, dtype=torch.int64, device=sums.device))
    x.bitwise_xor_(_shr(x, 30))
    x.mul_(_M1_S)
    x.bitwise_xor_(_shr(x, 27))
    x.mul_(_M2_S)
    return x.bitwise_xor_(_shr(x, 31))


def _signed_int(value: int) -> int:
    """``value`` mod 2^64 as the int64 of the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _columns(sums: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer sums ``[rows]`` as ``[rows, layers]`` (one layer: a view, no copy)."""
    return sums[0][:, None] if len(sums) == 1 else torch.stack(sums, dim=1)


__all__ = ["CPU_CHUNK_WORDS", "DEVICE_CHUNK_WORDS", "ENGINES", "TensorSpan",
           "TorchBlockDigester"]
