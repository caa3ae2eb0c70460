"""Verified pull loads: the consumer checks the blocks it READ against the
producer's digests before it reports them loaded.

Both engines run in this process over real NIXL (UCX on host memory). The
fault injection wraps the producer's real digest answer: right after it took
the digests of the blocks a consumer is about to read, a byte of one of those
blocks is flipped in the producer's KV memory, so the real READ moves
corrupted bytes. The consumer must fail exactly that block (the engine
recomputes it and everything after it), and the reference engine's oracle
still checks every byte of the output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvbridge.connectors import KVRole, TransferMode
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.engine.core import Engine
from kvbridge.engine.request import RequestSpec, RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.layouts import ParallelTopology
from kvbridge.layouts.digests import DigestMode
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config

PULL = TransferMode.PULL
MODEL = "tiny-gqa"
BLOCK_TOKENS = 16  # tiny-gqa's block size


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _pair(producer_tp: int = 1, consumer_tp: int = 1, **consumer_extra: Any
          ) -> tuple[Engine, Engine]:
    consumer_extra.setdefault("verify", "full")
    producer = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(tp_size=producer_tp),
                                  PULL, lease_s=60.0))
    consumer = Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=consumer_tp),
                                  PULL, **consumer_extra))
    return producer, consumer


def _run(router: InProcessRouter, specs: list[RequestSpec], timeout_s: float = 60) -> None:
    for spec in specs:
        router.submit(spec)
    deadline = time.monotonic() + timeout_s
    while len(router.results) < len(specs):
        assert time.monotonic() < deadline, "requests did not finish"
        router.poll()
        time.sleep(0.002)


def _totals(engine: Engine) -> dict[str, int]:
    out: dict[str, int] = {}
    for worker in engine.workers:
        for key, value in worker.connector.totals().items():  # type: ignore[union-attr]
            if isinstance(value, int):
                out[key] = out.get(key, 0) + value
    return out


def _corrupt_after_digest(producer: Engine, block_index: int, layer_pos: int,
                          flipped: list[tuple[int, int]]) -> None:
    """Wrap each producer rank's real digest taking (as a hold starts): once the digests
    are taken, flip one byte of the request's ``block_index``-th block of region 0 in
    the ``layer_pos``-th layer of the region, in the producer's KV memory."""
    for worker in producer.workers:
        conn: Any = worker.connector
        real = conn.hold_digests.take

        def take(request_id: str, block_ids: Any, consumers: Any, _real: Any = real,
                 _conn: Any = conn) -> None:
            _real(request_id, block_ids, consumers)
            if request_id.startswith("tick") or len(block_ids[0]) <= block_index:
                return
            block = block_ids[0][block_index]
            layer = _conn.ctx.spec.rank_shapes(_conn.rank)[0].layer_ids[layer_pos]
            tensor = worker_tensor(_conn, layer)
            raw = tensor.view(-1).view(torch.uint8)
            raw[block * _conn.memory[layer].block_stride + 5] ^= 0x40  # inside the block
            flipped.append((0, block))

        conn.hold_digests.take = take


def worker_tensor(conn: Any, layer: int) -> Any:
    return next(t for t in conn._kv_tensors if int(t.data_ptr()) == conn.memory[layer].base_addr)


def test_clean_loads_are_verified_block_by_block_in_full_mode() -> None:
    # the default samples (measured: full costs 30-50 % of a host-memory READ)
    assert PdSettings().verify is DigestMode.SAMPLE
    assert PdSettings().verify_sample == 1 / 16
    producer, consumer = _pair()
    try:
        router = InProcessRouter(producer, consumer, PULL)
        specs = make_requests(3, prompt_tokens=80, max_tokens=2, seed=5, prefix="clean")
        _run(router, specs)
        assert check_outputs(router.results, specs) == []
        assert all(r.num_external_tokens > 0 and r.mismatched_bytes == 0 for r in router.results)
        totals, served = _totals(consumer), _totals(producer)
        loaded_blocks = sum(r.num_external_tokens // BLOCK_TOKENS for r in router.results)
        assert totals["blocks_verified"] >= loaded_blocks > 0
        assert totals["digest_mismatches"] == 0 and totals["blocks_unverified"] == 0
        assert served["digests_served"] == totals["blocks_verified"]
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_byte_flipped_after_the_digest_fails_exactly_that_block(
        caplog: pytest.LogCaptureFixture) -> None:
    producer, consumer = _pair()
    try:
        flipped: list[tuple[int, int]] = []
        _corrupt_after_digest(producer, block_index=2, layer_pos=1, flipped=flipped)
        spec = make_requests(1, prompt_tokens=96, max_tokens=3, seed=9, prefix="flip")[0]
        # prefill, then step the producer until its hold started (digests taken, byte
        # flipped) before the consumer may READ: the READ must see the flipped byte
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
        invalid: set[tuple[int, int]] = set()
        results = []
        with caplog.at_level(logging.WARNING):
            while not results:
                assert time.monotonic() < deadline, "consumer did not finish"
                report = consumer.step()
                if report.output is not None:
                    invalid.update(report.output.invalid_block_ids)
                results += consumer.pop_results()
                time.sleep(0.002)
        (result,) = results
        # the oracle: every byte the consumer kept is right, and so is the output
        assert result.state is RequestState.FINISHED_LENGTH, result
        assert check_outputs(results, [spec]) == []
        assert result.mismatched_bytes == 0
        # exactly the corrupted block failed: recomputed from its first token on
        totals = _totals(consumer)
        assert len(invalid) == 1, (totals, result, flipped)
        assert totals["digest_mismatches"] == 1 and totals["loads_corrupt"] == 1
        assert totals["blocks_verified"] == 96 // BLOCK_TOKENS - 1
        assert result.num_external_tokens == 2 * BLOCK_TOKENS  # blocks 0 and 1 kept
        assert result.num_recomputed_tokens > 0
        lines = [r.getMessage() for r in caplog.records if "digest mismatch" in r.getMessage()]
        assert len(lines) == 1 and f"request={spec.request_id}" in lines[0]
        assert f"producer_engine={producer.engine_id}" in lines[0]
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_sample_mode_checks_a_deterministic_fraction_and_off_checks_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    for mode, fraction in ((DigestMode.SAMPLE, 0.5), (DigestMode.OFF, 1.0)):
        producer, consumer = _pair(verify=mode.value, verify_sample=fraction)
        try:
            router = InProcessRouter(producer, consumer, PULL)
            specs = make_requests(4, prompt_tokens=160, max_tokens=1, seed=13, prefix=mode.value)
            _run(router, specs)
            assert check_outputs(router.results, specs) == []
            totals = _totals(consumer)
            loaded = sum(r.num_external_tokens // BLOCK_TOKENS for r in router.results)
            if mode is DigestMode.OFF:
                assert totals["blocks_verified"] == 0 and _totals(producer)["digests_served"] == 0
            else:
                assert 0 < totals["blocks_verified"] < loaded
            # sampled out on purpose is not counted
            assert totals["blocks_unverified"] == 0, [
                r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
        finally:
            consumer.shutdown()
            producer.shutdown()


def test_head_slices_from_an_older_producer_are_counted_unverified_or_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP2 -> TP1 reads half of each consumer block from each producer rank. A producer
    that offers no slice digests (an older kvbridge: its handshake lists ``xxh3-64``
    only) is not asked for them: no digest it has covers a consumer block, so the loads
    are counted unverified; with ``verify_allow_unverified: false`` they fail and the
    engine recomputes them. (A current producer's slices are verified:
    ``test_verified_slices.py``.)"""
    from kvbridge.connectors.pd import worker as worker_module

    for allow in (True, False):
        with monkeypatch.context() as patch:  # only the producer's handshake record
            patch.setattr(worker_module, "OFFERED_DIGESTS", ("xxh3-64",))
            producer = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(tp_size=2),
                                          PULL, lease_s=60.0))
        consumer = Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1),
                                      PULL, verify="full", verify_allow_unverified=allow))
        try:
            router = InProcessRouter(producer, consumer, PULL)
            specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=17,
                                  prefix=f"tp-{allow}")
            _run(router, specs)
            assert check_outputs(router.results, specs) == []
            totals = _totals(consumer)
            assert totals["blocks_verified"] == 0
            assert totals["blocks_unverified"] == sum(48 // BLOCK_TOKENS for _ in specs)
            assert _totals(producer)["digests_served"] == 0
            if allow:
                assert all(r.num_external_tokens > 0 for r in router.results)
            else:
                assert all(r.num_external_tokens == 0 and r.num_recomputed_tokens > 0
                           for r in router.results)
                assert totals["loads_failed"] == len(specs)
        finally:
            consumer.shutdown()
            producer.shutdown()


PUSH = TransferMode.PUSH


def test_push_loads_are_verified_and_a_byte_flipped_before_the_write_fails_its_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Push: the producer takes the digests once every layer is final, before it posts
    the WRITEs, and sends them in ``pushed``. A byte flipped between the two (the real
    digest taking, wrapped) reaches the consumer with the real WRITE: that block fails,
    the rest is verified, the output is right."""
    from kvbridge.connectors.pd import push as push_module  # takes push digests

    producer = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(), PUSH))
    consumer = Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(), PUSH,
                                  verify="full"))
    try:
        router = InProcessRouter(producer, consumer, PUSH)
        clean = make_requests(2, prompt_tokens=64, max_tokens=2, seed=23, prefix="push-clean")
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
            block = block_ids[0][1]
            layer = conn.ctx.spec.rank_shapes(conn.rank)[0].layer_ids[0]
            raw = worker_tensor(conn, layer).view(-1).view(torch.uint8)
            raw[block * conn.memory[layer].block_stride + 7] ^= 0x10
            flipped.append(block)
            return answer

        monkeypatch.setattr(push_module, "take_hold_digests", take)
        spec = make_requests(1, prompt_tokens=80, max_tokens=2, seed=29, prefix="push-flip")[0]
        router.results.clear()
        _run(router, [spec])
        assert flipped, "the fault was not injected"
        (result,) = router.results
        assert check_outputs(router.results, [spec]) == []
        assert result.mismatched_bytes == 0
        assert result.num_external_tokens == BLOCK_TOKENS  # block 0 kept, block 1 on recomputed
        after = _totals(consumer)
        assert after["digest_mismatches"] == 1 and after["loads_corrupt"] == 1
    finally:
        consumer.shutdown()
        producer.shutdown()
