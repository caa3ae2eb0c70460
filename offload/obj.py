"""The ``obj`` secondary tier: blocks as objects in the Mooncake distributed store.

Zero-copy: the primary tier's slot memory is registered with the client once
(``attach_primary``), and ``batch_put_from``/``batch_get_into`` move bytes
straight between slots and the store. Existence probes use one
``batch_exists`` per step. Object names are derived from key hashes only
(``<prefix><blake2b-128 hex>``), like the fs tier's file names.

Failure rules, as for the fs tier: a failed get is reported per job with the
leading keys that succeeded (``successful_keys``), and the runner's lookup
cache marks the rest as misses (``TierRunner.get_finished_jobs``). The only
object the tier removes is one proven too short (Mooncake returned fewer bytes
than a block): the analogue of the fs tier's short read. Not-found (evicted by
Mooncake meanwhile), timeouts and an unreachable master remove nothing.

Digests: beside each block object ``<name>``, a digest object ``<name>.dg``
holds its block header (``fs_io``'s format-2 header without the padding: key
hash, layer digests, checksum), put in the same batch as the block; the block
object itself stays a zero-copy put from the slot. A load gets both in one
batch and checks the bytes that landed in the slot against the digests
before the block counts as loaded (policy ``verify``). A mismatch (another
key's or changed bytes under this name), or a torn digest object, is a
failed load of that block and removes both objects (a REMOVED event); a
digest object made for another key is checked whenever digest objects are
fetched (``verify`` not off, sampled or not) and counted in
``foreign_key_loads``. A
block without a digest object (evicted apart by Mooncake, or written with
``verify`` off) is served and counted unverified, or fails the load if the
policy refuses unverified loads. Mooncake puts do not overwrite: if one of
a pair was evicted and the block stored again from bytes that differ (a
recompute that is not bit-exact), the pair no longer matches; the next load
fails, removes both, and the store after it writes a matching pair.

Timeouts: a get or put that outlived ``op_timeout_s`` is abandoned by the
client but keeps running. Its job is reported failed only once the client is
idle (the fence of ``TierRunner``): until then its slots stay WRITING, so
no other key's promotion or store gets a slot a late get could still write
(which would serve, and cascade, another key's bytes). Requests waiting on
such a promotion turn into misses at ``load_timeout_s``; the default deadlines
leave every call its ``op_timeout_s`` (:func:`default_deadlines`).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence

from kvbridge.backends.mooncake import KeyResult, McStatus, MooncakeStoreClient
from kvbridge.events.schema import Locality
from kvbridge.layouts.digests import VerifyPolicy
from kvbridge.offload.blockdigest import (
    DEFAULT_VERIFY,
    DigestMismatchError,
    LayerDigests,
    layer_digests,
    verify_views,
    wants_key,
)
from kvbridge.offload.fs_io import (
    BadBlockHeaderError,
    ForeignKeyError,
    buffer_address,
    byte_views,
    compact_header_bytes,
    decode_block_header,
    encode_block_header,
)
from kvbridge.offload.fs_layout import FINGERPRINT_RE, FileMapper
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.tier import WHOLE_JOB, BlockBuffers, Tier
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


#: every object name of the obj tier starts with this, then ``<fingerprint>/`` (fsck_obj)
OBJECT_ROOT = "kvbridge/offload/"


#: threads of each pool of the obj tier's runner by default
DEFAULT_READ_THREADS = 2
DEFAULT_WRITE_THREADS = 2


def default_deadlines(op_timeout_s: float) -> tuple[float, float]:
    """``(probe_timeout_s, load_timeout_s)`` of an obj tier's runner: every Mooncake call
    is bounded by ``op_timeout_s`` already, so the deadlines leave it room (a load is a
    get of the block and its digest object)."""
    return op_timeout_s + 1.0, 2 * op_timeout_s + 1.0


def run_obj_tier(tier: ObjTier, *, probe_timeout_s: float | None = None,
                 load_timeout_s: float | None = None) -> TierRunner:
    """``tier`` on a runner with the obj tier's threads; a deadline not given is
    :func:`default_deadlines` of the tier's client."""
    probe_s, load_s = default_deadlines(tier.client.config.op_timeout_s)
    return TierRunner(tier, read_threads=DEFAULT_READ_THREADS,
                      write_threads=DEFAULT_WRITE_THREADS,
                      probe_timeout_s=probe_s if probe_timeout_s is None else probe_timeout_s,
                      load_timeout_s=load_s if load_timeout_s is None else load_timeout_s)


class ObjTier(Tier):
    """Blocks in Mooncake under ``kvbridge/offload/<fingerprint>/<hash>``.

    ``client`` must be set up (``MooncakeStoreClient.setup``); the tier does
    not close it. Run it with its own read and write pools, as every tier
    (``TierRunner``), so a promotion never waits behind a cascade.
    """

    locality = Locality.REMOTE.value
    #: a job is one batched request: never cut into parts
    load_part_blocks = WHOLE_JOB
    store_part_blocks = WHOLE_JOB
    #: suffix of a block's digest object
    DIGEST_SUFFIX = ".dg"

    def __init__(self, client: MooncakeStoreClient, block_bytes: int, fingerprint: str, *,
                 name: str = "obj", verify: VerifyPolicy = DEFAULT_VERIFY,
                 num_layers: int = 1) -> None:
        if not FINGERPRINT_RE.match(fingerprint):
            raise OffloadError("fingerprint",
                               f"expected 8-64 lowercase hex digits, got {fingerprint!r}")
        super().__init__(name, block_bytes, verify=verify, num_layers=num_layers)
        self.client = client
        self.prefix = f"{OBJECT_ROOT}{fingerprint}/"
        self._registered: list[int] = []
        #: fences handed out (pruned as they pass); shutdown waits for them
        self._pending_fences: list[_IdleFence] = []
        self._fence_lock = threading.Lock()
        #: bytes of a digest object
        self.digest_object_bytes = compact_header_bytes(self.num_layers)

    def object_name(self, key: OffloadKey) -> str:
        return self.prefix + hashlib.blake2b(key, digest_size=16).hexdigest()

    def digest_name(self, key: OffloadKey) -> str:
        """The object holding ``key``'s block header (its digests)."""
        return self.object_name(key) + self.DIGEST_SUFFIX

    def attach_primary(self, buffer: memoryview) -> None:
        """Register the primary tier's slot memory for zero-copy puts and gets."""
        ptr = buffer_address(buffer)
        self.client.register_buffer(ptr, len(buffer))
        self._registered.append(ptr)

    def probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
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

    def load(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
             digests_out: list[LayerDigests | None]) -> None:
        """Get each block (and, unless ``verify`` is off, its digest object) in one batch;
        check the bytes before the block counts as loaded. ``digests_out`` gets, per
        loaded key, the digests stored with it (None: none)."""
        names = [self.object_name(k) for k in keys]
        single = self._single_views(buffers)
        staging: list[bytearray] = []
        if single is None:   # several views per key: read into staging, then scatter
            staging = [bytearray(self.block_bytes) for _ in keys]
            targets = [memoryview(b) for b in staging]
        else:
            targets = single
        verify = self.verify.enabled
        headers = [bytearray(self.digest_object_bytes) for _ in keys] if verify else []
        header_views = [memoryview(h) for h in headers]
        get_names = names + [self.digest_name(k) for k in keys] if verify else names
        results = self.client.batch_get_into(
            get_names, [buffer_address(v) for v in targets + header_views],
            [self.block_bytes] * len(keys) + [self.digest_object_bytes] * len(headers))
        if any(r.code == McStatus.TIMEOUT for r in results):
            # the get was abandoned, not ended: it may still write into ``targets``
            i = next(i for i, r in enumerate(results) if not r.ok)
            raise BatchIOError(0, OSError(errno.ETIMEDOUT, f"mooncake get of "
                                          f"{get_names[i]}: {results[i]}"),
                               self._fence(targets + header_views))
        #: blocks that failed on their own (provably wrong, removed): the batch goes on
        corrupt: dict[int, OSError] = {}
        for i, result in enumerate(results[:len(keys)]):
            if not result.ok:
                raise BatchIOError(i, self._load_error(keys[i], names[i], result),
                                   skipped=corrupt)
            digests: LayerDigests | None = None
            if verify:
                try:
                    digests = self._check(keys[i], names[i], targets[i], headers[i],
                                          results[len(keys) + i])
                except (DigestMismatchError, BadBlockHeaderError) as exc:
                    if isinstance(exc, BadBlockHeaderError) and not exc.corrupt:
                        raise BatchIOError(i, exc, skipped=corrupt) from exc
                    if isinstance(exc, ForeignKeyError):
                        self.counters.foreign_key()
                    corrupt[i] = exc
                    continue
                except OSError as exc:
                    raise BatchIOError(i, exc, skipped=corrupt) from exc
            digests_out.append(digests)
            if staging:
                offset = 0
                for view in byte_views(buffers[i]):
                    view[:] = staging[i][offset:offset + len(view)]
                    offset += len(view)
        if corrupt:
            raise BatchIOError(len(keys), corrupt[min(corrupt)], skipped=corrupt)

    def _check(self, key: OffloadKey, name: str, target: memoryview, header: bytearray,
               got: KeyResult) -> LayerDigests | None:
        """``target`` (the bytes that landed) against the digest object read into ``header``.

        Raises ``DigestMismatchError`` / ``BadBlockHeaderError`` (both objects removed) or
        ``OSError``; returns the stored digests (None: the block has no digest object).
        """
        policy = self.verify
        if got.not_found:
            if not policy.allow_unverified:
                raise OSError(errno.EPROTO, f"{name} has no digest object and the verify "
                              "policy refuses unverified loads")
            self.counters.unverified()
            return None
        if not got.ok:
            if got.code == McStatus.SIZE_MISMATCH:
                exc = BadBlockHeaderError(name + self.DIGEST_SUFFIX,
                                          f"digest object of {got.nbytes} bytes, expected "
                                          f"{self.digest_object_bytes}", True)
                exc.deleted = self._remove_pair(key)
                raise exc
            raise OSError(errno.EIO, f"mooncake get of {name}{self.DIGEST_SUFFIX}: {got}")
        try:
            parsed = decode_block_header(name + self.DIGEST_SUFFIX, bytes(header))
            if parsed.key_hash != FileMapper.key_hash_bytes(key):
                raise ForeignKeyError(name + self.DIGEST_SUFFIX, parsed.key_hash,
                                      FileMapper.key_hash_bytes(key))
            if parsed.block_bytes != self.block_bytes or parsed.num_layers != self.num_layers:
                raise BadBlockHeaderError(name + self.DIGEST_SUFFIX, f"{parsed.num_layers} "
                                          f"layers of {parsed.block_bytes} bytes, expected "
                                          f"{self.num_layers} of {self.block_bytes}", False)
        except BadBlockHeaderError as exc:
            if exc.corrupt:
                exc.deleted = self._remove_pair(key)
            raise
        if parsed.layer_digests is None:
            self.counters.unverified()
            return None
        if wants_key(policy, key):
            try:
                verify_views(self.name, name, key, parsed.layer_digests, [target])
            except DigestMismatchError as exc:
                exc.deleted = self._remove_pair(key)
                raise
            self.counters.verified()
        return parsed.layer_digests

    def _remove_pair(self, key: OffloadKey) -> bool:
        """Remove a key's block and digest objects (provably wrong); True if both are gone."""
        removed = self.client.remove([self.object_name(key), self.digest_name(key)],
                                     force=True)
        gone = bool(removed) and all(r.ok or r.not_found for r in removed)
        if not gone:
            logger.warning("%s: could not remove the objects of key %s: %s", self.name,
                           key.hex(), removed)
        return gone

    def _load_error(self, key: OffloadKey, name: str, result: KeyResult) -> OSError:
        if result.code == McStatus.SIZE_MISMATCH and result.nbytes < self.block_bytes:
            short = ShortReadError(name, self.block_bytes, result.nbytes)
            short.deleted = self._remove_pair(key)
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

    def store(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
              digests: Sequence[LayerDigests | None]) -> None:
        """Put each block (zero-copy from its slot) and, unless ``verify`` is off, its digest
        object (``digests[i]``, taken where the bytes were written, else taken here)."""
        names = [self.object_name(k) for k in keys]
        single = self._single_views(buffers)
        if single is None:
            staged = [memoryview(b"".join(bytes(v) for v in byte_views(views)))
                      for views in buffers]
            sources = staged
        else:
            sources = single
        headers: list[memoryview] = []
        if self.verify.enabled:
            for i, key in enumerate(keys):
                layers = digests[i]
                if layers is None:
                    layers = layer_digests([sources[i]], self.num_layers)
                if len(layers) != self.num_layers:
                    raise BatchIOError(i, OSError(errno.EINVAL, f"{len(layers)} layer digests "
                                                  f"for {self.num_layers} layers"))
                header = encode_block_header(self.block_bytes, FileMapper.key_hash_bytes(key),
                                             self.num_layers, layers)
                headers.append(memoryview(bytearray(header[:self.digest_object_bytes])))
        all_names = names + [self.digest_name(k) for k in keys] if headers else names
        results = self.client.batch_put_from(
            all_names, [buffer_address(v) for v in sources + headers],
            [self.block_bytes] * len(keys) + [self.digest_object_bytes] * len(headers))
        if any(r.code == McStatus.TIMEOUT for r in results):
            # an abandoned put may still read ``sources``: the slots stay held (no eviction,
            # so no other key's bytes) until it ended
            i = next(i for i, r in enumerate(results) if not r.ok)
            raise BatchIOError(0, OSError(errno.ETIMEDOUT, f"mooncake put of {all_names[i]}: "
                                          f"{results[i]}"), self._fence(sources + headers))
        for i in range(len(keys)):
            for j in (i, len(keys) + i) if headers else (i,):
                if not results[j].ok:
                    raise BatchIOError(i, OSError(errno.EIO, f"mooncake put of "
                                                  f"{all_names[j]}: {results[j]}"))

    def close(self) -> None:
        """Unregister the slot memory once no Mooncake call runs (the runner's jobs ended)."""
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
