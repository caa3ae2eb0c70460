"""How much memory an engine's KV cache takes, and whether this host can give it.

Owns: the estimate (:func:`kv_cache_bytes`: every rank and region, plus the block
pools' bookkeeping), what the host can give now (``MemAvailable``, capped by the
process's memory cgroup, v1 or v2) and the refusal (:func:`check_host_memory`,
which the engine calls before it allocates anything). Reads ``/proc``,
``/sys/fs/cgroup`` and a GPU's free memory only; may not allocate, nor touch an
engine, pool or tensor.
"""

from __future__ import annotations

import os

import torch

from kvbridge.connectors import ConfigError
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.devices import check_device, device_free_bytes, rank_device

#: Bytes of bookkeeping per block and region besides its KV (block pool lists, hashes).
BLOCK_OVERHEAD_BYTES = 256
#: Share of the host's available memory one engine's KV cache may take.
HOST_MEMORY_FRACTION = 0.8


def kv_cache_bytes(config: EngineConfig) -> int:
    """Bytes an engine of ``config`` allocates for its KV cache, every rank and region,
    plus its block pools' bookkeeping (the reference engine keeps every rank in memory)."""
    return sum(kv_bytes_by_device(config).values()) + block_overhead_bytes(config)


def block_overhead_bytes(config: EngineConfig) -> int:
    """The block pools' bookkeeping (host memory, whatever the KV's device)."""
    return config.num_blocks * BLOCK_OVERHEAD_BYTES * len(config.spec.regions)


def kv_bytes_by_device(config: EngineConfig) -> dict[str, int]:
    """KV tensor bytes per device (``cpu``, ``cuda:0``, ...) for ``config``'s ranks."""
    out: dict[str, int] = {}
    for index, rank in enumerate(config.topology.sizes().ranks()):
        where = "cpu" if config.device == "cpu" else str(rank_device(config.device, index))
        nbytes = config.num_blocks * sum(s.block_bytes for s in config.spec.rank_shapes(rank))
        out[where] = out.get(where, 0) + nbytes
    return out


def available_memory_bytes(root: str = "/") -> int:
    """What this host could give a new allocation now: ``MemAvailable`` (Linux), else
    all physical memory; at most what this process's cgroup still allows (its memory
    limit less its usage, cgroup v2 or v1: a container's limit is often far below the
    host's memory). ``root``: where ``proc`` and ``sys`` are looked up (tests)."""
    have: int | None = None
    try:
        with open(os.path.join(root, "proc/meminfo")) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_memory_room(root)
    return have if room is None else min(have, room)


def cgroup_memory_room(root: str = "/") -> int | None:
    """Bytes this process's memory cgroup still allows (limit - usage), None if unlimited
    or unknown. Reads the cgroup of ``/proc/self/cgroup`` under ``/sys/fs/cgroup``."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            entries = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        return None
    base = os.path.join(root, "sys/fs/cgroup")
    for entry in entries:
        if len(entry) != 3:
            continue
        _hierarchy, controllers, path = entry
        if controllers == "":  # v2: one unified hierarchy
            pairs = [(os.path.join(base, path.lstrip("/")), "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            pairs = [(os.path.join(base, "memory", path.lstrip("/")),
                      "memory.limit_in_bytes", "memory.usage_in_bytes")]
        else:
            continue
        for directory, limit_file, usage_file in pairs:
            try:
                with open(os.path.join(directory, limit_file)) as f:
                    limit_text = f.read().strip()
                with open(os.path.join(directory, usage_file)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit_text == "max":
                return None
            try:
                limit = int(limit_text)
            except ValueError:
                continue
            if limit >= 1 << 60:  # v1's "unlimited" (a page-rounded LONG_MAX)
                return None
            return max(0, limit - usage)
    return None


def check_host_memory(config: EngineConfig) -> None:
    """Refuse (``num_blocks`` named) a KV cache this host could not hold, before any of
    it is allocated: too many blocks must be a usage error, not an engine that
    allocates until the machine runs out. KV on a GPU is checked against that GPU's
    free memory (``device`` named first when the host has no such GPU)."""
    check_device(config.device)
    by_device = kv_bytes_by_device(config)
    for where, nbytes in by_device.items():
        if where == "cpu":
            continue
        free = int(device_free_bytes(torch.device(where)) * HOST_MEMORY_FRACTION)
        if nbytes > free:
            raise ConfigError("num_blocks", f"{config.num_blocks} blocks of this model on "
                                            f"{config.topology.sizes().describe()} need "
                                            f"{nbytes / 2**30:.1f} GiB of KV memory on "
                                            f"{where}; it can give {free / 2**30:.1f} GiB "
                                            f"({HOST_MEMORY_FRACTION:.0%} of its free "
                                            f"memory): use fewer blocks, ranks or GPUs")
    need = by_device.get("cpu", 0) + block_overhead_bytes(config)
    have = int(available_memory_bytes() * HOST_MEMORY_FRACTION)
    if need > have:
        raise ConfigError("num_blocks", f"{config.num_blocks} blocks of this model on "
                                        f"{config.topology.sizes().describe()} need "
                                        f"{need / 2**30:.1f} GiB of KV memory; this host can "
                                        f"give {have / 2**30:.1f} GiB "
                                        f"({HOST_MEMORY_FRACTION:.0%} of what is available): "
                                        f"use fewer blocks, ranks or a smaller model")
