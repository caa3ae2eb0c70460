"""How KV bytes sit across ranks: topology, region specs, plans, hashes, key namespaces.

Pure and synchronous: no sockets, no threads, nothing else of kvbridge.
"""

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.hashing import (
    DEFAULT_SEED,
    HASH_VERSION,
    BlockHash,
    ExtraKey,
    block_extra_keys,
    hash_block,
    hash_blocks,
    root_hash,
)
from kvbridge.layouts.namespaces import (
    NAMESPACE_VERSION,
    BlockKey,
    KeyNamespace,
    WriteTarget,
    block_keys,
    lookup_namespaces,
    namespace_for,
    write_targets,
)
from kvbridge.layouts.plan import (
    Descriptor,
    LayerMemory,
    PlanStats,
    RankPlan,
    RankPlanStats,
    TransferDescriptors,
    TransferPlan,
    absolute_descriptors,
    plan_transfer,
    rank_at,
    rank_index,
    rank_memory,
)
from kvbridge.layouts.presets import PRESETS, load_spec, preset_names
from kvbridge.layouts.spec import (
    DTYPE_BYTES,
    Interior,
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
    "Interior",
    "NAMESPACE_VERSION",
    "PRESETS",
    "BlockHash",
    "ExtraKey",
    "BlockKey",
    "Descriptor",
    "KVCacheSpec",
    "KeyNamespace",
    "LayerMemory",
    "LayoutError",
    "MemoryOrder",
    "ParallelTopology",
    "PlanStats",
    "RankPlan",
    "RankPlanStats",
    "RankRegionShape",
    "RegionLayout",
    "RegionSpec",
    "TransferDescriptors",
    "TransferPlan",
    "WriteTarget",
    "absolute_descriptors",
    "block_keys",
    "block_extra_keys",
    "hash_block",
    "hash_blocks",
    "load_spec",
    "lookup_namespaces",
    "namespace_for",
    "plan_transfer",
    "preset_names",
    "rank_at",
    "rank_index",
    "rank_memory",
    "root_hash",
    "write_targets",
]
