"""The worker-role half of the vLLM adapter: vLLM's per-layer KV tensors and worker
hooks, translated to one kvbridge :class:`WorkerConnector`.

Owns (:class:`WorkerSide`, a base of
:class:`~kvbridge.integrations.vllm.connector.KVBridgeConnectorBase`):

* tensors: vLLM's per-layer KV tensors -> views in kvbridge's memory model
  (``register_kv_caches``), checked against the spec and the pipeline split;
* each step: the metadata vLLM hands the worker (its kvbridge metadata and the
  request ids first seen this step), then ``start_load_kv`` at bind time,
  per-layer waits and saves;
* worker results: ``get_finished`` / ``get_transfer_results`` /
  ``get_block_ids_with_load_errors`` and transfer stats, back into vLLM's types;
* the kvbridge id <-> vLLM id lookups both halves use (``_kvb_ids``, ``_vllm_ids``).

May not touch: scheduler-side request tracking (views, block lists, hashes) or
building the halves (:mod:`kvbridge.integrations.vllm.connector`). Imports vLLM:
loaded only inside vLLM, like the connector module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.connectors import KVCaches, WorkerConnector
from kvbridge.integrations.vllm.description import EngineDescription
from kvbridge.integrations.vllm.layout import AdapterConfigError, kvbridge_view
from kvbridge.integrations.vllm.messages import KVBridgeHandshake, KVBridgeVllmMetadata
from kvbridge.integrations.vllm.stats import KVBridgePromMetrics, KVBridgeStats


class WorkerSide(KVConnectorBase_V1):
    """vLLM's worker hooks over one kvbridge worker half (set on worker-role connectors)."""

    # set by KVBridgeConnectorBase.__init__
    _desc: EngineDescription
    _worker: WorkerConnector | None
    #: layer name -> the kvbridge view of its KV tensor
    _views: dict[str, torch.Tensor]
    #: the last transfer record already reported to vLLM's stats logger
    _records_seen: Any
    #: kvbridge id <-> vLLM id, only where they differ (see KVBridgeVllmMetadata)
    _to_vllm: dict[str, str]
    _to_kvb: dict[str, str]

    @property
    def kvbridge_worker(self) -> WorkerConnector:
        if self._worker is None:
            raise RuntimeError("kvbridge: worker hook called on a scheduler-role connector")
        return self._worker

    def _kvb_ids(self, vllm_ids: Iterable[str] | None) -> frozenset[str]:
        return frozenset(self._to_kvb.get(i, i) for i in vllm_ids or ())

    def _vllm_ids(self, kvb_ids: Iterable[str]) -> set[str]:
        return {self._to_vllm.get(i, i) for i in kvb_ids}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self.kvbridge_worker
        shapes = worker.ctx.rank_shapes()
        names = {lid: name for name, lid in self._desc.adapter.layer_ids.items()}
        unknown = sorted(set(kv_caches) - set(self._desc.adapter.layer_ids))
        if unknown:
            raise AdapterConfigError("kv_cache_config", f"KV tensors for layers not in any KV "
                                                        f"cache group: {unknown[:3]}")
        layers: dict[int, torch.Tensor] = {}
        num_blocks: list[int] = []
        for shape in shapes:
            count = self._desc.num_blocks
            for lid in shape.layer_ids:
                name = names[lid]
                if name not in kv_caches:
                    raise AdapterConfigError(
                        "pipeline_parallel_size",
                        f"layer {name} belongs to this pipeline stage in kvbridge's split "
                        f"({self._desc.topology.pp_size} stages) but vLLM gave this rank no "
                        f"KV tensor for it")
                tensor = kv_caches[name]
                count = int(tensor.shape[0])
                if count != self._desc.num_blocks and count % self._desc.num_blocks == 0:
                    count = self._desc.num_blocks  # kernel blocks, regrouped by kvbridge_view
                view = kvbridge_view(tensor, shape.region, shape.tensor_shape(count), name,
                                     self._desc.adapter.fmt.kv_cache_layout,
                                     manager_blocks=self._desc.num_blocks)
                self._views[name] = view
                layers[lid] = view
            num_blocks.append(count)
        if len(layers) != len(kv_caches):
            raise AdapterConfigError("pipeline_parallel_size",
                                     f"vLLM gave {len(kv_caches)} KV tensors, kvbridge's "
                                     f"pipeline split expects {len(layers)} on this rank")
        worker.register_kv_caches(KVCaches(shapes, tuple(num_blocks), layers))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        blob = self._worker.get_handshake_metadata()
        return KVBridgeHandshake(blob) if blob else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVBridgeVllmMetadata)
        inner, new_ids = connector_metadata.unpack()
        for kvb_id, vllm_id in new_ids.items():
            self._to_vllm[kvb_id] = vllm_id
            self._to_kvb[vllm_id] = kvb_id
        worker = self.kvbridge_worker
        worker.bind_connector_metadata(inner)
        # vLLM 0.32 calls start_load_kv *after* the forward unless the step has
        # synchronous loads; kvbridge's contract calls it before any layer is
        # computed (a push producer learns the step's writes there, before
        # save_kv_layer). Starting here keeps kvbridge's order on every path.
        worker.start_load_kv()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Already done in :meth:`bind_connector_metadata` (see there)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        lid = self._desc.adapter.layer_id(layer_name)
        if lid is not None:
            self.kvbridge_worker.wait_for_layer_load(lid)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        lid = self._desc.adapter.layer_id(layer_name)
        view = self._views.get(layer_name)
        if lid is not None and view is not None:
            self.kvbridge_worker.save_kv_layer(lid, view)

    def wait_for_save(self) -> None:
        self.kvbridge_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str],
                     ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.kvbridge_worker
        sending, recving = worker.get_finished(self._kvb_ids(finished_req_ids))
        failed = worker.get_failed_recving()
        results = KVConnectorTransferResults(
            finished_sending=self._vllm_ids(sending),
            finished_recving=self._vllm_ids(set(recving) | set(failed)),
            failed_recving=self._vllm_ids(failed))
        for kvb_id in sending:
            vllm_id = self._to_vllm.pop(kvb_id, None)
            if vllm_id is not None:
                self._to_kvb.pop(vllm_id, None)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.get_block_ids_with_load_errors()
        if len(self._desc.adapter.spec.regions) > 1:
            # vLLM's block ids are unique only within a KV cache group, and its scheduler
            # raises on block-level errors of a model with several groups (hybrid): the
            # failed request is in failed_recving, which recomputes it whole
            return set()
        return {block_id for _region, block_id in errors}

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        worker = self._worker
        records_of = getattr(worker, "records", None)
        if records_of is None:
            return None
        records = records_of()
        start = 0
        if self._records_seen is not None:
            for index in range(len(records) - 1, -1, -1):
                if records[index] is self._records_seen:
                    start = index + 1
                    break
        new = records[start:]
        if not new:
            return None
        self._records_seen = new[-1]
        data = KVBridgeStats().data
        for record in new:
            if not record.ok:
                data["failed"] += 1
                continue
            data["transfer_duration"].append(float(record.duration_s))
            data["bytes_transferred"].append(int(record.nbytes))
            data["num_descriptors"].append(int(record.num_descs))
            data["nixl_xfer_duration"].extend(map(float, record.library_xfer_s))
        return KVBridgeStats.packed(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)
