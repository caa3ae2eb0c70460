"""Pull and push across heterogeneous TP and PP, producer and consumer in separate processes.

One producer process and one consumer process host every engine of the
matrix (tiny-gqa, tiny-mla, tiny-hybrid x pull, push x TP 1->2, 2->1, 4->2,
2->4, plus PP 2->1): all pairs run at once, then each parametrized case checks
its own requests. Every loaded byte is verified against the content function
by the consumer engine; nothing may be recomputed, left held or in flight.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvbridge.connectors import KVRole, TransferMode
from kvbridge.engine.request import RequestState
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.tools.demo.nixl import Router
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import EngineHost, nixl_config


@dataclass(frozen=True)
class Pair:
    model: str
    mode: TransferMode
    producer: ParallelTopology
    consumer: ParallelTopology

    @property
    def name(self) -> str:
        p, c = self.producer, self.consumer
        return (f"{self.model}-{self.mode.value}-tp{p.tp_size}pp{p.pp_size}"
                f"-tp{c.tp_size}pp{c.pp_size}")


def _t(tp: int, pp: int = 1) -> ParallelTopology:
    return ParallelTopology(tp_size=tp, pp_size=pp)


PAIRS = [Pair(model, mode, _t(p), _t(c))
         for model in ("tiny-gqa", "tiny-mla", "tiny-hybrid")
         for mode in (TransferMode.PULL, TransferMode.PUSH)
         for p, c in ((1, 2), (2, 1), (4, 2), (2, 4))]
PAIRS += [Pair("tiny-gqa", mode, _t(1, 2), _t(1)) for mode in (TransferMode.PULL,
                                                                TransferMode.PUSH)]
REQUESTS_PER_PAIR = 2


def _key(model: str, mode: TransferMode, topo: ParallelTopology) -> str:
    return f"{model}-{mode.value}-tp{topo.tp_size}pp{topo.pp_size}"


@pytest.fixture(scope="module")
def matrix() -> Iterator[dict[str, Any]]:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    producers = {_key(p.model, p.mode, p.producer): nixl_config(p.model, KVRole.PRODUCER,
                                                                p.producer, p.mode)
                 for p in PAIRS}
    consumers = {_key(p.model, p.mode, p.consumer): nixl_config(p.model, KVRole.CONSUMER,
                                                                p.consumer, p.mode)
                 for p in PAIRS}
    prod_host = EngineHost(producers)
    try:
        cons_host = EngineHost(consumers)
    except BaseException:
        prod_host.close()
        raise
    try:
        routers: dict[str, Router] = {}
        specs: dict[str, list[Any]] = {}
        for pair in PAIRS:
            producer = prod_host.engine(_key(pair.model, pair.mode, pair.producer))
            consumer = cons_host.engine(_key(pair.model, pair.mode, pair.consumer))
            router = Router(producer, consumer, pair.mode, pair.producer,
                            load_spec(pair.model).fingerprint())
            reqs = make_requests(REQUESTS_PER_PAIR, prompt_tokens=40, max_tokens=2,
                                 seed=len(routers), prefix=pair.name)
            router.submit(reqs)
            routers[pair.name] = router
            specs[pair.name] = reqs
        owner = {s.request_id: routers[name] for name, reqs in specs.items() for s in reqs}
        deadline = time.monotonic() + 240
        while not all(r.done for r in routers.values()):
            assert time.monotonic() < deadline, {
                n: len(r.results) for n, r in routers.items() if not r.done}
            moved = 0
            for name in producers:  # one engine serves several pairs: dispatch by request
                for result in prod_host.engine(name).results():
                    moved += owner[result.request_id].on_producer_results([result])
            for name in consumers:
                for result in cons_host.engine(name).results():
                    moved += owner[result.request_id].on_consumer_results([result])
            if not moved:
                time.sleep(0.02)
        idle_deadline = time.monotonic() + 30
        while True:
            problems = {n: prod_host.engine(n).stats()["idle_problems"] for n in producers}
            problems.update({n: cons_host.engine(n).stats()["idle_problems"] for n in consumers})
            problems = {n: p for n, p in problems.items() if p}
            if not problems or time.monotonic() > idle_deadline:
                break
            time.sleep(0.05)
        totals = {**prod_host.call("*", "totals")["totals"],
                  **{f"c:{k}": v for k, v in cons_host.call("*", "totals")["totals"].items()}}
        yield {"routers": routers, "specs": specs, "idle_problems": problems, "totals": totals}
    finally:
        codes = (cons_host.close(), prod_host.close())
        assert codes == (0, 0), f"engine hosts exited with {codes}"


@pytest.mark.parametrize("pair", PAIRS, ids=[p.name for p in PAIRS])
def test_pair(matrix: dict[str, Any], pair: Pair) -> None:
    router: Router = matrix["routers"][pair.name]
    specs = matrix["specs"][pair.name]
    results = [router.results[s.request_id] for s in specs]
    assert all(r.state is RequestState.FINISHED_LENGTH for r in results), \
        [(r.request_id, r.state, r.error) for r in results]
    assert check_outputs(results, specs) == []
    for r in results:
        assert r.num_external_tokens > 0, f"{r.request_id}: no KV came through the connector"
        assert r.num_recomputed_tokens == 0, f"{r.request_id}: a load failed"
        assert r.mismatched_bytes == 0 and r.verified_bytes > 0


def test_everything_released(matrix: dict[str, Any]) -> None:
    """No engine holds blocks or waits for a transfer; no rank holds a lease, a load,
    a transfer handle or a zombie after the matrix drained."""
    assert matrix["idle_problems"] == {}
    for name, ranks in matrix["totals"].items():
        for index, totals in enumerate(ranks):
            where = f"{name} rank {index}"
            assert totals["held"] == 0, where
            assert totals["in_flight"] == 0, where
            assert totals["nixl_xfer_handles"] == 0 and totals["nixl_zombies"] == 0, where
            assert totals["nixl_forced_releases"] == 0, where
            assert totals["loads_failed"] == 0 and totals["pushes_failed"] == 0, where
            assert totals["lease_expiries"] == 0, where
