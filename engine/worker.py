"""One worker rank of the reference engine: its KV tensors, its compute, its connector half."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvbridge.connectors import ConnectorMetadata, KVCaches, WorkerConnector, WorkerOutput
from kvbridge.engine.content import fill_tokens, torch_dtype, verify_blocks
from kvbridge.layouts import KVCacheSpec, ParallelTopology
from kvbridge.layouts.kv_memory import guard_host_access

logger = logging.getLogger(__name__)

#: (side, worker index or None, hook name, request id or None) -> None
HookRecorder = Callable[[str, "int | None", str, "str | None"], None]


@dataclass(frozen=True)
class ComputeItem:
    """Tokens ``[start, end)`` of one request to compute this step, into ``block_ids``."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    seeds: torch.Tensor  # prefix seeds of at least ``end`` tokens
    start: int
    end: int


class Worker:
    """A rank's KV cache (torch tensors shaped by the spec, on the rank's device) and its
    step execution.

    The step follows a serving engine's model runner: bind metadata, start
    loads, then per layer: wait for its load, compute, save; wait for saves;
    report finished transfers and load errors; clear metadata.
    """

    def __init__(self, spec: KVCacheSpec, sizes: ParallelTopology, rank: ParallelTopology,
                 worker_index: int, num_blocks: Sequence[int],
                 connector: WorkerConnector | None, record: HookRecorder | None = None, *,
                 device: torch.device | None = None, host_guard: bool = False) -> None:
        """``device``: where this rank's KV tensors live (default the host);
        ``host_guard``: host-memory KV refuses host-only reads, as device KV does
        (:func:`kvbridge.layouts.kv_memory.guard_host_access`)."""
        self.spec = spec
        self.sizes = sizes
        self.rank = rank
        self.worker_index = worker_index
        self.shapes = spec.rank_shapes(rank)
        self.connector = connector
        self._record = record
        layers: dict[int, torch.Tensor] = {}
        for index, shape in enumerate(self.shapes):
            for layer in shape.layer_ids:
                tensor = torch.zeros(shape.tensor_shape(num_blocks[index]),
                                     dtype=torch_dtype(shape.region.dtype), device=device)
                layers[layer] = (guard_host_access(tensor)
                                 if host_guard and tensor.device.type == "cpu" else tensor)
        self.layer_order = tuple(sorted(layers))
        self._region_of = {layer: index for index, shape in enumerate(self.shapes)
                           for layer in shape.layer_ids}
        self.caches = KVCaches(self.shapes, tuple(num_blocks), layers)
        #: the same tensors without the guard: the engine's own compute and checks are
        #: torch ops on the KV's device, not host reads, and skip the guard's per-op cost
        self._own_layers = {layer: t.as_subclass(torch.Tensor) for layer, t in layers.items()}
        self.tokens_computed = 0
        if connector is not None:
            self._hook("register_kv_caches")
            connector.register_kv_caches(self.caches)

    def _hook(self, name: str, request_id: str | None = None) -> None:
        if self._record is not None:
            self._record("worker", self.worker_index, name, request_id)

    def execute(self, metadata: ConnectorMetadata | None, items: Sequence[ComputeItem],
                finished_request_ids: frozenset[str]) -> WorkerOutput | None:
        connector = self.connector
        if connector is not None:
            assert metadata is not None
            self._hook("bind_connector_metadata")
            connector.bind_connector_metadata(metadata)
            self._hook("start_load_kv")
            connector.start_load_kv()
        for layer in self.layer_order:
            if connector is not None:
                self._hook("wait_for_layer_load")
                connector.wait_for_layer_load(layer)
            self._compute_layer(layer, items)
            if connector is not None:
                self._hook("save_kv_layer")
                connector.save_kv_layer(layer, self.caches.layers[layer])
        self.tokens_computed += sum(item.end - item.start for item in items)
        if connector is None:
            return None
        self._hook("wait_for_save")
        connector.wait_for_save()
        self._hook("get_finished")
        output = connector.collect_output(finished_request_ids)
        if output.worker_index != self.worker_index:
            output = WorkerOutput(self.worker_index, output.finished_sending,
                                  output.finished_recving, output.failed_recving,
                                  output.invalid_block_ids, output.stats, output.events)
        self._hook("clear_connector_metadata")
        connector.clear_connector_metadata()
        return output

    def _compute_layer(self, layer: int, items: Sequence[ComputeItem]) -> None:
        region_index = self._region_of[layer]
        shape = self.shapes[region_index]
        tensor = self._own_layers[layer]
        for item in items:
            fill_tokens(tensor, shape, self.rank, self.sizes.dcp_size, layer,
                        item.block_ids[region_index], item.seeds, item.start, item.end)

    def verify(self, block_ids: Sequence[Sequence[int]], token_ids: Sequence[int], start: int,
               end: int) -> tuple[int, int]:
        """``(verified_bytes, mismatched_bytes)`` of tokens ``[start, end)`` on this rank."""
        return verify_blocks(self._own_layers, self.shapes, self.spec, self.rank,
                             self.sizes.dcp_size, block_ids, token_ids, start, end)

    def shutdown(self) -> None:
        if self.connector is not None:
            self._hook("shutdown")
            try:
                self.connector.shutdown()
            except Exception:  # one rank's failure must not keep the others alive
                logger.exception("worker %d: connector shutdown failed", self.worker_index)
