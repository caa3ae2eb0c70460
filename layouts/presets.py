"""Built-in model specs, small enough for tests and demos on a laptop."""

from __future__ import annotations

from pathlib import Path

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.spec import KVCacheSpec, MemoryOrder, RegionLayout, RegionSpec


def _tiny_gqa() -> KVCacheSpec:
    return KVCacheSpec("tiny-gqa", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 1, 2, 3), block_size=16, num_kv_heads=8,
                   head_dim=32, dtype="float16"),
    ))


def _tiny_mla() -> KVCacheSpec:
    return KVCacheSpec("tiny-mla", (
        RegionSpec("mla", RegionLayout.REPLICATE, (0, 1, 2, 3), block_size=16, num_kv_heads=1,
                   head_dim=96, dtype="bfloat16", key_only=True),
    ))


def _tiny_hybrid() -> KVCacheSpec:
    return KVCacheSpec("tiny-hybrid", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 2), block_size=16, num_kv_heads=4,
                   head_dim=32, dtype="float16"),
        RegionSpec("state", RegionLayout.REPLICATE, (1, 3), block_size=16, num_kv_heads=2,
                   head_dim=64, dtype="float32", key_only=True, token_sharded=False),
    ))


def _tiny_gqa_nhd() -> KVCacheSpec:
    return KVCacheSpec("tiny-gqa-nhd", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 1, 2, 3), block_size=16, num_kv_heads=8,
                   head_dim=32, dtype="float16", memory_order=MemoryOrder.NHD),
    ))


def _bench_gqa() -> KVCacheSpec:
    # One block of one rank = 2 MiB at TP 1 (2 x 32 heads x 64 tokens x 128 x fp16 x 2 layers).
    return KVCacheSpec("bench-gqa", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 1), block_size=64, num_kv_heads=32,
                   head_dim=128, dtype="float16"),
    ))


PRESETS = {
    "tiny-gqa": _tiny_gqa,
    "tiny-mla": _tiny_mla,
    "tiny-hybrid": _tiny_hybrid,
    "tiny-gqa-nhd": _tiny_gqa_nhd,
    "bench-gqa": _bench_gqa,
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_spec(name_or_path: str) -> KVCacheSpec:
    """A built-in preset by name, or a spec from a JSON file path."""
    factory = PRESETS.get(name_or_path)
    if factory is not None:
        return factory()
    if name_or_path.endswith(".json") or Path(name_or_path).exists():
        return KVCacheSpec.from_json_file(name_or_path)
    raise LayoutError("model", f"unknown preset {name_or_path!r} and no such file; presets: "
                               f"{', '.join(preset_names())}")
