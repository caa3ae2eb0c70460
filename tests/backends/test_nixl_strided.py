"""Strided descriptor lists on real NIXL, verified to the byte against per-block lists.

The connector prepares every list in NIXL's strided form (one row per
descriptor of the plan, ``count`` = blocks) instead of one row per block and
descriptor. Here both forms are prepared for the same plan -- homogeneous and
heterogeneous TP, HND and NHD, a hybrid spec -- against a real peer process,
and the same READs and WRITEs are run through each: the bytes that land must
be identical, and equal to the oracle computed from the per-block rows.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.conftest import require

torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl import (  # noqa: E402
    NixlTransport,
    NixlTransportError,
    XferState,
    expand_descs,
    strided_descs,
)
from kvbridge.connectors.pd.routing import (  # noqa: E402
    consumer_table,
    pair_indices,
    producer_table,
    pull_indices,
)
from kvbridge.layouts import ParallelTopology, load_spec, plan_transfer, rank_memory  # noqa: E402
from kvbridge.tools.bench.nixl_peer import PeerProcess  # noqa: E402
from kvbridge.tools.bench.nixl_peer import pattern as np_pattern  # noqa: E402

NB_PRODUCER, NB_CONSUMER = 24, 20
SEED = 11


def _layout(spec_name: str, topo: ParallelTopology, base: int, num_blocks: int
            ) -> tuple[dict[int, int], int]:
    """Layer id -> offset from ``base`` of every layer tensor of one rank, and the bytes."""
    spec = load_spec(spec_name)
    addrs, off = {}, 0
    for shape in spec.rank_shapes(topo):
        for layer in shape.layer_ids:
            addrs[layer] = base + off
            off += shape.block_bytes_per_layer * num_blocks + 64  # a gap between layers
    return addrs, off


CASES = [  # (spec, producer tp, consumer tp)
    ("tiny-gqa", 1, 1),
    ("tiny-gqa", 1, 2),  # consumer reads a head slice of every producer block
    ("tiny-gqa", 2, 1),  # consumer reads from two producer ranks
    ("tiny-gqa-nhd", 1, 2),  # head slices per token: many sub-block descriptors
    ("tiny-hybrid", 2, 4),  # a SPLIT and a REPLICATE region
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-tp{p}to{c}" for m, p, c in CASES])
def test_strided_lists_move_the_same_bytes_as_per_block_lists(case: tuple[str, int, int]
                                                             ) -> None:
    model, ptp, ctp = case
    spec = load_spec(model)
    producer, consumer = ParallelTopology(tp_size=ptp), ParallelTopology(tp_size=ctp)
    plan = plan_transfer(spec, producer, consumer)
    # every producer rank's memory in one peer buffer (addresses are all NIXL sees)
    spans = [_layout(model, producer.with_rank(tp_rank=p), 0, NB_PRODUCER)[1]
             for p in range(ptp)]
    with PeerProcess(f"strided-peer-{uuid.uuid4().hex[:8]}", sum(spans), seed=SEED) as peer:
        peer_bytes = np_pattern(peer.nbytes, SEED)
        p_mems, base = {}, peer.addr
        for p in range(ptp):
            addrs, _ = _layout(model, producer.with_rank(tp_rank=p), base, NB_PRODUCER)
            p_mems[p] = rank_memory(spec, producer.with_rank(tp_rank=p), addrs, NB_PRODUCER)
            base += spans[p]
        rng = np.random.default_rng(len(model) * 7 + ptp * 3 + ctp)
        for c in range(ctp):
            me = consumer.with_rank(tp_rank=c)
            rank_plan = plan.for_consumer(me)
            _check_rank(spec, me, rank_plan, peer, peer_bytes, p_mems, rng)


def _check_rank(spec, me, rank_plan, peer, peer_bytes, p_mems, rng) -> None:
    _, nbytes = _layout(spec.model, me, 0, NB_CONSUMER)
    flat = {form: torch.zeros(nbytes, dtype=torch.uint8) for form in ("strided", "per_block")}
    t = NixlTransport(f"strided-{uuid.uuid4().hex[:8]}")
    try:
        tables, lists = {}, {}
        for form, buf in flat.items():
            addrs, _ = _layout(spec.model, me, buf.data_ptr(), NB_CONSUMER)
            mem = rank_memory(spec, me, addrs, NB_CONSUMER)
            # every layer a view of one flat allocation: registered once
            views = [buf[a - buf.data_ptr():a - buf.data_ptr() + m.block_stride * m.num_blocks]
                     for a, m in ((addrs[layer], mem[layer]) for layer in sorted(mem))]
            t.register_regions(views)
            local = consumer_table(rank_plan, mem)
            rows = local.strided() if form == "strided" else local.rows
            tables[form] = local
            lists[form] = t.prepare_local_descs(rows)
        assert t.counters().registrations == 2  # one per flat buffer, not one per layer
        ph = t.add_peer(peer.name, peer.metadata)
        nregions = len(spec.regions)
        c_ids = tuple(tuple(rng.permutation(NB_CONSUMER)[:12].tolist()) for _ in range(nregions))
        p_ids = tuple(tuple(rng.permutation(NB_PRODUCER)[:12].tolist()) for _ in range(nregions))
        for p in rank_plan.sources:
            remote = producer_table(rank_plan.for_producer(p), p_mems[p])
            strided_rows = remote.strided()
            assert strided_rows.shape[0] == remote.num_descs  # one row per descriptor
            np.testing.assert_array_equal(expand_descs(strided_rows)[:, :2], remote.rows)
            rlists = {"strided": t.prepare_remote(ph, strided_rows),
                      "per_block": t.prepare_remote(ph, remote.rows)}
            assert {d.num_descs for d in rlists.values()} == {remote.num_rows}
            for form in flat:
                lidx, ridx, _ = pull_indices(rank_plan, tables[form], remote, p, c_ids, p_ids)
                x = t.post("READ", lists[form], lidx, rlists[form], ridx, deadline_s=30)
                assert t.wait(x) is XferState.DONE, x.error
            # oracle from the per-block rows: what each READ must have put where
            lidx, ridx, _ = pull_indices(rank_plan, tables["per_block"], remote, p, c_ids,
                                         p_ids)
            lrows, rrows = tables["per_block"].rows[lidx], remote.rows[ridx]
            want = flat["per_block"].numpy().copy()
            base_l = flat["per_block"].data_ptr()
            for (la, ln), (ra, _) in zip(lrows.tolist(), rrows.tolist(), strict=True):
                want[la - base_l:la - base_l + ln] = peer_bytes[ra - peer.addr:
                                                                ra - peer.addr + ln]
            np.testing.assert_array_equal(flat["per_block"].numpy(), want)
        assert lidx.size > 0
        np.testing.assert_array_equal(flat["strided"].numpy(), flat["per_block"].numpy())
        assert flat["strided"].numpy().any()
        # WRITE back through the strided lists: the peer's bytes at the producer rows
        # become the consumer's (here: zeroed where nothing was read, then filled)
        p = rank_plan.sources[0]
        remote = producer_table(rank_plan.for_producer(p), p_mems[p])
        sub = rank_plan.for_producer(p)
        which = np.arange(sub.num_descriptors)
        flat["strided"].copy_(torch.from_numpy(np_pattern(flat["strided"].numel(), SEED + 1)))
        rl = t.prepare_remote(ph, remote.strided())
        local_which = np.flatnonzero(rank_plan.producer_ranks == p)
        lidx, ridx, _ = pair_indices(tables["strided"], local_which, c_ids, "consumer",
                                     remote, which, p_ids, "producer")
        x = t.post("WRITE", lists["strided"], lidx, rl, ridx, deadline_s=30)
        assert t.wait(x) is XferState.DONE, x.error
        lrows, rrows = tables["strided"].rows[lidx], remote.rows[ridx]
        src = flat["strided"].numpy()
        base_l = flat["strided"].data_ptr()
        for (la, ln), (ra, _) in zip(lrows.tolist(), rrows.tolist(), strict=True):
            assert peer.read(ra - peer.addr, ln) == src[la - base_l:la - base_l + ln].tobytes()
        peer.call("fill", seed=SEED)  # the shared pattern again for the next rank
    finally:
        final = t.close(strict=False)
    assert final.live == 0, final


def test_strided_rows_are_checked_before_nixl_sees_them() -> None:
    t = NixlTransport(f"strided-unit-{uuid.uuid4().hex[:8]}")
    try:
        buf = torch.zeros(4096, dtype=torch.uint8)
        t.register_regions([buf])
        a = buf.data_ptr()
        ok = t.prepare_local_descs(strided_descs(a + 16, 32, 256, 16))
        assert ok.num_descs == 16
        with pytest.raises(NixlTransportError, match="row 0"):  # last block past the end
            t.prepare_local_descs(strided_descs(a + 16, 32, 256, 17))
        with pytest.raises(NixlTransportError, match="stride"):  # overlapping rows
            t.prepare_local_descs(np.array([[a, 64, 0, 32, 4]], dtype=np.uint64))
        with pytest.raises(NixlTransportError, match="count"):
            t.prepare_local_descs(np.array([[a, 64, 0, 64, 0]], dtype=np.uint64))
        with pytest.raises(NixlTransportError, match="int32"):
            t.prepare_local_descs(np.array([[a, 1, 0, 1, 1 << 31]], dtype=np.uint64))
        with pytest.raises(NixlTransportError, match="stride >= length"):
            strided_descs(a, 64, 32, 2)
        assert t.counters().dlists == 1
    finally:
        t.close(strict=False)
