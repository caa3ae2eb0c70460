"""Store keys of the Mooncake store connector, and the pure lookup arithmetic (no I/O).

One Mooncake object holds what one rank stores of one **layer** of one block::

    <KeyNamespace.encode()>:L<layer id>:<64 hex digits of the chained block hash>

Why one object per layer, not per block: a block's bytes on a rank are one
contiguous slice *per layer tensor* (``tensor[block_id]``), so a per-layer
object is put and got zero-copy from the registered KV tensor with Mooncake's
plain ``batch_put_from`` / ``batch_get_into`` (one pointer per key). The
layer id is global, so the key is unambiguous across pipeline stages too.

A block is a **hit** only if every key a lookup must check exists: every
namespace of :func:`kvbridge.layouts.lookup_namespaces` for the block's region
(DCP ranks ``1..n-1`` and every pipeline stage included) times every layer of
the region on that namespace's stage. Partial objects (a put that stored some
layers, an eviction of one) are therefore misses, never a partial load.

Next to a block's layer objects each namespace holds one small **digest
record** (``<namespace>:D1:<hash>``, see :mod:`.records`) that readers check
the bytes against. A lookup does not ask for it: a block without a record
(stored by an older version, or its record evicted) is still a hit, and the
reader's policy decides whether it is loaded unverified. Removal deletes it
with the block's layer objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.connectors.mooncake_store.records import digest_key_prefix
from kvbridge.layouts import (
    BlockHash,
    KeyNamespace,
    KVCacheSpec,
    ParallelTopology,
    lookup_namespaces,
)


def layer_key_prefix(namespace: KeyNamespace, layer_id: int) -> str:
    """Everything of a key before the block hash (cached by callers: keys are built hot)."""
    return f"{namespace.encode()}:L{layer_id}:"


def store_key(namespace: KeyNamespace, layer_id: int, block_hash: BlockHash) -> str:
    """The Mooncake key of one rank's part of one layer of one block."""
    return layer_key_prefix(namespace, layer_id) + block_hash.hex()


@dataclass(frozen=True)
class RegionLookup:
    """The key prefixes that must all exist for a block of one region to be a hit.

    ``prefixes`` covers every namespace holding a part of the region (all TP,
    DCP, PCP ranks and PP stages, de-duplicated writers) times the region's
    layers on that namespace's stage.
    """

    region_index: int
    region: str
    tokens_per_key: int
    prefixes: tuple[str, ...]
    #: digest record key prefix of each namespace holding a part of the region
    record_prefixes: tuple[str, ...] = ()

    def keys(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """Keys of ``block_hashes``, block-major (``len(prefixes)`` keys per block)."""
        prefixes = self.prefixes
        return [p + h for h in (b.hex() for b in block_hashes) for p in prefixes]


def region_lookups(spec: KVCacheSpec, topology: ParallelTopology, *,
                   every_layer: bool = True) -> tuple[RegionLookup, ...]:
    """One :class:`RegionLookup` per region of ``spec`` on an engine of ``topology``'s sizes.

    ``every_layer`` False checks only the last layer of each namespace (one key
    per namespace and block instead of one per layer: for deep models a lookup
    of every layer costs ``layers`` times more keys). Every namespace is still
    checked; a block whose other layers are gone then fails at load time and is
    recomputed (a load error, never wrong bytes).
    """
    sizes = topology.sizes()
    namespaces = lookup_namespaces(spec, sizes)
    out = []
    for index, region in enumerate(spec.regions):
        prefixes: list[str] = []
        record_prefixes: list[str] = []
        for ns in namespaces:
            if ns.region != region.name:
                continue
            stage = spec.stage_layers(ns.pp_size, ns.pp_rank)
            layers = [layer for layer in sorted(region.layer_ids) if layer in stage]
            prefixes.extend(layer_key_prefix(ns, layer)
                            for layer in (layers if every_layer else layers[-1:]))
            if layers:
                record_prefixes.append(digest_key_prefix(ns))
        if not prefixes:
            raise AssertionError(f"region {region.name!r} has no namespace to look up")
        out.append(RegionLookup(index, region.name, region.tokens_per_key(sizes.dcp_size),
                                tuple(prefixes), tuple(record_prefixes)))
    return tuple(out)


def leading_hits(exists: Sequence[bool], keys_per_block: int) -> int:
    """How many leading blocks have *all* their keys present (keys block-major)."""
    if keys_per_block <= 0:
        raise ValueError(f"keys_per_block must be > 0, got {keys_per_block}")
    if len(exists) % keys_per_block:
        raise ValueError(f"{len(exists)} existence results are not a multiple of "
                         f"{keys_per_block} keys per block")
    for block in range(len(exists) // keys_per_block):
        if not all(exists[block * keys_per_block:(block + 1) * keys_per_block]):
            return block
    return len(exists) // keys_per_block


def missing_blocks(exists: Sequence[bool], keys_per_block: int) -> list[int]:
    """Indices of blocks with at least one key missing."""
    return [block for block in range(len(exists) // keys_per_block)
            if not all(exists[block * keys_per_block:(block + 1) * keys_per_block])]


def matched_tokens(hit_blocks: Sequence[int], tokens_per_key: Sequence[int]) -> int:
    """Tokens covered by the hits of *every* region, in whole steps of the regions' LCM.

    ``hit_blocks[r]`` counts region ``r``'s leading hit blocks from token 0.
    Regions with different key sizes (token-sharded vs replicated under DCP)
    must all cover the matched prefix, and the engine allocates in units every
    region can split, so the result is floored to ``lcm(tokens_per_key)``.
    """
    if len(hit_blocks) != len(tokens_per_key) or not hit_blocks:
        raise ValueError("hit_blocks and tokens_per_key need one entry per region")
    step = math.lcm(*tokens_per_key)
    covered = min(h * t for h, t in zip(hit_blocks, tokens_per_key, strict=True))
    return covered // step * step
