"""The ``obj`` secondary tier: blocks as objects in the Mooncake distributed store.

Zero-copy: the primary tier's slot memory is registered with the client once
(``attach_primary``), and ``batch_put_from``/``batch_get_into`` move bytes
straight between slots and the store. Existence probes use one
``batch_exists`` per step. Object names are derived from key hashes only
(``<prefix><blake2b-128 hex>``), like the fs tier's file names.

Failure rules, as for the fs tier: a failed get is reported per job with the
leading keys that succeeded (``successful_keys``), and the tier's own lookup
cache marks the rest as misses (``SecondaryTier.get_finished_jobs``). The only
object the tier removes is one proven too short (Mooncake returned fewer bytes
than a block): the analogue of the fs tier's short read. Not-found (evicted by
Mooncake meanwhile), timeouts and an unreachable master remove nothing.

Timeouts: a get or put that outlived ``op_timeout_s`` is abandoned by the
client but keeps running. Its job is reported failed only once the client is
idle (the fence of ``SecondaryTier``): until then its slots stay WRITING, so
no other key's promotion or store gets a slot a late get could still write
(which would serve, and cascade, another key's bytes). Requests waiting on
such a promotion turn into misses at ``load_timeout_s``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvbridge.backends.mooncake import KeyResult, McStatus, MooncakeStoreClient
from kvbridge.events.schema import Locality, Medium
from kvbridge.layouts.digests import VerifyPolicy
from kvbridge.offload.blockdigest import DEFAULT_VERIFY
from kvbridge.offload.fs import FINGERPRINT_RE
from kvbridge.offload.fs_io import byte_views
from kvbridge.offload.tier import BlockBuffers, SecondaryTier
from kvbridge.offload.types import BatchIOError, OffloadError, OffloadKey, ShortReadError

logger = logging.getLogger(__name__)


#: fences (holding views of memory an abandoned call may still write) kept until exit
_KEPT_ALIVE: list[_IdleFence] = []


class _IdleFence:
    """Callable: True once the client is idle; holds ``views`` alive until then."""

    def __init__(self, client: MooncakeStoreClient, views: list[memoryview]) -> None:
        self._client = client
        self._views: list[memoryview] | None = views
        self.passed = False

    def __call__(self) -> bool:
        if not self.passed and self._client.wait_idle(0):
            self.passed = True
            self._views = None
        return self.passed


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class ObjTier(SecondaryTier):
    """Blocks in Mooncake under ``kvbridge/offload/<fingerprint>/<hash>``.

    ``client`` must be set up (``MooncakeStoreClient.setup``); the tier does
    not close it. Reads and writes each get their own thread pool, as in
    every tier, so a promotion never waits behind a cascade.
    """

    medium = Medium.STORAGE.value
    locality = Locality.REMOTE.value

    def __init__(self, client: MooncakeStoreClient, block_bytes: int, fingerprint: str, *,
                 read_threads: int = 2, write_threads: int = 2, name: str = "obj",
                 probe_timeout_s: float | None = None, load_timeout_s: float | None = None,
                 verify: VerifyPolicy = DEFAULT_VERIFY, num_layers: int = 1) -> None:
        if not FINGERPRINT_RE.match(fingerprint):
            raise OffloadError("fingerprint",
                               f"expected 8-64 lowercase hex digits, got {fingerprint!r}")
        # every Mooncake call is bounded by op_timeout_s already: the deadlines leave it room
        op_timeout_s = client.config.op_timeout_s
        super().__init__(name, block_bytes, read_threads, write_threads,
                         probe_timeout_s=(op_timeout_s + 1.0 if probe_timeout_s is None
                                          else probe_timeout_s),
                         load_timeout_s=(2 * op_timeout_s + 1.0 if load_timeout_s is None
                                         else load_timeout_s),
                         verify=verify, num_layers=num_layers)
        self.client = client
        self.prefix = f"kvbridge/offload/{fingerprint}/"
        self._registered: list[int] = []
        #: fences handed out (pruned as they pass); shutdown waits for them
        self._pending_fences: list[_IdleFence] = []
        self._fence_lock = threading.Lock()

    def object_name(self, key: OffloadKey) -> str:
        return self.prefix + hashlib.blake2b(key, digest_size=16).hexdigest()

    def attach_primary(self, buffer: memoryview) -> None:
        """Register the primary tier's slot memory for zero-copy puts and gets."""
        ptr = _address(buffer)
        self.client.register_buffer(ptr, len(buffer))
        self._registered.append(ptr)

    def probe_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return self.client.batch_exists([self.object_name(k) for k in keys])

    def _single_views(self, buffers: BlockBuffers) -> list[memoryview] | None:
        """One contiguous view per key (zero-copy), or None when some key has several."""
        out: list[memoryview] = []
        for views in buffers:
            if len(views) != 1:
                return None
            (view,) = byte_views(views)
            if len(view) != self.block_bytes:
                raise OffloadError("buffers", f"expected {self.block_bytes} bytes per key, "
                                   f"got {len(view)}")
            out.append(view)
        return out

    def load_batch(self, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        names = [self.object_name(k) for k in keys]
        single = self._single_views(buffers)
        staging: list[bytearray] = []
        if single is None:   # several views per key: read into staging, then scatter
            staging = [bytearray(self.block_bytes) for _ in keys]
            targets = [memoryview(b) for b in staging]
        else:
            targets = single
        results = self.client.batch_get_into(names, [_address(v) for v in targets],
                                             [self.block_bytes] * len(keys))
        if any(r.code == McStatus.TIMEOUT for r in results):
            # the get was abandoned, not ended: it may still write into ``targets``
            i = next(i for i, r in enumerate(results) if not r.ok)
            raise BatchIOError(0, OSError(errno.ETIMEDOUT, f"mooncake get of {names[i]}: "
                                          f"{results[i]}"), self._fence(targets))
        for i, result in enumerate(results):
            if not result.ok:
                raise BatchIOError(i, self._load_error(names[i], result))
            if staging:
                offset = 0
                for view in byte_views(buffers[i]):
                    view[:] = staging[i][offset:offset + len(view)]
                    offset += len(view)

    def _load_error(self, name: str, result: KeyResult) -> OSError:
        if result.code == McStatus.SIZE_MISMATCH and result.nbytes < self.block_bytes:
            short = ShortReadError(name, self.block_bytes, result.nbytes)
            removed = self.client.remove([name], force=True)
            short.deleted = bool(removed and (removed[0].ok or removed[0].not_found))
            if not short.deleted:
                logger.warning("could not remove short object %s: %s", name, removed)
            return short
        return OSError(errno.ENOENT if result.not_found else errno.EIO,
                       f"mooncake get of {name}: {result}")

    def _fence(self, views: list[memoryview]) -> Callable[[], bool]:
        """True once no call of the client is running, so the abandoned one ended.

        The same proof the Mooncake store connector uses before a block may be
        reused (``MooncakeStoreClient.wait_idle``): the client cannot say which
        call ended, only that none runs. The fence keeps ``views`` (slot views,
        or staging buffers) alive: an abandoned call writes through raw pointers.
        """
        fence = _IdleFence(self.client, views)
        with self._fence_lock:
            self._pending_fences = [f for f in self._pending_fences if not f.passed]
            self._pending_fences.append(fence)
        return fence

    def store_batch(self, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        names = [self.object_name(k) for k in keys]
        single = self._single_views(buffers)
        if single is None:
            staged = [memoryview(b"".join(bytes(v) for v in byte_views(views)))
                      for views in buffers]
            sources = staged
        else:
            sources = single
        results = self.client.batch_put_from(names, [_address(v) for v in sources],
                                             [self.block_bytes] * len(keys))
        if any(r.code == McStatus.TIMEOUT for r in results):
            # an abandoned put may still read ``sources``: the slots stay held (no eviction,
            # so no other key's bytes) until it ended
            i = next(i for i, r in enumerate(results) if not r.ok)
            raise BatchIOError(0, OSError(errno.ETIMEDOUT, f"mooncake put of {names[i]}: "
                                          f"{results[i]}"), self._fence(sources))
        for i, result in enumerate(results):
            if not result.ok:
                raise BatchIOError(i, OSError(errno.EIO, f"mooncake put of {names[i]}: {result}"))

    def shutdown(self, timeout_s: float | None = None) -> None:
        super().shutdown(timeout_s)
        # an abandoned get still writing into the slot memory must end before the memory
        # is unregistered (and later unmapped): wait for it, bounded
        grace = 2 * self.client.config.op_timeout_s + 1.0
        if not self.client.wait_idle(grace):
            logger.error("%s: Mooncake calls still running %.1f s after shutdown; keeping the "
                         "slot memory registered and mapped", self.name, grace)
            _KEPT_ALIVE.extend(self._pending_fences)
            return
        self._pending_fences.clear()
        for ptr in self._registered:
            try:
                self.client.unregister_buffer(ptr)
            except Exception as exc:  # the client may already be closed
                logger.warning("unregister of the primary buffer failed: %s", exc)
        self._registered.clear()
