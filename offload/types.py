"""Shared vocabulary of the tiered offload store: keys, verdicts, jobs, events, errors.

Keys are opaque bytes (``OffloadKey``): the caller builds them from a layout's
key namespace and chained block hash. Nothing in ``offload`` parses a key; the
fs tier only hashes it into a file name, so nothing a peer sends becomes a path.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvbridge.events.schema import Locality

#: A block's key: namespace + chained block hash, opaque to the store.
OffloadKey = bytes
#: A request id as the engine names it.
RequestId = str


class OffloadError(Exception):
    """Error of the offload store; ``field`` names what was wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ShortReadError(OSError):
    """A block file ended before ``expected_bytes``: provable corruption.

    Stores are atomic (temp file + rename), so a correct writer can never leave
    a short file behind. It deletes the file, as do the other proofs of corruption of
    a full-size file (a torn block header, bytes that fail their digests; ``fs_io``).
    """

    def __init__(self, path: str, expected_bytes: int, read_bytes: int) -> None:
        super().__init__(f"short read of {path}: expected {expected_bytes} bytes, "
                         f"read {read_bytes}")
        self.path = path
        self.expected_bytes = expected_bytes
        self.read_bytes = read_bytes
        #: whether the short file was removed (a failed delete is logged, never raised)
        self.deleted = False

    removal_reason = "short"


class NotRegularFileError(OSError):
    """Something other than a regular file is where a block file should be.

    The fs tier only ever renames regular files into place, so a directory,
    FIFO, device or symlink there is provably not a block (never read, never
    followed). ``deleted``: whether it was removed.
    """

    removal_reason = "not_regular"

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {what}, not a block file")
        self.path = path
        self.what = what
        self.deleted = False


class BatchIOError(OSError):
    """A batch load/store stopped at its first failing block.

    ``num_succeeded`` blocks (the leading ones, in batch order) completed before
    the failure: they are valid and reported as ``JobResult.successful_keys``.

    ``skipped``: blocks before ``num_succeeded`` that failed on their own (index
    -> error) while the batch went on past them: a load whose bytes landed but
    failed their digests (or a provably torn header) says nothing about the next
    block, so a tier checks the rest of the batch, and only those blocks fail.
    ``num_succeeded == len(keys)`` then means nothing stopped the batch (``cause``
    is the first skipped error).

    ``fence``: set by a tier whose failed call may still be running (a Mooncake
    get abandoned at its timeout): True once that call provably ended; until
    then the job's buffers must not be reused (``SecondaryTier`` holds the job).
    """

    def __init__(self, num_succeeded: int, cause: BaseException,
                 fence: Callable[[], bool] | None = None,
                 skipped: Mapping[int, OSError] | None = None) -> None:
        super().__init__(f"batch failed after {num_succeeded} blocks: {cause}")
        self.num_succeeded = num_succeeded
        self.skipped: dict[int, OSError] = dict(skipped or {})
        self.cause = cause
        self.fence = fence


class LookupStatus(enum.Enum):
    """Verdict of ``OffloadManager.lookup`` for one request.

    HIT: ``num_blocks`` leading keys are ready in the primary (CPU) tier and
    pinned for the request; MISS: none is (``num_blocks`` is 0); HIT_PENDING:
    promotions from a secondary tier are in flight, ask again next step;
    RETRY: a secondary tier's verdict is not known yet (probe in flight), ask
    again next step. Neither of the last two blocks the scheduler thread.
    """

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


@dataclass(frozen=True)
class LookupResult:
    status: LookupStatus
    #: leading keys ready in the primary tier now (pinned for the request)
    num_blocks: int

    @property
    def ready(self) -> bool:
        """True when the answer is final for this step (HIT or MISS)."""
        return self.status in (LookupStatus.HIT, LookupStatus.MISS)


class JobKind(enum.Enum):
    LOAD = "load"      # secondary tier -> primary slot (promotion)
    STORE = "store"    # primary slot -> secondary tier (cascade)


@dataclass(frozen=True)
class JobResult:
    """Outcome of one tier job, reported on the scheduler thread.

    ``successful_keys``: every key of a successful job; for a failed batch, the
    keys that completed (kept): the leading ones before the failure, less any
    that failed on their own while the batch went on (``BatchIOError.skipped``:
    a block that failed its digests) — every other key of the job failed.
    """

    job_id: int
    success: bool
    successful_keys: tuple[OffloadKey, ...] = ()
    #: loads of a tier that stores digests: per successful key, the layer digests stored
    #: with its block (None: stored without); empty when the tier keeps none
    digests: tuple[tuple[int, ...] | None, ...] = ()


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class OffloadEvent:
    """Blocks appeared in or left a tier.

    ``medium`` and ``locality`` are the wire strings of ``kvbridge.events``
    (``Medium``: CPU for the primary tier, STORAGE for files and object stores;
    ``Locality``: LOCAL, or REMOTE for a shared store), so a connector turns
    this into a ``BlockStored``/``BlockRemoved`` by adding what only it knows
    (block hashes, token ids). ``tier`` names the tier ("cpu", "fs", "obj").
    """

    kind: EventKind
    keys: tuple[OffloadKey, ...]
    tier: str
    medium: str
    locality: str = Locality.LOCAL.value


@dataclass
class TierStats:
    """Counters of one tier; plain integers so a test can assert on them."""

    probes: int = 0
    probe_batches: int = 0
    loads_ok: int = 0          # blocks
    loads_failed: int = 0      # blocks
    load_jobs_failed: int = 0
    stores_ok: int = 0         # blocks
    stores_failed: int = 0     # blocks
    files_deleted: int = 0     # provably broken files removed on a load: short, torn header,
    #                            digest mismatch, not a regular file
    files_quarantined: int = 0  # removed after failing every read quarantine_after times
    jobs_fenced: int = 0       # completions held until an abandoned call ended
    close_errors_ignored: int = 0
    loads_verified: int = 0    # blocks whose bytes were checked against their digests
    loads_unverified: int = 0  # blocks loaded that were stored without digests
    digest_mismatches: int = 0  # blocks whose bytes did not match (failed loads)
    #: blocks whose header / digest object named another key (failed loads, removed): a
    #: block copied or renamed under this key's name, refused whatever the verify policy
    foreign_key_loads: int = 0
    extra: dict[str, int] = field(default_factory=dict)
