"""Batched copies between one rank's KV (any device) and the CPU slots, as a block swap.

A slot row holds one part of one block: the block's bytes of each layer of the
region, layer after layer. A batch of ``n`` (block, slot) pairs moves as:

* **store** (KV -> slots): on the KV's device, gather the ``n`` blocks of every
  layer into one ``[n, slot_bytes]`` tensor (on a GPU one ``index_select`` per
  layer into its columns; on the host row copies, which torch runs as memcpy
  where its ``index_select`` goes element by element), then copy it across into
  the slot rows, one copy per run of consecutive slots (fresh slots mostly come
  in one run);
* **load** (slots -> KV): copy the slot rows across into one ``[n, slot_bytes]``
  tensor on the KV's device (one copy per run of consecutive slots), then
  scatter it into every layer (on a GPU one ``index_copy_`` per layer; on the
  host row copies).

On a CUDA device every step runs on the device's dedicated copy stream,
ordered after the compute stream, ``non_blocking`` from or to the (pinned) slot
memory; :meth:`SlotCopier.copy` returns only once the stream ran the batch,
waiting at most ``timeout_s`` (:mod:`kvbridge.backends.device.copy`). On the
host (plain or guarded KV) the same steps run synchronously: no stream, and
no host-only access to the KV (only torch ops), so the CPU suite exercises this
path with KV that refuses host reads. A batch is cut into rounds of at most
``max_gather_bytes`` so the gathered tensor on the device stays bounded.

Owns: the copy of one batch. May not touch: which blocks or slots (the
worker's metadata), statistics, the slot bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.backends.device.copy import finish, is_cuda, on_copy_stream
from kvbridge.backends.device.fence import FENCE_TIMEOUT_S

#: Bound of the gathered rows a round puts on the KV's device (bytes)
DEFAULT_MAX_GATHER_BYTES = 256 << 20


class CopyTimeout(RuntimeError):
    """The copy stream did not finish a batch within its bound."""


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position in slots, first slot, count)`` of each run of consecutive slot indices."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


class SlotCopier:
    """Batched copies between KV layers on ``device`` and CPU slot rows."""

    def __init__(self, device: torch.device | str, *,
                 max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
                 timeout_s: float = FENCE_TIMEOUT_S) -> None:
        if max_gather_bytes <= 0:
            raise ValueError(f"max_gather_bytes must be positive, got {max_gather_bytes}")
        self.device = torch.device(device)
        self.max_gather_bytes = max_gather_bytes
        self.timeout_s = timeout_s
        self._async = is_cuda(self.device)
        #: rounds copied (one gather + copies across + scatter each)
        self.rounds = 0
        self._host_rows: torch.Tensor | None = None

    def copy(self, layers: Sequence[torch.Tensor], pool: torch.Tensor,
             blocks: Sequence[int], slots: Sequence[int], *, load: bool) -> int:
        """Copy ``blocks`` of ``layers`` (each ``[num_blocks, layer_bytes]`` uint8 on
        the device) to (store) or from (load) ``slots`` of ``pool``
        (``[num_slots, slot_bytes]`` uint8, host); the bytes moved. Raises
        :class:`CopyTimeout` if the device did not finish in time, RuntimeError
        on a bad index or shape."""
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks for {len(slots)} slots")
        slot_bytes = int(pool.shape[1])
        per_round = max(1, self.max_gather_bytes // slot_bytes)
        with on_copy_stream(self.device):
            for start in range(0, len(blocks), per_round):
                round_blocks = blocks[start:start + per_round]
                round_slots = slots[start:start + per_round]
                if load:
                    self._load_round(layers, pool, round_blocks, round_slots)
                else:
                    self._store_round(layers, pool, round_blocks, round_slots)
                self.rounds += 1
        if not finish(self.device, self.timeout_s):
            raise CopyTimeout(f"the copy stream of {self.device} did not finish "
                              f"{len(blocks)} block copies within {self.timeout_s:.1f} s")
        return slot_bytes * len(blocks)

    def _rows(self, count: int, slot_bytes: int) -> torch.Tensor:
        """``[count, slot_bytes]`` on the device for one round's gathered rows. On a GPU
        the caching allocator recycles them; on the host the buffer is kept (grown to
        at most ``max_gather_bytes``): fresh host pages cost as much as the copy."""
        if self._async:
            return torch.empty((count, slot_bytes), dtype=torch.uint8, device=self.device)
        nbytes = count * slot_bytes
        if self._host_rows is None or self._host_rows.numel() < nbytes:
            self._host_rows = torch.empty(nbytes, dtype=torch.uint8)
        return self._host_rows[:nbytes].view(count, slot_bytes)

    def _store_round(self, layers: Sequence[torch.Tensor], pool: torch.Tensor,
                     blocks: Sequence[int], slots: Sequence[int]) -> None:
        rows = self._rows(len(blocks), int(pool.shape[1]))
        gather_rows(layers, blocks, rows, kernels=self._async)
        for position, slot, count in slot_runs(slots):
            pool[slot:slot + count].copy_(rows[position:position + count],
                                          non_blocking=self._async)

    def _load_round(self, layers: Sequence[torch.Tensor], pool: torch.Tensor,
                    blocks: Sequence[int], slots: Sequence[int]) -> None:
        rows = self._rows(len(blocks), int(pool.shape[1]))
        for position, slot, count in slot_runs(slots):
            rows[position:position + count].copy_(pool[slot:slot + count],
                                                  non_blocking=self._async)
        scatter_rows(layers, blocks, rows, kernels=self._async)


def gather_rows(layers: Sequence[torch.Tensor], blocks: Sequence[int], rows: torch.Tensor, *,
                kernels: bool) -> None:
    """``rows[j]`` = block ``blocks[j]`` of every layer, layer after layer (all on one
    device). ``kernels``: per layer one ``index_select`` into its column window (a GPU's
    way; the temporary is one layer's share of the round, so the round's device memory
    stays near ``rows``); else row copies (the host's: its ``index_select`` goes element
    by element)."""
    index = (torch.tensor(blocks, dtype=torch.int64).to(rows.device, non_blocking=True)
             if kernels else None)
    offset = 0
    for layer in layers:
        size = layer.shape[1]
        if index is not None:
            rows.narrow(1, offset, size).copy_(layer.index_select(0, index))
        else:
            for position, block in enumerate(blocks):
                rows[position, offset:offset + size].copy_(layer[block])
        offset += size


def scatter_rows(layers: Sequence[torch.Tensor], blocks: Sequence[int], rows: torch.Tensor, *,
                 kernels: bool) -> None:
    """The inverse of :func:`gather_rows`: block ``blocks[j]`` of every layer = its span
    of ``rows[j]``. ``kernels``: one ``index_copy_`` per layer; else row copies."""
    index = (torch.tensor(blocks, dtype=torch.int64).to(rows.device, non_blocking=True)
             if kernels else None)
    offset = 0
    for layer in layers:
        size = layer.shape[1]
        if index is not None:
            layer.index_copy_(0, index, rows[:, offset:offset + size])
        else:
            for position, block in enumerate(blocks):
                layer[block].copy_(rows[position, offset:offset + size])
        offset += size
