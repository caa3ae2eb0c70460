"""Peer sessions: one handshaken remote engine as seen from one local rank.

A consumer rank opens a :class:`PeerSession` per producer engine address: the
handshake (bounded, retried, refusing an incompatible fingerprint, e.g. push
against pull), the transfer plan for this rank, transport peers for every producer
rank it reads from or notifies, a ``hello`` to each (our own agent metadata, so
they can answer and, in push mode, write to us), and the remote descriptor
lists prepared right away, so the first request posts indices only.

A session is built off the engine thread (:func:`open_session` runs on one of
the worker's handshake threads, bounded by the worker's handshake deadline) and
is immutable once READY; nothing proportional to a peer's advertised block count
is built before the transport accepted that its registration covers those blocks
(:func:`check_remote_coverage`); a failure
anywhere drops it as a whole (:meth:`PeerSession.close`) and the next request
to that address handshakes again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.backends.transfer import DescList, PeerHandle, TransportError
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.routing import (
    DescTable,
    consumer_table,
    expected_notifs,
    notify_targets,
    producer_table,
)
from kvbridge.connectors.pd.transport import PdTransport
from kvbridge.connectors.pd.verify import SliceCheck
from kvbridge.handshake import (
    CompatHeader,
    EngineMetadata,
    FetchResult,
    HandshakeError,
    format_address,
)
from kvbridge.layouts import KVCacheSpec, LayerMemory, ParallelTopology, RankPlan, plan_transfer
from kvbridge.layouts.plan import rank_index

logger = logging.getLogger(__name__)

SessionKey = tuple[str, str, int]  # (producer engine id, host, port)

_LOCAL_CACHE_LOCK = threading.Lock()


@dataclass
class LocalLists:
    """This rank's prepared list for one plan (one per distinct remote topology)."""

    table: DescTable
    dlist: DescList


@dataclass
class PeerSession:
    key: SessionKey
    metadata: EngineMetadata
    rank_plan: RankPlan
    targets: tuple[int, ...]  # producer ranks this rank notifies
    expected: dict[int, int]  # producer rank -> how many consumer ranks notify it
    peers: dict[int, PeerHandle]  # producer rank -> transport peer
    remote_tables: dict[int, DescTable] = field(default_factory=dict)
    remote_lists: dict[int, DescList] = field(default_factory=dict)
    local: LocalLists | None = None
    opened_at: float = 0.0
    validated_at: float = 0.0
    active: int = 0  # requests currently using it
    #: producer rank -> regions whose blocks are checked against its digests, or why none
    #: (worked out once per session: see ``connectors.pd.verify``)
    digest_regions: dict[int, tuple[frozenset[int], str]] = field(default_factory=dict)
    #: the regions checked with slice digests (head slices at another TP), worked out once
    slice_check: SliceCheck | None = None
    #: producer rank -> the digest algorithm this rank asks it for (None: none in common)
    digest_algorithms: dict[int, str | None] = field(default_factory=dict)

    @property
    def sources(self) -> tuple[int, ...]:
        return self.rank_plan.sources

    @property
    def address(self) -> str:
        return format_address(self.key[1], self.key[2])

    def close(self, transport: PdTransport) -> None:
        """Drop the transport peers (failing their pending transfers) and their lists."""
        for peer in self.peers.values():
            transport.remove_peer(peer)  # releases the peer's remote lists too
        self.peers.clear()
        self.remote_lists.clear()


def check_remote_coverage(transport: PdTransport, peer: PeerHandle,
                          memory: Mapping[int, LayerMemory], layers: Iterable[int],
                          who: str, mem_type: str = "DRAM", device_id: int = 0) -> None:
    """Refuse a peer whose transport registration does not cover the blocks it advertises.

    A peer's handshake says how many blocks each layer tensor holds; the rows of a
    prepared list are one per descriptor *per block*, so they are built only after
    The transport accepted one descriptor per layer spanning every advertised block (what
    the peer's registration, carried in its agent blob, really covers). Costs one
    row per layer: nothing here grows with a claimed ``num_blocks``. ``mem_type`` and
    ``device_id`` are the peer's (its handshake document's), as for its real lists.
    """
    chosen = sorted({int(layer) for layer in layers})
    missing = [layer for layer in chosen if layer not in memory]
    if missing:
        raise HandshakeError("regions", f"{who} advertises no memory for layer(s) "
                                        f"{missing[:8]}")
    if not chosen:
        return
    spans = np.array([(memory[layer].base_addr,
                       memory[layer].num_blocks * memory[layer].block_stride, device_id)
                      for layer in chosen], dtype=np.uint64)
    try:
        dlist = transport.prepare_remote(peer, spans, mem_type)
    except TransportError as exc:
        first = memory[chosen[0]]
        raise HandshakeError(
            "regions.num_blocks",
            f"{who} advertises {first.num_blocks} blocks of {first.block_stride} bytes per "
            f"layer (layers {chosen[:8]}), but its transport registration does not cover that "
            f"memory; refusing it before preparing any per-block descriptor ({exc})"
        ) from None
    transport.release_dlist(dlist)


def open_session(key: SessionKey, transport: PdTransport,
                 fetch: Callable[[str, CompatHeader], FetchResult],
                 expected_header: CompatHeader, spec: KVCacheSpec, sizes: ParallelTopology,
                 rank: ParallelTopology, memory: dict[int, LayerMemory], hello: bytes,
                 local_cache: dict[ParallelTopology, LocalLists]) -> PeerSession:
    """Handshake with the engine at ``key`` and prepare everything for transfers.

    Raises HandshakeError / LayoutError / TransportError; on error nothing
    is left behind (peers added so far are removed).
    """
    _engine_id, host, port = key
    result = fetch(format_address(host, port), expected_header)
    meta = result.metadata
    if meta.engine_id != key[0]:
        raise HandshakeError("engine_id", f"{format_address(host, port)} serves engine "
                                          f"{meta.engine_id!r}, the request names {key[0]!r}")
    plan = plan_transfer(spec, meta.topology, sizes)
    me = rank_index(rank)
    rank_plan = plan.for_consumer(me)
    targets = notify_targets(plan)
    mine = targets.get(me, ())
    session = PeerSession(key, meta, rank_plan, mine,
                          {p: expected_notifs(targets, p) for p in mine}, {},
                          opened_at=time.monotonic(), validated_at=time.monotonic())
    by_index = {m.rank_index: m for m in meta.ranks}
    try:
        hello_msg = messages.encode(messages.Hello(hello))
        for p in mine:
            agent = by_index[p]
            peer = transport.add_peer(agent.agent_name, agent.agent_blob)
            session.peers[p] = peer
            transport.send_notif(peer, hello_msg)
            if p in rank_plan.sources:
                sub = rank_plan.for_producer(p)
                remote_memory = agent.layer_memory()
                check_remote_coverage(transport, peer, remote_memory, sub.layers.tolist(),
                                      f"producer rank {p} ({agent.agent_name})",
                                      agent.mem_type, agent.device_id)
                table = producer_table(sub, remote_memory)
                session.remote_tables[p] = table
                session.remote_lists[p] = transport.prepare_remote(  # peer's memory type
                    peer, table.strided(agent.device_id), agent.mem_type)
        sizes_key = meta.topology.sizes()
        with _LOCAL_CACHE_LOCK:  # handshakes with several producers run concurrently
            local = local_cache.get(sizes_key)
            if local is None and rank_plan.num_descriptors:
                table = consumer_table(rank_plan, memory)
                local = LocalLists(table, transport.prepare_local_descs(
                    table.strided(transport.memory_type[1])))
                local_cache[sizes_key] = local
        session.local = local
    except BaseException:
        session.close(transport)
        raise
    return session
