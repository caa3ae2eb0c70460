"""Key namespaces: which store keys hold which part of a block.

A store (Mooncake, the offload tiers) keeps what one rank holds of one region
for one block under ``namespace + chained block hash``. The namespace is
``(model, region, tp_rank, pcp_rank, dcp_rank, pp_rank)`` together with the
parallel sizes those ranks refer to and the layout fingerprint of the spec:
``tp_rank 1`` means different heads under ``tp_size 2`` and ``tp_size 4``, and
a changed dtype or block size must never read old bytes, so both are part of
the key.

Which ranks share a namespace (the bytes are identical, so they are stored once):

* **SPLIT, dcp_size 1**: ranks holding the same KV heads (GQA heads replicated
  when there are more TP ranks than KV heads) share the namespace of the
  smallest such TP rank, which is the designated writer.
* **SPLIT, dcp_size > 1**: no KV-head de-duplication: every TP rank has its own
  namespace (each DCP rank holds different token slots: docs/architecture.md,
  "Vocabulary"). This also
  holds for SPLIT regions that are not token-sharded: a duplicate copy is
  stored per DCP rank, which is wasteful but never wrong.
* **REPLICATE** (MLA latent, Mamba-like state): every TP rank holds the same
  block, stored once under ``tp_rank 0``; when the region is token-sharded and
  ``dcp_size > 1``, once per DCP rank ``d`` under ``tp_rank d`` (DCP ranks
  ``1..n-1`` hold different tokens and are never dropped).
* Every **PCP rank** and every **PP stage** holding layers of the region has
  its own namespaces.

A lookup must check :func:`lookup_namespaces` (every namespace that holds a
part of a block); the block is a hit only if every part hits. Under DCP a
token-sharded region's key covers ``block_size * dcp_size`` tokens
(``RegionSpec.tokens_per_key``), a replicated one keeps ``block_size``.

Encoding (ASCII, ``:``-separated, names percent-quoted so any model name
round-trips)::

    kvb1:<model>:<fingerprint>:<region>:tp<r>-<n>:pcp<r>-<n>:dcp<r>-<n>:pp<r>-<n>

A key's ``str`` form appends ``:<64 hex digits of the block hash>``; its
``bytes`` form appends ``:`` and the 32 raw hash bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.hashing import HASH_BYTES, BlockHash
from kvbridge.layouts.spec import KVCacheSpec, RegionLayout, RegionSpec
from kvbridge.layouts.topology import ParallelTopology

#: Bump when the encoding changes: keys of different versions never match.
NAMESPACE_VERSION = 1
_PREFIX = f"kvb{NAMESPACE_VERSION}"
_DIMS = ("tp", "pcp", "dcp", "pp")
_DIM_RE = re.compile(r"^(tp|pcp|dcp|pp)(\d+)-(\d+)$")
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{1,64}$")


@dataclass(frozen=True, order=True)
class KeyNamespace:
    """Where one rank's part of one region of a block lives in a store."""

    model: str
    fingerprint: str
    region: str
    tp_rank: int
    tp_size: int
    pcp_rank: int
    pcp_size: int
    dcp_rank: int
    dcp_size: int
    pp_rank: int
    pp_size: int

    def __post_init__(self) -> None:
        for name in ("model", "region"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise LayoutError(name, f"expected a non-empty string, got {value!r}")
        if not isinstance(self.fingerprint, str) or not _FINGERPRINT_RE.match(self.fingerprint):
            raise LayoutError("fingerprint", f"expected lowercase hex, got {self.fingerprint!r}")
        for dim in _DIMS:
            rank, size = getattr(self, f"{dim}_rank"), getattr(self, f"{dim}_size")
            for name, value in ((f"{dim}_size", size), (f"{dim}_rank", rank)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise LayoutError(name, f"expected an integer >= 0, got {value!r}")
            if not rank < size:
                raise LayoutError(f"{dim}_rank", f"expected an integer in [0, {size}), "
                                                 f"got {rank}")
        if self.tp_size % self.dcp_size or self.dcp_rank != self.tp_rank % self.dcp_size:
            raise LayoutError("dcp_rank", f"expected tp_rank % dcp_size = "
                                          f"{self.tp_rank % self.dcp_size} with tp_size a "
                                          f"multiple of dcp_size, got dcp_rank {self.dcp_rank}")

    def encode(self) -> str:
        dims = ":".join(f"{d}{getattr(self, d + '_rank')}-{getattr(self, d + '_size')}"
                        for d in _DIMS)
        return (f"{_PREFIX}:{quote(self.model, safe='')}:{self.fingerprint}:"
                f"{quote(self.region, safe='')}:{dims}")

    __str__ = encode

    @classmethod
    def parse(cls, text: str) -> KeyNamespace:
        """Inverse of :meth:`encode`; a LayoutError names the bad part."""
        parts = text.split(":")
        if len(parts) != 8:
            raise LayoutError("namespace", f"expected 8 ':'-separated parts, got {len(parts)} "
                                           f"in {text[:200]!r}")
        if parts[0] != _PREFIX:
            raise LayoutError("namespace.version", f"expected {_PREFIX!r}, got {parts[0]!r}")
        values: dict[str, Any] = {"model": unquote(parts[1]), "fingerprint": parts[2],
                                  "region": unquote(parts[3])}
        for dim, part in zip(_DIMS, parts[4:], strict=True):
            match = _DIM_RE.match(part)
            if match is None or match.group(1) != dim:
                raise LayoutError(f"namespace.{dim}", f"expected {dim}<rank>-<size>, "
                                                      f"got {part!r}")
            values[f"{dim}_rank"] = int(match.group(2))
            values[f"{dim}_size"] = int(match.group(3))
        try:
            return cls(**values)
        except LayoutError as exc:
            raise LayoutError(f"namespace.{exc.field}", exc.reason) from None

    def key(self, block_hash: BlockHash) -> BlockKey:
        return BlockKey(self, block_hash)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.encode(), "model": self.model,
                "fingerprint": self.fingerprint, "region": self.region,
                **{f"{d}_{k}": getattr(self, f"{d}_{k}") for d in _DIMS for k in ("rank", "size")}}


@dataclass(frozen=True, order=True)
class BlockKey:
    """A store key: a namespace plus one chained block hash."""

    namespace: KeyNamespace
    block_hash: BlockHash

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or len(self.block_hash) != HASH_BYTES:
            raise LayoutError("block_hash", f"expected {HASH_BYTES} bytes, got "
                                            f"{self.block_hash!r:.80}")

    def to_str(self) -> str:
        return f"{self.namespace.encode()}:{self.block_hash.hex()}"

    __str__ = to_str

    def to_bytes(self) -> bytes:
        return self.namespace.encode().encode("ascii") + b":" + self.block_hash

    @classmethod
    def from_str(cls, text: str) -> BlockKey:
        namespace, sep, digest = text.rpartition(":")
        if not sep or len(digest) != 2 * HASH_BYTES:
            raise LayoutError("key.block_hash", f"expected {2 * HASH_BYTES} hex digits at the "
                                                f"end of {text[:200]!r}")
        try:
            block_hash = bytes.fromhex(digest)
        except ValueError:
            raise LayoutError("key.block_hash", f"not hex: {digest!r}") from None
        return cls(KeyNamespace.parse(namespace), block_hash)

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockKey:
        if len(data) <= HASH_BYTES + 1 or data[-HASH_BYTES - 1:-HASH_BYTES] != b":":
            raise LayoutError("key", f"expected '<namespace>:' and {HASH_BYTES} hash bytes, "
                                     f"got {len(data)} bytes")
        try:
            namespace = data[:-HASH_BYTES - 1].decode("ascii")
        except UnicodeDecodeError:
            raise LayoutError("key.namespace", "not ASCII") from None
        return cls(KeyNamespace.parse(namespace), data[-HASH_BYTES:])


@dataclass(frozen=True)
class WriteTarget:
    """What one rank stores of one region: its namespace and whether it writes it.

    Ranks sharing a de-duplicated namespace hold identical bytes; only the
    designated writer (``is_writer``) puts them, the others skip the put.
    """

    region: str
    namespace: KeyNamespace
    is_writer: bool
    tokens_per_key: int  # tokens hashed into one block key of this region


def _writer_tp_rank(region: RegionSpec, topology: ParallelTopology) -> int:
    """TP rank whose namespace ``topology``'s rank shares for ``region`` (its writer)."""
    if region.layout is RegionLayout.REPLICATE:
        return topology.dcp_rank if region.token_sharded and topology.dcp_size > 1 else 0
    if topology.dcp_size > 1:
        return topology.tp_rank  # no KV-head de-duplication under DCP
    region.heads_of(topology)  # raises when the heads cannot be sharded
    groups, heads = topology.num_head_groups, region.num_kv_heads
    if heads % groups == 0:
        return topology.tp_rank  # every rank (= head group, no DCP) holds its own heads
    # replicated: group g holds head g*H//G; the first group holding that head is the
    # writer (O(1): a topology of many ranks must not cost ranks**2)
    replicas = groups // heads
    return topology.tp_rank // replicas * replicas


def namespace_for(spec: KVCacheSpec, region: RegionSpec | str,
                  topology: ParallelTopology) -> KeyNamespace:
    """The namespace ``topology``'s rank reads and writes for ``region``.

    Raises a LayoutError naming ``region`` when the rank's pipeline stage holds
    no layer of it.
    """
    spec.validate_topology(topology)
    region_spec = spec.region(region) if isinstance(region, str) else region
    stage = spec.stage_layers(topology.pp_size, topology.pp_rank)
    if not any(layer in stage for layer in region_spec.layer_ids):
        raise LayoutError("region", f"pipeline stage {topology.pp_rank} holds no layer of "
                                    f"region {region_spec.name!r}")
    tp_rank = _writer_tp_rank(region_spec, topology)
    return KeyNamespace(
        model=spec.model, fingerprint=spec.fingerprint(), region=region_spec.name,
        tp_rank=tp_rank, tp_size=topology.tp_size, pcp_rank=topology.pcp_rank,
        pcp_size=topology.pcp_size, dcp_rank=tp_rank % topology.dcp_size,
        dcp_size=topology.dcp_size, pp_rank=topology.pp_rank, pp_size=topology.pp_size,
    )


def write_targets(spec: KVCacheSpec, topology: ParallelTopology) -> tuple[WriteTarget, ...]:
    """One entry per region with layers on ``topology``'s stage, in region order."""
    out = []
    stage = spec.stage_layers(topology.pp_size, topology.pp_rank)
    for region in spec.regions:
        if not any(layer in stage for layer in region.layer_ids):
            continue
        namespace = namespace_for(spec, region, topology)
        out.append(WriteTarget(region.name, namespace, namespace.tp_rank == topology.tp_rank,
                               region.tokens_per_key(topology.dcp_size)))
    return tuple(out)


def lookup_namespaces(spec: KVCacheSpec, topology: ParallelTopology) -> tuple[KeyNamespace, ...]:
    """Every namespace holding a part of a block on an engine of ``topology``'s sizes.

    Ordered by region, then pp, pcp and tp rank; no duplicates. A block is in
    the store only if every one of these holds its key.
    """
    sizes = topology.sizes()
    spec.validate_topology(sizes)
    seen: dict[KeyNamespace, None] = {}
    for region in spec.regions:
        for pp_rank in range(sizes.pp_size):
            stage = spec.stage_layers(sizes.pp_size, pp_rank)
            if not any(layer in stage for layer in region.layer_ids):
                continue
            for pcp_rank in range(sizes.pcp_size):
                for tp_rank in range(sizes.tp_size):
                    rank = sizes.with_rank(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank)
                    seen.setdefault(namespace_for(spec, region, rank), None)
    return tuple(seen)


def block_keys(namespaces: Iterable[KeyNamespace],
               block_hash: BlockHash | Mapping[str, BlockHash]) -> list[BlockKey]:
    """The keys that must all hit for one block.

    ``block_hash`` is one hash, or one per region name when regions hash a
    different number of tokens per key (token-sharded vs replicated under DCP).
    """
    if isinstance(block_hash, bytes):
        return [ns.key(block_hash) for ns in namespaces]
    out = []
    for ns in namespaces:
        if ns.region not in block_hash:
            raise LayoutError("block_hash", f"no hash given for region {ns.region!r}")
        out.append(ns.key(block_hash[ns.region]))
    return out
