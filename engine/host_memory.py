"""How much memory an engine's KV cache takes, and whether this host can give it.

Owns: the estimate (:func:`kv_cache_bytes`: every rank and region, plus the block
pools' bookkeeping), what the host can give now (``MemAvailable``, capped by the
process's memory cgroup, v1 or v2) and the refusal (:func:`check_host_memory`,
which the engine calls before it allocates anything). Reads ``/proc`` and
``/sys/fs/cgroup`` only; may not allocate, nor touch an engine, pool or tensor.
"""

from __future__ import annotations

import os

from kvbridge.connectors import ConfigError
from kvbridge.engine.config import EngineConfig

#: Bytes of bookkeeping per block and region besides its KV (block pool lists, hashes).
BLOCK_OVERHEAD_BYTES = 256
#: Share of the host's available memory one engine's KV cache may take.
HOST_MEMORY_FRACTION = 0.8


def kv_cache_bytes(config: EngineConfig) -> int:
    """Bytes an engine of ``config`` allocates for its KV cache, every rank and region,
    plus its block pools' bookkeeping (the reference engine keeps every rank in memory)."""
    per_block = 0
    for rank in config.topology.sizes().ranks():
        per_block += sum(shape.block_bytes for shape in config.spec.rank_shapes(rank))
    return config.num_blocks * (per_block + BLOCK_OVERHEAD_BYTES * len(config.spec.regions))


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
    allocates until the machine runs out."""
    need = kv_cache_bytes(config)
    have = int(available_memory_bytes() * HOST_MEMORY_FRACTION)
    if need > have:
        raise ConfigError("num_blocks", f"{config.num_blocks} blocks of this model on "
                                        f"{config.topology.sizes().describe()} need "
                                        f"{need / 2**30:.1f} GiB of KV memory; this host can "
                                        f"give {have / 2**30:.1f} GiB "
                                        f"({HOST_MEMORY_FRACTION:.0%} of what is available): "
                                        f"use fewer blocks, ranks or a smaller model")
