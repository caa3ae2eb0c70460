"""Transfer statistics for vLLM's stats logger and Prometheus metrics.

Owns: :class:`KVBridgeStats` (a worker's per-transfer samples and failure count;
it crosses vLLM's pickling channel as msgpack bytes only, validated when opened)
and :class:`KVBridgePromMetrics` (``vllm:kvbridge_*`` histograms and counter,
like vLLM's NIXL ones). May not touch: the connector halves or the transfers
themselves; :mod:`kvbridge.integrations.vllm.connector` turns the worker's
transfer records into :class:`KVBridgeStats` and re-exports both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.connectors.metadata_wire import MetadataWireError

_STAT_LISTS = ("transfer_duration", "bytes_transferred", "num_descriptors", "nixl_xfer_duration")
#: The scheduler's counter of every refused transfer params; ``ALL_REFUSED + "_" + reason``
#: counts one reason (``refused_params_block_ids``, ``refused_params_seal``, ...).
ALL_REFUSED = "refused_params"
#: Refusal counters one report may carry (a scheduler has a handful).
MAX_REFUSAL_COUNTERS = 64


def refusal_deltas(now: Mapping[str, int | float], before: Mapping[str, int | float],
                   ) -> dict[str, int]:
    """The refusal counters of a scheduler's ``get_stats()`` that grew since ``before``."""
    return {name: int(value) - int(before.get(name, 0)) for name, value in now.items()
            if name.startswith(ALL_REFUSED) and int(value) > int(before.get(name, 0))}


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Per-transfer samples and cumulative counters, worker -> vLLM's stats logger.

    ``data``: ``transfer_duration`` (s), ``bytes_transferred``,
    ``num_descriptors`` (lists, one entry per finished transfer since the
    last report), ``nixl_xfer_duration`` (s: NIXL's own telemetry of each READ,
    one entry per NIXL transfer, the measurement vLLM's NixlConnector reports),
    ``failed`` (count of failed transfers in those) and ``refused`` (the
    scheduler's refused transfer params since the last report, by counter name:
    ``refused_params`` for all of them, ``refused_params_<reason>`` per reason;
    the scheduler-side connector reports these, vLLM aggregates them with the
    workers').

    A worker's report crosses vLLM's (pickling) channel as ``wire`` only: msgpack
    bytes of ``data``, with ``data`` empty (:meth:`packed`). Every method opens
    ``wire`` into ``data`` first, validating it.
    """

    data: dict[str, Any] = field(default_factory=lambda: {
        "transfer_duration": [], "bytes_transferred": [], "num_descriptors": [],
        "nixl_xfer_duration": [], "failed": 0, "refused": {}})
    wire: bytes = b""

    @classmethod
    def packed(cls, data: Mapping[str, Any]) -> KVBridgeStats:
        return cls(data={}, wire=msgpack.packb(dict(data), use_bin_type=True))

    def _open(self) -> dict[str, Any]:
        if self.wire:
            wire, self.wire = self.wire, b""
            try:
                raw = msgpack.unpackb(wire, raw=False)
            except (msgpack.UnpackException, ValueError) as exc:
                raise MetadataWireError("kv_connector_stats", f"not valid msgpack: {exc}") from None
            if not isinstance(raw, dict):
                raise MetadataWireError("kv_connector_stats", "expected a map")
            for key in _STAT_LISTS:
                values = raw.get(key, [])
                if not isinstance(values, list) or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                    raise MetadataWireError(f"kv_connector_stats.{key}", "expected a number list")
            failed = raw.get("failed", 0)
            if not isinstance(failed, int) or isinstance(failed, bool):
                raise MetadataWireError("kv_connector_stats.failed", "expected an int")
            refused = raw.setdefault("refused", {})
            if not isinstance(refused, dict) or len(refused) > MAX_REFUSAL_COUNTERS or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                    and v >= 0 for k, v in refused.items()):
                raise MetadataWireError("kv_connector_stats.refused",
                                        f"expected at most {MAX_REFUSAL_COUNTERS} counters "
                                        f"(name -> int >= 0)")
            self.data = raw
        return self.data

    def to_dict(self) -> dict[str, Any]:
        return self._open()

    def reset(self) -> None:
        self.data = KVBridgeStats().data
        self.wire = b""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data = self._open()
        theirs = other._open() if isinstance(other, KVBridgeStats) else other.data
        for key in _STAT_LISTS:
            data.setdefault(key, []).extend(theirs.get(key, []))
        data["failed"] = data.get("failed", 0) + theirs.get("failed", 0)
        refused = data.setdefault("refused", {})
        for name, count in theirs.get("refused", {}).items():
            refused[name] = refused.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self._open()
        durations = sorted(data.get("transfer_duration", []))
        nbytes = data.get("bytes_transferred", [])
        count = len(durations)
        return {
            "num_transfers": count,
            "num_failed": data.get("failed", 0),
            "median_xfer_time_ms": round(1e3 * durations[count // 2], 3) if count else 0.0,
            "total_mb": round(sum(nbytes) / 2**20, 3),
            "num_refused_params": data.get("refused", {}).get(ALL_REFUSED, 0),
        }

    def is_empty(self) -> bool:
        data = self._open()
        return not data.get("transfer_duration") and not data.get("failed") \
            and not data.get("refused")


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbridge_xfer_time_seconds`` (a whole load) / ``_nixl_xfer_time_seconds``
    (NIXL's telemetry of each READ, as vLLM's ``vllm:nixl_xfer_time_seconds``) /
    ``_bytes_transferred`` / ``_num_descriptors`` histograms and
    ``vllm:kvbridge_num_failed_transfers``, like vLLM's NIXL ones; the consumer's
    ``vllm:kvbridge_refused_params`` and ``_refused_params_by_reason{reason=...}``
    counters (transfer params refused, the request recomputed)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from prometheus_client import Counter, Histogram

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        time_buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
        self.xfer_time = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_xfer_time_seconds",
            documentation="Duration of kvbridge KV transfers (one per request and rank).",
            buckets=time_buckets, labelnames=labelnames))
        self.nixl_xfer_time = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_nixl_xfer_time_seconds",
            documentation="NIXL's own telemetry of each kvbridge READ (post to completion).",
            buckets=time_buckets, labelnames=labelnames))
        self.xfer_bytes = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_bytes_transferred",
            documentation="Bytes moved per kvbridge KV transfer.",
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames))
        self.xfer_descs = per_engine(metric_types[Histogram](
            name="vllm:kvbridge_num_descriptors",
            documentation="Descriptors per kvbridge KV transfer.",
            buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000], labelnames=labelnames))
        self.failed = per_engine(metric_types[Counter](
            name="vllm:kvbridge_num_failed_transfers",
            documentation="Failed kvbridge KV transfers.", labelnames=labelnames))
        self.refused = per_engine(metric_types[Counter](
            name="vllm:kvbridge_refused_params",
            documentation="Transfer params the consumer refused (the request recomputed).",
            labelnames=labelnames))
        by_reason = metric_types[Counter](
            name="vllm:kvbridge_refused_params_by_reason",
            documentation="Refused transfer params by reason (seal, prompt, replay, "
                          "num_tokens, block_ids, block_id, ...).",
            labelnames=[*labelnames, "reason"])
        self._labelvalues = per_engine_labelvalues
        self._by_reason = by_reason

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for metric, key in ((self.xfer_time, "transfer_duration"),
                            (self.nixl_xfer_time, "nixl_xfer_duration"),
                            (self.xfer_bytes, "bytes_transferred"),
                            (self.xfer_descs, "num_descriptors")):
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
        failed = transfer_stats_data.get("failed", 0)
        if failed:
            self.failed[engine_idx].inc(failed)
        for name, count in transfer_stats_data.get("refused", {}).items():
            if name == ALL_REFUSED:
                self.refused[engine_idx].inc(count)
            elif name.startswith(ALL_REFUSED + "_"):
                reason = name[len(ALL_REFUSED) + 1:]
                self._by_reason.labels(*self._labelvalues[engine_idx], reason).inc(count)
