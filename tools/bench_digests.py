"""`kvbridge bench digests`: the two digest algorithms on the same bytes.

``torch-mix64-v1`` (``layouts.torch_digests``: int64 tensor reductions on the
KV tensor's device, the only one GPU memory can have) against ``xxh3-64``
(``layouts.digests``: the C hash over host memory), both through their block
digesters, over the same one-layer tensor of ``num_blocks`` blocks of
``block_bytes``, in an order that is not one run (every other block, then the
rest: what a sampled check asks), and their head-slice digests of the same
blocks (``*-slices``: the K and V halves of the heads of an HND block that one
TP 2 consumer rank reads of a TP 1 producer's block). Interleaved, best of
``iters``: a busy machine's scheduler noise only ever slows a run down. ``device``: where the
tensor for the torch digester lives (default CPU; ``cuda`` on a GPU machine,
where the XXH3-64 figure is still of a host copy of the same bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    TORCH_ALGORITHM,
    TORCH_SLICE_ALGORITHM,
    BlockDigester,
    LayerSpan,
)
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester


def digest_rates(num_blocks: int, block_bytes: int, *, iters: int = 5,
                 device: str = "cpu") -> dict[str, Any]:
    """GB/s of each algorithm's ``block_digests`` over the same blocks (and whether the
    torch digests on ``device`` equal those of a CPU copy: they must)."""
    if num_blocks < 1 or block_bytes < 8 or block_bytes % 8:
        raise ValueError(f"expected >= 1 blocks of a multiple of 8 bytes, got "
                         f"{num_blocks} x {block_bytes}")
    words = num_blocks * block_bytes // 8
    host = torch.randint(-(1 << 62), 1 << 62, (words,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(block_bytes))
    here = host.to(device)
    ids = list(range(0, num_blocks, 2)) + list(range(1, num_blocks, 2))
    xxh3 = BlockDigester({0: LayerSpan(int(host.data_ptr()), block_bytes, block_bytes,
                                       num_blocks)}, [(0,)], owner=host)
    mix = TorchBlockDigester({0: TensorSpan(here, block_bytes, block_bytes, num_blocks)},
                             [(0,)])
    quarter = block_bytes // 32 * 8  # the first half of the K heads, then of the V heads
    half_heads = ((0, ((0, quarter), (block_bytes // 2, quarter))),)
    runs: list[tuple[str, Callable[[], Any]]] = [
        (ALGORITHM, lambda: xxh3.block_digests(0, ids)),
        (TORCH_ALGORITHM, lambda: mix.block_digests(0, ids)),
        (SLICE_ALGORITHM, lambda: xxh3.slice_digests(half_heads, ids)),
        (TORCH_SLICE_ALGORITHM, lambda: mix.slice_digests(half_heads, ids))]
    if not quarter:
        runs = runs[:2]
    best = {name: float("inf") for name, _run in runs}
    for _name, run in runs:  # warm-up: allocator, keys, first kernels
        run()
    for it in range(max(1, iters)):
        for name, run in runs if it % 2 == 0 else runs[::-1]:
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    on_cpu = TorchBlockDigester({0: TensorSpan(host, block_bytes, block_bytes, num_blocks)},
                                [(0,)])
    same = mix.block_digests(0, ids[:4]) == on_cpu.block_digests(0, ids[:4]) and \
        mix.slice_digests(half_heads, ids[:4]) == on_cpu.slice_digests(half_heads, ids[:4])
    nbytes, sliced = num_blocks * block_bytes, num_blocks * 2 * quarter
    out = {"num_blocks": num_blocks, "block_bytes": block_bytes, "device": str(here.device),
           "xxh3_gbps": nbytes / best[ALGORITHM] / 1e9,
           "torch_mix64_gbps": nbytes / best[TORCH_ALGORITHM] / 1e9,
           "torch_threads": torch.get_num_threads(), "same_on_cpu": same}
    if quarter:  # GB/s of the bytes the slice digests read (half of each block)
        out["xxh3_slices_gbps"] = sliced / best[SLICE_ALGORITHM] / 1e9
        out["torch_mix64_slices_gbps"] = sliced / best[TORCH_SLICE_ALGORITHM] / 1e9
    return out
