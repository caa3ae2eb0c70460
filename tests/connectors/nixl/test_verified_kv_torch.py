"""Verified NIXL loads with the ``torch-mix64-v1`` digests (KV in GPU memory).

A rank whose KV is on a GPU offers only ``torch-mix64-v1`` (XXH3-64 needs host
memory); a host rank offers both, XXH3-64 first. There is no GPU here, so a
"GPU-like" rank is a host rank with ``verify_algorithms: [torch-mix64-v1]``:
the same offer, the same digester (int64 tensor reductions on the tensors'
device, CPU here). Both engines run in this process over real NIXL (UCX on host
memory); corruption is a byte flipped in the producer's KV memory right after
its real digests were taken, as in ``test_verified_kv``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvbridge.backends.nixl import VRAM, NixlTransport
from kvbridge.connectors import KVRole, TransferMode
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.engine.core import Engine
from kvbridge.engine.request import RequestSpec, RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.handshake import decode_agent
from kvbridge.layouts import ParallelTopology
from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    TORCH_ALGORITHM,
    TORCH_SLICE_ALGORITHM,
)
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config
from tests.connectors.nixl.test_verified_kv import (
    BLOCK_TOKENS,
    MODEL,
    _corrupt_after_digest,
    _run,
    _totals,
    worker_tensor,
)

PULL, PUSH = TransferMode.PULL, TransferMode.PUSH
TORCH_ONLY = [TORCH_ALGORITHM]  # what a GPU rank offers


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _pair(mode: TransferMode, producer_algs: list[str] | None,
          consumer_algs: list[str] | None, **consumer_extra: Any) -> tuple[Engine, Engine]:
    consumer_extra.setdefault("verify", "full")
    p_extra = {"verify_algorithms": producer_algs} if producer_algs else {}
    c_extra = {"verify_algorithms": consumer_algs} if consumer_algs else {}
    # host ranks (a "GPU" one is a host rank limited to the torch algorithm), whatever
    # KVBRIDGE_KV_HOST_GUARD says
    producer = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(), mode,
                                  lease_s=60.0, host_kv=True, **p_extra))
    consumer = Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(), mode,
                                  host_kv=True, **c_extra, **consumer_extra))
    return producer, consumer


def _offered(engine: Engine) -> tuple[str, ...]:
    doc = engine.workers[0].connector.get_handshake_metadata()  # type: ignore[union-attr]
    assert doc is not None
    return decode_agent(doc).digests


def _asked(consumer: Engine) -> set[str | None]:
    """The algorithms the consumer's sessions ask their producer ranks for."""
    conn: Any = consumer.workers[0].connector
    return {alg for s in conn.sessions.sessions.values() for alg in s.digest_algorithms.values()}


def _flip_and_load(producer: Engine, consumer: Engine, spec: RequestSpec,
                   flipped: list[tuple[int, int]]) -> tuple[Any, set[tuple[int, int]]]:
    """Prefill on the producer until its hold started (digests taken, byte flipped),
    then load on the consumer: (its result, the invalid blocks it reported)."""
    producer.add_request(replace(spec, remote_decode=True, max_tokens=1))
    ticks, prefilled = 0, []
    deadline = time.monotonic() + 60
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
    invalid: set[tuple[int, int]] = set()
    results: list[Any] = []
    while not results:
        assert time.monotonic() < deadline, "consumer did not finish"
        report = consumer.step()
        if report.output is not None:
            invalid.update(report.output.invalid_block_ids)
        results += consumer.pop_results()
        time.sleep(0.002)
    (result,) = results
    assert result.state is RequestState.FINISHED_LENGTH, result
    assert check_outputs(results, [spec]) == [] and result.mismatched_bytes == 0
    return result, invalid


def test_a_rank_announcing_gpu_memory_offers_only_the_torch_algorithm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport's memory type (VRAM for CUDA tensors) decides: it stands in for a
    CUDA registration while the engine is built, as in test_peer_memory_type."""
    with monkeypatch.context() as patch:
        patch.setattr(NixlTransport, "memory_type", property(lambda self: (VRAM, 0)))
        gpu = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(), PULL))
        xxh3_only = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(), PULL,
                                       host_kv=True, verify_algorithms=[ALGORITHM]))
    try:
        assert _offered(gpu) == (TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)
        assert _offered(xxh3_only) == ()  # nothing it can compute: no digests offered
    finally:
        gpu.shutdown()
        xxh3_only.shutdown()


def test_a_host_rank_offers_both_algorithms_and_a_setting_narrows_it() -> None:
    producer, consumer = _pair(PULL, TORCH_ONLY, None)
    try:
        assert _offered(producer) == (TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)
        # each algorithm's slice digests right after it (the same digester)
        assert _offered(consumer) == (ALGORITHM, SLICE_ALGORITHM, TORCH_ALGORITHM,
                                      TORCH_SLICE_ALGORITHM)
    finally:
        consumer.shutdown()
        producer.shutdown()
    assert PdSettings.parse({"verify_algorithms": [TORCH_ALGORITHM, ALGORITHM]}) \
        .verify_algorithms == (TORCH_ALGORITHM, ALGORITHM)
    for bad in (["md5"], [], "xxh3-64", [1], [SLICE_ALGORITHM], [ALGORITHM, SLICE_ALGORITHM],
                [TORCH_SLICE_ALGORITHM]):
        with pytest.raises(ConfigError, match="verify_algorithms"):
            PdSettings.parse({"verify_algorithms": bad})


@pytest.mark.parametrize("producer_algs, consumer_algs", [
    (TORCH_ONLY, None),  # a GPU producer, a host consumer: the torch one, the common one
    (None, TORCH_ONLY),  # a host producer, a GPU consumer: digests taken on its CPU
])
def test_pull_loads_with_a_gpu_side_are_verified_with_the_torch_digests(
        producer_algs: list[str] | None, consumer_algs: list[str] | None) -> None:
    producer, consumer = _pair(PULL, producer_algs, consumer_algs)
    try:
        router = InProcessRouter(producer, consumer, PULL)
        specs = make_requests(3, prompt_tokens=80, max_tokens=2, seed=41, prefix="torch-pull")
        _run(router, specs)
        assert check_outputs(router.results, specs) == []
        totals, served = _totals(consumer), _totals(producer)
        loaded = sum(r.num_external_tokens // BLOCK_TOKENS for r in router.results)
        assert totals["blocks_verified"] == loaded > 0
        assert totals["digest_mismatches"] == 0 and totals["blocks_unverified"] == 0
        assert served["digests_served"] == loaded
        assert _asked(consumer) == {TORCH_ALGORITHM}
        if producer_algs is None:  # asked once, the host producer takes them as holds start
            assert producer.workers[0].connector.hold_digests.algorithms == {TORCH_ALGORITHM}  # type: ignore[union-attr]
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_byte_flipped_after_a_gpu_producers_digest_fails_exactly_that_block() -> None:
    producer, consumer = _pair(PULL, TORCH_ONLY, None)
    try:
        flipped: list[tuple[int, int]] = []
        _corrupt_after_digest(producer, block_index=2, layer_pos=1, flipped=flipped)
        spec = make_requests(1, prompt_tokens=96, max_tokens=3, seed=43, prefix="tflip")[0]
        result, invalid = _flip_and_load(producer, consumer, spec, flipped)
        totals = _totals(consumer)
        assert len(invalid) == 1, (totals, result, flipped)
        assert totals["digest_mismatches"] == 1 and totals["loads_corrupt"] == 1
        assert totals["blocks_verified"] == 96 // BLOCK_TOKENS - 1
        assert result.num_external_tokens == 2 * BLOCK_TOKENS  # blocks 0 and 1 kept
        assert _asked(consumer) == {TORCH_ALGORITHM}
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_host_producer_takes_the_torch_digests_as_holds_start_once_asked() -> None:
    """The first load a GPU consumer asks a host producer for in torch-mix64-v1 is
    digested when asked; from then on the producer takes those digests as every hold
    starts too, so a byte flipped during the hold is caught."""
    producer, consumer = _pair(PULL, None, TORCH_ONLY)
    try:
        router = InProcessRouter(producer, consumer, PULL)
        first = make_requests(1, prompt_tokens=48, max_tokens=1, seed=47, prefix="first")
        _run(router, first)
        assert _totals(consumer)["blocks_verified"] > 0
        flipped: list[tuple[int, int]] = []
        _corrupt_after_digest(producer, block_index=1, layer_pos=0, flipped=flipped)
        spec = make_requests(1, prompt_tokens=64, max_tokens=2, seed=53, prefix="later")[0]
        result, invalid = _flip_and_load(producer, consumer, spec, flipped)
        totals = _totals(consumer)
        assert len(invalid) == 1 and totals["digest_mismatches"] == 1, (totals, flipped)
        assert result.num_external_tokens == BLOCK_TOKENS
    finally:
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize("producer_algs", [TORCH_ONLY, None])
def test_push_with_the_torch_digests_is_verified_and_a_flipped_byte_fails_its_block(
        monkeypatch: pytest.MonkeyPatch, producer_algs: list[str] | None) -> None:
    """Push, the consumer asking torch-mix64-v1 in its ``register``: the producer takes
    those digests once every layer is final (a GPU producer: its only ones; a host
    producer: besides its XXH3-64 ones) and sends them in ``pushed``. A byte flipped
    right after the torch digests were taken reaches the consumer with the WRITE."""
    from kvbridge.connectors.pd import push as push_module  # takes push digests

    producer, consumer = _pair(PUSH, producer_algs, TORCH_ONLY)
    try:
        router = InProcessRouter(producer, consumer, PUSH)
        clean = make_requests(2, prompt_tokens=64, max_tokens=2, seed=59, prefix="tpush")
        _run(router, clean)
        assert check_outputs(router.results, clean) == []
        totals = _totals(consumer)
        assert totals["blocks_verified"] == sum(
            r.num_external_tokens // BLOCK_TOKENS for r in router.results) > 0
        assert totals["digest_mismatches"] == 0 and totals["blocks_unverified"] == 0

        conn: Any = producer.workers[0].connector
        real = push_module.take_hold_digests
        flipped: list[int] = []

        def take(digester: Any, block_ids: Any) -> Any:
            answer = real(digester, block_ids)
            if digester.algorithm == TORCH_ALGORITHM and not flipped:
                block = block_ids[0][1]
                layer = conn.ctx.spec.rank_shapes(conn.rank)[0].layer_ids[0]
                raw = worker_tensor(conn, layer).view(-1).view(torch.uint8)
                raw[block * conn.memory[layer].block_stride + 7] ^= 0x10
                flipped.append(block)
            return answer

        monkeypatch.setattr(push_module, "take_hold_digests", take)
        spec = make_requests(1, prompt_tokens=80, max_tokens=2, seed=61, prefix="tpush-flip")[0]
        router.results.clear()
        _run(router, [spec])
        assert flipped, "the fault was not injected"
        (result,) = router.results
        assert check_outputs(router.results, [spec]) == [] and result.mismatched_bytes == 0
        assert result.num_external_tokens == BLOCK_TOKENS  # block 0 kept, block 1 on recomputed
        after = _totals(consumer)
        assert after["digest_mismatches"] == 1 and after["loads_corrupt"] == 1
        assert _asked(consumer) == {TORCH_ALGORITHM}
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_mixed_preferences_fall_back_to_the_common_algorithm_or_to_unverified() -> None:
    """A consumer preferring torch-mix64-v1 but also computing XXH3-64 asks an XXH3-only
    producer (an older kvbridge) for XXH3-64; a torch-only (GPU) consumer has nothing
    in common with it: counted unverified, or failed with allow_unverified off."""
    cases = (([TORCH_ALGORITHM, ALGORITHM], True, ALGORITHM),
             (TORCH_ONLY, True, None), (TORCH_ONLY, False, None))
    for consumer_algs, allow, asked in cases:
        producer, consumer = _pair(PULL, [ALGORITHM], consumer_algs,
                                   verify_allow_unverified=allow)
        try:
            router = InProcessRouter(producer, consumer, PULL)
            specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=67,
                                  prefix=f"mixed-{len(consumer_algs)}-{allow}")
            _run(router, specs)
            assert check_outputs(router.results, specs) == []
            totals = _totals(consumer)
            assert _asked(consumer) == {asked}
            if asked is not None:
                assert totals["blocks_verified"] > 0 and totals["blocks_unverified"] == 0
            else:
                assert totals["blocks_verified"] == 0 and totals["blocks_unverified"] > 0
                assert _totals(producer)["digests_served"] == 0
                if allow:
                    assert all(r.num_external_tokens > 0 for r in router.results)
                else:
                    assert totals["loads_failed"] == len(specs)
                    assert all(r.num_external_tokens == 0 for r in router.results)
        finally:
            consumer.shutdown()
            producer.shutdown()
