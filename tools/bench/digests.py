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

``torch-mix64-v1`` has two engines (``TorchBlockDigester(engine=...)``): the
torch ops, measured here always (forced, so that a CUDA run still measures
them), and the fused Triton kernel (``layouts.triton_digests``), measured beside
them on the same blocks when the tensor is on a CUDA device and triton imports:
its block and slice digests end to end, its word sums alone (the kernel, what
the fixed per-call cost of the shared finish and combine does not dilute), and a
device copy of the same bytes (the bound of a pass over them). Elsewhere the
result says why there are no Triton figures.
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
from kvbridge.layouts.triton_digests import TritonSums, interpreter_active, unavailable


def triton_unavailable(device: torch.device) -> str | None:
    """Why this run has no Triton figures (None: it has them)."""
    if device.type != "cuda":
        return f"the Triton rows need a CUDA device (tensors on {device})"
    reason = unavailable(device)
    if reason is None and interpreter_active():
        reason = "triton runs under its interpreter in this process (TRITON_INTERPRET=1)"
    return None if reason is None else f"no Triton rows: {reason}"


def digest_rates(num_blocks: int, block_bytes: int, *, iters: int = 5,
                 device: str = "cpu") -> dict[str, Any]:
    """GB/s of each algorithm's ``block_digests`` over the same blocks (and whether the
    torch digests on ``device`` equal those of a CPU copy, and the Triton kernel's those
    of the torch ops: they must). ``triton``: the Triton engine's note, or why this run
    has no Triton figures."""
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
    spans = {0: TensorSpan(here, block_bytes, block_bytes, num_blocks)}
    mix = TorchBlockDigester(spans, [(0,)], engine="torch")
    quarter = block_bytes // 32 * 8  # the first half of the K heads, then of the V heads
    half_heads = ((0, ((0, quarter), (block_bytes // 2, quarter))),)
    runs: list[tuple[str, Callable[[], Any]]] = [
        (ALGORITHM, lambda: xxh3.block_digests(0, ids)),
        (TORCH_ALGORITHM, lambda: mix.block_digests(0, ids)),
        (SLICE_ALGORITHM, lambda: xxh3.slice_digests(half_heads, ids)),
        (TORCH_SLICE_ALGORITHM, lambda: mix.slice_digests(half_heads, ids))]
    if not quarter:
        runs = runs[:2]
    no_triton = triton_unavailable(here.device)
    fused: TorchBlockDigester | None = None
    if no_triton is None:
        fused = by_kernel = TorchBlockDigester(spans, [(0,)], engine="triton")
        kernel = TritonSums(here.device)
        on_device = torch.tensor(ids, dtype=torch.int64, device=here.device)
        whole = ((0, block_bytes),)
        copy = torch.empty_like(here)

        def sums_only() -> None:
            kernel.sums(here, here.view(torch.uint8), block_bytes, whole, on_device)
            torch.cuda.synchronize(here.device)

        def device_copy() -> None:
            copy.copy_(here)
            torch.cuda.synchronize(here.device)

        runs += [("triton", lambda: by_kernel.block_digests(0, ids)),
                 ("triton sums", sums_only), ("device copy", device_copy)]
        if quarter:
            runs.append(("triton slices", lambda: by_kernel.slice_digests(half_heads, ids)))
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
    same = all(d.block_digests(0, ids[:4]) == on_cpu.block_digests(0, ids[:4]) and
               d.slice_digests(half_heads, ids[:4]) == on_cpu.slice_digests(half_heads, ids[:4])
               for d in (mix, fused) if d is not None)
    if fused is not None:  # the kernel against the torch ops, every block of the batch
        same = same and fused.block_digests(0, ids) == mix.block_digests(0, ids) and \
            fused.slice_digests(half_heads, ids) == mix.slice_digests(half_heads, ids)
    nbytes, sliced = num_blocks * block_bytes, num_blocks * 2 * quarter
    out = {"num_blocks": num_blocks, "block_bytes": block_bytes, "device": str(here.device),
           "xxh3_gbps": nbytes / best[ALGORITHM] / 1e9,
           "torch_mix64_gbps": nbytes / best[TORCH_ALGORITHM] / 1e9,
           "torch_threads": torch.get_num_threads(), "same_on_cpu": same}
    if quarter:  # GB/s of the bytes the slice digests read (half of each block)
        out["xxh3_slices_gbps"] = sliced / best[SLICE_ALGORITHM] / 1e9
        out["torch_mix64_slices_gbps"] = sliced / best[TORCH_SLICE_ALGORITHM] / 1e9
    if fused is None:
        out["triton"] = no_triton
        return out
    out.update({"triton_mix64_gbps": nbytes / best["triton"] / 1e9,
                "triton_sums_gbps": nbytes / best["triton sums"] / 1e9,
                "device_copy_gbps": nbytes / best["device copy"] / 1e9,
                "triton": fused.engine_note, "triton_launches": fused.kernel_launches})
    if quarter:
        out["triton_mix64_slices_gbps"] = sliced / best["triton slices"] / 1e9
    return out
