"""Puts and gets of KV the host cannot read, through a bounded host staging buffer.

The store client's zero-copy calls read and write registered host memory. KV in
GPU memory is not that for every Mooncake wheel that loads here (the CUDA wheel
links ``libcudart.so.12`` and cannot load on a CUDA 13 host or without a
driver), and KV guarded as device KV on a CPU host must not be read by the host
either (:func:`kvbridge.layouts.kv_memory.host_readable`). For such KV the
worker registers :class:`StagedKV`'s buffer with the client instead of the KV
tensors and moves the bytes in rounds:

* **put**: gather the round's blocks on the KV's device into the staging
  buffer (on a GPU one ``index_select`` and one copy across per run of keys of
  one layer), wait (bounded) for the copy stream, then ``batch_put_from`` out of
  the buffer;
* **get**: ``batch_get_into`` the buffer, then copy across and scatter the keys
  that arrived in full into their blocks (on a GPU one copy across per run of
  adjacent keys and one ``index_copy_`` per run of keys of one layer), and wait
  (bounded) for the copy stream.

On the host the gather and the scatter are row copies straight between the KV
and the buffer: torch's host ``index_select`` / ``index_copy_`` go element by
element, row copies are memcpy.

A round holds at most half of ``staging_bytes`` (puts and gets have a half each,
so the save path and the load thread never share bytes); a batch larger than
that takes several rounds. On a CUDA device the buffer is pinned and the copies
run ``non_blocking`` on the device's copy stream, ordered after the compute
stream (:mod:`kvbridge.backends.device.copy`); on the host the same steps run
synchronously. Only torch ops touch the KV.

The calls mirror the client's ``start_batch_put_from`` / ``start_batch_get_into``
on the KV's own addresses (what :func:`.plans.gather` makes), so the worker's
batching, timeouts and verification stay as they are; the calls finish before
they return (:class:`StagedBatch`). After a round timed out, the abandoned call
may still read or write the buffer: it is not reused until the client is idle
(``abandon_grace_s`` at most; meanwhile keys fail ``STAGING_BUSY`` uncalled).

Owns: the staging buffers, the mapping from KV addresses to tensors, the
rounds and their counters. May not touch: keys, plans, digests, worker stats.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from kvbridge.backends.device.copy import finish, host_buffer, is_cuda, on_copy_stream
from kvbridge.backends.mooncake import KeyResult, KeyStatus, McStatus, MooncakeStoreClient
from kvbridge.connectors.errors import ContractError

#: Default bound of the staging buffer (both halves), bytes
DEFAULT_STAGING_BYTES = 256 << 20

_COPY_TIMEOUT = KeyResult(KeyStatus.ERROR, McStatus.DEVICE_COPY_TIMEOUT)
_BUSY = KeyResult(KeyStatus.ERROR, McStatus.STAGING_BUSY)


class BatchCall(Protocol):
    """A batch call whose per-key results can be collected (:class:`PendingBatch` too)."""

    def results(self) -> list[KeyResult]: ...


class StagedBatch:
    """A staged call: finished when made."""

    def __init__(self, results: list[KeyResult]) -> None:
        self._results = results

    def done(self) -> bool:
        return True

    def results(self) -> list[KeyResult]:
        return self._results


class _Half:
    """One half of the staging buffer: used by one call at a time."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor = host_buffer(nbytes, device)
        self.ptr = int(self.tensor.data_ptr())
        self.nbytes = nbytes
        self.lock = threading.Lock()
        #: an abandoned (timed-out) call may still use it
        self.tainted = False


class StagedKV:
    """Staged puts and gets of ``tensors`` (the rank's KV, contiguous, one device).

    ``client``'s buffer registrations are the caller's: :attr:`buffers` lists
    what to register. Raises :class:`ContractError` when the KV spans devices.
    """

    def __init__(self, client: MooncakeStoreClient, tensors: Iterable[torch.Tensor], *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, timeout_s: float,
                 abandon_grace_s: float) -> None:
        flat = [t.view(-1).view(torch.uint8) for t in tensors]
        devices = {t.device for t in flat}
        if len(devices) != 1:
            raise ContractError("kv_caches.layers", f"staged KV must live on one device, "
                                                    f"got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._async = is_cuda(self.device)
        self._client = client
        self._timeout_s = timeout_s
        self._grace_s = abandon_grace_s
        spans = sorted(((int(t.data_ptr()), t) for t in flat), key=lambda s: s[0])
        self._bases = [base for base, _ in spans]
        self._spans = spans
        half = staging_bytes // 2
        self._put = _Half(half, self.device)
        self._get = _Half(half, self.device)
        self.round_bytes = half
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"kv_staged": 1, "staging_bytes": 2 * half,
                                      "staged_put_bytes": 0, "staged_get_bytes": 0,
                                      "staging_rounds": 0, "staging_copy_timeouts": 0}

    @property
    def buffers(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of the staging memory, to register with the client."""
        return [(self._put.ptr, self._put.nbytes), (self._get.ptr, self._get.nbytes)]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    # ------------------------------------------------------------------ calls

    def start_batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int],
                             sizes: Sequence[int]) -> StagedBatch:
        """Put ``keys`` from the KV bytes at ``ptrs`` (KV addresses), through staging."""
        return StagedBatch(self._rounds(self._put, keys, ptrs, sizes, self._put_round))

    def start_batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                             sizes: Sequence[int]) -> StagedBatch:
        """Get ``keys`` into the KV bytes at ``ptrs`` (KV addresses), through staging."""
        return StagedBatch(self._rounds(self._get, keys, ptrs, sizes, self._get_round))

    def _rounds(self, half: _Half, keys: Sequence[str], ptrs: Sequence[int],
                sizes: Sequence[int],
                run: Callable[[_Half, Sequence[str], list[tuple[torch.Tensor, int, int]]],
                              list[KeyResult]]) -> list[KeyResult]:
        if not len(keys) == len(ptrs) == len(sizes):
            raise ContractError("batch", f"{len(keys)} keys, {len(ptrs)} ptrs, "
                                         f"{len(sizes)} sizes")
        places = [self._locate(ptr, size) for ptr, size in zip(ptrs, sizes, strict=True)]
        results: list[KeyResult] = []
        with half.lock:
            start = 0
            while start < len(keys):
                if half.tainted and not self._client.wait_idle(0):
                    results.extend([_BUSY] * (len(keys) - start))
                    break
                half.tainted = False
                stop, used = start, 0
                while stop < len(keys) and used + places[stop][2] <= half.nbytes:
                    used += places[stop][2]
                    stop += 1
                if stop == start:  # one object larger than the round: refused at setup
                    raise ContractError("staging_bytes", f"an object of {places[start][2]} "
                                                         f"bytes exceeds a staging round of "
                                                         f"{half.nbytes}")
                got = run(half, keys[start:stop], places[start:stop])
                results.extend(got)
                with self._lock:
                    self.stats["staging_rounds"] += 1
                if any(r.code == McStatus.TIMEOUT for r in got):
                    # the abandoned call may still use the buffer: never reuse it before
                    # the client is idle
                    half.tainted = not self._client.wait_idle(self._grace_s)
                start = stop
        return results

    def _locate(self, ptr: int, size: int) -> tuple[torch.Tensor, int, int]:
        """``(flat KV tensor, byte offset, size)`` of the KV bytes ``[ptr, ptr + size)``."""
        index = bisect.bisect_right(self._bases, ptr) - 1
        for base, tensor in (self._spans[i] for i in range(index, -1, -1)):
            if base <= ptr and ptr + size <= base + tensor.numel():
                return tensor, ptr - base, size
        raise ContractError("ptrs", f"0x{ptr:x} (+{size} B) is in no KV tensor of this rank")

    # ------------------------------------------------------------------ rounds

    def _put_round(self, half: _Half, keys: Sequence[str],
                   places: list[tuple[torch.Tensor, int, int]]) -> list[KeyResult]:
        offsets = _offsets(places)
        with on_copy_stream(self.device):
            for first, stop in _runs(places):
                tensor, size = places[first][0], places[first][2]
                staged = half.tensor.narrow(0, offsets[first], size * (stop - first))
                spans = [p[1] for p in places[first:stop]]
                if self._async:  # gather on the device, one copy across
                    rows = gather_spans(tensor, spans, size, self.device)
                    staged.view(stop - first, size).copy_(rows, non_blocking=True)
                else:  # the host gathers fastest by row copies (index_select is elementwise)
                    for n, offset in enumerate(spans):
                        staged.narrow(0, n * size, size).copy_(tensor.narrow(0, offset, size))
        if not finish(self.device, self._timeout_s):
            with self._lock:
                self.stats["staging_copy_timeouts"] += 1
            return [_COPY_TIMEOUT] * len(keys)
        results = self._client.batch_put_from(
            keys, [half.ptr + o for o in offsets], [p[2] for p in places])
        with self._lock:
            self.stats["staged_put_bytes"] += sum(p[2] for p in places)
        return results

    def _get_round(self, half: _Half, keys: Sequence[str],
                   places: list[tuple[torch.Tensor, int, int]]) -> list[KeyResult]:
        offsets = _offsets(places)
        results = self._client.batch_get_into(
            keys, [half.ptr + o for o in offsets], [p[2] for p in places])
        arrived = [i for i, r in enumerate(results) if r.status is KeyStatus.OK]
        if not arrived:
            return results
        moved = 0
        with on_copy_stream(self.device):
            for first, stop in _runs(places, arrived):
                tensor, size = places[arrived[first]][0], places[arrived[first]][2]
                chosen = arrived[first:stop]
                moved += size * len(chosen)
                if not self._async:  # the host scatters fastest by row copies
                    for i in chosen:
                        tensor.narrow(0, places[i][1], size).copy_(
                            half.tensor.narrow(0, offsets[i], size))
                    continue
                rows = torch.empty((len(chosen), size), dtype=torch.uint8, device=self.device)
                row = 0
                for key_first, count in adjacent_runs(chosen, offsets, size):
                    rows[row:row + count].copy_(
                        half.tensor.narrow(0, offsets[key_first], size * count)
                        .view(count, size), non_blocking=True)
                    row += count
                scatter_spans(tensor, [places[i][1] for i in chosen], size, rows, self.device)
        if not finish(self.device, self._timeout_s):
            with self._lock:
                self.stats["staging_copy_timeouts"] += 1
            return [_COPY_TIMEOUT if r.status is KeyStatus.OK else r for r in results]
        with self._lock:
            self.stats["staged_get_bytes"] += moved
        return results


def _offsets(places: Sequence[tuple[torch.Tensor, int, int]]) -> list[int]:
    """Byte offset of each key in the staging round (keys packed in order)."""
    offsets, position = [], 0
    for _, _, size in places:
        offsets.append(position)
        position += size
    return offsets


def _runs(places: Sequence[tuple[torch.Tensor, int, int]],
          chosen: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``[first, stop)`` over ``chosen`` (default: every key) of runs of keys of one
    tensor and size: each run is one gather or scatter (``gather`` orders keys by
    region, then layer, so a layer's keys form one run)."""
    order = list(range(len(places))) if chosen is None else list(chosen)
    runs: list[tuple[int, int]] = []
    first = 0
    for n in range(1, len(order) + 1):
        if n == len(order) or not (places[order[n]][0] is places[order[first]][0]
                                   and places[order[n]][2] == places[order[first]][2]):
            runs.append((first, n))
            first = n
    return runs


def adjacent_runs(chosen: Sequence[int], offsets: Sequence[int],
                 size: int) -> list[tuple[int, int]]:
    """``(first key, count)`` of the runs of ``chosen`` keys adjacent in the staging
    buffer (all of them unless some key of the round did not arrive)."""
    out: list[tuple[int, int]] = []
    for key in chosen:
        if out and offsets[out[-1][0]] + out[-1][1] * size == offsets[key]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((key, 1))
    return out


def _block_index(offsets: Sequence[int], size: int, tensor: torch.Tensor,
                 device: torch.device) -> torch.Tensor | None:
    """The row index of each offset in ``tensor`` seen as ``[-1, size]`` rows, or None
    when the offsets are not whole rows."""
    if tensor.numel() % size or any(o % size for o in offsets):
        return None
    return torch.tensor([o // size for o in offsets], dtype=torch.int64).to(
        device, non_blocking=True)


def gather_spans(tensor: torch.Tensor, offsets: Sequence[int], size: int,
          device: torch.device) -> torch.Tensor:
    """Gather ``[len(offsets), size]`` bytes of ``tensor`` on its device."""
    index = _block_index(offsets, size, tensor, device)
    if index is not None:
        return tensor.view(-1, size).index_select(0, index)
    return torch.stack([tensor.narrow(0, o, size) for o in offsets])


def scatter_spans(tensor: torch.Tensor, offsets: Sequence[int], size: int, rows: torch.Tensor,
             device: torch.device) -> None:
    """Write ``rows`` (``[len(offsets), size]`` on the device) at ``offsets`` of ``tensor``."""
    index = _block_index(offsets, size, tensor, device)
    if index is not None:
        tensor.view(-1, size).index_copy_(0, index, rows)
        return
    for n, o in enumerate(offsets):
        tensor.narrow(0, o, size).copy_(rows[n])
