"""Settings of the offloading connector (``kv_connector_extra_config``), parsed once.

Keys:

* ``cpu_blocks`` (256): CPU slots per pool (primary tier size, in blocks).
* ``policy`` ("lru"): CPU eviction policy, ``lru`` or ``arc``.
* ``fs_dir`` (none): directory of the ``fs`` secondary tier; none = no fs tier.
* ``fs_o_direct`` (true): use O_DIRECT where the store directory allows it.
* ``fs_read_threads`` / ``fs_write_threads`` (4 / 4): the fs tier's I/O threads;
  a job (one request's promotion or store) runs on all of its pool's threads at once
  (``kvbridge.offload.fs``).
* ``fs_io_engine`` ("auto"): how the fs tier reads block files: ``auto``
  (batched io_uring reads through NIXL's POSIX backend for block files up to
  1 MiB when the backend works, else one by one), ``uring`` (batched, or the
  connector fails to start) or ``python`` (one by one) (``kvbridge.offload.fs``).
* ``shm_dir`` (none): back the CPU slots by files in this directory (e.g.
  ``/dev/shm``) so worker halves in other processes can map them; without it
  the workers must run in the scheduler's process.
* ``probe_timeout_s`` (fs: 5.0; obj: the client's ``op_timeout_s`` + 1): a
  lookup whose existence probe has not answered this long is a miss (the
  request computes instead of waiting: vLLM has no deadline of its own on a
  connector's "ask again").
* ``load_timeout_s`` (fs: 10.0; obj: 2 x ``op_timeout_s`` + 1): a promotion
  from a secondary tier still running this long is a failed load for the
  requests waiting on it (they recompute); its CPU slot stays reserved until
  the read really ends. Also the age at which a stuck I/O thread is replaced.
* ``fs_quarantine_after`` (3): a block file whose loads fail this many times
  in a row (EIO and the like, never provably short) is removed, so a later
  store can write it again.
* ``verify`` (CPU and obj tiers "sample", fs tier "full"): how the tiers check
  KV against the block digests taken where it was written
  (``kvbridge.layouts.digests``): ``off`` (no digest taken or checked),
  ``sample`` (a deterministic fraction of blocks checked) or ``full`` (every
  block); given, it applies to every tier. The defaults are measured (docs/verified-kv.md):
  full costs ~30-45 % of a CPU-tier copy and ~130 us of scheduler time per
  1 MiB CPU hit, nothing measurable on an O_DIRECT disk. A block whose bytes
  do not match is a failed load (recomputed); its stored copy is removed.
* ``verify_sample`` (1/16): the fraction of blocks ``sample`` checks, in (0, 1].
* ``verify_allow_unverified`` (true): a block stored without digests (written
  with ``verify`` off) is served and counted; false: such a load fails.
* ``obj`` (none): a Mooncake client config (``kvbridge.backends.mooncake.
  MooncakeConfig`` fields, e.g. ``{"master_address": "127.0.0.1:50051",
  "metadata_server": "http://127.0.0.1:8080/metadata"}``) for the ``obj``
  secondary tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.verify_config import parse_verify
from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, IO_ENGINES

#: no fs tier runs more I/O threads per pool than this (a bound on what a config starts)
MAX_FS_THREADS = 64

_PREFIX = "kv_connector_extra_config"
KNOWN = ("cpu_blocks", "policy", "fs_dir", "fs_o_direct", "fs_io_engine", "fs_read_threads",
         "fs_write_threads", "obj", "shm_dir",
         "probe_timeout_s", "load_timeout_s", "fs_quarantine_after", "verify", "verify_sample",
         "verify_allow_unverified")


@dataclass(frozen=True)
class OffloadSettings:
    cpu_blocks: int = 256
    policy: str = "lru"
    fs_dir: str | None = None
    fs_o_direct: bool = True
    obj: Mapping[str, Any] | None = field(default=None)
    shm_dir: str | None = None
    #: None: each tier's own default (see the module docstring)
    probe_timeout_s: float | None = None
    load_timeout_s: float | None = None
    fs_quarantine_after: int = 3
    #: what the CPU and obj tiers check before a block counts as loaded
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    #: what the fs tier checks: ``verify`` when it is given, else every block (the
    #: disk is the bottleneck: full costs nothing measurable with O_DIRECT)
    fs_verify: VerifyPolicy = field(default_factory=lambda: VerifyPolicy(DigestMode.FULL))
    fs_read_threads: int = DEFAULT_READ_THREADS
    fs_write_threads: int = DEFAULT_WRITE_THREADS
    fs_io_engine: str = "auto"


def parse_settings(extra: Mapping[str, Any]) -> OffloadSettings:
    """Validate ``extra``; a ConfigError names the offending key."""
    for key in extra:
        if key not in KNOWN:
            raise ConfigError(f"{_PREFIX}.{key}", f"unknown setting; expected one of {list(KNOWN)}")
    cpu_blocks = extra.get("cpu_blocks", 256)
    if isinstance(cpu_blocks, bool) or not isinstance(cpu_blocks, int) or cpu_blocks < 1:
        raise ConfigError(f"{_PREFIX}.cpu_blocks",
                          f"expected a positive number of blocks, got {cpu_blocks!r}")
    policy = extra.get("policy", "lru")
    if policy not in ("lru", "arc"):
        raise ConfigError(f"{_PREFIX}.policy", f"expected 'lru' or 'arc', got {policy!r}")
    fs_dir = extra.get("fs_dir")
    if fs_dir is not None and (not isinstance(fs_dir, str) or not fs_dir):
        raise ConfigError(f"{_PREFIX}.fs_dir", f"expected a directory path, got {fs_dir!r}")
    o_direct = extra.get("fs_o_direct", True)
    if not isinstance(o_direct, bool):
        raise ConfigError(f"{_PREFIX}.fs_o_direct", f"expected true or false, got {o_direct!r}")
    io_engine = extra.get("fs_io_engine", "auto")
    if io_engine not in IO_ENGINES:
        raise ConfigError(f"{_PREFIX}.fs_io_engine", f"expected one of "
                                                     f"{', '.join(IO_ENGINES)}, got {io_engine!r}")
    obj = extra.get("obj")
    if obj is not None:
        if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
            raise ConfigError(f"{_PREFIX}.obj", "expected a Mooncake client config object "
                                                "(master_address, metadata_server, ...)")
        obj = dict(obj)
    shm_dir = extra.get("shm_dir")
    if shm_dir is not None and (not isinstance(shm_dir, str) or not shm_dir):
        raise ConfigError(f"{_PREFIX}.shm_dir", f"expected a directory path, got {shm_dir!r}")
    timeouts: dict[str, float | None] = {}
    for name in ("probe_timeout_s", "load_timeout_s"):
        value = extra.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 < value < float("inf")):
            raise ConfigError(f"{_PREFIX}.{name}", f"expected a positive number of seconds, "
                                                   f"got {value!r}")
        timeouts[name] = None if value is None else float(value)
    quarantine = extra.get("fs_quarantine_after", 3)
    if isinstance(quarantine, bool) or not isinstance(quarantine, int) or quarantine < 1:
        raise ConfigError(f"{_PREFIX}.fs_quarantine_after",
                          f"expected a count >= 1 of failed loads, got {quarantine!r}")
    threads = {}
    for name, default in (("fs_read_threads", DEFAULT_READ_THREADS),
                          ("fs_write_threads", DEFAULT_WRITE_THREADS)):
        value = extra.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_FS_THREADS:
            raise ConfigError(f"{_PREFIX}.{name}", f"expected a number of threads in "
                                                   f"[1, {MAX_FS_THREADS}], got {value!r}")
        threads[name] = value
    return OffloadSettings(cpu_blocks, policy, fs_dir, o_direct, obj, shm_dir,
                           timeouts["probe_timeout_s"], timeouts["load_timeout_s"], quarantine,
                           parse_verify(extra, _PREFIX),
                           parse_verify(extra, _PREFIX, DigestMode.FULL),
                           threads["fs_read_threads"], threads["fs_write_threads"], io_engine)
