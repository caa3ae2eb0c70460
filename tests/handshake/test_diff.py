"""Compatibility diff: every mismatching field is named, and the plan verdict is right."""

from __future__ import annotations

from dataclasses import replace

from kvbridge.handshake import (
    CompatibilityReport,
    EngineMetadata,
    Role,
    Severity,
    TransferMode,
    diff_engines,
)
from kvbridge.handshake.example import example_store
from kvbridge.layouts import KVCacheSpec, MemoryOrder, ParallelTopology, load_spec


def _engine(spec: KVCacheSpec, engine_id: str, tp: int = 2, pp: int = 1, dcp: int = 1,
            mode: TransferMode = TransferMode.PULL, num_blocks: int = 64) -> EngineMetadata:
    topology = ParallelTopology(tp_size=tp, pp_size=pp, dcp_size=dcp)
    return example_store(spec, topology, engine_id, mode, num_blocks=num_blocks).snapshot()


def _by_field(report: CompatibilityReport) -> dict[str, Severity]:
    return {m.field: m.severity for m in report.mismatches}


def test_identical_engines_are_compatible_with_a_plan():
    spec = load_spec("tiny-gqa")
    report = diff_engines(_engine(spec, "decode"), _engine(spec, "prefill"))
    assert report.mismatches == () and report.plan_exists and report.compatible


def test_heterogeneous_tp_and_pp_are_plan_differences_that_a_plan_bridges():
    spec = load_spec("tiny-hybrid")
    report = diff_engines(_engine(spec, "decode", tp=2, pp=2), _engine(spec, "prefill", tp=4))
    assert _by_field(report) == {"topology.tp_size": Severity.PLAN,
                                 "topology.pp_size": Severity.PLAN}
    assert report.compatible and "descriptors" in report.plan_reason


def test_every_incompatible_format_field_is_named():
    spec = load_spec("tiny-hybrid")
    attn, state = spec.regions
    other = KVCacheSpec("tiny-hybrid", (
        replace(attn, dtype="bfloat16", head_dim=64, block_size=32,
                memory_order=MemoryOrder.NHD),
        replace(state, key_only=False, num_kv_heads=4),
    ))
    local = _engine(spec, "decode")
    remote = _engine(other, "prefill", mode=TransferMode.PUSH, num_blocks=32)
    report = diff_engines(local, remote)
    fields = _by_field(report)
    for name in ("regions[attn].dtype", "regions[attn].head_dim", "regions[state].key_only",
                 "regions[state].num_kv_heads", "transfer_mode"):
        assert fields[name] is Severity.BLOCKING, name
    assert fields["regions[attn].block_size"] is Severity.PLAN
    assert fields["regions[attn].memory_order"] is Severity.PLAN
    assert fields["num_blocks"] is Severity.INFO
    assert not report.compatible and not report.plan_exists
    dtype = next(m for m in report.mismatches if m.field == "regions[attn].dtype")
    assert (dtype.local, dtype.remote) == ("float16", "bfloat16") and dtype.why
    as_json = report.to_dict()
    assert as_json["compatible"] is False
    assert {m["field"] for m in as_json["mismatches"]} == set(fields)


def test_model_and_layer_structure_mismatch():
    report = diff_engines(_engine(load_spec("tiny-gqa"), "a"),
                          _engine(load_spec("tiny-hybrid"), "b"))
    fields = _by_field(report)
    assert fields["model"] is Severity.BLOCKING and fields["regions"] is Severity.BLOCKING
    assert not report.compatible


def test_block_size_alone_has_no_plan_and_says_why():
    spec = load_spec("tiny-gqa")
    bigger = KVCacheSpec(spec.model, (replace(spec.regions[0], block_size=32),))
    report = diff_engines(_engine(spec, "a"), _engine(bigger, "b"))
    assert _by_field(report) == {"regions[attn].block_size": Severity.PLAN}
    assert not report.plan_exists and not report.compatible
    assert report.plan_field == "regions[attn].block_size"


def test_unequal_dcp_has_no_plan_naming_the_planner_field():
    spec = load_spec("tiny-gqa")
    report = diff_engines(_engine(spec, "a", tp=4, dcp=2), _engine(spec, "b", tp=4))
    assert _by_field(report) == {"topology.dcp_size": Severity.PLAN}
    assert not report.plan_exists and report.plan_field == "consumer.dcp_size"


def test_same_engine_id_and_missing_ranks_block():
    spec = load_spec("tiny-gqa")
    whole = _engine(spec, "same")
    partial = replace(_engine(spec, "other"), ranks=_engine(spec, "other").ranks[:1])
    fields = _by_field(diff_engines(whole, _engine(spec, "same")))
    assert fields["engine_id"] is Severity.BLOCKING
    report = diff_engines(whole, partial)
    assert _by_field(report)["remote.ranks"] is Severity.BLOCKING and not report.compatible


def test_role_sets_the_plan_direction():
    spec = load_spec("tiny-gqa")
    local, remote = _engine(spec, "a", tp=1), _engine(spec, "b", tp=4)
    as_consumer = diff_engines(local, remote, Role.CONSUMER)
    as_producer = diff_engines(local, remote, Role.PRODUCER)
    assert "producer tp=4" in as_consumer.plan_reason
    assert "producer tp=1" in as_producer.plan_reason
