"""The one row shape of ``kvbridge bench``, the sizes each path is measured at, and the
arithmetic every bench shares.

Owns: :func:`row` (every path's result rows, so the table, the JSON file and
the plot treat them alike), ``--pattern`` parsing (:func:`parse_pattern`), the
default and ``--quick`` patterns per path, :func:`memcpy_gbps` (the limit
column of every row), :func:`size_label` and :class:`Skipped` (a path whose
backend is missing); and the figures the bench modules compute alike:
:func:`gbps`, :func:`paired_ratio` (the ratio of two ways timed back to back),
:func:`memcpy_seconds` and :func:`percentiles`. May not touch: any backend or
path (nothing here imports NIXL, Mooncake or the offload store; torch only
inside :func:`memcpy_gbps`), the CLI or the rendering.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

GB = 1e9
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}

#: (num_blocks, block_bytes) per path when --pattern is not given
DEFAULT_PATTERNS: dict[str, tuple[tuple[int, int], ...]] = {
    "nixl": ((64, 2 << 20), (256, 256 << 10), (4096, 16 << 10)),
    "mooncake": ((64, 2 << 20), (256, 256 << 10), (4096, 16 << 10)),
    "offload": ((32, 2 << 20), (128, 256 << 10)),
    "nixl-scale": ((100_000, 16),),  # blocks per layer x bytes of one layer's block
    "auth": ((64, 2 << 20),),  # the NIXL transfer measured with and without a secret
    "digests": ((4096, 16 << 10), (32, 2 << 20)),
}
#: --quick: small enough for a test or a smoke run (seconds, not minutes)
QUICK_PATTERNS: dict[str, tuple[tuple[int, int], ...]] = {
    "nixl": ((16, 64 << 10),),
    "mooncake": ((16, 64 << 10),),
    "offload": ((8, 64 << 10),),
    "nixl-scale": ((2000, 16),),
    "auth": ((16, 64 << 10),),
    "digests": ((64, 16 << 10),),
}


class Skipped(Exception):
    """The path's backend is not available here (reported, not a failure)."""


def parse_size(text: str) -> int:
    """``"2MiB"``, ``"256K"``, ``"16384"`` -> bytes; ValueError when it is not a number with
    one of the units (b, k/KiB, m/MiB, g/GiB)."""
    size = text.strip()
    digits = size.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = size[len(digits):].lower()
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"expected a size such as 2MiB, 256K or 16384, got {text!r}")
    return int(digits) * _UNITS[unit]


def parse_pattern(text: str) -> tuple[int, int]:
    """``"64x2MiB"`` -> ``(64, 2097152)``; ValueError naming the expected form."""
    count, sep, size = text.strip().partition("x")
    try:
        if not sep or not count.isdigit():
            raise ValueError(text)
        num_blocks, block_bytes = int(count), parse_size(size)
    except ValueError:
        raise ValueError(f"--pattern: expected NUMxSIZE such as 64x2MiB or 4096x16384, "
                         f"got {text!r}") from None
    if num_blocks < 1 or block_bytes < 1:
        raise ValueError(f"--pattern: needs >= 1 block of >= 1 byte, got {text!r}")
    return num_blocks, block_bytes


def row(path: str, case: str, op: str, unit: str, kvbridge: float, raw: float, raw_name: str,
        *, num_blocks: int | None = None, block_bytes: int | None = None,
        limit: float | None = None, limit_name: str | None = None,
        verified: bool = True, lower_is_better: bool = False,
        ratio: float | None = None) -> dict[str, Any]:
    """One result row. ``ratio`` overrides kvbridge/raw of the two figures when the path
    measures better itself (e.g. the median of per-round paired ratios)."""
    if ratio is None and lower_is_better:
        ratio = raw / kvbridge if kvbridge > 0 else 0.0
    elif ratio is None:
        ratio = kvbridge / raw if raw > 0 else 0.0
    return {"path": path, "case": case, "op": op, "unit": unit,
            "num_blocks": num_blocks, "block_bytes": block_bytes,
            "total_bytes": num_blocks * block_bytes if num_blocks and block_bytes else None,
            "kvbridge": round(kvbridge, 4), "raw": round(raw, 4), "raw_name": raw_name,
            "ratio": round(ratio, 3),
            "limit": round(limit, 4) if limit is not None else None, "limit_name": limit_name,
            "verified": verified}


def memcpy_gbps(nbytes: int, repeats: int = 9) -> float:
    """GB/s of the best of ``repeats`` contiguous torch copies of ``nbytes``.

    The limit column of every path. Best, not median: it is the physical bound
    the machine reached in this run; medians of sub-millisecond copies on a busy
    2-core machine measure the scheduler, not the memory."""
    import torch

    src = torch.ones(max(1, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in, untimed
    return nbytes / min(memcpy_seconds(src, dst, repeats)) / GB


def size_label(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 bytes); infinite for a zero time (a timer too coarse for the size)."""
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def paired_ratio(raw_s: Sequence[float], ours_s: Sequence[float]) -> float:
    """Median over rounds of our throughput / raw throughput (= raw time / our time).

    Both sides run back to back in a round, so slow drifts of machine load cancel.
    """
    return statistics.median(r / o for r, o in zip(raw_s, ours_s, strict=True) if o > 0)


def memcpy_seconds(src: Any, dst: Any, rounds: int) -> list[float]:
    """Times of ``dst.copy_(src)`` (at least 3): the local limit a bench reports beside it."""
    times = []
    for _ in range(max(3, rounds)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def percentiles(samples: Sequence[float], digits: int | None = None) -> dict[str, float]:
    """``{"median", "p99", "max"}`` of ``samples`` (rounded to ``digits`` when given)."""
    ordered = sorted(samples)
    figures = {"median": statistics.median(ordered),
               "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
               "max": ordered[-1]}
    return figures if digits is None else {k: round(v, digits) for k, v in figures.items()}
