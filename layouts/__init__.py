"""How KV bytes sit across ranks: topology, region specs, plans, hashes, key namespaces.

Pure and synchronous: no sockets, no threads, nothing else of kvbridge.
"""

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.hashing import (
    DEFAULT_SEED,
    HASH_VERSION,
    BlockHash,
    hash_block,
    hash_blocks,
    root_hash,
)
from kvbridge.layouts.presets import PRESETS, load_spec, preset_names
from kvbridge.layouts.spec import (
    DTYPE_BYTES,
    KVCacheSpec,
    MemoryOrder,
    RankRegionShape,
    RegionLayout,
    RegionSpec,
)
from kvbridge.layouts.topology import ParallelTopology

__all__ = [
    "DEFAULT_SEED",
    "DTYPE_BYTES",
    "HASH_VERSION",
    "PRESETS",
    "BlockHash",
    "KVCacheSpec",
    "LayoutError",
    "MemoryOrder",
    "ParallelTopology",
    "RankRegionShape",
    "RegionLayout",
    "RegionSpec",
    "hash_block",
    "hash_blocks",
    "load_spec",
    "preset_names",
    "root_hash",
]
