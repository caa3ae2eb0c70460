"""A kvbridge tier's ``secondary_tiers`` entry under vLLM: every key checked with an error
that names it, the defaults, and the key namespace, whose fingerprint names every stored
file and object (golden: changing it orphans what is stored). Pure: no vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

from kvbridge.connectors.errors import ConfigError
from kvbridge.integrations.vllm.tier_options import (
    DEFAULT_BOUNCE_BYTES,
    DEFAULT_STORE_TIMEOUT_S,
    FS_KEYS,
    OBJ_KEYS,
    layout_fingerprint,
    layout_identity,
    option_where,
    parse_fs_options,
    parse_options,
)
from kvbridge.layouts.digests import DigestMode


def _spec(agnostic: bool = False) -> Any:
    """The fields of vLLM's offloading spec that the identity reads."""
    return NS(blocks_per_chunk=1, config=NS(
        model=NS(name="org/model", dtype="bfloat16"), kv_cache_layout="NHD",
        canonical_layout=False, replicated_layout=False,
        groups=[NS(tokens_per_block=16, layer_names=("a", "b"))],
        cache=NS(tokens_per_hash=16),
        parallel=NS(is_parallelism_agnostic=agnostic, tp_size=2, pp_size=1, pcp_size=1,
                    dcp_size=1, world_size=2)))


def test_the_fingerprint_is_golden() -> None:
    identity = layout_identity(_spec(), 1 << 20)
    assert identity == {
        "model": "org/model", "dtype": "bfloat16", "kv_cache_layout": "NHD",
        "canonical_layout": False, "replicated_layout": False, "groups": [[16, 2]],
        "tokens_per_hash": 16, "blocks_per_chunk": 1, "chunk_bytes": 1 << 20,
        "namespace": "", "parallel": [2, 1, 1, 1, 2]}
    assert layout_fingerprint(identity) == "ed53efe0e9c9a26a"
    assert layout_fingerprint(layout_identity(_spec(), 1 << 20, "tenant-a")) \
        == "67306672d41bad46"


def test_topology_free_bytes_share_a_fingerprint_across_topologies() -> None:
    agnostic = layout_identity(_spec(agnostic=True), 1 << 20)
    assert "parallel" not in agnostic
    other = _spec(agnostic=True)
    other.config.parallel.tp_size = 8
    assert layout_fingerprint(layout_identity(other, 1 << 20)) == layout_fingerprint(agnostic)
    assert layout_fingerprint(agnostic) != layout_fingerprint(layout_identity(_spec(), 1 << 20))


def test_defaults() -> None:
    options = parse_options("KvbridgeFsTier", {"root_dir": "/kv"}, FS_KEYS, DigestMode.FULL)
    assert options.verify.mode is DigestMode.FULL
    assert options.store_timeout_s == DEFAULT_STORE_TIMEOUT_S
    assert options.bounce_bytes == DEFAULT_BOUNCE_BYTES
    assert (options.probe_timeout_s, options.load_timeout_s) == (None, None)
    assert (options.read_threads, options.write_threads) == (None, None)
    assert options.enable_kv_events is False and options.locality is None
    assert dict(options.own) == {"root_dir": "/kv"}
    fs = parse_fs_options("KvbridgeFsTier", options.own)
    assert (fs.root_dir, fs.io_engine, fs.o_direct, fs.fsync, fs.quarantine_after) \
        == ("/kv", "python", True, False, 3)


@pytest.mark.parametrize("key, value, message", [
    ("root_dri", "/kv", "unknown key"),
    ("load_timeout_s", 0, "positive number of seconds"),
    ("probe_timeout_s", float("inf"), "positive number of seconds"),
    ("store_timeout_s", True, "positive number of seconds"),
    ("read_threads", 0, r"integer in \[1, 64\]"),
    ("write_threads", 65, r"integer in \[1, 64\]"),
    ("bounce_bytes", "1G", "integer in"),
    ("enable_kv_events", "yes", "true or false"),
    ("locality", "NEARBY", "LOCAL or REMOTE"),
    ("namespace", "x" * 257, "at most 256"),
])
def test_a_bad_common_key_is_named(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_options("KvbridgeFsTier", {"root_dir": "/kv", key: value}, FS_KEYS,
                      DigestMode.FULL)
    assert option_where("KvbridgeFsTier", key) in str(info.value)


@pytest.mark.parametrize("own, key, message", [
    ({}, "root_dir", "expected a directory path"),
    ({"root_dir": ""}, "root_dir", "expected a directory path"),
    ({"root_dir": "/kv", "io_engine": "aio"}, "io_engine", "expected one of"),
    ({"root_dir": "/kv", "o_direct": 1}, "o_direct", "true or false"),
    ({"root_dir": "/kv", "fsync": "no"}, "fsync", "true or false"),
    ({"root_dir": "/kv", "quarantine_after": 0}, "quarantine_after", "integer in"),
])
def test_a_bad_fs_key_is_named(own: dict[str, object], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_fs_options("KvbridgeFsTier", own)
    assert option_where("KvbridgeFsTier", key) in str(info.value)


def test_an_fs_key_is_unknown_to_the_obj_tier() -> None:
    with pytest.raises(ConfigError, match="unknown key") as info:
        parse_options("KvbridgeObjTier", {"mooncake": {}, "root_dir": "/kv"}, OBJ_KEYS,
                      DigestMode.SAMPLE)
    assert "secondary_tiers[KvbridgeObjTier].root_dir" in str(info.value)
