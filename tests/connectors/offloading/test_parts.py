"""Part tables: every namespace a lookup must check, its bytes, its pool, its writer."""

from __future__ import annotations

import pytest

from kvbridge.connectors import ConfigError
from kvbridge.connectors.offloading import build_part_table, parse_settings, pool_fingerprint
from kvbridge.layouts import (
    BlockKey,
    KVCacheSpec,
    ParallelTopology,
    RegionLayout,
    RegionSpec,
    load_spec,
    lookup_namespaces,
)


def test_one_pool_per_part_size_and_every_lookup_namespace() -> None:
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology(tp_size=2)
    table = build_part_table(spec, topology)
    assert [p.namespace for p in table.parts] == list(lookup_namespaces(spec, topology))
    assert len(table.parts) == 2 and len(table.pool_bytes) == 1
    shape = spec.rank_shapes(topology)[0]
    assert table.pool_bytes == (shape.block_bytes,)
    # a part's key is exactly the layouts' BlockKey bytes
    h = bytes(range(32))
    assert table.parts[1].key(h) == BlockKey(table.parts[1].namespace, h).to_bytes()


def test_replicated_region_has_one_part_but_dcp_ranks_keep_theirs() -> None:
    spec = load_spec("tiny-mla")
    assert len(build_part_table(spec, ParallelTopology(tp_size=2)).parts) == 1
    dcp = build_part_table(spec, ParallelTopology(tp_size=2, dcp_size=2))
    assert sorted(p.namespace.dcp_rank for p in dcp.parts) == [0, 1]


def test_unequal_pipeline_stages_get_their_own_pools() -> None:
    spec = KVCacheSpec("three-layers", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 1, 2), block_size=16, num_kv_heads=4,
                   head_dim=32, dtype="float16"),))
    topology = ParallelTopology(pp_size=2)
    table = build_part_table(spec, topology)
    assert len(table.parts) == 2
    assert len(table.pool_bytes) == 2
    assert {p.block_bytes for p in table.parts} == set(table.pool_bytes)
    assert pool_fingerprint(spec, table.pool_bytes[0]) != pool_fingerprint(spec,
                                                                            table.pool_bytes[1])


def test_replicated_heads_share_a_part_and_only_the_writer_stores() -> None:
    spec = load_spec("tiny-gqa")  # 8 KV heads
    topology = ParallelTopology(tp_size=16)
    table = build_part_table(spec, topology)
    assert len(table.parts) == 8
    writers = 0
    readers: dict[int, int] = {}
    for rank in topology.ranks():
        part, writer = table.rank_parts(spec, rank)[0]
        writers += writer
        readers[part.index] = readers.get(part.index, 0) + 1
    assert writers == 8
    assert set(readers.values()) == {2}


@pytest.mark.parametrize(("extra", "field"), [
    ({"cpu_blocks": 0}, "cpu_blocks"),
    ({"policy": "mru"}, "policy"),
    ({"fs_dir": ""}, "fs_dir"),
    # fault injection is no setting: tests and the demo hand the tier a wrapped I/O
    ({"fs_dir": "/x", "fs_faults": {"rate": 0.1}}, "fs_faults"),
    ({"obj": "localhost"}, "obj"),
    ({"shm_dir": 3}, "shm_dir"),
    ({"bogus": 1}, "bogus"),
    ({"verify": "paranoid"}, "verify"),
    ({"verify": True}, "verify"),
    ({"verify_sample": 0}, "verify_sample"),
    ({"verify_sample": 1.5}, "verify_sample"),
    ({"verify_sample": True}, "verify_sample"),
    ({"verify_allow_unverified": "yes"}, "verify_allow_unverified"),
    ({"fs_read_threads": 0}, "fs_read_threads"),
    ({"fs_write_threads": 65}, "fs_write_threads"),
    ({"fs_read_threads": True}, "fs_read_threads"),
    ({"fs_write_threads": 2.0}, "fs_write_threads"),
    ({"fs_io_engine": "aio"}, "fs_io_engine"),
    ({"fs_io_engine": True}, "fs_io_engine"),
])
def test_settings_errors_name_the_key(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(extra)
    assert info.value.field == f"kv_connector_extra_config.{field}"


def test_deadline_and_quarantine_settings_are_parsed_and_validated() -> None:
    import pytest

    from kvbridge.connectors.errors import ConfigError
    from kvbridge.connectors.offloading.settings import parse_settings

    settings = parse_settings({"probe_timeout_s": 2, "load_timeout_s": 7.5,
                               "fs_quarantine_after": 5})
    assert (settings.probe_timeout_s, settings.load_timeout_s,
            settings.fs_quarantine_after) == (2.0, 7.5, 5)
    defaults = parse_settings({})
    assert defaults.probe_timeout_s is None and defaults.load_timeout_s is None
    for key, bad in (("probe_timeout_s", 0), ("load_timeout_s", -1), ("load_timeout_s", True),
                     ("probe_timeout_s", float("inf")), ("fs_quarantine_after", 0),
                     ("fs_quarantine_after", 2.5)):
        with pytest.raises(ConfigError, match=key):
            parse_settings({key: bad})


def test_fs_thread_settings_reach_the_fs_tier(tmp_path) -> None:
    from kvbridge.connectors.offloading.scheduler import build_managers
    from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS

    defaults = parse_settings({})
    assert (defaults.fs_read_threads, defaults.fs_write_threads) == (
        DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS)
    spec = load_spec("tiny-gqa")
    table = build_part_table(spec, ParallelTopology())
    settings = parse_settings({"fs_dir": str(tmp_path), "fs_o_direct": False,
                               "fs_read_threads": 3, "fs_write_threads": 1, "cpu_blocks": 4})
    managers, client = build_managers(spec, table, settings)
    try:
        assert client is None
        fs = managers[0].secondaries[0]
        assert fs._read_pool.num_threads == 3 and fs._write_pool.num_threads == 1
    finally:
        for manager in managers:
            manager.shutdown()


def test_fs_io_engine_reaches_the_fs_tier(tmp_path) -> None:
    """The default batches a small-block fs tier's reads once the CPU tier attached (the
    manager attaches it); ``python`` reads one by one."""
    from kvbridge.connectors.offloading.scheduler import build_managers

    assert parse_settings({}).fs_io_engine == "auto"
    spec = load_spec("tiny-gqa")
    table = build_part_table(spec, ParallelTopology())
    for engine, batched in (("auto", True), ("python", False)):
        settings = parse_settings({"fs_dir": str(tmp_path / engine), "cpu_blocks": 4,
                                   "fs_io_engine": engine})
        managers, _client = build_managers(spec, table, settings)
        try:
            fs = managers[0].secondaries[0].tier
            assert fs.io_engine == engine and fs.o_direct
            assert fs.batched is batched
        finally:
            for manager in managers:
                manager.shutdown()


def test_verify_settings_defaults_are_measured_and_reach_every_tier(tmp_path) -> None:
    from kvbridge.connectors.offloading.scheduler import build_managers
    from kvbridge.layouts.digests import DigestMode

    defaults = parse_settings({})
    # CPU and obj tiers sample (full costs ~30-45 % of a copy); the disk-bound fs tier
    # checks every block; a given ``verify`` applies to every tier
    assert defaults.verify.mode is DigestMode.SAMPLE and defaults.verify.sample_fraction == 1 / 16
    assert defaults.fs_verify.mode is DigestMode.FULL
    given = parse_settings({"verify": "sample"})
    assert given.fs_verify.mode is given.verify.mode is DigestMode.SAMPLE
    sample = parse_settings({"verify": "sample", "verify_sample": 0.5,
                             "verify_allow_unverified": False}).verify
    assert (sample.mode, sample.sample_fraction, sample.allow_unverified) == (
        DigestMode.SAMPLE, 0.5, False)
    spec = load_spec("tiny-hybrid")
    table = build_part_table(spec, ParallelTopology())
    settings = parse_settings({"verify": "off", "fs_dir": str(tmp_path), "fs_o_direct": False})
    managers, _ = build_managers(spec, table, settings)
    try:
        for pool, manager in enumerate(managers):
            layers = table.pool_layers(pool)
            assert layers > 1                      # a mismatch names the layer
            tiers = [manager.primary, *(runner.tier for runner in manager.secondaries)]
            assert {t.verify.mode for t in tiers} == {DigestMode.OFF}
            assert {t.num_layers for t in tiers} == {layers}
    finally:
        for manager in managers:
            manager.shutdown()


def test_the_fs_io_hook_is_scoped_and_one_at_a_time() -> None:
    from kvbridge.connectors.offloading.io_hook import fs_io_factory, installed_fs_io_factory
    from kvbridge.offload.fs_io import FsIO

    def factory(root: str, fingerprint: str) -> FsIO:
        return FsIO()

    assert installed_fs_io_factory() is None        # the real I/O unless a block says else
    with fs_io_factory(factory):
        assert installed_fs_io_factory() is factory
        with pytest.raises(ConfigError, match="one at a time"), fs_io_factory(factory):
            pass
        assert installed_fs_io_factory() is factory
    assert installed_fs_io_factory() is None        # off again when the block ends
