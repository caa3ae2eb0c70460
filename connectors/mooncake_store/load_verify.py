"""Which blocks of a load are checked against their digest records, and what the check found.

Owns the reader's side of verified KV for the Mooncake store: :func:`checked_blocks`
(the blocks a :class:`~kvbridge.layouts.digests.VerifyPolicy` checks: every
one, a deterministic sample the same on every rank, or none) and
:func:`verify_blocks`, which compares the digests of the bytes that landed
(taken in place, :mod:`.verify`) with the records got beside the KV and
returns a :class:`Verified`: counts, the blocks that fail (their KV did not
arrive whole, the record is missing and unverified blocks are refused, the
record is not this key's, or the bytes differ), the keys to remove so a
recomputed block can be stored again, and the first failure to log.

May not touch: the store client (the worker gets and removes keys), stats,
the load thread or the log (the worker logs the one line per load from
:attr:`Verified.first`). Pure apart from reading the KV through
:class:`~.verify.RankDigests`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.backends.mooncake import KeyStatus, McStatus
from kvbridge.connectors.api import BlockRef
from kvbridge.connectors.mooncake_store.metadata import LoadBlock
from kvbridge.connectors.mooncake_store.plans import RegionPlan
from kvbridge.connectors.mooncake_store.records import (
    RecordVerdict,
    algorithm_of,
    digests_of_keys,
)
from kvbridge.connectors.mooncake_store.verify import RankDigests
from kvbridge.layouts.digests import DigestMode, VerifyPolicy

_STATUS = operator.attrgetter("status")
#: a get into a slot of the wrong size: smaller objects read short (SIZE_MISMATCH), bigger
#: ones are refused by Mooncake ("buffer too small": INVALID_PARAMS) without a write
_WRONG_SIZE = frozenset((McStatus.SIZE_MISMATCH, McStatus.INVALID_PARAMS))


@dataclass
class Verified:
    """What the digest check of one load found (counts of blocks; ``failed``: refs)."""

    verified: int = 0
    unverified: int = 0
    missing: int = 0
    mismatches: int = 0
    invalid: int = 0
    #: of ``invalid``: records made for another key (a block copied under this one's keys)
    foreign: int = 0
    failed: set[BlockRef] = field(default_factory=set)
    corrupt_keys: list[str] = field(default_factory=list)
    first: tuple[LoadBlock, str, str] | None = None  # (block, key, what): logged once

    def note(self, block: LoadBlock, key: str, what: str) -> None:
        if self.first is None:
            self.first = (block, key, what)

    def absorb(self, other: Verified) -> None:
        """Add what the check of another part of the same load found."""
        self.verified += other.verified
        self.unverified += other.unverified
        self.missing += other.missing
        self.mismatches += other.mismatches
        self.invalid += other.invalid
        self.foreign += other.foreign
        self.failed |= other.failed
        self.corrupt_keys.extend(other.corrupt_keys)
        if self.first is None:
            self.first = other.first


def checked_blocks(policy: VerifyPolicy, request_id: str, blocks: Sequence[LoadBlock],
                   addressed: set[int]) -> tuple[list[int], int]:
    """Indices (into ``blocks``) of the addressed blocks the policy checks, and how many
    addressed blocks it does not check.

    The policy's block index is the block's position among this load's blocks of
    its region: every rank gets the same load, so the ranks check the same blocks.
    """
    if policy.mode is DigestMode.OFF:
        return [], len(addressed)
    ordered = sorted(addressed)
    if policy.mode is DigestMode.FULL:
        return ordered, 0
    if blocks and len({block.region_index for block in blocks}) == 1:  # positions = indices
        chosen = policy.chosen(request_id, blocks[0].region_index, len(blocks))
        if len(addressed) != len(blocks):
            chosen = [i for i in chosen if i in addressed]
        return chosen, len(addressed) - len(chosen)
    position: dict[int, int] = {}
    chosen = []
    for i, block in enumerate(blocks):
        index = position.get(block.region_index, 0)
        position[block.region_index] = index + 1
        if i in addressed and policy.wants(request_id, block.region_index, index):
            chosen.append(i)
    return chosen, len(addressed) - len(chosen)


def verify_blocks(plans: Sequence[RegionPlan], digests: RankDigests | None,
                  policy: VerifyPolicy, blocks: Sequence[LoadBlock], checked: Sequence[int],
                  record_keys: Sequence[str], record_results: Sequence[Any],
                  failed: set[BlockRef]) -> Verified:
    """Check the blocks ``checked`` whose KV arrived against the records that landed
    (``record_keys``/``record_results``: one per checked block, empty without
    host digests)."""
    out = Verified()
    allow = policy.allow_unverified
    if digests is None:  # no host view of the KV: nothing can be checked here
        for i in checked:
            ref = (blocks[i].region_index, blocks[i].block_id)
            if ref in failed:
                continue
            out.missing += 1
            if allow:
                out.unverified += 1
            else:
                out.failed.add(ref)
        return out
    by_region: dict[int, list[int]] = {}  # region -> positions in ``checked``
    if (not failed and list(map(_STATUS, record_results)).count(KeyStatus.OK)
            == len(record_results)):  # the usual load: every KV key and record arrived
        if len({blocks[i].region_index for i in checked}) == 1:
            by_region[blocks[checked[0]].region_index] = list(range(len(checked)))
        else:
            for n, i in enumerate(checked):
                by_region.setdefault(blocks[i].region_index, []).append(n)
    else:
        for n, (i, result) in enumerate(zip(checked, record_results, strict=True)):
            block = blocks[i]
            ref = (block.region_index, block.block_id)
            if ref in failed:
                continue  # its KV did not arrive: already a load error
            if result.ok:
                by_region.setdefault(block.region_index, []).append(n)
            elif result.not_found:  # stored by an older version, or the record evicted
                out.missing += 1
                if allow:
                    out.unverified += 1
                else:
                    out.failed.add(ref)
                    out.note(block, record_keys[n],
                             "no digest record (verify_allow_unverified is false)")
            elif result.code in _WRONG_SIZE:  # an object of another size: not a record
                # of this key's geometry (a bigger one is refused, nothing written)
                out.invalid += 1
                out.failed.add(ref)
                out.note(block, record_keys[n], f"digest record get: {result}")
                out.corrupt_keys.extend(block_keys(plans, block, record_keys[n]))
            else:  # the record's get failed (transient): unchecked, so not loaded
                out.failed.add(ref)
                out.note(block, record_keys[n], f"digest record get: {result}")
    for region_index, positions in by_region.items():
        table = digests.load[region_index]
        fields = table.algorithms([blocks[checked[n]].block_id for n in positions])
        if fields.size and bool((fields == fields[0]).all()):  # the usual load: one writer
            groups = {int(fields[0]): positions}
        else:
            groups = {}
            for position, field in zip(positions, fields.tolist(), strict=True):
                groups.setdefault(int(field), []).append(position)
        for field, members in groups.items():
            algorithm = algorithm_of(field)
            if algorithm is not None and algorithm not in digests.algorithms:
                for n in members:  # a record this rank cannot check (XXH3-64, KV on a device)
                    block = blocks[checked[n]]
                    out.missing += 1
                    if allow:
                        out.unverified += 1
                    else:
                        out.failed.add((block.region_index, block.block_id))
                        out.note(block, record_keys[n], f"digest record taken with "
                                 f"{algorithm}, which this rank cannot take "
                                 f"(verify_allow_unverified is false)")
                continue
            # an unknown algorithm is checked as this rank's own: its header fails
            _check_group(out, plans, digests, region_index, blocks, checked, members,
                         record_keys, algorithm or digests.algorithm)
    return out


def _check_group(out: Verified, plans: Sequence[RegionPlan], digests: RankDigests,
                 region_index: int, blocks: Sequence[LoadBlock], checked: Sequence[int],
                 positions: Sequence[int], record_keys: Sequence[str], algorithm: str) -> None:
    """Compare the landed bytes of the checked blocks at ``positions`` (of one region,
    whose records name ``algorithm``) with their records; the findings go to ``out``."""
    ids = [blocks[checked[n]].block_id for n in positions]
    actual = digests.layer_digests(region_index, ids, algorithm)
    table = digests.load[region_index]
    bad = table.failures(ids, digests_of_keys([record_keys[n] for n in positions]), actual,
                         algorithm)
    out.verified += len(ids) - len(bad)
    for position, check in bad:
        n = positions[position]
        block, block_id = blocks[checked[n]], ids[position]
        out.failed.add((region_index, block_id))
        if check.verdict is RecordVerdict.MISMATCH:
            out.mismatches += 1
            layer = check.layer_position
            slot = plans[region_index].layers[layer]
            out.note(block, slot.prefix + block.block_hash.hex(),
                     f"layer {slot.layer_id}: stored {algorithm} digest "
                     f"{table.stored_digest(block_id, layer):#018x}, loaded bytes "
                     f"{int(actual[position][layer]):#018x}")
        else:
            out.invalid += 1
            out.foreign += check.verdict is RecordVerdict.FOREIGN
            out.note(block, record_keys[n], f"digest record: {check.reason}")
        out.corrupt_keys.extend(block_keys(plans, block, record_keys[n]))


def block_keys(plans: Sequence[RegionPlan], block: LoadBlock, digest_key: str) -> list[str]:
    """Every key of ``block`` on this rank: its layer objects and its digest record."""
    suffix = block.block_hash.hex()
    return [slot.prefix + suffix for slot in plans[block.region_index].layers] + [
        digest_key]
