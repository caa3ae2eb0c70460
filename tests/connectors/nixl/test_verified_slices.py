"""Verified head slices at heterogeneous TP: a SPLIT region read as head
slices from another TP is checked with slice digests, over exactly the bytes each
consumer rank reads from each producer rank.

Both engines run in this process over real NIXL (UCX on host memory). The fault
injection wraps the producer's real digest taking: right after it took the digests
(as the hold starts, or before the push WRITEs), a byte of one block is flipped in
the producer's KV memory, so the real transfer moves it. Exactly that block fails
on the consumer rank that received it; the reference engine's oracle checks every
byte of the output.

Each case runs with ``xxh3-64-slices`` (host ranks) and with
``torch-mix64-v1-slices``: ranks set to ``verify_algorithms: [torch-mix64-v1]``
offer what a rank whose KV is in GPU memory offers (no GPU here: the torch
digester runs on the CPU tensors).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvbridge.connectors import KVRole, TransferMode
from kvbridge.engine.core import Engine
from kvbridge.engine.request import RequestSpec, RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.layouts import ParallelTopology
from kvbridge.layouts.digests import SLICE_ALGORITHM, TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config
from tests.connectors.nixl.test_verified_kv import _run, _totals, worker_tensor

PULL, PUSH = TransferMode.PULL, TransferMode.PUSH
MODEL = "tiny-gqa"  # one SPLIT region: 8 KV heads, HND, 16-token blocks, 4 layers
BLOCK_TOKENS = 16
#: which ranks compute only torch-mix64-v1 (as a GPU rank does): neither, both, or the
#: producer (the host consumer then asks for the torch slices, the only ones in common)
GPU_LIKE = {"host": (False, False), "gpu": (True, True), "gpu-producer": (True, False)}


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


@pytest.fixture(params=["host", "gpu"])
def algs(request: pytest.FixtureRequest) -> str:
    """The ranks' algorithms (:data:`GPU_LIKE`): each test runs with both slice digests."""
    return str(request.param)


def _pair(mode: TransferMode, producer_tp: int, consumer_tp: int, model: str = MODEL,
          algs: str = "host") -> tuple[Engine, Engine]:
    gpu_producer, gpu_consumer = GPU_LIKE[algs]
    torch_only = {"verify_algorithms": [TORCH_ALGORITHM]}
    producer = Engine(nixl_config(model, KVRole.PRODUCER, ParallelTopology(tp_size=producer_tp),
                                  mode, lease_s=60.0, host_kv=True,
                                  **(torch_only if gpu_producer else {})))
    consumer = Engine(nixl_config(model, KVRole.CONSUMER, ParallelTopology(tp_size=consumer_tp),
                                  mode, verify="full", host_kv=True,
                                  **(torch_only if gpu_consumer else {})))
    return producer, consumer


def _slice_algorithm(consumer: Engine) -> str:
    """The slice algorithm the consumer's sessions asked for (one, whatever the rank)."""
    asked = {s.slice_check.algorithm for w in consumer.workers
             for s in w.connector.sessions.sessions.values()  # type: ignore[union-attr]
             if s.slice_check is not None and s.slice_check.regions}
    assert len(asked) == 1, asked
    return asked.pop()


def _expected_slice_algorithm(algs: str) -> str:
    return SLICE_ALGORITHM if algs == "host" else TORCH_SLICE_ALGORITHM


def _loaded_blocks(router: InProcessRouter) -> int:
    return sum(r.num_external_tokens // BLOCK_TOKENS for r in router.results)


@pytest.mark.parametrize(("model", "producer_tp", "consumer_tp", "algs"),
                         [(MODEL, 1, 2, "host"), (MODEL, 2, 1, "host"), (MODEL, 2, 4, "host"),
                          ("tiny-hybrid", 1, 2, "host"), (MODEL, 1, 2, "gpu"),
                          (MODEL, 2, 4, "gpu"), ("tiny-hybrid", 1, 2, "gpu"),
                          (MODEL, 1, 2, "gpu-producer")])
def test_head_slices_at_another_tp_are_verified_pull(model: str, producer_tp: int,
                                                     consumer_tp: int, algs: str) -> None:
    """Every loaded block is verified on every consumer rank, none unverified. The
    first request meets a consumer the producer did not know at its hold start: its
    slice digests are taken at ``begin``; the later ones as their holds start."""
    producer, consumer = _pair(PULL, producer_tp, consumer_tp, model, algs)
    try:
        router = InProcessRouter(producer, consumer, PULL)
        first = make_requests(1, prompt_tokens=64, max_tokens=2, seed=41, prefix="first")
        _run(router, first)
        at_begin = _totals(producer)["slice_digests_at_begin"]
        at_hold = _totals(producer)["slice_digests_at_hold"]
        more = make_requests(3, prompt_tokens=80, max_tokens=2, seed=43, prefix="more")
        _run(router, more)
        assert check_outputs(router.results, first + more) == []
        assert all(r.num_external_tokens > 0 and r.mismatched_bytes == 0
                   and r.num_recomputed_tokens == 0 for r in router.results)
        totals, served = _totals(consumer), _totals(producer)
        # each consumer rank checks its own part of every block it loaded, per region
        regions = len(producer.config.spec.regions)
        assert totals["blocks_verified"] == _loaded_blocks(router) * consumer_tp * regions > 0
        assert totals["blocks_unverified"] == 0 and totals["digest_mismatches"] == 0
        assert served["digests_served"] >= totals["blocks_verified"]
        assert _slice_algorithm(consumer) == _expected_slice_algorithm(algs)
        if producer_tp < consumer_tp:  # sub-slices: hashed for each consumer rank
            assert at_begin + at_hold > 0, served  # the first: at begin (unless its hello won)
            # the later ones' holds start after the producer knew the consumer ranks
            assert served["slice_digests_at_begin"] == at_begin
            assert served["slice_digests_at_hold"] > at_hold
        else:  # a producer rank's whole slice is read: its block digests serve
            assert served["slice_digests_at_begin"] == served["slice_digests_at_hold"] == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


def _flip_after_hold_digests(producer: Engine, rank: int, block_index: int, offset: int,
                             flipped: list[int]) -> None:
    """Wrap producer rank ``rank``'s real digest taking as a hold starts (block and
    slice digests): once taken, flip the byte at ``offset`` of the request's
    ``block_index``-th block in its first layer, in the producer's KV memory."""
    conn: Any = producer.workers[rank].connector
    real = conn.hold_digests.take

    def take(request_id: str, block_ids: Any, consumers: Any) -> None:
        real(request_id, block_ids, consumers)
        if not request_id.startswith("flip") or len(block_ids[0]) <= block_index:
            return
        block = block_ids[0][block_index]
        layer = conn.ctx.spec.rank_shapes(conn.rank)[0].layer_ids[0]
        raw = worker_tensor(conn, layer).view(-1).view(torch.uint8)
        raw[block * conn.memory[layer].block_stride + offset] ^= 0x40
        flipped.append(block)

    conn.hold_digests.take = take


def _prefill_then_load(producer: Engine, consumer: Engine, spec: RequestSpec,
                       flipped: list[int]) -> tuple[Any, set[Any]]:
    """Prefill on the producer until its hold started (digests taken, byte flipped),
    then load on the consumer: the READ must see the flipped byte."""
    producer.add_request(replace(spec, remote_decode=True, max_tokens=1))
    ticks = 0
    deadline = time.monotonic() + 60
    prefilled = []
    while not (prefilled and flipped):
        assert time.monotonic() < deadline, "prefill / hold not seen"
        if not producer.has_work():
            producer.add_request(RequestSpec(f"tick-{ticks}", (1, 2, 3), max_tokens=1))
            ticks += 1
        producer.step()
        prefilled += [r for r in producer.pop_results() if r.request_id == spec.request_id]
    params = prefilled[0].transfer_params
    assert params is not None
    consumer.add_request(replace(spec, transfer_params=params))
    invalid: set[Any] = set()
    results = []
    while not results:
        assert time.monotonic() < deadline, "consumer did not finish"
        report = consumer.step()
        if report.output is not None:
            invalid.update(report.output.invalid_block_ids)
        results += consumer.pop_results()
        time.sleep(0.002)
    (result,) = results
    return result, invalid


@pytest.mark.parametrize(("producer_tp", "consumer_tp", "flip_rank", "offset"),
                         [(1, 2, 0, 5 + 8192 // 4 * 3), (2, 1, 1, 5)])
def test_a_byte_flipped_in_a_head_slice_after_the_digest_fails_exactly_that_block(
        producer_tp: int, consumer_tp: int, flip_rank: int, offset: int, algs: str) -> None:
    """TP 1 -> 2: the byte lies in the K rows of the heads consumer rank 1 reads (a
    sub-slice hashed for it at hold start); TP 2 -> 1: in producer rank 1's half of
    the consumer's block (its block digest is the slice digest). Either way exactly
    that block fails, once, and every other block is verified and loaded right."""
    producer, consumer = _pair(PULL, producer_tp, consumer_tp, algs=algs)
    try:
        router = InProcessRouter(producer, consumer, PULL)
        _run(router, make_requests(1, prompt_tokens=40, max_tokens=1, seed=3, prefix="warm"))
        assert _slice_algorithm(consumer) == _expected_slice_algorithm(algs)
        before, served_before = _totals(consumer), _totals(producer)
        flipped: list[int] = []
        _flip_after_hold_digests(producer, flip_rank, block_index=2, offset=offset,
                                 flipped=flipped)
        spec = make_requests(1, prompt_tokens=96, max_tokens=3, seed=9, prefix="flip")[0]
        result, invalid = _prefill_then_load(producer, consumer, spec, flipped)
        # the oracle: every byte the consumer kept is right, and so is the output
        assert result.state is RequestState.FINISHED_LENGTH, result
        assert check_outputs([result], [spec]) == []
        assert result.mismatched_bytes == 0
        totals = _totals(consumer)
        assert len(invalid) == 1, (totals, result, flipped)
        assert totals["digest_mismatches"] - before["digest_mismatches"] == 1
        assert totals["loads_corrupt"] - before["loads_corrupt"] == 1
        blocks = 96 // BLOCK_TOKENS
        assert totals["blocks_verified"] - before["blocks_verified"] == \
            blocks * consumer_tp - 1
        assert totals["blocks_unverified"] == 0
        assert result.num_external_tokens == 2 * BLOCK_TOKENS  # blocks 0 and 1 kept
        assert result.num_recomputed_tokens > 0
        if producer_tp < consumer_tp:  # the consumer was known: slices taken at hold start
            served = _totals(producer)
            assert served["slice_digests_at_begin"] == served_before["slice_digests_at_begin"]
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_push_head_slices_are_verified_and_a_byte_flipped_before_the_write_fails_its_block(
        monkeypatch: pytest.MonkeyPatch, algs: str) -> None:
    """Push, TP 1 -> 2: the producer takes each consumer rank's slice digests once every
    layer is final, before it posts that rank's WRITEs, and sends them in ``pushed``. A
    byte flipped right after (in consumer rank 1's heads) reaches rank 1 with the real
    WRITE: that block fails there, every other block of both ranks is verified."""
    from kvbridge.connectors.pd import push as push_module  # takes push digests

    producer, consumer = _pair(PUSH, 1, 2, algs=algs)
    try:
        router = InProcessRouter(producer, consumer, PUSH)
        clean = make_requests(2, prompt_tokens=64, max_tokens=2, seed=23, prefix="push-clean")
        _run(router, clean)
        assert check_outputs(router.results, clean) == []
        assert _slice_algorithm(consumer) == _expected_slice_algorithm(algs)
        totals = _totals(consumer)
        assert totals["blocks_verified"] == _loaded_blocks(router) * 2 > 0
        assert totals["digest_mismatches"] == 0 and totals["blocks_unverified"] == 0
        assert _totals(producer)["slice_digests_at_hold"] > 0

        conn: Any = producer.workers[0].connector
        real = push_module.take_slice_digests
        layer = conn.ctx.spec.rank_shapes(conn.rank)[0].layer_ids[0]
        offset = 8192 // 2 + 7  # K rows of heads 4..7: consumer rank 1's slice
        flipped: list[int] = []

        def take(digester: Any, plan: Any, block_ids: Any, held: Any) -> Any:
            answer = real(digester, plan, block_ids, held)
            mine = dict(plan.layers[0]).get(layer, ())
            if not flipped and any(o <= offset < o + n for o, n in mine):
                block = block_ids[0][1]
                raw = worker_tensor(conn, layer).view(-1).view(torch.uint8)
                raw[block * conn.memory[layer].block_stride + offset] ^= 0x10
                flipped.append(block)
            return answer

        monkeypatch.setattr(push_module, "take_slice_digests", take)
        spec = make_requests(1, prompt_tokens=80, max_tokens=2, seed=29, prefix="push-flip")[0]
        router.results.clear()
        _run(router, [spec])
        assert flipped, "the fault was not injected"
        (result,) = router.results
        assert check_outputs(router.results, [spec]) == []
        assert result.mismatched_bytes == 0
        assert result.num_external_tokens == BLOCK_TOKENS  # block 0 kept, block 1 on recomputed
        after = _totals(consumer)
        assert after["digest_mismatches"] - totals["digest_mismatches"] == 1
        assert after["loads_corrupt"] - totals["loads_corrupt"] == 1
        assert after["blocks_verified"] - totals["blocks_verified"] == 80 // BLOCK_TOKENS * 2 - 1
    finally:
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(2, 1), (2, 4)])
def test_push_hybrid_slices_and_another_ranks_replicated_region_are_verified(
        producer_tp: int, consumer_tp: int, algs: str) -> None:
    """Push, tiny-hybrid (a SPLIT and a REPLICATE region): a consumer rank registers
    every region with each producer rank it reads from, but reads the replicated region
    from one of them only; the others answer that region empty, so every block of both
    regions is verified on every consumer rank, none unverified."""
    producer, consumer = _pair(PUSH, producer_tp, consumer_tp, "tiny-hybrid", algs)
    try:
        router = InProcessRouter(producer, consumer, PUSH)
        specs = make_requests(3, prompt_tokens=48, max_tokens=2, seed=31, prefix="hybrid")
        _run(router, specs)
        assert check_outputs(router.results, specs) == []
        assert all(r.num_recomputed_tokens == 0 for r in router.results)
        totals = _totals(consumer)
        assert totals["blocks_unverified"] == 0 and totals["digest_mismatches"] == 0
        assert totals["blocks_verified"] == _loaded_blocks(router) * 2 * consumer_tp > 0
    finally:
        consumer.shutdown()
        producer.shutdown()
