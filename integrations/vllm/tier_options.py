"""What a kvbridge tier's ``secondary_tiers`` entry says, checked once at start-up, and
the namespace its keys get.

Pure: no vLLM import, no I/O. :mod:`kvbridge.integrations.vllm.tiering` (which vLLM
loads) parses an entry with :func:`parse_options` and prefixes vLLM's keys with
:func:`layout_fingerprint` of :func:`layout_identity`. The tuning defaults below
(threads, part sizes, holding) are the fs tier's under vLLM, each with the measurement
that chose it.

Owns: the config keys, their checks and defaults; the layout identity and its
fingerprint, which names every stored file and object (a persistent format: changing
what goes into it orphans every stored chunk). May not touch: vLLM, the tiers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.verify_config import parse_verify
from kvbridge.layouts.digests import DigestMode
from kvbridge.offload.fs_batch import IO_ENGINES

# ---- config ------------------------------------------------------------------------
#: keys every kvbridge tier takes (beside ``type``/``module_path``/``backpressure``,
#: which vLLM's factory takes away)
COMMON_KEYS = ("verify", "verify_sample", "verify_allow_unverified", "probe_timeout_s",
               "load_timeout_s", "store_timeout_s", "read_threads", "write_threads",
               "bounce_bytes", "enable_kv_events", "locality", "namespace")
FS_KEYS = ("root_dir", "o_direct", "io_engine", "quarantine_after", "fsync") + COMMON_KEYS
OBJ_KEYS = ("mooncake",) + COMMON_KEYS
#: default arena of a tier: the bytes of I/O in flight (and given up) at once
DEFAULT_BOUNCE_BYTES = 512 << 20
#: a store nobody waits for, but it pins its primary slots until reported
DEFAULT_STORE_TIMEOUT_S = 30.0
MAX_THREADS = 64
#: I/O threads of the fs tier inside vLLM: vLLM promotes and cascades one job per request
#: and step, often of one chunk, so a job rarely fills more than one thread and the
#: parallelism the disk sees is the number of jobs in flight. vLLM's own fs tier runs 16
#: load-first and 16 store-first threads, each taking the other queue when its own is
#: empty: 32 reads in flight when nothing is stored. Jobs of one 16 KiB chunk loaded at
#: 1.9x vLLM's fs tier with 16 read threads and 2.6x with 32 (both in one process,
#: paired rounds); at 2 MiB the count made no difference beyond the noise. Threads start
#: as jobs arrive (an idle tier holds none of them).
FS_READ_THREADS = 32
FS_WRITE_THREADS = 32
#: keys the fs tier remembers having stored or loaded (a lookup of one is a hit at
#: once, with no ``lstat`` on a probe thread and no RETRY step): ~12 MiB at most
FS_REMEMBER_PRESENT = 1 << 16
#: the fs tier cuts a job into parts of at least this many bytes of block files, one
#: part per thread: a part's own Python work (a pool hand-off, its result) costs about
#: as much as reading a small file, so a job of 8 chunks of 16 KiB runs whole on one
#: thread, chunks of 128 KiB and up one per thread. For the same reason a step's burst
#: of smaller jobs (one chunk of 16 KiB per request) shares load calls up to this size
#: (``Tier.merge_load_blocks``)
FS_PART_MIN_BYTES = 128 << 10
#: stores are cut into bigger parts: a stored block's Python work (the copy into the
#: arena, its digests and header) is larger than a loaded one's, and a cascade has no
#: reader waiting on its first block. Jobs of 8 chunks of 256 KiB in 1 MiB parts stored
#: at 0.95-1.01 of vLLM's fs tier against 0.76-0.80 in 128 KiB parts (three runs each
#: of ``tools/bench/vllm_tiering``'s case, 9 rounds)
FS_STORE_PART_MIN_BYTES = 1 << 20
#: jobs smaller than this wait for the tier's ``on_schedule_end`` and start together
#: (``TierRunner.flush_jobs``): hundreds of one-chunk jobs of 16 KiB in one step cost a
#: pool hand-off per thread, not per job. Larger jobs start when submitted: a cascade
#: held to the step's end only starts later (jobs of one 2 MiB chunk stored at 0.77 of
#: vLLM's fs tier held, against 0.88 before holding)
HOLD_BELOW_BYTES = 128 << 10
#: loads of any size wait for ``on_schedule_end`` too (``TierRunner(hold_loads=...)``):
#: vLLM submits every promotion in its ``on_schedule_end`` just before the tiers' own, so
#: the wait is nothing, and a step's promotions then cost the scheduler a pool hand-off
#: per thread, not per job or part. Jobs of one 256 KiB chunk loaded at 1.20 of vLLM's
#: fs tier held against 1.07 not (one process, paired rounds); 2 MiB: no difference
HOLD_LOADS = True


def option_where(tier_type: str, key: str = "") -> str:
    """How an error names a tier's entry, or one of its keys:
    ``secondary_tiers[TYPE].key``."""
    return f"secondary_tiers[{tier_type}]" + (f".{key}" if key else "")


def _seconds(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or not math.isfinite(value):
        raise ConfigError(where, f"expected a positive number of seconds, got {value!r}")
    return float(value)


def _count(where: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(where, f"expected an integer in [{low}, {high}], got {value!r}")
    return value


def _flag(where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(where, f"expected true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class TierOptions:
    """What a kvbridge tier's config dict says, checked (``parse_options``)."""

    tier_type: str
    verify: Any
    probe_timeout_s: float | None
    load_timeout_s: float | None
    store_timeout_s: float
    read_threads: int | None
    write_threads: int | None
    bounce_bytes: int
    enable_kv_events: bool
    locality: str | None
    namespace: str
    #: the tier's own keys (root_dir, mooncake, ...), as given
    own: Mapping[str, Any] = field(default_factory=dict)


def parse_options(tier_type: str, options: Mapping[str, Any], known: Sequence[str],
                  default_verify: DigestMode) -> TierOptions:
    """Check ``options`` (a ``secondary_tiers`` entry less what vLLM takes); a
    ``ConfigError`` names the key."""
    where = option_where(tier_type)
    for key in options:
        if key not in known:
            raise ConfigError(f"{where}.{key}", f"unknown key; {tier_type} takes "
                                                f"{sorted(known)}")
    verify = parse_verify(options, where, default_verify)
    timeouts = {name: None if options.get(name) is None
                else _seconds(f"{where}.{name}", options[name])
                for name in ("probe_timeout_s", "load_timeout_s", "store_timeout_s")}
    threads = {name: None if options.get(name) is None
               else _count(f"{where}.{name}", options[name], 1, MAX_THREADS)
               for name in ("read_threads", "write_threads")}
    bounce = _count(f"{where}.bounce_bytes", options.get("bounce_bytes", DEFAULT_BOUNCE_BYTES),
                    1, 1 << 40)
    locality = options.get("locality")
    if locality is not None and str(locality).upper() not in ("LOCAL", "REMOTE"):
        raise ConfigError(f"{where}.locality", f"expected LOCAL or REMOTE, got {locality!r}")
    namespace = options.get("namespace", "")
    if not isinstance(namespace, str) or len(namespace) > 256:
        raise ConfigError(f"{where}.namespace", f"expected a string of at most 256 "
                                                f"characters, got {namespace!r}")
    return TierOptions(
        tier_type, verify, timeouts["probe_timeout_s"], timeouts["load_timeout_s"],
        timeouts["store_timeout_s"] or DEFAULT_STORE_TIMEOUT_S, threads["read_threads"],
        threads["write_threads"], bounce,
        _flag(f"{where}.enable_kv_events", options.get("enable_kv_events", False)),
        None if locality is None else str(locality).upper(), namespace,
        {k: v for k, v in options.items() if k not in COMMON_KEYS})


@dataclass(frozen=True)
class FsOptions:
    """The fs tier's own keys of its entry, checked (``parse_fs_options``)."""

    root_dir: str
    io_engine: str
    o_direct: bool
    fsync: bool
    quarantine_after: int


def parse_fs_options(tier_type: str, own: Mapping[str, Any]) -> FsOptions:
    """Check the fs tier's own keys (``TierOptions.own``); a ``ConfigError`` names the key.
    ``io_engine`` defaults to ``python`` (one read per file): vLLM promotes a request's
    chunks per step, often one or a few, and the batched io_uring path loaded 2-5x
    slower than plain reads for such jobs in tools/bench/vllm_tiering (256 KiB x 1,
    16 KiB x 8 per job)."""
    root = own.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ConfigError(option_where(tier_type, "root_dir"),
                          f"expected a directory path, got {root!r}")
    io_engine = own.get("io_engine", "python")
    if io_engine not in IO_ENGINES:
        raise ConfigError(option_where(tier_type, "io_engine"),
                          f"expected one of {', '.join(IO_ENGINES)}, got {io_engine!r}")
    return FsOptions(
        root, io_engine,
        _flag(option_where(tier_type, "o_direct"), own.get("o_direct", True)),
        _flag(option_where(tier_type, "fsync"), own.get("fsync", False)),
        _count(option_where(tier_type, "quarantine_after"), own.get("quarantine_after", 3),
               1, 1 << 20))


# ---- the namespace -----------------------------------------------------------------
def layout_identity(spec: Any, block_bytes: int, namespace: str = "") -> dict[str, Any]:
    """What must match for a stored chunk to be the same bytes: model, KV dtype and
    layout, chunk geometry (tokens, groups, bytes) and, unless vLLM says the bytes are
    the same under every topology, the parallel sizes. Read from the offloading spec."""
    config = spec.config
    parallel = config.parallel
    identity: dict[str, Any] = {
        "model": config.model.name, "dtype": config.model.dtype,
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
        "canonical_layout": bool(getattr(config, "canonical_layout", False)),
        "replicated_layout": bool(getattr(config, "replicated_layout", False)),
        "groups": [[g.tokens_per_block, len(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": spec.blocks_per_chunk, "chunk_bytes": block_bytes,
        "namespace": namespace,
    }
    if not parallel.is_parallelism_agnostic:
        identity["parallel"] = [parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                                parallel.dcp_size, parallel.world_size]
    return identity


def layout_fingerprint(identity: Mapping[str, Any]) -> str:
    """16 hex digits of the identity (the fs tier's file names, the obj tier's prefix)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
