"""What a Mooncake store client is configured with, its errors, and the checks of its arguments.

Owns :class:`MooncakeConfig` (validated at construction, errors naming the
field), :class:`Protocol`, the error types the client raises for misuse or a
failed setup (per-key failures are results, see :mod:`.mooncake_results`), and
the edge checks of keys, pointers and sizes a batch call passes before the
binding sees them (:func:`check_keys`, :func:`check_ptr`,
:func:`check_batch`), written to cost no Python-level loop per key on the
usual batch.

May not touch: the Mooncake binding, sockets or threads (pure: nothing here
connects or calls the store). Imports nothing of kvbridge.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

MiB = 1 << 20


# ---- errors ---------------------------------------------------------------------
class MooncakeError(RuntimeError):
    """Base of this module's errors (per-key failures are results, not exceptions)."""


class MooncakeConfigError(MooncakeError, ValueError):
    """A configuration field or call argument is invalid; the message names it."""


class MooncakeUnavailable(MooncakeError):
    """The ``mooncake`` wheel cannot be imported here (missing, or its libraries fail to load)."""


class MooncakeSetupError(MooncakeError):
    """``setup()`` failed, or its master / metadata server is unreachable or stalled."""


class MooncakeClosedError(MooncakeError):
    """The client was closed (or never set up) and cannot serve calls."""


# ---- configuration --------------------------------------------------------------
class Protocol(str, enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


def _split_host_port(value: str, field_name: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise MooncakeConfigError(f"{field_name} must be 'host:port', got {value!r}")
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class MooncakeConfig:
    """Everything a client needs to join a store; validated at construction.

    ``master_address`` is the master's ``host:port`` (``MooncakeMaster.rpc_address``);
    ``metadata_server`` the HTTP metadata URL (``MooncakeMaster.metadata_url``),
    or ``P2PHANDSHAKE``/``etcd://...`` as Mooncake accepts them.
    ``global_segment_size`` (bytes) is what this client lends to the store (0
    mounts nothing: a pure reader/writer); ``local_buffer_size`` (bytes) is the
    client's staging buffer. ``device_name`` is the RDMA device list (ignored
    with TCP). ``op_timeout_s`` bounds each batch call; ``probe_timeout_s``
    bounds each reachability check (and the checks before ``setup()``).
    ``check_master_before_ops`` makes every call probe the master first and
    fail fast with ``MASTER_UNREACHABLE`` (~70 µs per call on loopback).
    ``num_op_threads`` calls can run at once (abandoned calls occupy one each).
    ``split_calls``: a put or get of at least ``split_calls`` x
    :data:`SPLIT_MIN_KEYS` keys of at most :data:`SPLIT_MAX_KEY_BYTES` each on
    average is cut into that many calls run at once (1: never cut; no more
    than ``num_op_threads``).
    """

    master_address: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 256 * MiB
    local_buffer_size: int = 64 * MiB
    protocol: Protocol = Protocol.TCP
    device_name: str = ""
    op_timeout_s: float = 5.0
    probe_timeout_s: float = 0.5
    check_master_before_ops: bool = True
    replica_num: int = 1
    num_op_threads: int = 4
    split_calls: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.protocol, str) and not isinstance(self.protocol, Protocol):
            try:
                object.__setattr__(self, "protocol", Protocol(self.protocol.lower()))
            except ValueError:
                raise MooncakeConfigError(
                    f"protocol must be one of {[p.value for p in Protocol]}, got {self.protocol!r}"
                ) from None
        _split_host_port(self.master_address, "master_address")
        if not self.metadata_server:
            raise MooncakeConfigError("metadata_server must be a URL such as http://127.0.0.1:8080/metadata")
        if not self.local_hostname:
            raise MooncakeConfigError("local_hostname must be this host's address, e.g. 127.0.0.1")
        if self.global_segment_size < 0:
            raise MooncakeConfigError(f"global_segment_size must be >= 0 bytes, got {self.global_segment_size}")
        if self.local_buffer_size < 0:
            raise MooncakeConfigError(f"local_buffer_size must be >= 0 bytes, got {self.local_buffer_size}")
        for name in ("op_timeout_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise MooncakeConfigError(f"{name} must be > 0 seconds, got {value}")
        if self.replica_num < 1:
            raise MooncakeConfigError(f"replica_num must be >= 1, got {self.replica_num}")
        if self.num_op_threads < 1:
            raise MooncakeConfigError(f"num_op_threads must be >= 1, got {self.num_op_threads}")
        if self.split_calls < 1:
            raise MooncakeConfigError(f"split_calls must be >= 1, got {self.split_calls}")
        if self.protocol is Protocol.RDMA and not self.device_name:
            raise MooncakeConfigError("device_name must name the RDMA device(s) when protocol is rdma")

    @property
    def master_host_port(self) -> tuple[str, int]:
        return _split_host_port(self.master_address, "master_address")

    @property
    def metadata_host_port(self) -> tuple[str, int] | None:
        """Host and port of an ``http://`` metadata server (None for other kinds)."""
        parts = urlsplit(self.metadata_server)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            return None
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def check_ptr(ptr: object, field_name: str) -> None:
    if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
        raise MooncakeConfigError(f"{field_name} must be a non-null address (int), got {ptr!r}")


_STR_ONLY = frozenset((str,))
_INT_ONLY = frozenset((int,))


def check_keys(keys: Sequence[str]) -> list[str]:
    keys_l = keys if type(keys) is list else list(keys)
    # Fast whole-batch test first, without a Python-level loop per key (4096 keys:
    # ~0.2 ms); find the culprit only on failure.
    if set(map(type, keys_l)) <= _STR_ONLY and all(keys_l):
        return keys_l
    for i, key in enumerate(keys_l):
        if not isinstance(key, str) or not key:
            raise MooncakeConfigError(f"keys[{i}] must be a non-empty str, got {key!r}")
    return keys_l


def _as_int_list(values: Sequence[int], field_name: str) -> list[int]:
    values_l = values if type(values) is list else list(values)
    if not set(map(type, values_l)) <= _INT_ONLY:  # exact ints (no bool), no per-item loop
        try:
            values_l = [int(v) for v in values_l]  # numpy integers, etc.
        except (TypeError, ValueError):
            raise MooncakeConfigError(f"{field_name} must be ints") from None
    return values_l


def check_batch(
    keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[str], list[int], list[int]]:
    keys_l = check_keys(keys)
    ptrs_l = _as_int_list(ptrs, "ptrs")
    sizes_l = _as_int_list(sizes, "sizes")
    if not len(keys_l) == len(ptrs_l) == len(sizes_l):
        raise MooncakeConfigError(
            f"keys, ptrs and sizes must have one entry per key; got {len(keys_l)}, "
            f"{len(ptrs_l)}, {len(sizes_l)}"
        )
    if keys_l and min(ptrs_l) <= 0:
        i = next(i for i, p in enumerate(ptrs_l) if p <= 0)
        raise MooncakeConfigError(f"ptrs[{i}] must be a non-null address, got {ptrs_l[i]}")
    if keys_l and min(sizes_l) <= 0:
        i = next(i for i, n in enumerate(sizes_l) if n <= 0)
        raise MooncakeConfigError(f"sizes[{i}] must be > 0 bytes, got {sizes_l[i]}")
    return keys_l, ptrs_l, sizes_l
#: a batch is cut into concurrent calls only with at least this many keys a call
SPLIT_MIN_KEYS = 256
#: ... and keys of at most this many bytes on average (larger ones gained nothing)
SPLIT_MAX_KEY_BYTES = 64 << 10


