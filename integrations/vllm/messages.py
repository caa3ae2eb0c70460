"""What the adapter sends through vLLM's own channels: the per-step connector
metadata (:class:`KVBridgeVllmMetadata`, scheduler -> workers) and a worker's
handshake bytes (:class:`KVBridgeHandshake`, worker -> scheduler).

vLLM moves these objects between its processes with pickle, so each holds only
bytes (msgpack of kvbridge's own records, :mod:`kvbridge.connectors.metadata_wire`).
Owns: those two types and their pack/unpack validation. May not touch: the
connector halves, requests or tensors (:mod:`kvbridge.integrations.vllm.connector`);
re-exported there, where vLLM and the tests find them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvbridge.connectors import ConnectorMetadata
from kvbridge.connectors.metadata_wire import MetadataWireError, decode_metadata, encode_metadata


@dataclass
class KVBridgeVllmMetadata(KVConnectorMetadata):
    """The kvbridge connector's per-step metadata, carried through vLLM to the workers.

    vLLM moves this object between its processes with pickle, so it holds only
    ``wire``: msgpack bytes of ``[kvbridge metadata (connectors.metadata_wire), new_ids]``.
    ``new_ids``: kvbridge request id -> vLLM request id, for requests first seen
    this step whose kvbridge id differs (push-mode producers use the router's
    ``producer_request_id``, which the consumer names in its registration;
    vLLM's own ids carry a random suffix no router can know).
    """

    wire: bytes

    @classmethod
    def pack(cls, inner: ConnectorMetadata, new_ids: Mapping[str, str]) -> KVBridgeVllmMetadata:
        return cls(msgpack.packb([encode_metadata(inner), dict(new_ids)], use_bin_type=True))

    def unpack(self) -> tuple[ConnectorMetadata, dict[str, str]]:
        """The kvbridge metadata and ``new_ids``; raises :class:`MetadataWireError` when bad."""
        try:
            raw = msgpack.unpackb(self.wire, raw=False)
        except (msgpack.UnpackException, ValueError) as exc:
            raise MetadataWireError("connector_metadata", f"not valid msgpack: {exc}") from None
        if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], bytes):
            raise MetadataWireError("connector_metadata", "expected [metadata bytes, new_ids]")
        new_ids = raw[1]
        if not isinstance(new_ids, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in new_ids.items()):
            raise MetadataWireError("connector_metadata.new_ids", "expected a map of str to str")
        return decode_metadata(raw[0]), new_ids


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """A worker's opaque handshake bytes (e.g. its NIXL agent document)."""

    blob: bytes
