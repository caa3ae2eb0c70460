"""Upper bounds on what a model spec or a topology may claim, checked once where they are built.

Every size a user or a peer gives (a spec file, ``--topology``, a handshake
document, transfer params) becomes a :class:`~kvbridge.layouts.RegionSpec` or a
:class:`~kvbridge.layouts.ParallelTopology`, so bounding them there bounds what
any planner, key lister or allocator downstream iterates over. The bounds are
generous for real models (hundreds of layers, <= 128 KV heads, head_dim <= 576,
tens of ranks) and small enough that planning the largest allowed pair stays
interactive (about a second of CPU); what an engine may *allocate* is bounded
separately, by the host's available memory (``kvbridge.engine.host_memory.check_host_memory``).
"""

from __future__ import annotations

from kvbridge.layouts.errors import LayoutError

#: Each parallel size (tp, pp, dcp, pcp).
MAX_PARALLEL_SIZE = 256
#: Ranks of one engine, ``tp * pp * pcp``.
MAX_WORLD_SIZE = 1024
#: Layers of one model (all regions).
MAX_LAYERS = 1024
#: Tokens per rank block.
MAX_BLOCK_SIZE = 1 << 16
#: Global KV heads of one region.
MAX_KV_HEADS = 4096
#: Elements per head and token.
MAX_HEAD_DIM = 1 << 14
#: ``num_kv_heads * block_size`` of one region: the head-token slices of one block
#: and layer (what an NHD plan lists one by one).
MAX_HEAD_TOKENS = 1 << 20
#: Layer-rank pairs of one engine: each layer times the ``tp * pcp`` ranks of its
#: stage. A transfer plan does one vectorised step per layer and pair of
#: overlapping ranks, so this bounds its time (the largest pair plans in seconds).
MAX_LAYER_RANKS = 1 << 15
#: Contiguous KV slices of one block index over all ranks of one engine (what a
#: transfer plan lists before coalescing; see ``KVCacheSpec.slice_count``): bounds
#: the plan's memory.
MAX_ENGINE_SLICES = 1 << 21
#: Bytes of a spec JSON file.
MAX_SPEC_FILE_BYTES = 1 << 20
#: Regions (KV cache groups) of one spec, as a handshake document or transfer params
#: carry them: one list each, so this bounds what a peer makes anyone loop over.
MAX_REGIONS = 64
#: Blocks per layer a peer's handshake may announce: prepared descriptor lists are
#: indexed with int32 rows (``connectors.pd.routing``), so no cache can hold more.
MAX_NUM_BLOCKS = (1 << 31) - 1
#: Largest block id transfer params may name (the last block of the largest cache):
#: a larger one can index no cache, and is refused before any lookup or int64 packing.
MAX_BLOCK_ID = MAX_NUM_BLOCKS - 1
#: Block ids of one transfer params record, all regions together, checked on the
#: lists' lengths before a single id is read: 2**20 ids are the blocks of 16M tokens
#: of one region at block size 16, past any prompt served today; a longer record is
#: refused in time proportional to its number of regions, not its ids. (The
#: consumer then bounds each list by its own prompt: ``TransferParams.check_request``.)
MAX_PARAMS_BLOCK_IDS = 1 << 20


def check_at_most(field: str, value: int, maximum: int, what: str = "") -> None:
    """Raise a LayoutError naming ``field`` when ``value`` exceeds ``maximum``."""
    if value > maximum:
        shown = str(value) if value < 10**12 else f"an integer of {len(str(value))} digits"
        raise LayoutError(field, f"{shown} exceeds kvbridge's limit of {maximum}"
                                 f"{' ' + what if what else ''}")
