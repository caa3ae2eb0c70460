"""The pure part of verified pull/push loads (``connectors.pd.verify``) and the
digest fields of the notifications."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.verify import (
    MAX_ASK_BLOCKS,
    answer_ask,
    check_answer,
    plan_ask,
    take_hold_digests,
    whole_block_regions,
)
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.layouts.digests import BlockDigester, DigestMode, LayerSpan, VerifyPolicy
from kvbridge.layouts.plan import plan_consumer_rank, rank_at

FULL = VerifyPolicy(DigestMode.FULL)


def _regions_checked(model: str, producer: ParallelTopology, consumer: ParallelTopology,
                     consumer_index: int = 0) -> dict[int, frozenset[int]]:
    """Per producer rank read from: the regions a consumer rank checks whole."""
    spec = load_spec(model)
    me = rank_at(consumer, consumer_index)
    plan = plan_consumer_rank(spec, producer, me)
    local = [s.block_bytes_per_layer for s in spec.rank_shapes(me)]
    out = {}
    for p in plan.sources:
        theirs = rank_at(producer, p)
        out[p] = whole_block_regions(plan, p, local,
                                     [s.block_bytes_per_layer for s in spec.rank_shapes(theirs)],
                                     [s.layer_ids for s in spec.rank_shapes(theirs)])
    return out


def test_equal_tp_checks_every_region_and_head_slices_none() -> None:
    one, two = ParallelTopology(tp_size=1), ParallelTopology(tp_size=2)
    assert _regions_checked("tiny-gqa", one, one) == {0: frozenset({0})}
    assert _regions_checked("tiny-gqa", two, two, 1) == {1: frozenset({0})}
    # TP2 -> TP1: each producer rank holds half of the consumer block's heads
    assert _regions_checked("tiny-gqa", two, one) == {0: frozenset(), 1: frozenset()}
    # TP1 -> TP2: the consumer reads a head slice of the producer's block
    assert _regions_checked("tiny-gqa", one, two) == {0: frozenset()}


def test_replicated_latent_is_checked_at_any_tp() -> None:
    one, two = ParallelTopology(tp_size=1), ParallelTopology(tp_size=2)
    for producer, consumer in ((two, one), (one, two), (two, two)):
        checked = _regions_checked("tiny-mla", producer, consumer)
        assert len(checked) == 1 and next(iter(checked.values())) == frozenset({0}), checked


def test_another_pipeline_split_is_not_checked() -> None:
    pp2 = ParallelTopology(pp_size=2)
    spec = load_spec("tiny-gqa")
    me = ParallelTopology()
    plan = plan_consumer_rank(spec, pp2, me)
    theirs = rank_at(pp2, plan.sources[0])
    checked = whole_block_regions(plan, plan.sources[0],
                                  [s.block_bytes_per_layer for s in spec.rank_shapes(me)],
                                  [s.block_bytes_per_layer for s in spec.rank_shapes(theirs)],
                                  [s.layer_ids for s in spec.rank_shapes(theirs)])
    assert checked == frozenset()


def test_plan_ask_samples_bounds_and_counts() -> None:
    ids = ((1, 2, 3, 4, 5, 6, 7, 8),)
    full = plan_ask(FULL, "r", frozenset({0}), ids, ((11, 12, 13, 14, 15, 16, 17, 18),))
    assert full.consumer_ids == ids and full.producer_ids[0][0] == 11 and full.unverified == 0
    assert full.positions == (tuple(range(8)),) and full.totals == (8,)
    sample = plan_ask(VerifyPolicy(DigestMode.SAMPLE, 0.5), "r", frozenset({0}), ids, ids)
    assert sample.num_blocks < 8 and sample.unverified == 0
    assert all(ids[0][i] == b for i, b in zip(sample.positions[0], sample.consumer_ids[0],
                                              strict=True))
    unchecked = plan_ask(FULL, "r", frozenset(), ids, ids)
    assert unchecked.num_blocks == 0 and unchecked.unverified == 0  # counted by the worker
    off = plan_ask(VerifyPolicy(DigestMode.OFF), "r", frozenset({0}), ids, ids)
    assert off.num_blocks == 0 and off.unverified == 0
    many = tuple(range(MAX_ASK_BLOCKS + 5))
    bounded = plan_ask(FULL, "r", frozenset({0}), (many,), (many,))
    assert bounded.num_blocks == MAX_ASK_BLOCKS and bounded.unverified == 5


def _digester(num_blocks: int = 6) -> tuple[BlockDigester, np.ndarray]:
    mem = np.arange(num_blocks * 64, dtype=np.uint8).reshape(num_blocks, 64) * 3
    span = LayerSpan(mem.ctypes.data, 64, 64, num_blocks)
    return BlockDigester({0: span}, [(0,)], owner=mem), mem


def test_answer_ask_gives_held_blocks_only_and_check_finds_each_changed_block() -> None:
    digester, mem = _digester()
    held = take_hold_digests(digester, ((1, 3, 5),))
    assert isinstance(answer_ask(held, ((7,),)), str)  # not held: no hashing of it
    assert "regions" in str(answer_ask(held, ((1,), (3,))))
    answer = answer_ask(held, ((5, 1),))
    assert isinstance(answer, tuple)
    ask = plan_ask(FULL, "r", frozenset({0}), ((2, 4),), ((5, 1),))
    # the consumer's blocks 2 and 4 hold what the producer's 5 and 1 held
    mem[2], mem[4] = mem[5].copy(), mem[1].copy()
    assert check_answer(ask, answer, digester) == (2, [])
    mem[4, 10] ^= 1
    assert check_answer(ask, answer, digester) == (1, [(0, 4)])
    # a malformed answer trusts nothing
    assert check_answer(ask, (answer[0][:8],), digester) == (0, [(0, 2), (0, 4)])
    assert check_answer(ask, (), digester) == (0, [(0, 2), (0, 4)])


def test_push_answers_cover_the_whole_load_and_the_sample_is_picked_from_it() -> None:
    digester, mem = _digester()
    held = take_hold_digests(digester, ((0, 1, 2, 3),))
    ask = plan_ask(VerifyPolicy(DigestMode.SAMPLE, 0.5), "push-r", frozenset({0}),
                   ((0, 1, 2, 3),), ((0, 1, 2, 3),))
    answer = answer_ask(held, ((0, 1, 2, 3),))
    assert isinstance(answer, tuple)
    assert check_answer(ask, answer, digester, whole_load=True) == (ask.num_blocks, [])


def test_digest_fields_are_both_or_neither_and_bounded() -> None:
    def raw(**body: object) -> bytes:
        return msgpack.packb({"v": 1, **body})

    with pytest.raises(messages.NotifError) as err:
        messages.decode(raw(t="begin", rid="r", cr=0, dig=[[1]]))
    assert err.value.field == "alg"
    with pytest.raises(messages.NotifError) as err:
        messages.decode(raw(t="held", rid="r", pr=0, ok=True, why="", alg="xxh3-64",
                            dig=[b"1234567"], **{"for": 1.0}))
    assert err.value.field == "dig"  # not whole 8-byte digests
    with pytest.raises(messages.NotifError) as err:
        messages.decode(raw(t="begin", rid="r", cr=0, alg="xxh3-64", dig=[[1]] * 65))
    assert err.value.field == "dig"
    with pytest.raises(messages.NotifError) as err:
        messages.decode(raw(t="ack", rid="r", pr=0, ok=True, why="", alg="xxh3-64"))
    assert err.value.field == "alg"  # only begin/held/register/pushed carry digests
    begin = messages.decode(raw(t="begin", rid="r", cr=0))
    assert isinstance(begin, messages.Begin) and begin.digest_ids == ()


def test_verify_settings_are_parsed_once_the_same_for_every_connector() -> None:
    from kvbridge.connectors.errors import ConfigError
    from kvbridge.connectors.mooncake_store.settings import parse_settings as mooncake
    from kvbridge.connectors.offloading.settings import parse_settings as offloading
    from kvbridge.connectors.pd.settings import PdSettings

    nixl = PdSettings.parse({"verify": "full", "verify_sample": 0.5,
                               "verify_allow_unverified": False}).verify_policy
    assert nixl == VerifyPolicy(DigestMode.FULL, 0.5, False)
    assert PdSettings.parse({}).verify_policy == VerifyPolicy()
    base = {"master_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"}
    assert mooncake({**base, "verify": "off"}).verify_policy.mode is DigestMode.OFF
    assert offloading({"verify": "full"}).verify == VerifyPolicy(DigestMode.FULL)
    for parse, extra in ((PdSettings.parse, {}), (offloading, {})):
        for key, value in (("verify", "all"), ("verify_sample", 0), ("verify_sample", True),
                           ("verify_allow_unverified", "yes")):
            with pytest.raises(ConfigError) as err:
                parse({**extra, key: value})
            assert err.value.field.endswith(key), err.value.field
