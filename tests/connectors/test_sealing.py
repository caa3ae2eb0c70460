"""Sealed params, without engines: the chain, the seal, the consumer's checks, the claims.

The end-to-end rows (real engines, real NIXL) are in
``tests/connectors/nixl/test_sealed_params.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.auth import Secret
from kvbridge.connectors import TransferMode, TransferParams, TransferParamsError
from kvbridge.connectors.pd.leases import LeaseTable, VerdictKind
from kvbridge.connectors.sealing import (
    CHAIN_TOKENS,
    MAX_CHAIN_LINKS,
    ParamsCheck,
    Sealer,
    canonical_record,
    prompt_chain,
    record_digest,
    verify_cluster_seal,
)
from kvbridge.layouts import ParallelTopology, hash_blocks

SECRET = Secret.from_value("a-test-cluster-secret-0123456789")
TOKENS = list(range(1000, 1100))


def _params(num_tokens: int = 40) -> TransferParams:
    return TransferParams(mode=TransferMode.PULL, producer_engine_id="p",
                          producer_host="127.0.0.1", producer_port=5600,
                          producer_request_id="req", block_ids=((1, 2, 3),),
                          producer_topology=ParallelTopology(tp_size=1), num_tokens=num_tokens)


def _sealed(sealer: Sealer, num_tokens: int = 40, salt: str | None = None) -> TransferParams:
    return sealer.seal(_params(num_tokens), prompt_chain(TOKENS, num_tokens, salt))


def test_the_chain_is_the_prefix_caches_block_hashes_where_blocks_hold_16_tokens() -> None:
    full = hash_blocks(TOKENS[:64], CHAIN_TOKENS)
    assert prompt_chain(TOKENS, 64) == full[-1]
    assert prompt_chain(TOKENS, 64, links=full) == full[-1]  # given, not recomputed
    # a partial last block is one more link, distinct from the full blocks' chain
    assert prompt_chain(TOKENS, 65) not in (full[-1], prompt_chain(TOKENS, 64))
    assert prompt_chain(TOKENS, 65, links=full) == prompt_chain(TOKENS, 65)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 100), at=st.integers(0, 99), salt=st.sampled_from([None, "s", "t"]))
def test_any_other_token_or_salt_is_another_chain(n: int, at: int, salt: str | None) -> None:
    chain = prompt_chain(TOKENS, n, salt)
    assert chain == prompt_chain(list(TOKENS), n, salt)
    if at < n:
        other = list(TOKENS)
        other[at] += 1
        assert prompt_chain(other, n, salt) != chain
    if n > 0:  # (nothing is loaded of an empty prefix)
        assert prompt_chain(TOKENS, n, "u") != chain  # another salt
    if n < len(TOKENS):
        assert prompt_chain(TOKENS, n + 1, salt) != chain  # another length


def test_the_chain_is_bounded_by_the_prompt_and_a_constant() -> None:
    with pytest.raises(TransferParamsError, match="num_tokens"):
        prompt_chain(TOKENS, len(TOKENS) + 1)
    with pytest.raises(TransferParamsError, match="at most"):
        prompt_chain(range(MAX_CHAIN_LINKS * CHAIN_TOKENS), MAX_CHAIN_LINKS * CHAIN_TOKENS)


def test_the_seal_covers_every_field_of_the_record() -> None:
    sealer = Sealer(SECRET)
    params = _sealed(sealer)
    assert params.seal_key == "cluster" and params.hold_id and params.incarnation
    assert verify_cluster_seal(SECRET, params) and sealer.verify(params)
    changes = {"mode": TransferMode.PUSH, "producer_engine_id": "q", "producer_host": "h",
               "producer_port": 5601, "producer_request_id": "other",
               "block_ids": ((1, 2, 4),), "producer_topology": ParallelTopology(tp_size=2),
               "num_tokens": 39, "consumer_engine_id": "c", "consumer_host": "h",
               "consumer_port": 1, "consumer_request_id": "d", "spec_fingerprint": "f",
               "extra": {"k": 1}, "hold_id": "0" * 32, "incarnation": "0" * 16,
               "prompt_chain": "0" * 64, "seal_key": "engine"}
    sealed_fields = {f.name for f in dataclasses.fields(TransferParams)} - {"seal", "version"}
    assert set(changes) == sealed_fields  # a new field must be sealed too
    for name, value in changes.items():
        push = {"consumer_engine_id": "c", "consumer_host": "h", "consumer_port": 1} \
            if name == "mode" else {}
        changed = dataclasses.replace(params, **{name: value}, **push)
        assert canonical_record(changed) != canonical_record(params), name
        assert record_digest(changed) != record_digest(params), name
        assert not verify_cluster_seal(SECRET, changed), name
    assert not verify_cluster_seal(Secret.from_value("another-secret-0123456789"), params)


def test_a_per_engine_key_is_the_producers_alone() -> None:
    sealer = Sealer()
    params = _sealed(sealer)
    assert params.seal_key == "engine" and sealer.verify(params)
    assert not Sealer().verify(params)
    assert not verify_cluster_seal(SECRET, params)
    assert _sealed(sealer).hold_id != params.hold_id  # every hold its own id


def test_the_consumer_refuses_what_is_not_sealed_for_its_prompt() -> None:
    params = _sealed(Sealer(SECRET), 40, "salt")
    for check in (ParamsCheck(SECRET), ParamsCheck()):
        check.check("a", TOKENS, "salt", params)  # its own: fine, repeatedly
        check.check("a", TOKENS, "salt", params)
        cases = {"transfer_params.prompt_chain": (TOKENS[1:], "salt", params),
                 "transfer_params.seal": (TOKENS, "salt", dataclasses.replace(params, seal=None))}
        cases["transfer_params.prompt_chain "] = (TOKENS, None, params)  # another salt
        for field, (tokens, salt, p) in cases.items():
            with pytest.raises(TransferParamsError) as info:
                check.check("a", tokens, salt, p)
            assert info.value.field == field.strip()
    cluster = ParamsCheck(SECRET)
    forged = dataclasses.replace(params, block_ids=((7, 8, 9),))
    with pytest.raises(TransferParamsError, match="does not verify"):
        cluster.check("a", TOKENS, "salt", forged)
    ParamsCheck().check("a", TOKENS, "salt", forged)  # only the producer can tell
    with pytest.raises(TransferParamsError) as info:
        cluster.check("a", TOKENS, "salt", _sealed(Sealer(), 40, "salt"))
    assert info.value.field == "transfer_params.seal_key"


def test_a_hold_is_loaded_by_one_request_until_its_load_fails() -> None:
    check = ParamsCheck()
    params = _sealed(Sealer())
    check.check("a", TOKENS, None, params)
    check.used("a", params)
    check.check("a", TOKENS, None, params)  # the same request asking again
    with pytest.raises(TransferParamsError) as info:
        check.check("b", TOKENS, None, params)
    assert info.value.field == "transfer_params.hold_id"
    check.failed("a")  # a failed load does not use the hold up
    check.check("b", TOKENS, None, params)
    check.used("b", params)
    check.finished("b")
    with pytest.raises(TransferParamsError):
        check.check("c", TOKENS, None, params)


def test_the_producer_answers_only_its_sealed_record_from_one_engine_once_per_rank() -> None:
    table = LeaseTable(lease_s=30.0)
    record, other = b"r" * 16, b"x" * 16
    # early notifications are judged when the hold starts
    assert table.notify("q", 0, 1, "stranger", now=0, record=other, engine="e9") is None
    assert table.hold("q", now=0, record=record)[0].kind is VerdictKind.REFUSED
    table.hold("r", now=0, record=record)
    assert table.guarantee("r", 1, record=other, engine="e1")[0] is None
    assert table.guarantee("r", 1, record=b"", engine="e1")[1].startswith("refused: unsealed")
    assert table.guarantee("r", 1, record=record, engine="e1", consumer_rank=0)[0] == 30.0
    lease, why = table.guarantee("r", 1, record=record, engine="e1", consumer_rank=0)
    assert lease is None and "already began" in why
    lease, why = table.guarantee("r", 1, record=record, engine="e2", consumer_rank=1)
    assert lease is None and "another consumer engine" in why
    verdict = table.notify("r", 1, 2, "peer", now=2, record=record, engine="e2")
    assert verdict is not None and verdict.kind is VerdictKind.REFUSED
    assert table.is_held("r")  # a refused notification never counts toward completion
    assert table.guarantee("r", 2, record=record, engine="e1", consumer_rank=1)[0] == 30.0
    for rank in (0, 1):
        verdict = table.notify("r", rank, 2, "peer", now=3, record=record, engine="e1")
        assert verdict is not None and verdict.ok
    assert not table.is_held("r") and table.stats.refused == 6
