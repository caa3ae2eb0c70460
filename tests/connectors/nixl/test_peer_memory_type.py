"""A consumer prepares the producer's lists with the memory type the producer announced.

The producer's handshake record carries its memory type and device (a peer must prepare
its rows with them).
Here a real producer on host memory announces VRAM on device 2 (its
transport's ``memory_type`` stands in for a CUDA registration while the engine
is built): the consumer must prepare the producer's rows as VRAM with device 2
-- seen by wrapping its real ``prepare_remote`` -- and, since NIXL then finds
no such memory on the producer, fail the load cleanly: the request is
recomputed and the engine keeps serving. Without the announcement the same
pair moves the KV.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvbridge.backends.nixl import DRAM, VRAM, NixlTransport
from kvbridge.connectors import KVRole, TransferMode
from kvbridge.engine.core import Engine
from kvbridge.engine.request import RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.layouts import ParallelTopology
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config

PULL = TransferMode.PULL
#: the failed load's blocks stay with the producer until its lease runs out (its
#: consumer cannot reach it over NIXL to release them); the default is 30 s
LEASE_S = 10.0


def _run(announce: tuple[str, int] | None, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[tuple[str, int]], Any, Any]:
    with monkeypatch.context() as patch:
        if announce is not None:
            patch.setattr(NixlTransport, "memory_type", property(lambda self: announce))
        producer = Engine(nixl_config("tiny-gqa", KVRole.PRODUCER, ParallelTopology(), PULL,
                                      lease_s=LEASE_S))
    consumer = Engine(nixl_config("tiny-gqa", KVRole.CONSUMER, ParallelTopology(), PULL,
                                  lease_s=LEASE_S))
    try:
        seen: list[tuple[str, int]] = []  # (mem_type, device column) per remote list
        for w in consumer.workers:
            transport: Any = w.connector.transport  # type: ignore[union-attr]
            real = transport.prepare_remote

            def spy(peer: Any, descs: Any, mem_type: str = DRAM, _real: Any = real) -> Any:
                seen.append((mem_type, int(descs[0][2])))
                return _real(peer, descs, mem_type)

            transport.prepare_remote = spy
        router = InProcessRouter(producer, consumer, PULL)
        spec = make_requests(1, prompt_tokens=40, max_tokens=2, seed=9, prefix="memtype")[0]
        router.submit(spec)
        deadline = time.monotonic() + 90
        while router.busy:
            assert time.monotonic() < deadline, "request not finished"
            router.poll()
            time.sleep(0.002)
        (result,) = router.results
        assert result.state is RequestState.FINISHED_LENGTH, result
        assert check_outputs(router.results, [spec]) == []
        return seen, result, consumer
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_remote_lists_use_the_announced_memory_type(monkeypatch: pytest.MonkeyPatch) -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    seen, result, _ = _run(None, monkeypatch)
    assert seen and set(seen) == {(DRAM, 0)}
    assert result.num_external_tokens > 0 and result.mismatched_bytes == 0

    seen, result, _ = _run((VRAM, 2), monkeypatch)
    assert seen and set(seen) == {(VRAM, 2)}  # the producer's type and device, not ours
    assert result.num_external_tokens == 0 and result.num_recomputed_tokens > 0
