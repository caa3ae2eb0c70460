"""Round trips and strict decoding of every kvbridge connector's metadata through msgpack."""

from __future__ import annotations

import msgpack
import pytest

from kvbridge.connectors import ConnectorMetadata, TransferMode, TransferParams
from kvbridge.connectors.metadata_wire import (
    MetadataWireError,
    decode_metadata,
    encode_metadata,
)
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.multi import MultiMetadata
from kvbridge.connectors.offloading.scheduler import OffloadMetadata
from kvbridge.connectors.pd.scheduler import (
    HoldOrder,
    LoadOrder,
    PdMetadata,
    PushOrder,
    ReleaseOrder,
)
from kvbridge.connectors.shared_storage import StorageMetadata
from kvbridge.events import BlockStored
from kvbridge.layouts import ParallelTopology


def _params(rid: str = "r1") -> TransferParams:
    return TransferParams(mode=TransferMode.PULL, producer_engine_id="p", producer_host="127.0.0.1",
                          producer_port=5555, producer_request_id=rid, block_ids=((1, 2), (3,)),
                          producer_topology=ParallelTopology(tp_size=2), num_tokens=32,
                          consumer_request_id="c-" + rid, extra={"k": "x", "n": 1})


def _nixl() -> PdMetadata:
    params = _params()
    return PdMetadata(
        step_id=7,
        loads=(LoadOrder("c1", params, ((4, 5), (6,)), ((1, 2), (3,)), (0, 0)),
               LoadOrder("c2", params, ((),), ((),), (1,), error="refused")),
        releases=(ReleaseOrder("c3", _params("r3")),),
        holds=(HoldOrder("p1", ((1, 2), ()), push=True),),
        pushes=(PushOrder("p2", params, ((9,),), end=16, final=False),),
        heartbeats=(params,),
        cancels=("c4",),
        drops=("p5", "p6"),
    )


def _store() -> StoreMetadata:
    event = BlockStored(block_hashes=(b"\x01" * 8,), parent_block_hash=None,
                        token_ids=tuple(range(4)), block_size=4, medium="CPU")
    return StoreMetadata(loads={"r": (LoadBlock(0, 3, b"\xaa" * 16), LoadBlock(1, 4, b"\xbb"))},
                         saves=(SaveBlock(0, 5, b"\x01" * 8, event),))


def _offload() -> OffloadMetadata:
    return OffloadMetadata(pools_token="tok", loads={"r": ((0, 0, 3, 0, 11), (1, 0, 3, 1, 12))},
                           stores=((0, 1, 2, 0, 5),), shared_pools=(("/dev/shm/x", 8, 4096),))


def _storage() -> StorageMetadata:
    return StorageMetadata(loads={"a": ((0, 1, b"\x02" * 32),)}, saves={"b": ((1, 2, b"\x03"),)},
                           delayed=frozenset({"b", "c"}))


CASES = {
    "base": ConnectorMetadata,
    "nixl_empty": PdMetadata,
    "nixl": _nixl,
    "mooncake_store": _store,
    "mooncake_store_empty": StoreMetadata,
    "offloading": _offload,
    "shared_storage": _storage,
    "shared_storage_empty": StorageMetadata,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip(name: str) -> None:
    meta = CASES[name]()
    data = encode_metadata(meta)
    assert isinstance(data, bytes)
    back = decode_metadata(data)
    assert type(back) is type(meta)
    if type(meta) is not ConnectorMetadata:
        assert back == meta
    assert encode_metadata(back) == data


def test_multi_round_trip_keeps_each_child_type() -> None:
    meta = MultiMetadata(children=(_nixl(), _offload(), ConnectorMetadata()), delayed={"r": 2})
    back = decode_metadata(encode_metadata(meta))
    assert isinstance(back, MultiMetadata)
    assert [type(c) for c in back.children] == [PdMetadata, OffloadMetadata, ConnectorMetadata]
    assert back.children[:2] == meta.children[:2]
    assert back.delayed == {"r": 2}


def _raw(meta: ConnectorMetadata) -> list:
    return msgpack.unpackb(encode_metadata(meta), raw=False, strict_map_key=False)


def test_wrong_field_type_names_the_field() -> None:
    raw = _raw(_offload())
    raw[2]["stores"][0][2] = "three"
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.stores[0][2]"


def test_bad_transfer_params_names_the_nested_field() -> None:
    raw = _raw(_nixl())
    raw[2]["loads"][0]["params"]["producer_port"] = -1
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.loads[0].params.producer_port"


def test_unknown_missing_and_tag_errors() -> None:
    raw = _raw(_storage())
    raw[2]["surprise"] = 1
    with pytest.raises(MetadataWireError, match="unknown field") as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.surprise"
    raw = _raw(_storage())
    del raw[2]["delayed"]
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.delayed"
    raw = _raw(_storage())
    raw[1] = "builtins:object"
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.tag"
    raw = _raw(_storage())
    raw[0] = 2
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(msgpack.packb(raw, use_bin_type=True))
    assert info.value.field == "metadata.version"
    with pytest.raises(MetadataWireError) as info:
        decode_metadata(b"\xc1")
    assert info.value.field == "metadata"


def test_encode_refuses_a_wrong_value_and_a_non_dataclass() -> None:
    with pytest.raises(MetadataWireError) as info:
        encode_metadata(OffloadMetadata(pools_token=3))  # type: ignore[arg-type]
    assert info.value.field == "metadata.pools_token"

    class Opaque(ConnectorMetadata):
        pass

    with pytest.raises(MetadataWireError, match="dataclass"):
        encode_metadata(Opaque())


def test_sets_encode_in_one_order_whatever_the_hash_seed() -> None:
    # a set's iteration order follows PYTHONHASHSEED and insertion history: the wire
    # sorts its elements, so equal metadata gives equal bytes in every process
    import subprocess
    import sys

    script = ("from kvbridge.connectors.metadata_wire import encode_metadata\n"
              "from kvbridge.connectors.shared_storage import StorageMetadata\n"
              "names = frozenset(f'req-{i}' for i in range(40))\n"
              "print(encode_metadata(StorageMetadata(delayed=names)).hex())\n")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, timeout=120,
                              env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("0", "1", "12345")}
    assert len(outputs) == 1 and outputs != {""}
