"""Tiered offload store: CPU primary tier, fs/obj secondary tiers, failed-load correction.

Public surface (scheduler side): ``OffloadManager`` with ``CpuTier`` and
secondary tiers (``FsTier``; ``ObjTier`` in ``kvbridge.offload.obj``), each the three
calls of a ``Tier`` run by a ``TierRunner`` (pools, lookup cache, deadlines).
See ``kvbridge.offload.manager`` for the life of a request and the rules.
Verified KV: every tier keeps each block's layer digests with its bytes and
checks them before a block counts as loaded (``kvbridge.offload.blockdigest``;
policy ``kvbridge.layouts.digests.VerifyPolicy``).
"""

from kvbridge.offload.async_lookup import LookupCache, ProbeRunner
from kvbridge.offload.blockdigest import DigestMismatchError
from kvbridge.offload.cpu import CpuTier, SlotMemory, SlotState
from kvbridge.offload.faults import FaultKind, FaultPlan, FaultyFsIO
from kvbridge.offload.fs import FsTier
from kvbridge.offload.manager import LoadSpec, ManagerStats, OffloadManager, StoreSpec
from kvbridge.offload.policy import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.tier import WHOLE_JOB, BlockBuffers, IOCounters, Tier
from kvbridge.offload.types import (
    BatchIOError,
    EventKind,
    JobResult,
    LookupResult,
    LookupStatus,
    OffloadError,
    OffloadEvent,
    OffloadKey,
    Removal,
    ShortReadError,
    StoredCopyError,
)

__all__ = [
    "WHOLE_JOB", "ARCPolicy", "BatchIOError", "BlockBuffers", "CpuTier", "DigestMismatchError",
    "EventKind", "EvictionPolicy",
    "FaultKind", "FaultPlan", "FaultyFsIO", "FsTier", "IOCounters", "JobResult", "LRUPolicy",
    "LoadSpec", "LookupCache", "LookupResult", "LookupStatus", "ManagerStats", "OffloadError",
    "OffloadEvent", "OffloadKey", "OffloadManager", "ProbeRunner", "Removal",
    "ShortReadError", "SlotMemory", "SlotState", "StoreSpec", "StoredCopyError", "Tier",
    "TierRunner", "make_policy",
]
