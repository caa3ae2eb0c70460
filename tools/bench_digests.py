"""`kvbridge bench digests`: the two block digest algorithms on the same bytes.

``torch-mix64-v1`` (``layouts.torch_digests``: int64 tensor reductions on the
KV tensor's device, the only one GPU memory can have) against ``xxh3-64``
(``layouts.digests``: the C hash over host memory), both through their block
digesters, over the same one-layer tensor of ``num_blocks`` blocks of
``block_bytes``, in an order that is not one run (every other block, then the
rest: what a sampled check asks). Interleaved, best of ``iters``: a busy
machine's scheduler noise only ever slows a run down. ``device``: where the
tensor for the torch digester lives (default CPU; ``cuda`` on a GPU machine,
where the XXH3-64 figure is still of a host copy of the same bytes).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvbridge.layouts.digests import ALGORITHM, TORCH_ALGORITHM, BlockDigester, LayerSpan
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
    best = {ALGORITHM: float("inf"), TORCH_ALGORITHM: float("inf")}
    digesters = ((ALGORITHM, xxh3), (TORCH_ALGORITHM, mix))
    for _name, d in digesters:  # warm-up: allocator, keys, first kernels
        d.block_digests(0, ids[:2])
    for it in range(max(1, iters)):
        for name, d in digesters if it % 2 == 0 else digesters[::-1]:
            started = time.perf_counter()
            d.block_digests(0, ids)
            best[name] = min(best[name], time.perf_counter() - started)
    same = mix.block_digests(0, ids[:4]) == TorchBlockDigester(
        {0: TensorSpan(host, block_bytes, block_bytes, num_blocks)}, [(0,)]
    ).block_digests(0, ids[:4])
    nbytes = num_blocks * block_bytes
    return {"num_blocks": num_blocks, "block_bytes": block_bytes, "device": str(here.device),
            "xxh3_gbps": nbytes / best[ALGORITHM] / 1e9,
            "torch_mix64_gbps": nbytes / best[TORCH_ALGORITHM] / 1e9,
            "torch_threads": torch.get_num_threads(), "same_on_cpu": same}
