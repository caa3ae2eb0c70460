"""What one key of a Mooncake batch call amounted to: status codes and typed per-key results.

Owns :class:`McStatus` (every Mooncake status code by name, plus kvbridge's
own codes for calls not made or not waited for), :class:`KeyStatus`,
:class:`KeyResult`, and the pure interpretation of the raw binding's return
values (``interpret_*``: bytes read, 1/0 for exists, negative codes), with
their batch fast paths and the shared immutable results that keep a
4096-key batch cheap.

May not touch: the Mooncake binding, sockets, threads or the client's
counters (no I/O here; unit-tested alone). Imports nothing of kvbridge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class McStatus(enum.IntEnum):
    """Mooncake store status codes (``mooncake-store/include/types.h``), plus kvbridge's own.

    Codes >= -1999 come from Mooncake. Codes <= -10000 are produced by this
    client and never by Mooncake: the call was not made (master unreachable,
    client closed) or its answer was not waited for (timeout), or a get
    returned a size other than the destination's.
    """

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    FILE_INVALID_BUFFER = -1104
    FILE_LOCK_FAIL = -1105
    FILE_INVALID_HANDLE = -1106
    BUCKET_NOT_FOUND = -1200
    BUCKET_ALREADY_EXISTS = -1201
    KEYS_EXCEED_BUCKET_LIMIT = -1202
    KEYS_ULTRA_LIMIT = -1203
    UNABLE_OFFLOAD = -1300
    UNABLE_OFFLOADING = -1301
    TASK_NOT_FOUND = -1400
    TASK_PENDING_LIMIT_EXCEEDED = -1401
    # kvbridge-side codes (never returned by Mooncake itself).
    TIMEOUT = -10001
    MASTER_UNREACHABLE = -10002
    CLIENT_CLOSED = -10003
    SIZE_MISMATCH = -10004
    DEVICE_COPY_TIMEOUT = -10005  # the copy between device KV and the staging buffer
    STAGING_BUSY = -10006  # an abandoned call may still use the staging buffer: not called

    @staticmethod
    def name_of(code: int) -> str:
        """The status name for ``code``, or ``UNKNOWN(code)`` for a code this list lacks."""
        try:
            return McStatus(code).name
        except ValueError:
            return f"UNKNOWN({code})"


class KeyStatus(enum.Enum):
    """What one key's operation amounted to."""

    OK = "ok"
    NOT_FOUND = "not_found"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class KeyResult:
    """The outcome of one key in a batch call.

    ``code`` is :class:`McStatus`-valued (0 on success, negative otherwise);
    ``nbytes`` is the bytes moved (gets and puts) or 0.
    """

    status: KeyStatus
    code: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is KeyStatus.OK

    @property
    def not_found(self) -> bool:
        return self.status is KeyStatus.NOT_FOUND

    @property
    def code_name(self) -> str:
        return McStatus.name_of(self.code)

    def __str__(self) -> str:
        if self.ok:
            return f"ok({self.nbytes} B)"
        return f"{self.status.value}({self.code_name})"


_NOT_FOUND = KeyResult(KeyStatus.NOT_FOUND, McStatus.OBJECT_NOT_FOUND)
_EXISTS = KeyResult(KeyStatus.OK)
# KeyResult is immutable, so equal results are shared: building one object per
# key costs ~2 us, which is 15 % of a 4096 x 16 KiB get. Caches are bounded.
_CACHE_LIMIT = 4096
_OK_BY_NBYTES: dict[int, KeyResult] = {}
_ERROR_BY_CODE: dict[int, KeyResult] = {McStatus.OBJECT_NOT_FOUND: _NOT_FOUND}


def _ok(nbytes: int) -> KeyResult:
    result = _OK_BY_NBYTES.get(nbytes)
    if result is None:
        result = KeyResult(KeyStatus.OK, 0, nbytes)
        if len(_OK_BY_NBYTES) < _CACHE_LIMIT:
            _OK_BY_NBYTES[nbytes] = result
    return result


def _error(code: int) -> KeyResult:
    result = _ERROR_BY_CODE.get(code)
    if result is None:
        result = KeyResult(KeyStatus.ERROR, code)
        if len(_ERROR_BY_CODE) < _CACHE_LIMIT:
            _ERROR_BY_CODE[code] = result
    return result


# ---- pure interpretation of raw return values (no I/O; unit-tested alone) -------
def interpret_put(code: int, nbytes: int) -> KeyResult:
    """A ``batch_put_from``/``batch_upsert_from`` element: 0 ok, negative error."""
    return _ok(nbytes) if code == 0 else _error(int(code))


def interpret_get(code: int, expected_nbytes: int, exact_size: bool = True) -> KeyResult:
    """A ``batch_get_into`` element: bytes read (>= 0) or a negative code.

    With ``exact_size`` an object whose size differs from the destination is
    ``SIZE_MISMATCH``: the bytes in the buffer are not a whole block.
    """
    code = int(code)
    if code < 0:
        return _error(code)
    if exact_size and code != expected_nbytes:
        return KeyResult(KeyStatus.ERROR, McStatus.SIZE_MISMATCH, code)
    return _ok(code)


def interpret_exists(code: int) -> KeyResult:
    """A ``batch_is_exist`` element: 1 exists, 0 absent, negative error."""
    code = int(code)
    if code == 1:
        return _EXISTS
    if code == 0:
        return _NOT_FOUND
    # The binding documents -1 for "error"; it carries Mooncake's INTERNAL_ERROR name.
    return _error(code)


def interpret_remove(code: int) -> KeyResult:
    """A ``batch_remove`` element: 0 removed, -704 absent, other negative error."""
    code = int(code)
    return _EXISTS if code == 0 else _error(code)


def _ok_batch(sizes: list[int]) -> list[KeyResult]:
    """``[_ok(n) for n in sizes]`` without a Python-level loop per key (hot: 4096-key batches)."""
    if not sizes:
        return []
    first = sizes[0]
    if sizes.count(first) == len(sizes):  # the usual batch: every block the same size
        return [_ok(first)] * len(sizes)
    by_size = {n: _ok(n) for n in set(sizes)}
    return list(map(by_size.__getitem__, sizes))


def interpret_put_batch(codes: list[int], sizes: list[int]) -> list[KeyResult]:
    """:func:`interpret_put` over a batch (fast path when every key succeeded)."""
    if not any(codes):
        return _ok_batch(sizes)
    return [interpret_put(c, n) for c, n in zip(codes, sizes, strict=True)]


def interpret_get_batch(codes: list[int], sizes: list[int], exact_size: bool = True) -> list[KeyResult]:
    """:func:`interpret_get` over a batch (fast path when every key read its full size)."""
    if codes == sizes:
        return _ok_batch(sizes)
    return [interpret_get(c, n, exact_size) for c, n in zip(codes, sizes, strict=True)]


_EXISTS_LUT = {1: _EXISTS, 0: _NOT_FOUND}


def interpret_exists_batch(codes: list[int]) -> list[KeyResult]:
    """:func:`interpret_exists` over a batch."""
    lut = _EXISTS_LUT
    return [lut.get(c) or interpret_exists(c) for c in codes]


def uniform(results_len: int, code: McStatus) -> list[KeyResult]:
    """The same failure for every key of a call that was not made or not waited for."""
    return [_error(code)] * results_len
