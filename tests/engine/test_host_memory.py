"""An engine refuses a KV cache its host could not hold, before allocating any of it, and
the estimate it checks is what its workers then allocate."""

from __future__ import annotations

import msgpack
import pytest

from kvbridge.auth import is_loopback as _is_loopback
from kvbridge.connectors import ConfigError
from kvbridge.engine import Engine, EngineConfig
from kvbridge.engine.core import (
    BLOCK_OVERHEAD_BYTES,
    HOST_MEMORY_FRACTION,
    available_memory_bytes,
    check_host_memory,
    kv_cache_bytes,
)
from kvbridge.engine.server import _handle_frames
from kvbridge.layouts import ParallelTopology, load_spec


@pytest.mark.parametrize(("preset", "topology"), [
    ("tiny-gqa", ParallelTopology(tp_size=2)),
    ("tiny-hybrid", ParallelTopology(tp_size=2, pp_size=2)),
    ("tiny-mla", ParallelTopology(tp_size=2, dcp_size=2)),
])
def test_the_estimate_is_what_the_workers_allocate(preset: str,
                                                   topology: ParallelTopology) -> None:
    config = EngineConfig(load_spec(preset), topology, num_blocks=8)
    engine = Engine(config)
    try:
        allocated = sum(t.numel() * t.element_size() for w in engine.workers
                        for t in w.caches.layers.values())
    finally:
        engine.shutdown()
    overhead = config.num_blocks * BLOCK_OVERHEAD_BYTES * len(config.spec.regions)
    assert kv_cache_bytes(config) == allocated + overhead


def test_more_blocks_than_the_host_holds_is_refused_naming_num_blocks() -> None:
    """Before: torch allocated block by block until the process (or machine) ran out."""
    spec = load_spec("tiny-gqa")
    one_block = kv_cache_bytes(EngineConfig(spec, num_blocks=1))
    # twice what fits now: the available memory moves between this read and the check's
    # own (other processes start and end), and one block over the line was flaky
    too_many = 2 * (int(available_memory_bytes() * HOST_MEMORY_FRACTION) // one_block) + 1
    config = EngineConfig(spec, num_blocks=too_many)
    with pytest.raises(ConfigError) as info:
        check_host_memory(config)  # what Engine() does first; nothing is allocated here
    assert info.value.field == "num_blocks"
    assert f"{too_many} blocks of this model" in info.value.reason
    assert "use fewer blocks" in info.value.reason
    check_host_memory(EngineConfig(spec, num_blocks=too_many // 8))  # fits: no error


def test_available_memory_is_a_positive_byte_count() -> None:
    have = available_memory_bytes()
    assert isinstance(have, int) and have > 1 << 20


def test_shutdown_is_refused_where_the_port_is_not_loopback() -> None:
    """The design choice: ``kvbridge serve`` on a non-loopback --host answers ``shutdown``
    with an error (stop it with a signal) unless --allow-remote-shutdown."""
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=8))
    try:
        limits = engine.control_limits()
        frame = [msgpack.packb({"op": "shutdown"})]
        reply, stop = _handle_frames(engine, frame, limits, allow_shutdown=False)
        assert not stop and reply["ok"] is False
        assert reply["error"].startswith("op: shutdown is not accepted over this control port")
        reply, stop = _handle_frames(engine, [msgpack.packb({"op": "info"})], limits,
                                     allow_shutdown=False)
        assert reply["ok"] is True and not stop  # everything else still served
        assert _handle_frames(engine, frame, limits, allow_shutdown=True) == ({"ok": True},
                                                                               True)
    finally:
        engine.shutdown()
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.0.0.5")
    assert not _is_loopback("host-a.example")


def _tree(tmp_path, cgroup: str, files: dict[str, str], available_kib: int = 8 << 20):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable: {available_kib} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_a_cgroup_limit_below_the_hosts_memory_bounds_what_is_available(tmp_path) -> None:
    """Before: a container limited to 1 GiB on an 8 GiB host was told 8 GiB were free."""
    gib = 1 << 30
    v2 = _tree(tmp_path / "v2", "0::/job\n", {"job/memory.max": str(gib),
                                               "job/memory.current": str(gib // 4)})
    assert available_memory_bytes(v2) == gib - gib // 4
    v1 = _tree(tmp_path / "v1", "4:memory:/box\n3:cpu:/\n",
               {"memory/box/memory.limit_in_bytes": str(2 * gib),
                "memory/box/memory.usage_in_bytes": str(gib)})
    assert available_memory_bytes(v1) == gib
    unlimited = _tree(tmp_path / "max", "0::/\n", {"memory.max": "max",
                                                    "memory.current": "5"})
    assert available_memory_bytes(unlimited) == 8 << 30
    v1_unlimited = _tree(tmp_path / "v1max", "4:memory:/\n",
                         {"memory/memory.limit_in_bytes": str(9223372036854771712),
                          "memory/memory.usage_in_bytes": "5"})
    assert available_memory_bytes(v1_unlimited) == 8 << 30
    # the host's MemAvailable stays the bound when it is the smaller
    small_host = _tree(tmp_path / "small", "0::/job\n", {"job/memory.max": str(64 * gib),
                                                         "job/memory.current": "0"},
                       available_kib=1 << 20)
    assert available_memory_bytes(small_host) == gib
    assert available_memory_bytes(str(tmp_path / "nothing-here")) > 0  # physical memory
