"""Digest records of the Mooncake store connector and its verify settings (no store needed)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbridge.connectors import ConfigError
from kvbridge.connectors.mooncake_store import parse_settings, store_key
from kvbridge.connectors.mooncake_store.records import (
    HEADER_BYTES,
    MAGIC,
    RecordTable,
    RecordVerdict,
    algorithm_id,
    algorithm_of,
    digest_key_prefix,
    key_digest,
    record_bytes,
    record_dtype,
)
from kvbridge.connectors.mooncake_store.verify import RankDigests
from kvbridge.connectors.mooncake_store.worker import LayerSlot, RegionPlan
from kvbridge.layouts import ParallelTopology, load_spec, namespace_for
from kvbridge.layouts.digests import (
    ALGORITHM,
    DIGEST_VERSION,
    TORCH_ALGORITHM,
    BlockDigester,
    DigestMode,
    LayerSpan,
    combine,
    digest_bytes,
    mix64_digest,
)

H = bytes(range(32))
EXTRA = {"master_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/m"}


def test_record_key_is_next_to_the_layer_keys_and_never_one_of_them() -> None:
    ns = namespace_for(load_spec("tiny-gqa"), "attn", ParallelTopology(tp_size=2))
    key = digest_key_prefix(ns) + H.hex()
    namespace, kind, digest = key.rsplit(":", 2)
    assert namespace == ns.encode() and kind == "D1" and bytes.fromhex(digest) == H
    assert all(key != store_key(ns, layer, H) for layer in range(4))


def test_record_layout_is_the_documented_little_endian_struct() -> None:
    assert record_dtype(3).itemsize == record_bytes(3) == HEADER_BYTES + 3 * 8
    buffer = np.zeros(2 * record_bytes(3), dtype=np.uint8)
    table = RecordTable(buffer, num_layers=3, block_bytes=4096, num_blocks=2)
    table.reset_headers()
    table.write([1], [0x1122334455667788], np.array([[1, 2, (1 << 64) - 1]], dtype=np.uint64))
    fields = struct.unpack("<4sHHIIQQ3Q", buffer[record_bytes(3):].tobytes())
    assert fields == (MAGIC, 1, DIGEST_VERSION, 1, 3, 4096, 0x1122334455667788,
                      1, 2, (1 << 64) - 1)
    assert table.slot_ptr(1) - table.slot_ptr(0) == record_bytes(3)


def _kv(num_blocks: int, layers: int, block_bytes: int, stride: int
        ) -> tuple[np.ndarray, RegionPlan]:
    rng = np.random.default_rng(3)
    memory = rng.integers(0, 256, size=(layers, num_blocks * stride), dtype=np.uint8)
    slots = tuple(LayerSlot(layer, f"p{layer}:", int(memory[layer].ctypes.data), stride,
                            block_bytes) for layer in range(layers))
    return memory, RegionPlan(0, num_blocks, True, slots, "d:")


def test_rank_digests_equal_the_block_digester_of_layouts_digests() -> None:
    memory, plan = _kv(num_blocks=6, layers=3, block_bytes=256, stride=320)  # padded pages
    digests = RankDigests([plan], owner=memory)
    reference = BlockDigester({s.layer_id: LayerSpan(s.base_ptr, s.block_stride,
                                                     s.block_nbytes, plan.num_blocks)
                               for s in plan.layers}, [[0, 1, 2]], owner=memory)
    got = digests.layer_digests(0, [5, 0, 3])
    assert got.shape == (3, 3) and got.dtype == np.uint64
    for row, block in zip(got, [5, 0, 3], strict=True):
        assert tuple(int(d) for d in row) == reference.layer_digests(0, block)
        assert combine(row) == reference.block_digest(0, block)
    assert int(got[0][1]) == digest_bytes(memory[1][5 * 320:5 * 320 + 256].tobytes())
    assert digests.layer_digests(0, []).shape == (0, 3)


def test_check_names_the_layer_that_differs_and_rejects_foreign_records() -> None:
    memory, plan = _kv(num_blocks=4, layers=2, block_bytes=128, stride=128)
    digests = RankDigests([plan], owner=memory)
    save, load = digests.save[0], digests.load[0]
    ids = [0, 1, 2, 3]
    keys = [key_digest(f"d:{i}") for i in ids]
    save.write(ids, keys, digests.layer_digests(0, ids))
    load.records[:] = save.records  # what a get of every record would land
    assert load.failures(ids, keys, digests.layer_digests(0, ids)) == []
    memory[1][2 * 128 + 7] ^= 0xFF          # a flipped byte in layer 1 of block 2
    load.records["num_layers"][1] = 3        # block 1: a record of another geometry
    bad = dict(load.failures(ids, [keys[0], keys[1], keys[2], keys[0]],  # 3: another key's
                             digests.layer_digests(0, ids)))
    assert sorted(bad) == [1, 2, 3]
    assert bad[1].verdict is RecordVerdict.INVALID and "num_layers 3" in bad[1].reason
    assert bad[2].verdict is RecordVerdict.MISMATCH and bad[2].layer_position == 1
    assert bad[3].verdict is RecordVerdict.FOREIGN and "another key" in bad[3].reason
    load.records["magic"][0] = b"XXXX"
    ((_, check),) = load.failures([0], [keys[0]], digests.layer_digests(0, [0]))
    assert check.verdict is RecordVerdict.INVALID and "magic" in check.reason


def test_verify_settings_parse_once_with_clear_errors() -> None:
    settings = parse_settings(EXTRA)
    # the default samples (measured: full costs 15-55 % of a get here)
    assert settings.verify is DigestMode.SAMPLE and settings.verify_policy.mode is DigestMode.SAMPLE
    assert settings.verify_sample == 1 / 16
    assert settings.verify_allow_unverified is True
    sample = parse_settings({**EXTRA, "verify": "sample", "verify_sample": 0.25,
                             "verify_allow_unverified": False})
    policy = sample.verify_policy
    assert policy.mode is DigestMode.SAMPLE and policy.sample_fraction == 0.25
    assert not policy.allow_unverified
    assert parse_settings(sample.to_extra()) == sample
    assert parse_settings({**EXTRA, "verify": "off"}).verify_policy.enabled is False
    for key, value, expected in (("verify", "all", "expected one of ['off', 'sample', 'full']"),
                                 ("verify", 1, "expected a string"),
                                 ("verify_sample", 0, "in (0, 1]"),
                                 ("verify_sample", 1.5, "in (0, 1]"),
                                 ("verify_sample", True, "in (0, 1]"),
                                 ("verify_allow_unverified", "yes", "true or false")):
        with pytest.raises(ConfigError) as info:
            parse_settings({**EXTRA, key: value})
        assert info.value.field == f"kv_connector_extra_config.{key}"
        assert expected in str(info.value)


def test_torch_digests_equal_the_reference_and_records_name_their_algorithm() -> None:
    """``torch-mix64-v1`` (what a rank with KV in device memory takes, on its device; a
    host rank can take it too): the reference definition of ``layouts.digests`` over
    each block's bytes, and the records say which algorithm they were taken with."""
    import torch

    memory, plan = _kv(num_blocks=5, layers=2, block_bytes=200, stride=264)  # tail words
    tensors = {layer: torch.from_numpy(memory[layer]) for layer in range(2)}
    host = RankDigests([plan], owner=memory, tensors=tensors)
    assert host.algorithm == ALGORITHM and host.algorithms == (ALGORITHM, TORCH_ALGORITHM)
    got = host.layer_digests(0, [4, 1], TORCH_ALGORITHM)
    assert got.shape == (2, 2) and got.dtype == np.uint64
    for row, block in zip(got, [4, 1], strict=True):
        assert [int(d) for d in row] == [
            mix64_digest(memory[layer][block * 264:block * 264 + 200].tobytes())
            for layer in range(2)]
    assert host.layer_digests(0, [], TORCH_ALGORITHM).shape == (0, 2)
    device = RankDigests([plan], owner=memory, tensors=tensors, on_host=False)
    assert device.algorithm == TORCH_ALGORITHM and device.algorithms == (TORCH_ALGORITHM,)
    assert device.save[0].records["algorithm"][0] == 2 == algorithm_id(TORCH_ALGORITHM)
    assert host.save[0].records["algorithm"][0] == 1 and algorithm_of(2) == TORCH_ALGORITHM
    assert algorithm_of(0) is None and algorithm_of(3) is None
    np.testing.assert_array_equal(device.layer_digests(0, [4, 1]), got)
    with pytest.raises(ValueError, match="cannot take 'xxh3-64'"):
        device.layer_digests(0, [0], ALGORITHM)
    with pytest.raises(ValueError, match="host memory"):
        RankDigests([plan], owner=memory, tensors=tensors, on_host=False, algorithm=ALGORITHM)
    chosen = RankDigests([plan], owner=memory, tensors=tensors, algorithm=TORCH_ALGORITHM)
    assert chosen.algorithms == (TORCH_ALGORITHM, ALGORITHM)
    # a record checked with another algorithm than the one it names is not trusted
    ids, keys = [0, 1], [key_digest("d:0"), key_digest("d:1")]
    chosen.save[0].write(ids, keys, chosen.layer_digests(0, ids))
    chosen.load[0].records[:] = chosen.save[0].records
    assert chosen.load[0].failures(ids, keys, chosen.layer_digests(0, ids),
                                   TORCH_ALGORITHM) == []
    bad = chosen.load[0].failures(ids, keys, host.layer_digests(0, ids), ALGORITHM)
    assert [c.verdict for _, c in bad] == [RecordVerdict.INVALID] * 2
    assert "algorithm 2, expected 1" in bad[0][1].reason


def test_verify_algorithm_setting() -> None:
    assert parse_settings(EXTRA).verify_algorithm == "auto"
    chosen = parse_settings({**EXTRA, "verify_algorithm": TORCH_ALGORITHM})
    assert chosen.verify_algorithm == TORCH_ALGORITHM and parse_settings(chosen.to_extra()) == chosen
    for value in ("crc32", 1, "xxh3-64-slices"):
        with pytest.raises(ConfigError) as info:
            parse_settings({**EXTRA, "verify_algorithm": value})
        assert info.value.field == "kv_connector_extra_config.verify_algorithm"
