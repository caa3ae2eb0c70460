"""The per-step message from the Mooncake store scheduler half to its workers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbridge.connectors.api import ConnectorMetadata
from kvbridge.events import BlockStored
from kvbridge.layouts import BlockHash


@dataclass(frozen=True)
class LoadBlock:
    """One local block to fill from the store: ``(region_index, block_id)`` <- ``block_hash``."""

    region_index: int
    block_id: int
    block_hash: BlockHash


@dataclass(frozen=True)
class SaveBlock:
    """One computed block to put. ``event`` is published once every rank stored its part.

    Every rank gets the same ``SaveBlock`` objects, so their events compare
    equal and the engine's aggregator emits each once all ranks reported it.
    """

    region_index: int
    block_id: int
    block_hash: BlockHash
    event: BlockStored


@dataclass(frozen=True)
class StoreMetadata(ConnectorMetadata):
    """``loads``: request id -> blocks to load this step; ``saves``: blocks computed this step."""

    loads: Mapping[str, tuple[LoadBlock, ...]] = field(default_factory=dict)
    saves: tuple[SaveBlock, ...] = ()
