"""Compatibility diff of two engines' handshake metadata (pure, no I/O).

:func:`diff_engines` lists **every** difference between a local and a remote
engine, each with both values and why it matters, and says whether a transfer
plan between them exists (and if not, why). The connector calls it at
handshake time to refuse a peer with a precise reason; ``kvbridge diff``
prints it.

Severity of a difference:

* ``blocking`` — the engines cannot exchange KV at all (other model, dtype,
  head size, layer assignment, transfer mode, the same engine id twice, ranks
  that never registered).
* ``plan`` — the engines differ in a way the transfer planner handles (TP and
  PP sizes: heterogeneous TP, stage intersection) or refuses (DCP/PCP sizes,
  block size, memory order); ``plan_exists`` and ``plan_reason`` say which.
* ``info`` — worth knowing, harmless for correctness (e.g. number of blocks).

The plan question is answered by :func:`kvbridge.layouts.plan.plan_transfer`,
which takes one KVCacheSpec for both sides: so block size and memory order
must be equal for a plan to exist, and DCP and PCP sizes must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvbridge.handshake.schema import EngineMetadata
from kvbridge.layouts import LayoutError
from kvbridge.layouts.plan import TransferPlan, plan_transfer


class Severity(str, Enum):
    BLOCKING = "blocking"
    PLAN = "plan"
    INFO = "info"


class Role(str, Enum):
    """Which side of the transfer the *local* engine is."""

    CONSUMER = "consumer"  # decode: receives KV (pull: reads it; push: is written to)
    PRODUCER = "producer"  # prefill: holds the KV to be moved


@dataclass(frozen=True)
class Mismatch:
    field: str
    local: Any
    remote: Any
    why: str
    severity: Severity

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "local": _jsonable(self.local),
                "remote": _jsonable(self.remote), "why": self.why,
                "severity": self.severity.value}


@dataclass(frozen=True)
class CompatibilityReport:
    local_engine: str
    remote_engine: str
    local_role: Role
    mismatches: tuple[Mismatch, ...]
    plan_exists: bool
    plan_reason: str  # why not, or a one-line summary of the plan
    plan_field: str | None = None  # the field the planner refused (e.g. "consumer.dcp_size")

    @property
    def compatible(self) -> bool:
        """True when the two engines can exchange KV."""
        return self.plan_exists and not self.blocking

    @property
    def blocking(self) -> tuple[Mismatch, ...]:
        return tuple(m for m in self.mismatches if m.severity is Severity.BLOCKING)

    def fields(self) -> list[str]:
        return [m.field for m in self.mismatches]

    def to_dict(self) -> dict[str, Any]:
        return {"local_engine": self.local_engine, "remote_engine": self.remote_engine,
                "local_role": self.local_role.value, "compatible": self.compatible,
                "plan_exists": self.plan_exists, "plan_reason": self.plan_reason,
                "plan_field": self.plan_field,
                "mismatches": [m.to_dict() for m in self.mismatches]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


_REGION_WHY = {
    "layout": "SPLIT divides heads across TP ranks, REPLICATE keeps whole blocks on every "
              "rank: the bytes of a block mean different things",
    "dtype": "KV elements have a different type or width; bytes cannot be copied across",
    "head_dim": "head size differs: a block's bytes would be misread",
    "num_kv_heads": "the number of KV heads differs: a different model or attention layout",
    "key_only": "one side stores K only (MLA latent), the other K and V",
    "token_sharded": "one side shards this region's tokens across DCP ranks, the other "
                     "does not",
    "layer_ids": "the region covers different layers: a different model structure",
}

_TOP_WHY = {
    "protocol_version": "the two kvbridge versions speak different handshake protocols",
    "model": "KV computed by one model is meaningless to another",
    "num_layers": "different layer count: a different model",
    "transfer_mode": "one side expects pull (consumer READs), the other push (producer "
                     "WRITEs); neither would move the bytes",
    "regions": "the models' KV regions differ by name or order",
}


def diff_engines(local: EngineMetadata, remote: EngineMetadata,
                 local_role: Role = Role.CONSUMER) -> CompatibilityReport:
    """Every difference between two engines and whether a transfer plan exists.

    ``local_role`` fixes the direction of the plan that is checked: as
    CONSUMER (the default) the remote engine is the producer.
    """
    out: list[Mismatch] = []
    add = out.append

    for field, a, b in local.header.differences(remote.header):
        if field.startswith("regions[") and "." in field:
            key = field.rsplit(".", 1)[1]
            why = _REGION_WHY.get(key, "region format differs")
        else:
            why = _TOP_WHY.get(field, "part of the compatibility fingerprint")
        add(Mismatch(field, a, b, why, Severity.BLOCKING))

    if local.engine_id == remote.engine_id:
        add(Mismatch("engine_id", local.engine_id, remote.engine_id,
                     "both engines use the same engine id; peers and their NIXL agents are "
                     "keyed by it, so each engine needs its own", Severity.BLOCKING))

    lt, rt = local.topology, remote.topology
    for name, why in (
        ("tp_size", "heterogeneous TP: a consumer rank reads head slices from several "
                    "producer ranks (or a sub-slice of one); more descriptors per block"),
        ("pp_size", "different pipeline split: each consumer layer is read from the producer "
                    "stage holding it"),
        ("dcp_size", "token shards only line up with equal DCP on both sides"),
        ("pcp_size", "pcp rank p reads pcp rank p only; sizes must be equal"),
    ):
        if getattr(lt, name) != getattr(rt, name):
            add(Mismatch(f"topology.{name}", getattr(lt, name), getattr(rt, name), why,
                         Severity.PLAN))

    remote_regions = {r.name: r for r in remote.spec.regions}
    for region in local.spec.regions:
        other = remote_regions.get(region.name)
        if other is None:
            continue
        if region.block_size != other.block_size:
            add(Mismatch(f"regions[{region.name}].block_size", region.block_size,
                         other.block_size,
                         "tokens per block differ; the planner maps block i to block i, so "
                         "both engines must use the same block size", Severity.PLAN))
        if region.memory_order is not other.memory_order:
            add(Mismatch(f"regions[{region.name}].memory_order", region.memory_order.value,
                         other.memory_order.value,
                         "HND vs NHD: the axes inside a block are ordered differently; the "
                         "planner copies bytes as they are, so both must use one order",
                         Severity.PLAN))

    for side, meta in (("local", local), ("remote", remote)):
        missing = meta.missing_ranks(limit=8)
        if missing:
            add(Mismatch(f"{side}.ranks", [k.describe() for k in missing], None,
                         f"{side} metadata lacks these ranks (not registered, or a partial "
                         f"save): no transfer can touch them", Severity.BLOCKING))

    local_blocks = _num_blocks(local)
    remote_blocks = _num_blocks(remote)
    if local_blocks is not None and remote_blocks is not None and local_blocks != remote_blocks:
        add(Mismatch("num_blocks", local_blocks, remote_blocks,
                     "KV capacity differs; harmless (block ids are bounds-checked per side)",
                     Severity.INFO))

    plan_exists, plan_reason, plan_field = _plan_verdict(local, remote, local_role)
    return CompatibilityReport(local.engine_id, remote.engine_id, Role(local_role), tuple(out),
                               plan_exists, plan_reason, plan_field)


def _num_blocks(meta: EngineMetadata) -> int | None:
    counts = {r.num_blocks for rank in meta.ranks for r in rank.regions if r.base_addrs}
    return min(counts) if counts else None


def plan_between(local: EngineMetadata, remote: EngineMetadata,
                 local_role: Role = Role.CONSUMER) -> TransferPlan:
    """The transfer plan between the two engines; raises LayoutError naming the field."""
    if local.header.differences(remote.header):
        raise LayoutError("fingerprint", "the engines' compatibility fingerprints differ")
    if local.spec != remote.spec:
        field = "spec"
        for a, b in zip(local.spec.regions, remote.spec.regions, strict=False):
            if a.block_size != b.block_size:
                field = f"regions[{a.name}].block_size"
                break
            if a.memory_order is not b.memory_order:
                field = f"regions[{a.name}].memory_order"
                break
        raise LayoutError(field, "the planner needs one KV cache spec for both sides; "
                                 "block size and memory order must be equal")
    producer, consumer = ((remote, local) if Role(local_role) is Role.CONSUMER
                          else (local, remote))
    return plan_transfer(local.spec, producer.topology, consumer.topology)


def _plan_verdict(local: EngineMetadata, remote: EngineMetadata,
                  local_role: Role) -> tuple[bool, str, str | None]:
    try:
        plan = plan_between(local, remote, local_role)
    except LayoutError as exc:
        return False, exc.reason, exc.field
    stats = plan.stats()
    return True, (f"producer {plan.producer.describe()} -> consumer "
                  f"{plan.consumer.describe()}: {stats.total_descriptors} descriptors, "
                  f"{stats.total_bytes_per_block} bytes per block index"), None

