"""Failures are misses: a master killed mid-run and restarted, with requests still flowing.

Real ``mooncake_master`` (a fresh one: this test kills it). A producer and a
consumer engine in this process share the store; the consumer's loads are
broken by killing the master right when they start.
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.backends.mooncake import ClientStats
from kvbridge.backends.mooncake_master import MooncakeMaster
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store import clients
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.workload import make_requests, run_workload
from kvbridge.layouts import ParallelTopology, load_spec
from tests.connectors.mooncake_store.conftest import store_extra


def client_stats(master: MooncakeMaster) -> ClientStats:
    """The summed counters of the pooled clients of ``master`` (the real clients the
    connector halves share): which path answered each call. Waits (bounded) until no
    call is running first, so a call abandoned earlier cannot count in a later phase."""
    with clients._lock:
        pooled = [e.client for k, e in clients._entries.items()
                  if k.master_address == master.rpc_address]
    assert all(c.wait_idle(30.0) for c in pooled), "a Mooncake call still running after 30 s"
    stats = [c.stats() for c in pooled]
    assert stats, "no pooled client for this master"
    return ClientStats(*(sum(getattr(s, f) for s in stats) for f in (
        "calls", "keys", "key_errors", "timeouts", "unreachable")))


def pair(master: MooncakeMaster, **overrides: Any) -> tuple[Engine, Engine]:
    extra = store_extra(master, **{"op_timeout_s": 1.5, "reconnect_interval_s": 0.2, **overrides})
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology(tp_size=2)
    producer = Engine(EngineConfig(spec, topology, num_blocks=96, connector=ConnectorConfig(
        "mooncake_store", KVRole.PRODUCER, extra=extra)))
    consumer = Engine(EngineConfig(spec, topology, num_blocks=96, connector=ConnectorConfig(
        "mooncake_store", KVRole.CONSUMER, extra=extra)))
    return producer, consumer


class KillOnLoad:
    """Consumer step hook: SIGKILL the master in the first step in which loads start."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.master = master
        self.fired_on: set[str] = set()

    def __call__(self, engine: Engine, step: object) -> None:
        if not self.fired_on and engine.loads_started:
            self.fired_on = set(engine.loads_started)
            self.master.kill()


def test_master_killed_mid_run_then_restarted(mooncake_master_fresh: MooncakeMaster) -> None:
    master = mooncake_master_fresh
    producer, consumer = pair(master)
    try:
        # 1. healthy: everything the producer stored is loaded by the consumer
        healthy = run_workload(make_requests(3, prompt_tokens=70, max_tokens=2, seed=1,
                                             prefix="up"), engine=producer, consumer=consumer,
                               shutdown=False)
        assert healthy.failed_requests == 0 and healthy.mismatched_bytes == 0
        assert all(r.num_external_tokens > 0 for r in healthy.results)

        # 2. the master dies as the consumer's loads start: loads fail, requests recompute
        killer = KillOnLoad(master)
        broken = run_workload(make_requests(3, prompt_tokens=70, max_tokens=2, seed=2,
                                            prefix="kill"), engine=producer, consumer=consumer,
                              shutdown=False, consumer_step_hook=killer, timeout_s=60)
        consumer.step_hooks.clear()
        assert killer.fired_on, "no load started, so the master was never killed"
        assert broken.failed_requests == 0, "every request must finish with the right output"
        assert broken.mismatched_bytes == 0
        assert broken.recomputed_tokens > 0
        assert consumer.stats()["failed_loads"] >= len(killer.fired_on)

        # 3. master still down: lookups miss, puts fail and are dropped, nothing hangs
        before = client_stats(master)
        down = run_workload(make_requests(2, prompt_tokens=70, max_tokens=2, seed=3,
                                          prefix="down"), engine=producer, consumer=consumer,
                            shutdown=False, timeout_s=60)
        assert down.failed_requests == 0 and down.external_tokens == 0
        producer_workers = producer.stats()["worker_stats"]
        assert isinstance(producer_workers, dict) and producer_workers["put_failures"] > 0
        # bounded: every call was refused by the fail-fast reachability check; none went
        # to Mooncake (~4.4 s per call to a dead master) to be cut off by op_timeout_s
        after = client_stats(master)
        assert after.unreachable > before.unreachable, (before, after)
        assert after.timeouts == before.timeouts, (before, after)

        # 4. master back (empty, same ports): the clients re-mount by themselves and
        #    later requests hit again, without restarting the engines
        master.restart()
        deadline = time.monotonic() + 30
        rounds = 0
        while True:
            rounds += 1
            again = run_workload(make_requests(2, prompt_tokens=70, max_tokens=2,
                                               seed=100 + rounds, prefix=f"back{rounds}"),
                                 engine=producer, consumer=consumer, shutdown=False,
                                 timeout_s=60)
            assert again.failed_requests == 0 and again.mismatched_bytes == 0
            if again.external_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.external_tokens > 0, f"no hit within {rounds} rounds after the restart"
        assert again.verified_bytes > 0
        for eng in (producer, consumer):
            assert eng.idle_problems() == []
    finally:
        consumer.shutdown()
        producer.shutdown()
    assert not [k for k in clients.live_keys() if k.master_address == master.rpc_address]


def test_stalled_master_costs_timeouts_not_hangs(mooncake_master_fresh: MooncakeMaster) -> None:
    """SIGSTOP: the master's ports still accept, nothing answers; every call is bounded."""
    master = mooncake_master_fresh
    producer, consumer = pair(master, op_timeout_s=0.5, abandon_grace_s=0.5)
    try:
        warm = run_workload(make_requests(1, prompt_tokens=40, max_tokens=1, seed=5,
                                          prefix="warm"), engine=producer, consumer=consumer,
                            shutdown=False)
        assert warm.failed_requests == 0
        before = client_stats(master)
        master.pause()
        try:
            stalled = run_workload(make_requests(2, prompt_tokens=40, max_tokens=2, seed=6,
                                                 prefix="stall"), engine=producer,
                                   consumer=consumer, shutdown=False, timeout_s=60)
        finally:
            master.resume()
        assert stalled.failed_requests == 0 and stalled.external_tokens == 0
        # bounded: the ports still accept, so the check passes and the client's own
        # deadline (op_timeout_s) answered the stalled calls (timeout_s=60: a hang guard)
        assert client_stats(master).timeouts > before.timeouts
        producer_workers = producer.stats()["worker_stats"]
        assert isinstance(producer_workers, dict) and producer_workers["put_failures"] > 0
        connector_stats = consumer.stats()["connector_stats"]
        assert isinstance(connector_stats, dict)
        assert connector_stats["lookup_failures"] + connector_stats["lookup_timeouts"] > 0
        # keys of puts that timed out may have been written later from reused blocks:
        # once the master answers again and the client is idle, they are removed
        assert producer_workers["put_timeouts"] > 0
        deadline = time.monotonic() + 20
        removed = 0
        while not removed and time.monotonic() < deadline:
            run_workload(make_requests(1, prompt_tokens=20, max_tokens=1, seed=7,
                                       prefix=f"after{time.monotonic_ns()}"),
                         engine=producer, consumer=consumer, shutdown=False, timeout_s=60)
            stats = producer.stats()["worker_stats"]
            assert isinstance(stats, dict)
            removed = int(stats["orphans_removed"])
            time.sleep(0.1)
        assert removed > 0
    finally:
        consumer.shutdown()
        producer.shutdown()
