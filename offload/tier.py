"""The secondary-tier interface: three blocking calls, one signature for every tier.

A secondary tier (``fs``: :class:`kvbridge.offload.fs.FsTier`, ``obj``:
:class:`kvbridge.offload.obj.ObjTier`) is the I/O of one store and nothing else:

* ``probe(keys)``: whether each key is stored;
* ``load(keys, buffers, digests_out)``: fill ``buffers`` from the stored blocks, in
  key order, and append to ``digests_out``, per loaded key, the layer digests stored
  with it (None: stored without; a tier that keeps none appends None);
* ``store(keys, buffers, digests)``: store ``buffers`` under ``keys``; ``digests[i]``
  are key ``i``'s layer digests, taken where its bytes were written (None: the tier
  takes them itself, or stores none).

The calls block and run on the threads of a :class:`kvbridge.offload.runner.TierRunner`,
which adds everything a scheduler needs around them (its pools, the lookup cache,
deadlines, fences, counts and events); the manager talks to runners only. A failed
load or store raises ``BatchIOError`` (``kvbridge.offload.types``); a block whose
stored copy the tier removed while loading it says so with a ``StoredCopyError``
(``removal``, ``deleted``).

Buffers (``BlockBuffers``): for each key, the list of memoryviews its block is read
into or written from, in order; their lengths add up to ``block_bytes``.

Two numbers, not flags, tell the runner how big a call is worth making:
``load_part_blocks`` and ``store_part_blocks``. The runner cuts a job into parts of
at least that many blocks, one per thread of its pool (a tier whose blocks are
independent files reads a promotion on every read thread at once); ``WHOLE_JOB``
(a tier that batches a job into one request, obj) means one call per job.
"""

from __future__ import annotations

import abc
import sys
import threading
from collections.abc import Sequence

from kvbridge.events.schema import Locality, Medium
from kvbridge.layouts.digests import VerifyPolicy
from kvbridge.offload.blockdigest import DEFAULT_VERIFY, LayerDigests, check_num_layers
from kvbridge.offload.types import OffloadError, OffloadKey

#: per key, the views its block bytes are read into / written from
BlockBuffers = Sequence[Sequence[memoryview]]

#: a part size no job reaches: the runner makes one call per job
WHOLE_JOB = sys.maxsize


class IOCounters:
    """What a tier's own I/O threads count (thread-safe); the runner counts the rest.

    ``loads_verified``/``loads_unverified``: blocks whose bytes were / could not be
    checked against stored digests; ``foreign_key_loads``: blocks whose header or digest
    object named another key (a block copied or renamed under this key's name, refused
    whatever the verify policy); ``close_errors_ignored``: a close that failed after a
    full read; ``extra``: the tier's own named counts (``fanout_refused``, ...).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loads_verified = 0
        self.loads_unverified = 0
        self.foreign_key_loads = 0
        self.close_errors_ignored = 0
        self.extra: dict[str, int] = {}

    def verified(self) -> None:
        with self._lock:
            self.loads_verified += 1

    def unverified(self) -> None:
        with self._lock:
            self.loads_unverified += 1

    def foreign_key(self) -> None:
        with self._lock:
            self.foreign_key_loads += 1

    def close_error(self) -> None:
        with self._lock:
            self.close_errors_ignored += 1

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the tier's own counter ``name`` (``extra``)."""
        with self._lock:
            self.extra[name] = self.extra.get(name, 0) + n

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"loads_verified": self.loads_verified,
                    "loads_unverified": self.loads_unverified,
                    "foreign_key_loads": self.foreign_key_loads,
                    "close_errors_ignored": self.close_errors_ignored,
                    "extra": dict(self.extra)}


def join_buffers(parts: Sequence[BlockBuffers]) -> BlockBuffers:
    """The buffers of several jobs as one call's: a buffer type with a ``join`` class
    method (one that carries more than views) joins itself; plain lists are concatenated."""
    join = getattr(type(parts[0]), "join", None) if parts else None
    if join is not None:
        joined: BlockBuffers = join(parts)
        return joined
    return [views for part in parts for views in part]


class Tier(abc.ABC):
    """A secondary tier's I/O: ``probe``, ``load`` and ``store`` (see the module docstring).

    ``verify``: what a load checks against the stored digests (digests are stored
    unless ``off``); ``num_layers``: equal layer spans of a block, one digest each
    (a mismatch names the layer).
    """

    medium: str = Medium.STORAGE.value
    locality: str = Locality.LOCAL.value
    #: a load job is cut into parts of at least this many blocks (``WHOLE_JOB``: none)
    load_part_blocks: int = WHOLE_JOB
    #: a store job is cut into parts of at least this many blocks (``WHOLE_JOB``: none)
    store_part_blocks: int = WHOLE_JOB
    #: small load jobs held by the runner (``hold_below_bytes``) may share one ``load`` call up
    #: to this many blocks (1: a call per job); the tier's ``load`` must then keep each
    #: block's outcome its own, as ``BatchIOError.skipped`` allows
    merge_load_blocks: int = 1
    #: the same for small store jobs and ``store``
    merge_store_blocks: int = 1

    def __init__(self, name: str, block_bytes: int, *, verify: VerifyPolicy = DEFAULT_VERIFY,
                 num_layers: int = 1) -> None:
        if block_bytes <= 0:
            raise OffloadError("block_bytes", f"expected a positive size, got {block_bytes}")
        self.name = name
        self.block_bytes = block_bytes
        self.verify = verify
        self.num_layers = check_num_layers(block_bytes, num_layers)
        self.counters = IOCounters()

    @abc.abstractmethod
    def probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether each key is stored (may block on I/O)."""

    @abc.abstractmethod
    def load(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
             digests_out: list[LayerDigests | None]) -> None:
        """Fill ``buffers`` from the stored blocks, in key order; per loaded key, append
        the digests stored with it to ``digests_out`` (None: none).

        Raises ``BatchIOError(num_succeeded, cause)`` at the first failing key; the
        keys before it were loaded completely, less those in its ``skipped`` (blocks
        that failed on their own, e.g. their digests, as the batch went on).
        """

    @abc.abstractmethod
    def store(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
              digests: Sequence[LayerDigests | None]) -> None:
        """Store ``buffers`` under ``keys`` with ``digests`` (one entry per key; None: the
        tier takes them, unless ``verify`` is off). ``BatchIOError`` as for loads."""

    def attach_primary(self, buffer: memoryview) -> None:  # noqa: B027 (optional hook)
        """The primary tier's slot memory (every buffer a job gets lies in it).

        Called once, before any job; a tier that registers memory for zero-copy
        transfers (obj) or batched reads (fs) does it here and undoes it in ``close``.
        """

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the tier holds; called once no job of it runs any more (or the
        runner gave up waiting for a stuck one)."""
