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
"""

from __future__ import annotations

import errno
import hashlib
import logging
from collections.abc import Sequence

import numpy as np

from kvbridge.backends.mooncake import KeyResult, McStatus, MooncakeStoreClient
from kvbridge.events.schema import Locality, Medium
from kvbridge.offload.fs import FINGERPRINT_RE
from kvbridge.offload.fs_io import byte_views
from kvbridge.offload.tier import BlockBuffers, SecondaryTier
from kvbridge.offload.types import BatchIOError, OffloadError, OffloadKey, ShortReadError

logger = logging.getLogger(__name__)


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
                 read_threads: int = 2, write_threads: int = 2, name: str = "obj") -> None:
        if not FINGERPRINT_RE.match(fingerprint):
            raise OffloadError("fingerprint",
                               f"expected 8-64 lowercase hex digits, got {fingerprint!r}")
        super().__init__(name, block_bytes, read_threads, write_threads)
        self.client = client
        self.prefix = f"kvbridge/offload/{fingerprint}/"
        self._registered: list[int] = []

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
        for i, result in enumerate(results):
            if not result.ok:
                raise BatchIOError(i, OSError(errno.EIO, f"mooncake put of {names[i]}: {result}"))

    def shutdown(self) -> None:
        super().shutdown()
        for ptr in self._registered:
            try:
                self.client.unregister_buffer(ptr)
            except Exception as exc:  # the client may already be closed
                logger.warning("unregister of the primary buffer failed: %s", exc)
        self._registered.clear()
