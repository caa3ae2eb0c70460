"""KV event records: what a cache tier tells the outside world about its blocks.

The records mirror vLLM's ``vllm/distributed/kv_events.py`` field for field (see
``wire.py`` for the exact encoding and the vLLM revisions it follows), so that a
router or indexer built for vLLM can index kvbridge's tiers unchanged:

- ``BlockStored`` is self-describing: block hashes, the parent hash that chains
  them to a prefix, the token ids they cover and the block size (tokens per
  block), so a consumer can index it with no other source.
- ``medium`` says which tier holds the blocks (``Medium``: GPU-equivalent primary
  blocks, CPU memory, or STORAGE for file and object stores), ``group_idx`` which
  KV-cache group (kvbridge: region) they belong to, and ``locality`` whether the
  storage is LOCAL to the publishing instance or REMOTE (e.g. a shared store).

Records are immutable and hashable so that worker-side events can be counted
across ranks (an event is published once every rank that holds it reported it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

#: vLLM's ``ExternalBlockHash``: an unsigned 64-bit int, or raw digest bytes.
BlockHash: TypeAlias = int | bytes


class Medium(str, enum.Enum):
    """Where the blocks live. Values are vLLM's wire strings (``MEDIUM_*``)."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, enum.Enum):
    """Storage placement relative to the publishing instance (vLLM's ``locality``)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


def _plain_str(value: str | enum.Enum | None) -> str | None:
    """Enums become their wire string; the wire carries plain strings only."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return str(value.value)
    return value


def freeze_value(value: object) -> object:
    """Lists become tuples (recursively) so records stay hashable after decoding."""
    if isinstance(value, list | tuple):
        return tuple(freeze_value(item) for item in value)
    if isinstance(value, dict):
        # sorted by key alone: keys 0 and "0" both become "0", and their values need not
        # be comparable (a hostile map must not raise TypeError here); ties keep wire order
        return tuple(sorted(((str(k), freeze_value(v)) for k, v in value.items()),
                            key=lambda item: item[0]))
    return value


@dataclass(frozen=True)
class BlockStored:
    """A run of contiguous, chained, full blocks became resident on ``medium``.

    Invariant: ``len(token_ids) == len(block_hashes) * block_size`` for events
    built by kvbridge; decoding does not enforce it because vLLM's offloading
    tiers publish hash-only stores (empty ``token_ids``).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = Medium.GPU.value
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        # Decoding already hands over tuples and plain strings: convert only when needed.
        if type(self.block_hashes) is not tuple:
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        if type(self.token_ids) is not tuple:
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.medium is not None and type(self.medium) is not str:
            object.__setattr__(self, "medium", _plain_str(self.medium))
        if self.locality is not None and type(self.locality) is not str:
            object.__setattr__(self, "locality", _plain_str(self.locality))
        if self.extra_keys is not None:
            object.__setattr__(self, "extra_keys", freeze_value(self.extra_keys))


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted or deleted from ``medium`` (published for every tier)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = Medium.GPU.value
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        if type(self.block_hashes) is not tuple:
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        if self.medium is not None and type(self.medium) is not str:
            object.__setattr__(self, "medium", _plain_str(self.medium))
        if self.locality is not None and type(self.locality) is not str:
            object.__setattr__(self, "locality", _plain_str(self.locality))


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the publisher was dropped (vLLM: the whole prefix cache was reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one engine step, published as one sequence-numbered message.

    ``ts`` is wall-clock seconds (``time.time()``), as vLLM sends it;
    ``data_parallel_rank`` says which DP rank's engine produced the batch.
    """

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if type(self.events) is not tuple:
            object.__setattr__(self, "events", tuple(self.events))

    @classmethod
    def now(cls, events: Iterable[KVEvent], data_parallel_rank: int | None = None) -> EventBatch:
        return cls(ts=time.time(), events=tuple(events), data_parallel_rank=data_parallel_rank)


EVENT_TYPES: tuple[type, ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


@dataclass(frozen=True)
class EventCounts:
    """How many events of each kind a sequence holds (for summaries and the CLI)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0

    @classmethod
    def of(cls, events: Iterable[KVEvent]) -> EventCounts:
        stored = removed = cleared = blocks_stored = blocks_removed = 0
        for event in events:
            if isinstance(event, BlockStored):
                stored += 1
                blocks_stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed += 1
                blocks_removed += len(event.block_hashes)
            else:
                cleared += 1
        return cls(stored, removed, cleared, blocks_stored, blocks_removed)
