"""One rank of one engine: its NIXL agent, the memory of each region, and the checks on it.

Owns :class:`RankKey`, :class:`RegionMemory` and :class:`AgentMetadata`,
:func:`check_agent` (memory agrees with what the spec says the rank holds; no
address range wraps past 2**64 or overlaps another, except the hybrid
allocator's exact aliasing), the rank's map form (shared with the engine
document, which carries ranks without their spec), the bounded decoding of a
peer's spec and topology, and the standalone rank record
(:func:`encode_agent` / :func:`decode_agent`).

May not touch: the compatibility header (:mod:`~kvbridge.handshake.header`), the
engine document (:mod:`~kvbridge.handshake.document`), the request/reply
messages, sockets. A peer posts RDMA descriptors into the ranges checked here:
a check relaxed here is memory another process may write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbridge.handshake.codec import (
    MAX_BLOB_BYTES,
    MAX_BLOCK_BYTES,
    MAX_DEVICE_ID,
    MAX_DIGEST_ALGORITHMS,
    MAX_LAYERS,
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_NUM_BLOCKS,
    MAX_RANKS,
    MAX_REGIONS,
    MEM_TYPES,
    PROTOCOL_VERSION,
    U64_MAX,
    _check_int,
    _check_str,
    _join,
    _pack,
    _prefixed,
    _Reader,
    _short,
    _versioned,
)
from kvbridge.handshake.errors import HandshakeError
from kvbridge.layouts import (
    KVCacheSpec,
    LayoutError,
    MemoryOrder,
    ParallelTopology,
)
from kvbridge.layouts.limits import MAX_PARALLEL_SIZE
from kvbridge.layouts.plan import LayerMemory, rank_index

# --------------------------------------------------------------------------- per rank


class RankKey(NamedTuple):
    """Coordinates of one rank inside an engine; orders like ParallelTopology.ranks()."""

    pp_rank: int
    pcp_rank: int
    tp_rank: int

    @classmethod
    def of(cls, topology: ParallelTopology) -> RankKey:
        return cls(topology.pp_rank, topology.pcp_rank, topology.tp_rank)

    def describe(self) -> str:
        return f"pp{self.pp_rank}/pcp{self.pcp_rank}/tp{self.tp_rank}"


@dataclass(frozen=True)
class RegionMemory:
    """Where one region's KV blocks sit on one rank.

    ``base_addrs[i]`` is the address of the tensor of the i-th layer of the region
    held by this rank (``RankRegionShape.layer_ids`` order); block ``b`` of that
    layer spans ``[base + b * block_bytes_per_layer, base + (b+1) * block_bytes_per_layer)``.
    A region with no layer on this pipeline stage has no addresses.
    ``block_stride`` (0: equal to ``block_bytes_per_layer``) is the distance between
    two blocks when pages are padded or interleaved by the engine (vLLM's padded
    MLA pages); block ``b`` then starts at ``base + b * block_stride``.
    """

    name: str
    base_addrs: tuple[int, ...]
    block_bytes_per_layer: int  # bytes of one block of one layer on this rank
    num_blocks: int
    memory_order: MemoryOrder
    block_size: int  # tokens per block on this rank
    block_stride: int = 0

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes_per_layer

    def to_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "base_addrs": list(self.base_addrs),
                               "block_bytes_per_layer": self.block_bytes_per_layer,
                               "num_blocks": self.num_blocks,
                               "memory_order": self.memory_order.value,
                               "block_size": self.block_size}
        if self.stride != self.block_bytes_per_layer:
            out["block_stride"] = self.block_stride
        return out

    @classmethod
    def from_map(cls, obj: object, path: str) -> RegionMemory:
        r = _Reader(obj, path, ("name", "base_addrs", "block_bytes_per_layer", "num_blocks",
                                "memory_order", "block_size"), ("block_stride",))
        addrs = tuple(_check_int(x, r.where(f"base_addrs[{i}]"), 1, U64_MAX)
                      for i, x in enumerate(r.get_list("base_addrs", MAX_LAYERS)))
        return cls(r.get_str("name", 64), addrs, r.get_int("block_bytes_per_layer", 1, MAX_BLOCK_BYTES),
                   r.get_int("num_blocks", 0, MAX_NUM_BLOCKS), r.get_enum("memory_order", MemoryOrder),
                   r.get_int("block_size", 1, 1 << 20),
                   r.opt_int("block_stride", 1, MAX_BLOCK_BYTES) or 0)


@dataclass(frozen=True)
class AgentMetadata:
    """Everything a peer needs to move KV to or from one rank of an engine."""

    engine_id: str
    agent_name: str
    agent_blob: bytes  # opaque NIXL agent metadata (nixl_agent.get_agent_metadata())
    topology: ParallelTopology  # sizes of the engine plus this rank's coordinates
    regions: tuple[RegionMemory, ...]  # in spec region order
    spec: KVCacheSpec
    generation: int = 0  # registration generation; the server stamps it on publish
    # where the rank's KV lives: a peer prepares this rank's descriptors with it
    mem_type: str = "DRAM"  # one of MEM_TYPES
    device_id: int = 0  # CUDA device of VRAM (0 for DRAM)
    #: block digest algorithms this rank computes for a consumer that asks (verified KV;
    #: ``layouts.digests``), preferred first; empty: none (an older kvbridge, verify off)
    digests: tuple[str, ...] = ()

    @classmethod
    def build(cls, engine_id: str, agent_name: str, agent_blob: bytes, spec: KVCacheSpec,
              topology: ParallelTopology, layer_addrs: Mapping[int, int],
              num_blocks: int, block_strides: Sequence[int] = (), mem_type: str = "DRAM",
              device_id: int = 0, digests: Sequence[str] = ()) -> AgentMetadata:
        """Metadata of one rank from its layer tensors' addresses, checked.

        ``layer_addrs`` maps every layer id on this rank's stage to the data
        pointer of that layer's KV tensor (``tensor.data_ptr()``), each tensor
        shaped ``RankRegionShape.tensor_shape(num_blocks)`` and densely packed,
        unless ``block_strides[r]`` gives region ``r``'s real block stride (padded pages);
        ``mem_type``/``device_id`` say where they are (``VRAM`` on a CUDA device).
        """
        regions: list[RegionMemory] = []
        try:
            shapes = spec.rank_shapes(topology)
        except LayoutError as exc:
            raise HandshakeError(exc.field, exc.reason) from None
        for shape in shapes:
            missing = [layer for layer in shape.layer_ids if layer not in layer_addrs]
            if missing:
                raise HandshakeError("layer_addrs", f"no address for layer(s) {missing} of "
                                                    f"region {shape.region.name!r}")
            regions.append(RegionMemory(
                shape.region.name, tuple(int(layer_addrs[layer]) for layer in shape.layer_ids),
                shape.block_bytes_per_layer, num_blocks if shape.layer_ids else 0,
                shape.region.memory_order, shape.region.block_size,
                _stride_field(block_strides, len(regions), shape.block_bytes_per_layer)))
        meta = cls(engine_id, agent_name, agent_blob, topology, tuple(regions), spec,
                   mem_type=mem_type, device_id=device_id, digests=tuple(digests))
        check_agent(meta)
        return meta

    @property
    def rank(self) -> RankKey:
        return RankKey.of(self.topology)

    @property
    def rank_index(self) -> int:
        """Flat rank index as the transfer planner numbers ranks."""
        return rank_index(self.topology)

    def exposed_bytes(self) -> int:
        """Bytes of KV this rank advertises to its peers: every block of every layer it
        holds (what a peer with its agent metadata may READ or WRITE over NIXL)."""
        return sum(len(r.base_addrs) * r.num_blocks * r.stride for r in self.regions)

    def layer_memory(self) -> dict[int, LayerMemory]:
        """Layer id -> where that layer's tensor sits (the planner's LayerMemory)."""
        out: dict[int, LayerMemory] = {}
        shapes = self.spec.rank_shapes(self.topology)
        for memory, shape in zip(self.regions, shapes, strict=True):
            for layer, addr in zip(shape.layer_ids, memory.base_addrs, strict=True):
                out[layer] = LayerMemory(addr, memory.stride, memory.num_blocks)
        return out

    def region(self, name: str) -> RegionMemory:
        for region in self.regions:
            if region.name == name:
                return region
        raise HandshakeError("regions", f"no region {name!r} on rank {self.rank.describe()}")


def _stride_field(strides: Sequence[int], index: int, block_bytes: int) -> int:
    """``RegionMemory.block_stride`` for a given stride: 0 when dense (the default)."""
    stride = int(strides[index]) if index < len(strides) else 0
    return 0 if stride == block_bytes else stride


def _mem_type_or_dram(value: str | None) -> str:
    """Absent: DRAM (documents from before memory types existed); present, it is
    checked as given (an empty string is refused, never read as DRAM)."""
    return "DRAM" if value is None else value


def check_agent(meta: AgentMetadata) -> None:
    """Raise a HandshakeError (field relative to the rank) unless ``meta`` is consistent.

    Checks that the memory described agrees with what ``spec`` says this rank
    holds, and that no address range wraps or overlaps another: a peer will post
    RDMA descriptors into these ranges, so they must be exactly right.
    """
    _check_str(meta.engine_id, "engine_id", MAX_NAME_CHARS)
    _check_str(meta.agent_name, "agent_name", MAX_NAME_CHARS)
    if not isinstance(meta.agent_blob, bytes) or len(meta.agent_blob) > MAX_BLOB_BYTES:
        raise HandshakeError("agent_blob", f"expected at most {MAX_BLOB_BYTES} bytes")
    _check_int(meta.generation, "generation", 0, U64_MAX)
    if meta.mem_type not in MEM_TYPES:
        raise HandshakeError("mem_type", f"expected one of {list(MEM_TYPES)}, got "
                                         f"{_short(meta.mem_type)}")
    _check_int(meta.device_id, "device_id", 0, MAX_DEVICE_ID if meta.mem_type == "VRAM" else 0)
    if len(meta.digests) > MAX_DIGEST_ALGORITHMS:
        raise HandshakeError("digests", f"{len(meta.digests)} algorithms exceed the limit of "
                                        f"{MAX_DIGEST_ALGORITHMS}")
    for i, name in enumerate(meta.digests):
        _check_str(name, f"digests[{i}]", 32, False)
    try:
        meta.spec.validate_topology(meta.topology)
        shapes = meta.spec.rank_shapes(meta.topology)
    except LayoutError as exc:
        raise HandshakeError(exc.field, exc.reason) from None
    if len(meta.regions) != len(shapes):
        raise HandshakeError("regions", f"expected {len(shapes)} regions (one per spec "
                                        f"region), got {len(meta.regions)}")
    ranges: list[tuple[int, int, str, int, int]] = []  # start, end, field, region, stride
    for index, (memory, shape) in enumerate(zip(meta.regions, shapes, strict=True)):
        where = f"regions[{index}]"
        spec_region = shape.region
        if memory.name != spec_region.name:
            raise HandshakeError(f"{where}.name", f"expected {spec_region.name!r} (spec order), "
                                                  f"got {memory.name!r}")
        if memory.block_size != spec_region.block_size:
            raise HandshakeError(f"{where}.block_size", f"spec says {spec_region.block_size}, "
                                                        f"got {memory.block_size}")
        if memory.memory_order is not spec_region.memory_order:
            raise HandshakeError(f"{where}.memory_order",
                                 f"spec says {spec_region.memory_order.value}, "
                                 f"got {memory.memory_order.value}")
        if memory.block_bytes_per_layer != shape.block_bytes_per_layer:
            raise HandshakeError(f"{where}.block_bytes_per_layer",
                                 f"spec and topology give {shape.block_bytes_per_layer} bytes "
                                 f"per block per layer on this rank, got "
                                 f"{memory.block_bytes_per_layer}")
        if len(memory.base_addrs) != len(shape.layer_ids):
            raise HandshakeError(f"{where}.base_addrs",
                                 f"expected one address per layer of the region on this stage "
                                 f"({len(shape.layer_ids)}), got {len(memory.base_addrs)}")
        if shape.layer_ids and memory.num_blocks < 1:
            raise HandshakeError(f"{where}.num_blocks", "expected at least one block")
        if memory.stride < memory.block_bytes_per_layer:
            raise HandshakeError(f"{where}.block_stride",
                                 f"{memory.block_stride} is smaller than a block "
                                 f"({memory.block_bytes_per_layer} bytes): blocks would overlap")
        span = (max(memory.num_blocks - 1, 0) * memory.stride
                + memory.block_bytes_per_layer * (memory.num_blocks > 0))
        for layer_index, addr in enumerate(memory.base_addrs):
            if addr + span > U64_MAX + 1:
                raise HandshakeError(f"{where}.base_addrs[{layer_index}]",
                                     f"range of {span} bytes from {addr:#x} wraps past 2**64")
            ranges.append((addr, addr + span, f"{where}.base_addrs[{layer_index}]", index,
                           memory.stride))
    ranges.sort()
    # The one overlap allowed: a layer of one region aliasing a layer of another at the
    # same address with the same block stride (vLLM's hybrid allocator puts layer i of
    # every KV cache group on the same bytes; a block id belongs to one group at a time).
    widest: tuple[int, int, str, int, int] | None = None
    aliased: set[int] = set()  # regions already seen at widest's address
    for current in ranges:
        if widest is not None and current[0] < widest[1]:
            aliases = (current[0] == widest[0] and current[3] not in aliased
                       and current[4] == widest[4])
            if not aliases:
                raise HandshakeError(current[2], f"tensor overlaps {widest[2]}: each layer of "
                                                 f"each region must be its own tensor, or "
                                                 f"alias a layer of another region exactly")
            aliased.add(current[3])
        if widest is None or current[1] > widest[1]:
            widest = current
            aliased = {current[3]}


def _agent_to_map(meta: AgentMetadata, include_spec: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "engine_id": meta.engine_id, "agent_name": meta.agent_name,
        "agent_blob": meta.agent_blob, "topology": meta.topology.to_dict(),
        "regions": [r.to_map() for r in meta.regions], "generation": meta.generation,
    }
    if meta.mem_type != "DRAM":  # absent = DRAM, so older peers read the same bytes
        out["mem_type"], out["device_id"] = meta.mem_type, meta.device_id
    if meta.digests:  # absent = none, as before digests existed
        out["digests"] = list(meta.digests)
    if include_spec:
        out["spec"] = meta.spec.to_dict()
    return out


def _spec_from(obj: object, path: str) -> KVCacheSpec:
    try:
        return KVCacheSpec.from_dict(obj)
    except LayoutError as exc:
        raise _prefixed(path, exc) from None
    except (TypeError, ValueError) as exc:  # from_dict trusts value types in places
        raise HandshakeError(path, f"invalid spec: {exc}") from None


def _topology_from(obj: object, path: str) -> ParallelTopology:
    """A peer's topology, with every size bounded before anything loops over its ranks."""
    if isinstance(obj, dict):
        for name in ("tp_size", "pp_size", "dcp_size", "pcp_size"):
            value = obj.get(name, 1)
            if not isinstance(value, bool) and isinstance(value, int) \
                    and not 1 <= value <= MAX_PARALLEL_SIZE:
                shown = value if abs(value) < 10**12 else f"an integer of {len(str(value))} digits"
                raise HandshakeError(_join(path, name), f"expected an integer in "
                                                        f"[1, {MAX_PARALLEL_SIZE}], got {shown}")
        world = 1
        for name in ("tp_size", "pp_size", "pcp_size"):
            value = obj.get(name, 1)
            world *= value if isinstance(value, int) and not isinstance(value, bool) else 1
        if world > MAX_RANKS:
            raise HandshakeError(path, f"tp_size * pp_size * pcp_size = {world} ranks exceeds "
                                       f"the limit of {MAX_RANKS}")
    try:
        return ParallelTopology.from_dict(obj, path)
    except LayoutError as exc:
        raise HandshakeError(exc.field, exc.reason) from None
    except TypeError as exc:
        raise HandshakeError(path, f"invalid topology: {exc}") from None


def _agent_from_map(obj: object, path: str, spec: KVCacheSpec | None) -> AgentMetadata:
    keys = ("engine_id", "agent_name", "agent_blob", "topology", "regions", "generation")
    r = _Reader(obj, path, keys + (("spec",) if spec is None else ()),
                optional=("mem_type", "device_id", "digests"))
    if spec is None:
        spec = _spec_from(r.raw("spec"), r.where("spec"))
    regions = tuple(RegionMemory.from_map(item, r.where(f"regions[{i}]"))
                    for i, item in enumerate(r.get_list("regions", MAX_REGIONS, 1)))
    meta = AgentMetadata(
        engine_id=r.get_str("engine_id"), agent_name=r.get_str("agent_name"),
        agent_blob=r.get_bytes("agent_blob", MAX_BLOB_BYTES, allow_empty=True),
        topology=_topology_from(r.raw("topology"), r.where("topology")),
        regions=regions, spec=spec, generation=r.get_int("generation"),
        mem_type=_mem_type_or_dram(r.opt_str("mem_type", 8)),
        device_id=r.opt_int("device_id", 0, MAX_DEVICE_ID) or 0,
        digests=tuple(_check_str(name, r.where(f"digests[{i}]"), 32, False) for i, name in
                      enumerate(r.get_list("digests", MAX_DIGEST_ALGORITHMS, 0)
                                if r.has("digests") else ())))
    try:
        check_agent(meta)
    except HandshakeError as exc:
        raise _prefixed(path, exc) from None
    return meta


def encode_agent(meta: AgentMetadata) -> bytes:
    """One rank's metadata as a standalone record (e.g. worker -> scheduler process)."""
    check_agent(meta)
    return _pack({"v": PROTOCOL_VERSION, **_agent_to_map(meta, include_spec=True)})


def decode_agent(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> AgentMetadata:
    obj = _versioned(data, "message", max_bytes)
    return _agent_from_map({k: v for k, v in obj.items() if k != "v"}, "", None)
