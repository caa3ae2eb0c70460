"""Benchmark of the offloading connector's batched copies against a plain pinned copy.

:func:`run_copy_bench` moves ``num_blocks`` blocks of ``layers`` layers between
KV on ``device`` and CPU slots with the connector's own :class:`.copier.SlotCopier`
(gather on the source device, one copy across per run of slots, scatter on the
destination, on the device's copy stream, synchronised), both ways, and in the
same run the same bytes as one contiguous torch copy between a device tensor and
a pinned host tensor (``copy_(non_blocking=True)`` then a synchronise): the
physical limit of the link. The KV's block ids are shuffled (blocks of a request
are scattered in the engine's pool) and the slots consecutive (fresh slots are);
the slot memory is a :class:`~kvbridge.offload.cpu.SlotMemory`, pinned on a CUDA
device as the worker pins it. ``ratio`` = connector GB/s / plain GB/s (1.0: the
batching costs nothing). Every round's bytes are checked once after the timed
rounds (slots against the KV, KV against the slots).

``device="cpu"`` runs the same code on host memory (nothing pinned, no stream):
what the CPU suite checks; ``device="cuda"`` is for a GPU host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbridge.backends.device.copy import host_buffer, is_cuda
from kvbridge.connectors.offloading.copier import SlotCopier
from kvbridge.offload.cpu import SlotMemory

#: Bound of the bytes one run moves each way (KV + slots + plain buffers are 4x this)
MAX_BENCH_BYTES = 4 << 30


def _synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def _best_gbps(nbytes: int, rounds: int, run: Callable[[], object],
               device: torch.device) -> float:
    """Median GB/s of ``rounds`` timed runs of ``run`` (after one untimed warm-up)."""
    run()
    _synchronize(device)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return nbytes / max(statistics.median(times), 1e-9) / 1e9


def run_copy_bench(device: str = "cpu", *, num_blocks: int = 64, block_bytes: int = 2 << 20,
                   layers: int = 4, rounds: int = 5, seed: int = 0) -> dict[str, Any]:
    """One row: the connector's store and load GB/s, the plain pinned copy's GB/s each
    way, and their ratios. ``block_bytes`` is one block's bytes across ``layers``
    (each layer holds ``block_bytes // layers``)."""
    dev = torch.device(device)
    if layers <= 0 or block_bytes % layers:
        raise ValueError(f"block_bytes ({block_bytes}) must split into {layers} layers")
    nbytes = num_blocks * block_bytes
    if not 0 < nbytes <= MAX_BENCH_BYTES:
        raise ValueError(f"{num_blocks} blocks of {block_bytes} bytes: expected 1 byte to "
                         f"{MAX_BENCH_BYTES} bytes each way")
    generator = torch.Generator().manual_seed(seed)
    pool_blocks = 2 * num_blocks
    layer_bytes = block_bytes // layers
    kv = [torch.randint(0, 256, (pool_blocks, layer_bytes), dtype=torch.uint8,
                        generator=generator).to(dev) for _ in range(layers)]
    blocks = torch.randperm(pool_blocks, generator=generator)[:num_blocks].tolist()
    slots = list(range(num_blocks))
    memory = SlotMemory(num_blocks, block_bytes)
    try:
        pinned = memory.pin() if is_cuda(dev) else False
        pool: torch.Tensor = memory.as_tensor()  # type: ignore[assignment]
        copier = SlotCopier(dev)
        store = _best_gbps(nbytes, rounds, lambda: copier.copy(kv, pool, blocks, slots,
                                                               load=False), dev)
        expected = torch.cat([layer[torch.tensor(blocks)].cpu() for layer in kv], dim=1)
        stored_ok = bool(torch.equal(pool, expected))
        target = [torch.zeros_like(layer) for layer in kv]
        load = _best_gbps(nbytes, rounds, lambda: copier.copy(target, pool, blocks, slots,
                                                              load=True), dev)
        index = torch.tensor(blocks, device=dev)
        loaded_ok = all(bool(torch.equal(t.index_select(0, index), k.index_select(0, index)))
                        for t, k in zip(target, kv, strict=True))
        source = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host = host_buffer(nbytes, dev)
        plain_d2h = _best_gbps(nbytes, rounds,
                               lambda: host.copy_(source, non_blocking=is_cuda(dev)), dev)
        plain_h2d = _best_gbps(nbytes, rounds,
                               lambda: source.copy_(host, non_blocking=is_cuda(dev)), dev)
    finally:
        memory.close()
    return {"device": str(dev), "num_blocks": num_blocks, "block_bytes": block_bytes,
            "layers": layers, "rounds": rounds, "slots_pinned": pinned,
            "store_gbps": store, "plain_d2h_gbps": plain_d2h,
            "store_ratio": store / plain_d2h if plain_d2h else 0.0,
            "load_gbps": load, "plain_h2d_gbps": plain_h2d,
            "load_ratio": load / plain_h2d if plain_h2d else 0.0,
            "copy_rounds": copier.rounds, "verified": stored_ok and loaded_ok}


def render(row: dict[str, Any]) -> str:
    """One line per direction: connector GB/s, plain pinned copy GB/s, ratio."""
    return "\n".join(
        f"offload copy {what} on {row['device']} ({row['num_blocks']} x {row['block_bytes']} B, "
        f"{row['layers']} layers, pinned={row['slots_pinned']}): "
        f"{row[f'{what}_gbps']:.2f} GB/s, plain {row[plain]:.2f} GB/s, "
        f"ratio {row[f'{what}_ratio']:.2f}, verified={row['verified']}"
        for what, plain in (("store", "plain_d2h_gbps"), ("load", "plain_h2d_gbps")))


if __name__ == "__main__":  # python -m kvbridge.tools.bench.offload_copy [device]
    import sys

    print(render(run_copy_bench(sys.argv[1] if len(sys.argv) > 1 else "cpu")))
