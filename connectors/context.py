"""What a connector half is given: its engine (:class:`ConnectorContext`) and, on a
worker, that rank's KV tensors (:class:`KVCaches`).

Owns: those two frozen records and the questions they answer (a region's block
tokens, a rank's region shapes, which region holds a layer, block strides, the
distinct backing storages a transport registers once, role checks). May not
touch: the tensors' bytes, or any transport; the hooks that receive these are in
:mod:`kvbridge.connectors.api`, which re-exports everything here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.errors import ContractError, RoleError
from kvbridge.events import EventBuffer
from kvbridge.layouts import KVCacheSpec, ParallelTopology, RankRegionShape

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ConnectorContext:
    """Everything a connector half is given about its engine.

    ``topology`` is the engine's parallel sizes (ranks 0). ``rank`` and
    ``worker_index`` are set for worker halves only (``worker_index`` is the
    rank's position in ``topology.ranks()``). ``extra`` is the plugin's parsed
    form of ``config.extra`` (``ConnectorPlugin.parse_extra``).
    ``num_blocks[r]`` is the engine's block-pool size of region ``r``.
    ``events`` is this half's own :class:`kvbridge.events.EventBuffer` (thread-safe):
    append ``kvbridge.events`` records (``BlockStored`` ...) to it; the engine
    takes them once per step (scheduler: ``take_events``; worker: into its
    :class:`WorkerOutput`).
    ``null_block_id`` is the block id the engine puts where a request holds no block
    (vLLM's null block: the positions a sliding window dropped); such a position is
    never read, written nor verified, and a producer cannot serve it. None: every
    block id is a block.
    """

    spec: KVCacheSpec
    topology: ParallelTopology
    config: ConnectorConfig
    num_blocks: tuple[int, ...]
    extra: Any = None
    events: EventBuffer = field(default_factory=EventBuffer)
    rank: ParallelTopology | None = None
    worker_index: int | None = None
    null_block_id: int | None = None

    @property
    def role(self) -> KVRole:
        return self.config.role

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def is_worker(self) -> bool:
        return self.rank is not None

    @property
    def num_workers(self) -> int:
        return self.topology.world_size

    def block_tokens(self, region_index: int) -> int:
        """Tokens covered by one block (and one hash key) of region ``region_index``."""
        return self.spec.regions[region_index].tokens_per_key(self.topology.dcp_size)

    def rank_shapes(self) -> tuple[RankRegionShape, ...]:
        if self.rank is None:
            raise ContractError("rank", "rank_shapes() is for worker halves only")
        return self.spec.rank_shapes(self.rank)

    def require_role(self, call: str, *allowed: KVRole) -> None:
        """Raise :class:`RoleError` unless this engine's role is one of ``allowed``."""
        if self.role not in allowed:
            raise RoleError("kv_role", f"{call} needs role {' or '.join(r.value for r in allowed)}"
                                       f"; this engine is {self.role.value}")


@dataclass(frozen=True)
class KVCaches:
    """The KV tensors of one worker rank, as registered with its connector.

    ``layers[layer_id]`` has shape ``shapes[r].tensor_shape(num_blocks[r])`` for
    the region ``r`` that owns ``layer_id``. Only this pipeline stage's layers
    are present.
    """

    shapes: tuple[RankRegionShape, ...]
    num_blocks: tuple[int, ...]
    layers: Mapping[int, torch.Tensor]

    def region_index_of_layer(self, layer_id: int) -> int:
        for index, shape in enumerate(self.shapes):
            if layer_id in shape.layer_ids:
                return index
        raise ContractError("layer_id", f"layer {layer_id} is not held by this rank")

    def region_layers(self, region_index: int) -> tuple[tuple[int, torch.Tensor], ...]:
        """``(layer_id, tensor)`` of one region's layers on this rank, in layer order."""
        return tuple((layer, self.layers[layer]) for layer in self.shapes[region_index].layer_ids)

    def block_stride(self, layer_id: int) -> int:
        """Bytes from one block of a layer to the next: the tensor's own dim-0 stride
        (larger than a block for padded pages, e.g. vLLM's hybrid or MLA caches)."""
        tensor = self.layers[layer_id]
        return int(tensor.stride(0)) * int(tensor.element_size())

    def backing_spans(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of each distinct backing storage of the layer tensors, once.

        Tensors that alias (vLLM's hybrid allocator puts layer i of every KV cache
        group on the same bytes) or are views of one allocation share a storage,
        which a transport must register once.
        """
        spans: dict[int, int] = {}
        for tensor in self.layers.values():
            storage = tensor.untyped_storage()
            spans[int(storage.data_ptr())] = int(storage.nbytes())
        return sorted(spans.items())
