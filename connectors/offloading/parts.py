"""Which store keys hold a block, and which CPU slot pool each one lives in (pure).

A block of region ``r`` is stored as one *part* per key namespace of the
region (``kvbridge.layouts.lookup_namespaces``): what one rank (or a group of
ranks holding identical bytes) keeps of that block across its layers of the
region. A part's bytes are ``RankRegionShape.block_bytes`` of the namespace's
writer rank. A lookup must find every part: the block is a hit only if all of
them hit.

Parts are grouped into *pools* by their byte size: one ``OffloadManager``
(one CPU tier of fixed-size slots, plus its secondary tiers) per distinct part
size. Usually every part of every region has the same size and there is one
pool; PP stages with unequal layer counts, or regions of different shapes,
get one pool each.

Both connector halves compute this table from the spec and the engine's
sizes, so scheduler and workers agree on namespace indices without sending
them anywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvbridge.layouts import (
    BlockHash,
    KeyNamespace,
    KVCacheSpec,
    ParallelTopology,
    lookup_namespaces,
    namespace_for,
)


@dataclass(frozen=True)
class Part:
    """One namespace of one region: ``index`` into ``PartTable.parts``."""

    index: int
    region_index: int
    namespace: KeyNamespace
    block_bytes: int   # bytes of this part of one block (the writer rank's layers)
    pool: int          # index into ``PartTable.pool_bytes``
    prefix: bytes      # ``namespace.encode()`` + b":"; a key is prefix + 32 hash bytes
    #: the writer rank's layers of the region: equal spans of ``block_bytes``, in layer order
    num_layers: int = 1

    def key(self, block_hash: BlockHash) -> bytes:
        """The store key of this part of the block ``block_hash`` (``BlockKey.to_bytes``)."""
        return self.prefix + block_hash


@dataclass(frozen=True)
class PartTable:
    """Every part of every region, and the pools they fall into."""

    parts: tuple[Part, ...]
    #: per region: the parts a lookup must find (in ``lookup_namespaces`` order)
    region_parts: tuple[tuple[Part, ...], ...]
    #: bytes of a slot of each pool
    pool_bytes: tuple[int, ...]

    def pool_layers(self, pool: int) -> int:
        """Layer spans of a slot of ``pool`` (one digest each): the layer count its parts
        share, or 1 (the whole slot) when they differ."""
        counts = {p.num_layers for p in self.parts if p.pool == pool}
        return counts.pop() if len(counts) == 1 else 1

    def pool_region_parts(self, pool: int, region_index: int) -> tuple[Part, ...]:
        return tuple(p for p in self.region_parts[region_index] if p.pool == pool)

    def rank_parts(self, spec: KVCacheSpec, rank: ParallelTopology) -> dict[int, tuple[Part, bool]]:
        """Per region held by ``rank``: ``(its part, whether it writes it)``.

        Ranks sharing a de-duplicated namespace read the same part; only the
        namespace's writer (``namespace.tp_rank == rank.tp_rank``) copies
        blocks into the store.
        """
        out: dict[int, tuple[Part, bool]] = {}
        by_ns = {p.namespace: p for p in self.parts}
        stage = spec.stage_layers(rank.pp_size, rank.pp_rank)
        for r, region in enumerate(spec.regions):
            if not any(layer in stage for layer in region.layer_ids):
                continue
            ns = namespace_for(spec, region, rank)
            out[r] = (by_ns[ns], ns.tp_rank == rank.tp_rank)
        return out


def pool_fingerprint(spec: KVCacheSpec, block_bytes: int) -> str:
    """The fs/obj tier fingerprint of a pool: the layout and the slot size.

    Pools of different sizes may share a store directory; each gets its own
    header (a tier refuses a directory whose header names another size).
    """
    digest = hashlib.blake2b(f"{spec.fingerprint()}:{block_bytes}".encode(), digest_size=8)
    return digest.hexdigest()


def build_part_table(spec: KVCacheSpec, topology: ParallelTopology) -> PartTable:
    """The part table of an engine of ``topology``'s sizes (ranks ignored)."""
    sizes = topology.sizes()
    writer_shape: dict[KeyNamespace, int] = {}
    writer_layers: dict[KeyNamespace, int] = {}
    for rank in sizes.ranks():
        shapes = spec.rank_shapes(rank)
        stage = spec.stage_layers(rank.pp_size, rank.pp_rank)
        for r, region in enumerate(spec.regions):
            if not any(layer in stage for layer in region.layer_ids):
                continue
            ns = namespace_for(spec, region, rank)
            if ns.tp_rank == rank.tp_rank:
                writer_shape[ns] = shapes[r].block_bytes
                writer_layers[ns] = len(shapes[r].layer_ids)
    region_index = {region.name: i for i, region in enumerate(spec.regions)}
    pool_bytes: list[int] = []
    parts: list[Part] = []
    for ns in lookup_namespaces(spec, sizes):
        nbytes = writer_shape[ns]
        if nbytes not in pool_bytes:
            pool_bytes.append(nbytes)
        parts.append(Part(len(parts), region_index[ns.region], ns, nbytes,
                          pool_bytes.index(nbytes), ns.encode().encode("ascii") + b":",
                          writer_layers[ns]))
    region_parts = tuple(tuple(p for p in parts if p.region_index == r)
                         for r in range(len(spec.regions)))
    return PartTable(tuple(parts), region_parts, tuple(pool_bytes))
