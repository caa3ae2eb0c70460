"""Per-rank memory type in the handshake: where a rank's KV lives.

A peer prepares a rank's descriptor lists with that rank's memory type and
device id, so both travel in the rank's record; a host-memory record is
byte-identical to one from before the field existed (and decodes as DRAM).
"""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from kvbridge.handshake import HandshakeError, decode_agent, encode_agent
from kvbridge.handshake.example import example_rank, example_store
from kvbridge.handshake.schema import decode_engine, encode_engine
from kvbridge.layouts import ParallelTopology, load_spec


def _rank(**changes: object):
    spec = load_spec("tiny-gqa")
    return replace(example_rank(spec, ParallelTopology(tp_size=2).with_rank(tp_rank=1), "e"),
                   **changes)


def test_vram_rank_round_trips_with_its_device() -> None:
    meta = _rank(mem_type="VRAM", device_id=3)
    back = decode_agent(encode_agent(meta))
    assert (back.mem_type, back.device_id) == ("VRAM", 3)
    raw = msgpack.unpackb(encode_agent(meta), raw=False)
    assert (raw["mem_type"], raw["device_id"]) == ("VRAM", 3)


def test_dram_rank_is_encoded_as_before_and_decodes_as_dram() -> None:
    meta = _rank()
    raw = msgpack.unpackb(encode_agent(meta), raw=False)
    assert "mem_type" not in raw and "device_id" not in raw
    back = decode_agent(encode_agent(meta))
    assert (back.mem_type, back.device_id) == ("DRAM", 0)


def test_engine_document_carries_each_ranks_memory_type() -> None:
    spec = load_spec("tiny-gqa")
    topo = ParallelTopology(tp_size=2)
    store = example_store(spec, topo, "e")
    for rank in topo.ranks():
        meta = example_rank(spec, rank, "e")
        store.publish(replace(meta, mem_type="VRAM", device_id=rank.tp_rank))
    doc = decode_engine(encode_engine(store.snapshot()))
    assert [(m.mem_type, m.device_id) for m in doc.ranks] == [("VRAM", 0), ("VRAM", 1)]


@pytest.mark.parametrize("fields,field", [
    ({"mem_type": "HBM", "device_id": 0}, "mem_type"),
    ({"mem_type": "VRAM", "device_id": -1}, "device_id"),
    ({"mem_type": "VRAM", "device_id": 1 << 20}, "device_id"),
    ({"mem_type": "VRAM", "device_id": "0"}, "device_id"),
    ({"mem_type": 7}, "mem_type"),
    ({"mem_type": ""}, "mem_type"),  # before: read as DRAM
    ({"device_id": 2}, "device_id"),  # a device for host memory
])
def test_hostile_memory_type_is_refused_with_its_field(fields: dict[str, object],
                                                       field: str) -> None:
    raw = msgpack.unpackb(encode_agent(_rank()), raw=False)
    raw.update(fields)
    with pytest.raises(HandshakeError) as info:
        decode_agent(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == field
