"""Scheduler-side manager of the tiered offload store.

The manager is the whole scheduler half of an offloading connector: it never
blocks on I/O, and every call is made from the scheduler thread. The worker
half only copies bytes between the engine's KV blocks and primary slots
(``LoadSpec``/``StoreSpec`` name the slots; ``slot_buffers`` gives the views).

Life of a request::

    lookup(req, keys)            # every step until .ready (HIT or MISS)
    prepare_load(req, keys[:n])  # n = result.num_blocks; copy slots -> engine
    complete_load(req, keys[:n])
    ... compute the rest ...
    prepare_store(req, new_keys) # copy engine -> the returned slots
    complete_store(new_keys)     # READY in CPU, cascaded to every secondary tier
    request_finished(req)        # drops pins and lookup references
    step()                       # once per scheduler step, for all requests

The prefix scan of ``lookup`` (which keys count, where the prefix ends, what to
pin, promote or give up on) is decided by
:class:`~kvbridge.offload.prefix_scan.PrefixScan`, a state machine with no I/O;
``lookup`` answers its questions from the slots, the tiers' cached verdicts and
the failed-load ledger, and carries out what it says.

Rules (each has a test):

* A key that is only in a secondary tier is *promoted* into a primary slot
  first (HIT_PENDING until the load job finishes); the request is told HIT
  only for blocks ready in CPU memory, so a load failure never reaches the
  engine: the block is simply not a hit and gets recomputed.
* A failed promotion frees its slots; the tier flips exactly the failed keys
  to a miss in its own lookup cache (``mark_miss``, no re-probe), so the next
  lookup of every request referencing them returns the prefix before them —
  no request can loop on a failed load. Keys loaded before the failure
  (``successful_keys``) become READY and are kept.
* A request that waited for a promotion that failed never counts that key
  (or any after it) as a hit again: it recomputes it, exactly once, even if
  another request stores the block meanwhile (``failed_loads``).
* A slot pinned by a request (hit or promotion it waits for) or read by an
  in-flight cascade is never evicted.
* A promotion still running ``load_timeout_s`` (of its tier) after it started
  is a failed load for every request waiting on it (``failed_loads``, counted
  in ``promotions_timed_out``): the request recomputes instead of waiting
  forever. The slot stays WRITING until the job really ends (a stuck read may
  still write into it); it then becomes READY (the bytes arrived) or is freed.
* Verified KV (policy ``primary.verify``: off, sample, full): a block's layer
  digests are taken when the engine's bytes land in its CPU slot
  (``complete_store``) and travel with every cascade; a promotion's slot keeps
  the digests its secondary tier stored (which checked the bytes that landed
  before it reported the load). A lookup checks a READY slot's bytes against
  its digests before it counts the block, once per request: a mismatch is a
  failed load of exactly that block (``failed_loads``; logged once with the
  key, layer and tier), the slot is condemned (never a hit again, removed with
  a REMOVED event once unreferenced) and the request recomputes it. ``off``
  takes and checks nothing. What is checked at lookup is the slot the
  worker copies from next; a slot corrupted between that check and the copy
  is not seen (the slot is pinned for the request meanwhile).
* ``hit_blocks_primary`` counts each (request, block) once, however often the
  engine asks again; ``hits_by_tier`` counts blocks the engine really copied
  (``complete_load`` with ``success=True``); failed copies are
  ``engine_loads_failed``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from kvbridge.offload.cpu import CpuTier, Slot, SlotState
from kvbridge.offload.prefix_scan import (
    ACT_GIVE_UP,
    ACT_PIN,
    ASK_DONE,
    ASK_PRIMARY,
    ASK_PROMOTE,
    ASK_VERIFY,
    PrefixScan,
    PrimaryState,
    SecondaryVerdict,
)
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.types import (
    JobKind,
    JobResult,
    LookupResult,
    OffloadError,
    OffloadEvent,
    OffloadKey,
    RequestId,
)

logger = logging.getLogger(__name__)

# Enum members as module globals for the per-key scan (a member looked up through
# its class costs a descriptor call each time on Python 3.11).
_FAILED = PrimaryState.FAILED
_ABSENT = PrimaryState.ABSENT
_WRITING_STORE = PrimaryState.WRITING_STORE
_PROMOTING = PrimaryState.PROMOTING
_PROMOTION_EXPIRED = PrimaryState.PROMOTION_EXPIRED
_READY = PrimaryState.READY
_SLOT_READY = SlotState.READY
_SLOT_WRITING_STORE = SlotState.WRITING_STORE


@dataclass(frozen=True)
class LoadSpec:
    """Primary slots to copy into the engine's blocks, in key order."""

    request_id: RequestId
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class StoreSpec:
    """Primary slots to copy the engine's blocks into (the keys that need storing).

    ``keys`` may be fewer than asked: keys already stored are skipped, and
    storing stops at the first key for which no slot could be freed.
    """

    request_id: RequestId
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    already_stored: tuple[OffloadKey, ...] = ()


@dataclass
class ManagerStats:
    lookups: int = 0
    hit_blocks_primary: int = 0        # (request, block) pairs reported as HIT, each once
    promotions_started: int = 0        # blocks
    promotions_ok: int = 0             # blocks
    promotions_failed: int = 0         # blocks
    promotions_timed_out: int = 0      # blocks whose waiters gave up at load_timeout_s
    promotions_skipped_no_slot: int = 0
    stores_started: int = 0            # blocks
    stores_ok: int = 0
    stores_failed: int = 0
    stores_skipped_no_slot: int = 0
    cascades_ok: int = 0               # blocks x tiers
    cascades_failed: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)   # blocks copied, by source
    engine_loads_failed: int = 0       # blocks the engine's copy out of a slot failed


@dataclass(frozen=True)
class _Job:
    kind: JobKind
    tier: TierRunner
    keys: tuple[OffloadKey, ...]


class OffloadManager:
    """Tiered offload store: a CPU primary tier and zero or more secondary tiers, each
    run by its ``TierRunner`` (``kvbridge.offload.runner``)."""

    def __init__(self, primary: CpuTier, secondaries: Sequence[TierRunner] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        for tier in secondaries:
            if tier.block_bytes != primary.block_bytes:
                raise OffloadError(f"secondaries[{tier.name}].block_bytes",
                                   f"expected {primary.block_bytes}, got {tier.block_bytes}")
        self.primary = primary
        self.secondaries = tuple(secondaries)
        names = [primary.name] + [t.name for t in self.secondaries]
        if len(set(names)) != len(names):
            raise OffloadError("secondaries", f"tier names must be unique, got {names}")
        for tier in self.secondaries:
            tier.attach_primary(primary.buffer)
        self._stats = ManagerStats()
        self._pins: dict[RequestId, set[OffloadKey]] = {}
        self._failed_loads: dict[RequestId, dict[OffloadKey, None]] = {}
        #: per request: the keys already counted in ``hit_blocks_primary``
        self._counted_hits: dict[RequestId, set[OffloadKey]] = {}
        #: per request: keys handed out by ``prepare_load``, with the tier credited
        self._loading: dict[RequestId, dict[OffloadKey, str]] = {}
        #: per request: READY keys whose slot bytes were checked (or passed over by the
        #: sample) for it: a request re-asking does not hash them again
        self._verified: dict[RequestId, set[OffloadKey]] = {}
        self._clock = clock
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        self._closed = False

    # -- lookup ----------------------------------------------------------------
    def lookup(self, request_id: RequestId, keys: Sequence[OffloadKey]) -> LookupResult:
        """How many leading ``keys`` are ready in CPU memory; never blocks.

        Pins every counted block for ``request_id`` (released by
        ``complete_load`` or ``request_finished``) and starts promotions for
        leading keys found in a secondary tier.
        """
        self._check_open()
        self._stats.lookups += 1
        for tier in self.secondaries:
            tier.drain_results()
        primary = self.primary
        pins = self._pins.setdefault(request_id, set())
        failed = self._failed_loads.get(request_id)
        now = self._clock()
        # the scan decides (offload/prefix_scan.py); this loop answers its questions
        # from the slots, the tiers' cached verdicts and the failed-load ledger
        scan = PrefixScan(len(keys))
        slot: Slot | None = None
        while True:
            ask = scan.ask
            if ask is ASK_DONE:
                break
            if ask is ASK_PROMOTE:
                plan = [(keys[position], self.secondaries[index])
                        for position, index in scan.to_promote]
                scan.promoted(self._promote(request_id, plan, pins))
                continue
            position = scan.position
            key = keys[position]
            if ask is ASK_PRIMARY:
                slot = primary.get(key)
                act = scan.primary(self._primary_state(key, slot, failed, now))
            elif ask is ASK_VERIFY:
                assert slot is not None  # this key's, read for its PRIMARY question
                act = scan.verified(self._slot_verified(request_id, key, slot, position, pins))
            else:
                verdict, tier_index = self._secondary_verdict(request_id, key)
                scan.secondary(verdict, tier_index)
                continue
            if act is ACT_PIN:
                if key not in pins:
                    primary.pin(key, request_id)
                    pins.add(key)
            elif act is ACT_GIVE_UP:
                assert slot is not None
                self._give_up_promotion(request_id, key, slot, pins)
        result = scan.outcome
        if not result.ready:
            return result
        # final verdict: keep pins only on the reported prefix
        num_ready = result.num_blocks
        counted = set(keys[:num_ready])
        for key in [k for k in pins if k not in counted]:
            primary.unpin(key, request_id)
            pins.discard(key)
        if num_ready:
            seen = self._counted_hits.setdefault(request_id, set())
            new = [k for k in keys[:num_ready] if k not in seen]
            seen.update(new)
            self._stats.hit_blocks_primary += len(new)   # an engine re-asking counts nothing
        return result

    @staticmethod
    def _primary_state(key: OffloadKey, slot: Slot | None,
                       failed: dict[OffloadKey, None] | None, now: float) -> PrimaryState:
        """What CPU memory holds of ``key`` (its ``slot``) for a request with ``failed``
        loads."""
        if failed is not None and key in failed:
            return _FAILED
        if slot is None:
            return _ABSENT
        state = slot.state
        if state is _SLOT_READY:
            return _READY
        if state is _SLOT_WRITING_STORE:
            return _WRITING_STORE
        if slot.deadline is not None and now >= slot.deadline:
            return _PROMOTION_EXPIRED
        return _PROMOTING

    def _secondary_verdict(self, request_id: RequestId, key: OffloadKey
                           ) -> tuple[SecondaryVerdict, int | None]:
        """The first secondary tier (in order) whose cached verdict is unknown or a hit."""
        for index, tier in enumerate(self.secondaries):
            verdict = tier.lookup(request_id, key)
            if verdict is None:
                return SecondaryVerdict.UNKNOWN, None
            if verdict:
                return SecondaryVerdict.HIT, index
        return SecondaryVerdict.MISS, None

    def _slot_verified(self, request_id: RequestId, key: OffloadKey, slot: Slot,
                       position: int, pins: set[OffloadKey]) -> bool:
        """Whether ``key``'s READY slot may count for ``request_id`` (its bytes match its
        digests, or the policy does not check it); a mismatch is a failed load."""
        if not slot.corrupt:
            done = self._verified.setdefault(request_id, set())
            if key in done:
                return True
            policy = self.primary.verify
            if not policy.wants(request_id, 0, position):
                done.add(key)
                return True
            if self.primary.digests_of(key) is None:
                # promoted from a tier that stores no digests, or stored without them
                if policy.allow_unverified:
                    self.primary.loads_unverified += 1
                    done.add(key)
                    return True
                logger.warning("offload: request %s, block %d: key %s has no digests and the "
                               "verify policy refuses unverified loads; recomputed",
                               request_id, position, key.hex())
            else:
                mismatch = self.primary.check(key)
                if mismatch is None:
                    self.primary.loads_verified += 1
                    done.add(key)
                    return True
                self.primary.digest_mismatches += 1
                logger.warning("offload: request %s, block %d: %s; the block is recomputed and "
                               "the slot removed", request_id, position, mismatch)
        if key in pins:
            self.primary.unpin(key, request_id)
            pins.discard(key)
        self._failed_loads.setdefault(request_id, {})[key] = None
        if not slot.corrupt:
            self.primary.condemn(key)
        return False

    def _give_up_promotion(self, request_id: RequestId, key: OffloadKey, slot: Slot,
                           pins: set[OffloadKey]) -> None:
        """``request_id`` stops waiting for a promotion past its deadline (it recomputes)."""
        if not slot.timed_out:
            slot.timed_out = True
            self._stats.promotions_timed_out += 1
            logger.warning("offload: promotion of a block from %s still running after its "
                           "load_timeout_s; waiting requests recompute it", slot.origin)
        if key in pins:
            self.primary.unpin(key, request_id)
            pins.discard(key)
        self._failed_loads.setdefault(request_id, {})[key] = None

    def _promote(self, request_id: RequestId, plan: list[tuple[OffloadKey, TierRunner]],
                 pins: set[OffloadKey]) -> bool:
        """Start loads of ``plan`` (leading keys, in order) into new primary slots."""
        per_tier: dict[str, tuple[TierRunner, list[OffloadKey], list[int]]] = {}
        started = 0
        for key, tier in plan:
            made = self.primary.allocate([key], SlotState.WRITING_PROMOTION)
            if not made:
                self._stats.promotions_skipped_no_slot += 1
                break  # no room: the prefix ends here; best effort
            self.primary.pin(key, request_id)
            pins.add(key)
            made[0].deadline = self._clock() + tier.load_timeout_s
            made[0].origin = tier.name
            entry = per_tier.setdefault(tier.name, (tier, [], []))
            entry[1].append(key)
            entry[2].append(made[0].index)
            started += 1
        for tier, keys, slots in per_tier.values():
            job_id = self._new_job(JobKind.LOAD, tier, keys)
            tier.submit_load(job_id, keys, self.slot_buffers(slots))
        self._stats.promotions_started += started
        return started > 0

    # -- loads into the engine -------------------------------------------------
    def prepare_load(self, request_id: RequestId, keys: Sequence[OffloadKey]) -> LoadSpec:
        """Slots of ``keys`` (all READY and pinned by an earlier HIT) for the worker to copy."""
        self._check_open()
        pins = self._pins.setdefault(request_id, set())
        slots: list[int] = []
        loading = self._loading.setdefault(request_id, {})
        for i, key in enumerate(keys):
            slot = self.primary.get(key)
            if slot is None or slot.state is not SlotState.READY:
                raise OffloadError(f"keys[{i}]", "expected a block ready in CPU memory "
                                   "(load only what lookup reported as HIT)")
            if key not in pins:
                self.primary.pin(key, request_id)
                pins.add(key)
            slots.append(slot.index)
            # the first load after a promotion is credited to the tier it came from
            # (in complete_load, once the engine's copy succeeded)
            loading[key] = slot.origin or self.primary.name
            slot.origin = None
        self.primary.touch(keys)
        return LoadSpec(request_id, tuple(keys), tuple(slots))

    def complete_load(self, request_id: RequestId, keys: Iterable[OffloadKey],
                      success: bool | Iterable[OffloadKey] = True) -> None:
        """The worker finished copying ``keys`` (or gave up on them): unpin them.

        ``success``: True (every copy succeeded), False (none did), or the keys
        whose copy failed. Only successful copies of ``prepare_load`` keys count
        as hits (``hits_by_tier``); failed ones count in ``engine_loads_failed``.
        """
        pins = self._pins.get(request_id)
        loading = self._loading.get(request_id, {})
        keys = list(keys)
        failed_keys: set[OffloadKey] = (set() if success is True else
                                        set(keys) if success is False else set(success))
        for key in keys:
            self.primary.unpin(key, request_id)
            if pins is not None:
                pins.discard(key)
            tier = loading.pop(key, None)
            if tier is None:
                continue   # a counted block the engine did not load: no hit
            if key in failed_keys:
                self._stats.engine_loads_failed += 1
            else:
                self._stats.hits_by_tier[tier] = self._stats.hits_by_tier.get(tier, 0) + 1
        if not loading:
            self._loading.pop(request_id, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark blocks as recently used (eviction order)."""
        self.primary.touch(keys)

    # -- stores from the engine ---------------------------------------------------
    def prepare_store(self, request_id: RequestId, keys: Sequence[OffloadKey]) -> StoreSpec:
        """Slots for the blocks of ``keys`` not yet stored, evicting as needed (best effort)."""
        self._check_open()
        fresh = [k for k in keys if k not in self.primary]
        already = tuple(k for k in keys if k in self.primary)
        self.primary.touch(already)
        made = self.primary.allocate(fresh, SlotState.WRITING_STORE)
        self._stats.stores_started += len(made)
        self._stats.stores_skipped_no_slot += len(fresh) - len(made)
        return StoreSpec(request_id, tuple(s.key for s in made), tuple(s.index for s in made),
                         already)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """The worker filled the slots of ``keys`` (from ``prepare_store``), or failed to.

        On success the blocks become READY and are cascaded to every secondary
        tier (each slot is held against eviction until its cascades finish).
        """
        self._check_open()
        if not keys:
            return
        for i, key in enumerate(keys):
            slot = self.primary.get(key)
            if slot is None or slot.state is not SlotState.WRITING_STORE:
                raise OffloadError(f"keys[{i}]", "expected a slot returned by prepare_store")
        if not success:
            self._drop_failed_writes(keys)
            self._stats.stores_failed += len(keys)
            return
        self.primary.mark_ready(keys)
        self._stats.stores_ok += len(keys)
        # the digests of the bytes as they landed: they travel with every cascade
        digests = ([self.primary.seal(k) for k in keys] if self.primary.verify.enabled
                   else [None] * len(keys))
        slots = [self._slot_index(k) for k in keys]
        for tier in self.secondaries:
            for key in keys:
                self.primary.add_io_ref(key)
            job_id = self._new_job(JobKind.STORE, tier, keys)
            tier.submit_store(job_id, keys, self.slot_buffers(slots), digests)

    # -- per step / per request ---------------------------------------------------
    def step(self) -> None:
        """Once per scheduler step: finish jobs, apply probe results, send probe batches."""
        for tier in self.secondaries:
            for result in tier.get_finished_jobs():
                self._finish_job(result)
            tier.drain_results()
            tier.step()

    def _finish_job(self, result: JobResult) -> None:
        job = self._jobs.pop(result.job_id)
        ok = set(result.successful_keys)
        if job.kind is JobKind.LOAD:
            done = [k for k in job.keys if k in ok]
            failed = [k for k in job.keys if k not in ok]
            if done:
                self.primary.mark_ready(done)
                stored = dict(zip(result.successful_keys, result.digests, strict=False))
                for key in done:
                    promoted = self.primary.get(key)
                    assert promoted is not None
                    promoted.origin = job.tier.name
                    # the digests its writer took (checked by the tier against these bytes)
                    self.primary.set_digests(key, stored.get(key))
            if failed:
                self._drop_failed_writes(failed)
            self._stats.promotions_ok += len(done)
            self._stats.promotions_failed += len(failed)
        else:
            for key in job.keys:
                self.primary.drop_io_ref(key)
            self._stats.cascades_ok += len(ok)
            self._stats.cascades_failed += len(job.keys) - len(ok)

    def _drop_failed_writes(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            slot = self.primary.get(key)
            waiters = set(slot.pinned_by) if slot is not None else set()
            self.primary.discard([key])
            for request_id in waiters:
                self._pins.get(request_id, set()).discard(key)
                self._failed_loads.setdefault(request_id, {})[key] = None

    def failed_loads(self, request_id: RequestId) -> tuple[OffloadKey, ...]:
        """Keys whose promotion failed while ``request_id`` waited for them (it recomputes them)."""
        return tuple(self._failed_loads.get(request_id, ()))

    def request_finished(self, request_id: RequestId) -> None:
        """Drop the request's pins and its references in every lookup cache."""
        for key in self._pins.pop(request_id, ()):
            self.primary.unpin(key, request_id)
        self._failed_loads.pop(request_id, None)
        self._counted_hits.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._verified.pop(request_id, None)
        for tier in self.secondaries:
            tier.release_request(request_id)

    # -- plumbing ----------------------------------------------------------------
    def slot_buffers(self, slots: Iterable[int]) -> list[list[memoryview]]:
        """Per slot, the views a tier or worker reads/writes (one view per block)."""
        return [[self.primary.view(index)] for index in slots]

    def _slot_index(self, key: OffloadKey) -> int:
        slot = self.primary.get(key)
        assert slot is not None
        return slot.index

    def _new_job(self, kind: JobKind, tier: TierRunner, keys: Sequence[OffloadKey]) -> int:
        self._next_job_id += 1
        self._jobs[self._next_job_id] = _Job(kind, tier, tuple(keys))
        return self._next_job_id

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Call ``step`` until no job or probe is in flight (tests, benchmarks, shutdown;
        it blocks, the scheduler never calls it). True when idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            busy = [t for t in self.secondaries
                    if t.num_jobs_in_flight or t.num_probes_in_flight]
            if not self._jobs and not busy:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if busy:
                busy[0].wait_for_finished(min(remaining, 0.05))

    def take_events(self) -> list[OffloadEvent]:
        """Stored/removed records of every tier since the last call."""
        events = self.primary.take_events()
        for tier in self.secondaries:
            events.extend(tier.take_events())
        return events

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self._stats)
        out["primary"] = {"name": self.primary.name, "medium": self.primary.medium, "blocks": len(self.primary),
                          "free_slots": self.primary.num_free,
                          "evictions": self.primary.evictions,
                          "verify": self.primary.verify.mode.value,
                          "loads_verified": self.primary.loads_verified,
                          "loads_unverified": self.primary.loads_unverified,
                          "digest_mismatches": self.primary.digest_mismatches,
                          "corrupt_removed": self.primary.corrupt_removed,
                          "policy": self.primary.policy.name}
        out["tiers"] = {t.name: {"medium": t.medium, "locality": t.locality,
                                 **t.stats_snapshot()}
                        for t in self.secondaries}
        out["jobs_in_flight"] = len(self._jobs)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("manager", "shut down")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Finish in-flight jobs (their buffers are primary slots), stop tiers, unmap slots."""
        if self._closed:
            return
        if not self.wait_idle(timeout_s):
            logger.warning("offload manager shut down with %d jobs in flight", len(self._jobs))
        self._closed = True
        for tier in self.secondaries:
            tier.shutdown()
        self.primary.close()
