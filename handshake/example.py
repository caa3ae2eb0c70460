"""FAKE but well-formed handshake metadata, for tests, demos and `kvbridge handshake`.

The addresses describe no real memory and the agent blobs are not NIXL agent
metadata: nothing may ever post a transfer against them. They are laid out
like a real engine's (one tensor per layer per region, non-overlapping, page
aligned) so that every validation of the schema applies to them.
"""

from __future__ import annotations

from kvbridge.handshake.schema import AgentMetadata, RegionMemory, TransferMode
from kvbridge.handshake.server import MetadataStore
from kvbridge.layouts import KVCacheSpec, ParallelTopology

#: Prefix of every fake agent blob, so nobody mistakes one for real NIXL metadata.
FAKE_BLOB_PREFIX = b"kvbridge-example-fake-agent:"
_FAKE_BASE = 0x7F00_0000_0000
_PAGE = 4096


def example_rank(spec: KVCacheSpec, topology: ParallelTopology, engine_id: str,
                 num_blocks: int = 64) -> AgentMetadata:
    """Fake metadata of one rank (``topology`` carries the rank's coordinates)."""
    index = ((topology.pp_rank * topology.pcp_size + topology.pcp_rank) * topology.tp_size
             + topology.tp_rank)
    cursor = _FAKE_BASE + (index << 36)
    regions = []
    for shape in spec.rank_shapes(topology):
        span = shape.block_bytes_per_layer * num_blocks
        addrs = []
        for _ in shape.layer_ids:
            addrs.append(cursor)
            cursor += -(-span // _PAGE) * _PAGE
        regions.append(RegionMemory(shape.region.name, tuple(addrs), shape.block_bytes_per_layer,
                                    num_blocks, shape.region.memory_order,
                                    shape.region.block_size))
    name = f"{engine_id}-pp{topology.pp_rank}-pcp{topology.pcp_rank}-tp{topology.tp_rank}"
    return AgentMetadata(engine_id, name, FAKE_BLOB_PREFIX + name.encode(), topology,
                         tuple(regions), spec)


def example_store(spec: KVCacheSpec, topology: ParallelTopology, engine_id: str,
                  transfer_mode: TransferMode = TransferMode.PULL, num_blocks: int = 64,
                  incarnation: str | None = None) -> MetadataStore:
    """A store with fake metadata published for every rank of ``topology``."""
    store = MetadataStore(engine_id, spec, topology, transfer_mode, incarnation=incarnation)
    for rank in topology.ranks():
        store.publish(example_rank(spec, rank, engine_id, num_blocks))
    return store
