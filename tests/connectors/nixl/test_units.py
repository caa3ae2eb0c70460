"""Pure parts of the NIXL connector: notification schema, leases, routing math, receive states."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvbridge.connectors import ConfigError, TransferMode, TransferParams
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.leases import LeaseTable, VerdictKind
from kvbridge.connectors.pd.routing import (
    consumer_table,
    expected_notifs,
    notify_targets,
    producer_table,
    pull_indices,
)
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.pd.state import RecvState, RecvTransfer
from kvbridge.connectors.pd.worker import LATENCY_BUCKETS_MS, histogram_percentile, latency_key
from kvbridge.layouts import (
    LayerMemory,
    LayoutError,
    ParallelTopology,
    load_spec,
    plan_transfer,
    rank_memory,
)

# ---------------------------------------------------------------- notifications

SAMPLES = [
    messages.Hello(b"\x01agent"),
    messages.ReadDone("req-1", 3, 2),
    messages.ReadDone("req-1", 0, 1, read=False),
    messages.Ack("req-1", 1, True),
    messages.Ack("req-1", 1, False, "lease late"),
    messages.Heartbeat(("a", "b")),
    messages.Register("r", 1, 2, (0, 3), ((1, 2), (9,))),
    messages.Register("r", 1, 2, (0,), ((),), cancel=True),
    messages.Pushed("r", 0, True),
    messages.Begin("r", 2),
    messages.Held("r", 1, True, 30.0),
    messages.Held("r", 1, False, 0.0, "lease expired"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_notif_round_trip(msg: messages.Notif) -> None:
    assert messages.decode(messages.encode(msg)) == msg


@pytest.mark.parametrize(("raw", "field"), [
    (b"\xc1", "bytes"),
    (msgpack.packb([1, 2]), "bytes"),
    (msgpack.packb({"v": 2, "t": "ack"}), "v"),
    (msgpack.packb({"v": 1, "t": "nope"}), "t"),
    (msgpack.packb({"v": 1, "t": "ack", "rid": "x", "pr": 0, "ok": True}), "why"),
    (msgpack.packb({"v": 1, "t": "ack", "rid": "x", "pr": 0, "ok": 1, "why": ""}), "ok"),
    (msgpack.packb({"v": 1, "t": "read", "rid": "x", "cr": -1, "n": 1, "read": True}), "cr"),
    (msgpack.packb({"v": 1, "t": "read", "rid": "x", "cr": 0, "n": 0, "read": True}), "n"),
    (msgpack.packb({"v": 1, "t": "register", "rid": "x", "cr": 0, "n": 1, "start": [0],
                    "ids": [[1], [2]], "cancel": False}), "ids"),
    (msgpack.packb({"v": 1, "t": "register", "rid": "x", "cr": 0, "n": 1, "start": [0],
                    "ids": [[-4]], "cancel": False}), "ids[0][0]"),
    (msgpack.packb({"v": 1, "t": "hello", "agent": "text", "x": 1}), "x"),
    (msgpack.packb({"v": 1, "t": "held", "rid": "x", "pr": 0, "ok": True, "for": 0.0,
                    "why": ""}), "for"),  # an ok promise of nothing
    (msgpack.packb({"v": 1, "t": "held", "rid": "x", "pr": 0, "ok": True,
                    "for": float("nan"), "why": ""}), "for"),
    (msgpack.packb({"v": 1, "t": "begin", "rid": "", "cr": 0}), "rid"),
])
def test_notif_decode_names_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(messages.NotifError) as info:
        messages.decode(raw)
    assert info.value.field == field


# ---------------------------------------------------------------- leases


def test_lease_completes_when_every_expected_rank_notified() -> None:
    table = LeaseTable(lease_s=10)
    assert table.hold("r", now=0) == []
    assert table.notify("r", 0, 2, "c0", now=1).kind is VerdictKind.OK
    assert table.take_finished() == ([], [])
    assert table.notify("r", 0, 2, "c0", now=1).kind is VerdictKind.DUPLICATE
    assert table.notify("r", 1, 2, "c1", now=2).kind is VerdictKind.OK
    assert table.take_finished() == (["r"], [])
    assert table.take_finished() == ([], [])  # reported once
    assert table.stats.completed == 1 and table.stats.expiries == 0


def test_lease_expires_renewal_and_late_notification() -> None:
    table = LeaseTable(lease_s=10)
    table.hold("r", now=0)
    assert table.renew("r", now=8)  # deadline 18
    table.expire(now=17.9)
    assert table.is_held("r")
    table.expire(now=18)
    assert table.take_finished() == ([], ["r"])
    assert table.stats.expiries == 1
    verdict = table.notify("r", 0, 1, "c0", now=19)
    assert verdict is not None and verdict.kind is VerdictKind.LATE and not verdict.ok
    assert table.stats.late_notifs == 1
    assert table.take_finished() == ([], [])  # a late read never completes anything


def test_early_notification_waits_for_the_hold_then_becomes_unknown() -> None:
    table = LeaseTable(lease_s=10, early_grace_s=5)
    assert table.notify("r", 0, 1, "c0", now=0) is None  # early: no verdict yet
    verdicts = table.hold("r", now=1)
    assert [v.kind for v in verdicts] == [VerdictKind.OK]
    assert table.take_finished() == (["r"], [])
    assert table.notify("x", 0, 1, "c0", now=0) is None
    assert table.expire(now=4.9) == []
    unknown = table.expire(now=5)
    assert [(v.request_id, v.kind) for v in unknown] == [("x", VerdictKind.UNKNOWN)]
    assert table.num_early() == 0 and table.stats.unknown_notifs == 1


def test_guarantee_pushes_the_deadline_and_is_refused_without_a_live_hold() -> None:
    table = LeaseTable(lease_s=10)
    assert table.guarantee("r", now=0) == (None, "not held (yet)")
    table.hold("r", now=0)  # deadline 10
    assert table.guarantee("r", now=7) == (10, "")  # deadline 17, promised until 17
    assert table.guaranteed_until == 17
    table.expire(now=16.9)
    assert table.is_held("r")  # a promise is never broken by expiry
    table.expire(now=17)
    assert table.guarantee("r", now=18) == (None, "lease expired")
    table.hold("s", now=20)
    table.guarantee("s", now=20)
    table.notify("s", 0, 1, "c0", now=21)  # the reader's own notification ends it
    assert table.guarantee("s", now=22) == (None, "already completed")
    assert table.stats.guarantees == 2 and table.stats.guarantees_refused == 3
    assert table.guaranteed_until == 30


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize(("model", "p", "c"), [
    ("tiny-gqa", (1, 1), (2, 1)), ("tiny-gqa", (4, 1), (2, 1)), ("tiny-mla", (4, 1), (1, 1)),
    ("tiny-hybrid", (2, 1), (4, 1)), ("tiny-gqa", (1, 2), (1, 1)), ("tiny-mla", (2, 2), (4, 1)),
])
def test_notify_targets_cover_every_producer_rank(model: str, p: tuple[int, int],
                                                  c: tuple[int, int]) -> None:
    plan = plan_transfer(load_spec(model), ParallelTopology(tp_size=p[0], pp_size=p[1]),
                         ParallelTopology(tp_size=c[0], pp_size=c[1]))
    targets = notify_targets(plan)
    for rank in plan.ranks:  # every source is notified by the rank that reads it
        assert set(rank.sources) <= set(targets[rank.consumer_rank])
    for producer_rank in range(plan.producer.world_size):
        assert expected_notifs(targets, producer_rank) >= 1


def _memory(spec_name: str, topo: ParallelTopology, base: int, num_blocks: int
            ) -> dict[int, LayerMemory]:
    spec = load_spec(spec_name)
    addrs, addr = {}, base
    for shape in spec.rank_shapes(topo):
        for layer in shape.layer_ids:
            addrs[layer] = addr
            addr += shape.block_bytes_per_layer * num_blocks + 4096
    return rank_memory(spec, topo, addrs, num_blocks)


def test_pull_indices_match_absolute_descriptors() -> None:
    """Index rows into the prepared lists name exactly the planner's absolute descriptors."""
    from kvbridge.layouts import absolute_descriptors

    spec = load_spec("tiny-hybrid")
    producer, consumer = ParallelTopology(tp_size=2), ParallelTopology(tp_size=4)
    plan = plan_transfer(spec, producer, consumer)
    me = consumer.with_rank(tp_rank=3)
    rank_plan = plan.for_consumer(me)
    c_mem = _memory("tiny-hybrid", me, 1 << 32, 16)
    p_mems = {p: _memory("tiny-hybrid", producer.with_rank(tp_rank=p), (p + 2) << 32, 24)
              for p in rank_plan.sources}
    local = consumer_table(rank_plan, c_mem)
    c_ids = ((3, 1, 7), (2, 0, 5))
    p_ids = ((20, 4, 9), (11, 12, 13))
    for p in rank_plan.sources:
        remote = producer_table(rank_plan.for_producer(p), p_mems[p])
        lidx, ridx, _runs = pull_indices(rank_plan, local, remote, p, c_ids, p_ids)
        got = sorted(zip(map(tuple, local.rows[lidx].tolist()),
                         map(tuple, remote.rows[ridx].tolist()), strict=True))
        # the oracle: the planner's own absolute descriptors, region by region
        want = []
        for region in range(2):
            sub = rank_plan.for_producer(p)
            mask = sub.regions == region
            if not mask.any():
                continue
            for d in absolute_descriptors(rank_plan, c_mem, p_mems, c_ids[region],
                                          p_ids[region], producer_ranks=[p],
                                          layers=set(sub.layers[mask].tolist())):
                want += list(zip(map(tuple, d.consumer.tolist()),
                                 map(tuple, d.producer.tolist()), strict=True))
        assert got == sorted(want)


def test_remote_block_ids_are_bounds_checked_before_posting() -> None:
    spec = load_spec("tiny-gqa")
    plan = plan_transfer(spec, ParallelTopology(), ParallelTopology())
    rank_plan = plan.for_consumer(0)
    local = consumer_table(rank_plan, _memory("tiny-gqa", ParallelTopology(), 1 << 32, 8))
    remote = producer_table(rank_plan.for_producer(0),
                            _memory("tiny-gqa", ParallelTopology(), 1 << 33, 4))
    with pytest.raises(LayoutError) as info:
        pull_indices(rank_plan, local, remote, 0, ((1,),), ((4,),))  # producer has 4 blocks
    assert info.value.field == "producer_block_ids[0]"
    with pytest.raises(LayoutError):
        pull_indices(rank_plan, local, remote, 0, ((8,),), ((0,),))
    lidx, ridx, runs = pull_indices(rank_plan, local, remote, 0, ((7,),), ((3,),))
    assert lidx.dtype == np.int32 and (local.rows[lidx, 1] == remote.rows[ridx, 1]).all()


def test_descriptor_leaving_its_block_is_refused() -> None:
    from kvbridge.connectors.pd.routing import build_table

    one = np.array([0], dtype=np.int64)
    with pytest.raises(LayoutError):
        build_table(one, one, np.array([100]), np.array([64]),
                    {0: LayerMemory(1 << 20, 128, 4)}, "producer")


# ---------------------------------------------------------------- receive state machine


def _params() -> TransferParams:
    return TransferParams(mode=TransferMode.PULL, producer_engine_id="p", producer_host="h",
                          producer_port=1, producer_request_id="r", block_ids=((1, 2),),
                          producer_topology=ParallelTopology(), num_tokens=20)


def test_recv_transfer_states() -> None:
    recv = RecvTransfer("r", _params(), ((5, 6),), ((1, 2),), (0,), deadline=10, started_at=0)
    assert recv.poll(1) is RecvState.BOOTSTRAPPING
    recv.posted(frozenset({0, 1}), [object()], pull=True)
    assert recv.poll(2) is RecvState.TRANSFERRING
    recv.transfers_done()
    recv.answer(0, True, "", 3)
    assert recv.poll(3) is RecvState.WAITING
    recv.answer(1, True, "", 4)
    assert recv.poll(4) is RecvState.DONE and recv.duration_s == 4
    assert not recv.fail("late", 5)  # terminal states never change


def test_recv_transfer_fails_on_refusal_and_deadline() -> None:
    refused = RecvTransfer("r", _params(), ((5, 6),), ((1, 2),), (0,), deadline=10,
                           started_at=0)
    refused.posted(frozenset({0}), [], pull=True)
    refused.answer(0, False, "lease late", 1)
    assert refused.poll(1) is RecvState.FAILED and "lease late" in (refused.error or "")
    assert refused.local_blocks == {(0, 5), (0, 6)}
    stuck = RecvTransfer("s", _params(), ((7,),), ((1,),), (0,), deadline=10, started_at=0)
    assert stuck.poll(9.99) is RecvState.BOOTSTRAPPING
    assert stuck.poll(10) is RecvState.FAILED and "bootstrapping" in (stuck.error or "")


def test_recv_transfer_finishes_on_a_promise_only_if_the_read_ended_inside_it() -> None:
    def posted() -> RecvTransfer:
        recv = RecvTransfer("r", _params(), ((5, 6),), ((1, 2),), (0,), deadline=100,
                            started_at=0)
        recv.begun_at = {0: 1.0, 1: 1.0}
        recv.posted(frozenset({0, 1}), [object(), object()], pull=True)
        recv.transfers_done()
        return recv

    recv = posted()
    recv.promised(0, 10.0)  # rank 0 holds until 11 (local), rank 1 says nothing yet
    recv.read_done(0, 5.0)
    recv.read_done(1, 5.0)
    assert recv.poll(5) is RecvState.WAITING  # rank 1: neither promise nor ack
    recv.answer(1, True, "", 6)
    assert recv.poll(6) is RecvState.DONE and recv.done_on_promise

    late = posted()
    late.promised(0, 10.0)
    late.promised(1, 10.0)
    late.read_done(0, 5.0)
    late.read_done(1, 11.5)  # seen done after the promise ran out: proves nothing
    assert late.poll(12) is RecvState.WAITING
    late.answer(1, False, "lease late", 13)  # the ack decides: fail closed
    assert late.poll(13) is RecvState.FAILED

    acked = posted()
    acked.answer(0, True, "", 2)
    acked.answer(1, True, "", 2)
    assert acked.poll(2) is RecvState.DONE and not acked.done_on_promise

    unasked = posted()
    unasked.begun_at = {}
    unasked.promised(0, 10.0)  # a promise for a begin never sent counts for nothing
    unasked.promised(1, 10.0)
    unasked.read_done(0, 2.0)
    unasked.read_done(1, 2.0)
    assert unasked.poll(3) is RecvState.WAITING


# ---------------------------------------------------------------- settings and stats


def test_settings_parse_and_refuse() -> None:
    s = PdSettings.parse({"mode": "push", "lease_s": 5, "port": 7000})
    assert s.mode is TransferMode.PUSH and s.lease_s == 5.0 and s.heartbeat_interval_s == 5 / 3
    assert PdSettings.parse({"idle_progress_ms": 0, "busy_progress_ms": 0.5,
                               "read_progress_ms": 0.1}) \
        == PdSettings(idle_progress_ms=0.0, busy_progress_ms=0.5, read_progress_ms=0.1)
    assert PdSettings().lanes == 2 and PdSettings.parse({"lanes": 1}).lanes == 1
    assert PdSettings.parse({"lanes": 16}).lanes == 16
    for bad, field in [({"mode": "both"}, "mode"), ({"lease_s": 0}, "lease_s"),
                       ({"lanes": 0}, "lanes"), ({"lanes": 17}, "lanes"),
                       ({"lanes": True}, "lanes"), ({"lanes": 2.0}, "lanes"),
                       ({"port": 70000}, "port"), ({"nope": 1}, "nope"),
                       ({"busy_progress_ms": 0}, "busy_progress_ms"),
                       ({"read_progress_ms": 0}, "read_progress_ms"),
                       ({"idle_progress_ms": -1}, "idle_progress_ms")]:
        with pytest.raises(ConfigError) as info:
            PdSettings.parse(bad)
        assert info.value.field == f"kv_connector_extra_config.{field}"


def test_histogram_percentiles() -> None:
    stats = {latency_key(1): 50, latency_key(10): 40, latency_key(1000): 10}
    assert histogram_percentile(stats, 0.5) == 1
    assert histogram_percentile(stats, 0.9) == 10
    assert histogram_percentile(stats, 0.99) == 1000
    assert histogram_percentile({}, 0.5) is None
    assert len(set(LATENCY_BUCKETS_MS)) == len(LATENCY_BUCKETS_MS)


def _runs_in_rows(local_rows: np.ndarray, remote_rows: np.ndarray) -> int:
    """Oracle: contiguous runs of consecutive (local, remote) rows, from the addresses."""
    la, ll = local_rows[:, 0].astype(np.int64), local_rows[:, 1].astype(np.int64)
    ra = remote_rows[:, 0].astype(np.int64)
    joins = (la[:-1] + ll[:-1] == la[1:]) & (ra[:-1] + ll[:-1] == ra[1:])
    return int(len(la) - np.count_nonzero(joins))


def _one_layer_tables(num_blocks: int) -> tuple[object, object, object]:
    from kvbridge.tools.bench.nixl import bench_spec

    spec = bench_spec(16 << 10)  # one layer, one whole-block descriptor per block
    topo = ParallelTopology()
    rank_plan = plan_transfer(spec, topo, topo).for_consumer(0)
    local = consumer_table(rank_plan, rank_memory(spec, topo, {0: 1 << 32}, num_blocks))
    remote = producer_table(rank_plan.for_producer(0),
                            rank_memory(spec, topo, {0: 1 << 36}, num_blocks))
    return rank_plan, local, remote


@pytest.mark.parametrize("consumer_ids, producer_ids, want_runs", [
    (tuple(range(63, -1, -1)), tuple(range(63, -1, -1)), 1),  # both descending: one run
    (tuple(range(64)), tuple(range(10, 74)), 1),
    (tuple(range(63, -1, -1)), tuple(range(64)), 64),  # opposite directions: nothing merges
    ((5, 6, 7, 0, 1, 2), (50, 51, 52, 20, 21, 22), 2),  # two runs, interleaved order
])
def test_pairs_are_ordered_so_nixl_merges_them(consumer_ids: tuple[int, ...],
                                               producer_ids: tuple[int, ...],
                                               want_runs: int) -> None:
    rank_plan, local, remote = _one_layer_tables(128)
    lidx, ridx, runs = pull_indices(rank_plan, local, remote, 0, (consumer_ids,),
                                    (producer_ids,))
    assert runs == want_runs == _runs_in_rows(local.rows[lidx], remote.rows[ridx])
    # the same pairs as the request's block order, only reordered
    got = sorted(zip(lidx.tolist(), ridx.tolist(), strict=True))
    want = sorted(zip(consumer_ids, producer_ids, strict=True))  # base rows are 0 here
    assert got == want


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-mla", "tiny-hybrid"])
def test_runs_count_matches_the_addresses_for_random_block_orders(model: str) -> None:
    """Random block orders (with runs in both directions) on multi-layer presets: the
    pairs are the request's pairs, and ``runs`` is what the addresses say."""
    rng = np.random.default_rng(7)
    spec = load_spec(model)
    topo = ParallelTopology()
    rank_plan = plan_transfer(spec, topo, topo).for_consumer(0)
    c_mem = _memory(model, topo, 1 << 32, 96)
    p_mem = _memory(model, topo, 1 << 36, 96)
    local = consumer_table(rank_plan, c_mem)
    remote = producer_table(rank_plan.for_producer(0), p_mem)
    nregions = len(spec.regions)
    merged = 0
    for _ in range(25):
        n = int(rng.integers(1, 40))
        c_ids, p_ids = [], []
        for _r in range(nregions):
            c = rng.permutation(96)[:n]
            p = rng.permutation(96)[:n]
            if rng.random() < 0.5:  # contiguous runs, maybe descending on both sides
                start_c, start_p = int(rng.integers(0, 96 - n)), int(rng.integers(0, 96 - n))
                c, p = np.arange(start_c, start_c + n), np.arange(start_p, start_p + n)
                if rng.random() < 0.5:
                    c, p = c[::-1], p[::-1]
            c_ids.append(tuple(int(x) for x in c))
            p_ids.append(tuple(int(x) for x in p))
        lidx, ridx, runs = pull_indices(rank_plan, local, remote, 0, c_ids, p_ids)
        assert runs == _runs_in_rows(local.rows[lidx], remote.rows[ridx]) <= lidx.size
        merged += lidx.size - runs
        got = sorted(zip(map(tuple, local.rows[lidx].tolist()),
                         map(tuple, remote.rows[ridx].tolist()), strict=True))
        want = []
        for j in range(rank_plan.num_descriptors):
            region = int(local.regions[j])
            for a, b in zip(c_ids[region], p_ids[region], strict=True):
                want.append((tuple(local.rows[local.base_row[j] + a].tolist()),
                             tuple(remote.rows[remote.base_row[j] + b].tolist())))
        assert got == sorted(want)
    assert merged > 0  # the presets' descriptors do merge across blocks
