"""The engine document: a header, then an opaque body with the engine's identity and ranks.

Owns :class:`EngineMetadata` and its encoding (:func:`encode_engine`), and the
two-step decoding that reads and checks the header first and interprets the
body only when the header matched (:func:`decode_header`,
:func:`decode_engine`): ranks of the body agree with the engine's topology,
engine id and generation, none twice. The same bytes are what
``kvbridge probe --save`` writes to a file and what a ``MetadataReply`` carries.

May not touch: the header's fields or fingerprint
(:mod:`~kvbridge.handshake.header`), what one rank holds or how it is checked
(:mod:`~kvbridge.handshake.agent`), the request/reply envelope
(:mod:`~kvbridge.handshake.messages`), sockets.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kvbridge.handshake.agent import (
    AgentMetadata,
    RankKey,
    _agent_from_map,
    _agent_to_map,
    _spec_from,
    _topology_from,
    check_agent,
)
from kvbridge.handshake.codec import (
    MAX_DOCUMENT_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_RANKS,
    PROTOCOL_VERSION,
    _pack,
    _prefixed,
    _Reader,
    _top,
    _unpack,
)
from kvbridge.handshake.errors import HandshakeError
from kvbridge.handshake.header import (
    CompatHeader,
    TransferMode,
    _header_from_map,
    _header_to_map,
    check_compatible,
)
from kvbridge.layouts import KVCacheSpec, ParallelTopology
from kvbridge.layouts.plan import LayerMemory

# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class EngineMetadata:
    """One engine's metadata as served: header, identity and the selected ranks.

    ``incarnation`` is random per server start, so a restarted engine at the same
    address is told apart; ``generation`` grows every time a rank re-registers.
    ``ranks`` holds the ranks that were asked for, ordered by ``RankKey``.
    """

    header: CompatHeader
    engine_id: str
    incarnation: str
    generation: int
    spec: KVCacheSpec
    topology: ParallelTopology  # sizes; rank coordinates are 0
    ranks: tuple[AgentMetadata, ...] = field(default=())

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint

    @property
    def transfer_mode(self) -> TransferMode:
        return self.header.transfer_mode

    def rank(self, pp_rank: int = 0, tp_rank: int = 0, pcp_rank: int = 0) -> AgentMetadata:
        key = RankKey(pp_rank, pcp_rank, tp_rank)
        for meta in self.ranks:
            if meta.rank == key:
                return meta
        raise HandshakeError("ranks", f"rank {key.describe()} not in this metadata "
                                      f"(have {[m.rank.describe() for m in self.ranks]})")

    def memory_by_rank(self) -> dict[int, dict[int, LayerMemory]]:
        """Planner rank index -> layer id -> LayerMemory, for ``absolute_descriptors``."""
        return {meta.rank_index: meta.layer_memory() for meta in self.ranks}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary (what ``kvbridge probe --json`` prints; blobs as size+digest)."""
        return {
            "engine_id": self.engine_id, "incarnation": self.incarnation,
            "generation": self.generation, "protocol_version": self.header.protocol_version,
            "fingerprint": self.fingerprint, "model": self.spec.model,
            "transfer_mode": self.transfer_mode.value, "topology": self.topology.describe(),
            "spec": self.spec.to_dict(),
            "missing_ranks": [k.describe() for k in self.missing_ranks()],
            "ranks": [{
                "rank": m.rank.describe(), "topology": m.topology.to_dict(),
                "agent_name": m.agent_name, "generation": m.generation,
                "agent_blob_bytes": len(m.agent_blob),
                "agent_blob_sha256": hashlib.sha256(m.agent_blob).hexdigest()[:16],
                "mem_type": m.mem_type, "device_id": m.device_id,
                "digests": list(m.digests),
                "exposed_bytes": m.exposed_bytes(),
                "regions": [{**r.to_map(), "base_addrs": [hex(a) for a in r.base_addrs]}
                            for r in m.regions],
            } for m in self.ranks],
        }

    def missing_ranks(self, limit: int | None = None) -> list[RankKey]:
        """Ranks of the topology that this document does not hold (the first ``limit``).

        Costs nothing for a complete document; otherwise at most one pass over the
        topology's ranks, which the decoder bounds by MAX_RANKS.
        """
        have = {m.rank for m in self.ranks}
        if len(have) >= self.topology.world_size:
            return []
        out: list[RankKey] = []
        for t in self.topology.ranks():
            key = RankKey.of(t)
            if key not in have:
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
        return out


def _body_to_map(meta: EngineMetadata) -> dict[str, Any]:
    return {"engine_id": meta.engine_id, "incarnation": meta.incarnation,
            "generation": meta.generation, "spec": meta.spec.to_dict(),
            "topology": meta.topology.to_dict(),
            "ranks": [_agent_to_map(m, include_spec=False) for m in meta.ranks]}


def encode_engine(meta: EngineMetadata) -> bytes:
    """The engine document: ``{"v", "header", "body": <msgpack bytes>}``."""
    if meta.header != CompatHeader.from_spec(meta.spec, meta.header.transfer_mode):
        raise HandshakeError("header", "does not describe the spec it is sent with")
    for index, rank in enumerate(meta.ranks):
        try:
            check_agent(rank)
        except HandshakeError as exc:
            raise _prefixed(f"ranks[{index}]", exc) from None
    body = _pack(_body_to_map(meta))
    data = _pack({"v": PROTOCOL_VERSION, "header": _header_to_map(meta.header), "body": body})
    if len(data) > MAX_DOCUMENT_BYTES:
        raise HandshakeError("ranks", f"engine document of {len(data)} bytes exceeds "
                                      f"{MAX_DOCUMENT_BYTES}; ask for fewer ranks at a time")
    return data


def decode_header(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> CompatHeader:
    """Decode only the header of an engine document (the body stays unread)."""
    r = _top(data, "message", max_bytes, ("header", "body"))
    return _header_from_map(r.raw("header"), "header")


def decode_engine(data: bytes, expected: CompatHeader | None = None,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> EngineMetadata:
    """Decode an engine document; with ``expected``, refuse a peer whose header differs.

    The header is decoded and compared first; the body is parsed only after it
    matched, so an incompatible peer is refused with a HandshakeError naming the
    first differing field (``"fingerprint.regions[attn].dtype"``) before any of its
    per-rank data is interpreted.
    """
    r = _top(data, "message", max_bytes, ("header", "body"))
    header = _header_from_map(r.raw("header"), "header")
    if expected is not None:
        check_compatible(expected, header)
    body_bytes = r.get_bytes("body", max_bytes)
    body = _Reader(_unpack(body_bytes, "body", max_bytes), "body",
                   ("engine_id", "incarnation", "generation", "spec", "topology", "ranks"))
    spec = _spec_from(body.raw("spec"), "body.spec")
    if CompatHeader.from_spec(spec, header.transfer_mode) != header:
        raise HandshakeError("body.spec", "does not match the header it came with")
    topology = _topology_from(body.raw("topology"), "body.topology")
    if topology != topology.sizes():
        raise HandshakeError("body.topology", "engine topology must have every rank set to 0")
    engine_id = body.get_str("engine_id")
    ranks = tuple(_agent_from_map(item, f"body.ranks[{i}]", spec)
                  for i, item in enumerate(body.get_list("ranks", MAX_RANKS)))
    seen: set[RankKey] = set()
    for index, rank in enumerate(ranks):
        where = f"body.ranks[{index}]"
        if rank.topology.sizes() != topology:
            raise HandshakeError(f"{where}.topology", f"sizes {rank.topology.describe()} differ "
                                                      f"from the engine's {topology.describe()}")
        if rank.engine_id != engine_id:
            raise HandshakeError(f"{where}.engine_id", f"{rank.engine_id!r} in an engine "
                                                       f"document of {engine_id!r}")
        if rank.rank in seen:
            raise HandshakeError(f"{where}.topology", f"rank {rank.rank.describe()} twice")
        seen.add(rank.rank)
    generation = body.get_int("generation")
    if any(rank.generation > generation for rank in ranks):
        raise HandshakeError("body.generation", "older than one of its ranks' generations")
    return EngineMetadata(header, engine_id, body.get_str("incarnation", 64), generation, spec,
                          topology, tuple(sorted(ranks, key=lambda m: m.rank)))
