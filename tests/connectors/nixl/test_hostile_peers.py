"""Hostile or broken peers of the NIXL connector, against served engines and real NIXL.

One peer's absurd claims (a topology of 2**40 ranks, 2**22 blocks its NIXL
registration does not hold) or one request's bad block id must cost that peer
or that request only: the engine keeps serving, other producers' loads keep
working, memory stays bounded and the engine still stops on SIGTERM.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import torch

from kvbridge.auth import Label, resolve_auth
from kvbridge.backends.nixl import NixlTransport
from kvbridge.connectors import KVRole, TransferMode
from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd import messages
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestResult, RequestSpec
from kvbridge.engine.workload import make_requests
from kvbridge.handshake import (
    AgentMetadata,
    EngineMetadata,
    HandshakeClient,
    HandshakeServer,
    MetadataReply,
    MetadataStore,
    RegionMemory,
    ServerClock,
    decode_request,
    encode_agent,
    encode_engine,
    encode_reply,
)
from kvbridge.handshake import TransferMode as WireMode
from kvbridge.layouts import ParallelTopology, load_spec, plan_transfer
from kvbridge.layouts.plan import plan_consumer_rank
from tests.conftest import forged_topology, require
from tests.connectors.nixl.nixl_helpers import member_hello, nixl_config
from tests.connectors.nixl.test_faults import (
    MODEL,
    PULL,
    Stepper,
    _check_output,
    _consumer,
    _prefill,
    _producer,
    _shutdown_clean,
    _wait_producer,
    _worker_totals,
)

PUSH = TransferMode.PUSH


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} for pid {pid}")


def _results(engine: EngineProcess, want: set[str], timeout_s: float) -> dict[str, RequestResult]:
    out: dict[str, RequestResult] = {}
    deadline = time.monotonic() + timeout_s
    while not want <= set(out):
        assert time.monotonic() < deadline, f"{engine.name}: only {sorted(out)} of " \
                                            f"{sorted(want)} within {timeout_s} s"
        for result in engine.results():
            out[result.request_id] = result
        time.sleep(0.02)
    return out


def _pointing_at(params: TransferParams, engine_id: str, port: int) -> TransferParams:
    return replace(params, producer_engine_id=engine_id, producer_host="127.0.0.1",
                   producer_port=port)


class _ClaimingSideChannel:
    """A raw ROUTER on 127.0.0.1 answering every request with one fixed document (a
    hostile member: it seals with the environment's cluster secret when there is one)."""

    def __init__(self, doc: bytes) -> None:
        import zmq

        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.doc = doc
        self.auth = resolve_auth()
        self.served = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            raw, nonce = frames[-1], b""
            if self.auth is not None:
                opened = self.auth.open_request(Label.SIDE_CHANNEL, raw)
                raw, nonce = opened.body, opened.nonce
            request = decode_request(raw)
            reply = MetadataReply(request.request_id, ServerClock(time.time(), time.monotonic()),
                                  self.doc)
            out = encode_reply(reply)
            if self.auth is not None:
                out = self.auth.seal_reply(Label.SIDE_CHANNEL, nonce, out)
            self.sock.send_multipart([*frames[:-1], out])
            self.served += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


@pytest.mark.parametrize("model, producer, consumer", [
    ("tiny-hybrid", ParallelTopology(tp_size=2, pp_size=2), ParallelTopology(tp_size=4)),
    ("tiny-gqa-nhd", ParallelTopology(tp_size=4), ParallelTopology(tp_size=2, pp_size=2)),
    ("tiny-mla", ParallelTopology(tp_size=4, dcp_size=2), ParallelTopology(tp_size=2,
                                                                             dcp_size=2)),
    ("tiny-gqa", ParallelTopology(tp_size=1), ParallelTopology(tp_size=8)),
])
def test_plan_of_one_consumer_rank_equals_that_rank_of_the_whole_plan(
        model: str, producer: ParallelTopology, consumer: ParallelTopology) -> None:
    spec = load_spec(model)
    whole = plan_transfer(spec, producer, consumer)
    for rank in consumer.ranks():
        alone = plan_consumer_rank(spec, producer, rank)
        expected = whole.for_consumer(rank)
        assert alone.consumer_rank == expected.consumer_rank
        for name in ("producer_ranks", "regions", "layers", "producer_offsets",
                     "consumer_offsets", "lengths"):
            assert getattr(alone, name).tolist() == getattr(expected, name).tolist(), name


#: forged params reach the worker's own checks only without a cluster secret: with one,
#: the consumer's scheduler refuses them before any I/O (test_sealed_params.py)
@pytest.mark.plaintext
def test_a_peer_claiming_two_to_the_forty_ranks_does_not_wedge_the_consumer() -> None:
    """The served consumer refuses the claim, and a load from a real producer asked
    for right after it still completes (before: the only handshake thread looped
    over the claimed ranks forever and every later load failed)."""
    spec = load_spec(MODEL)
    header_src = MetadataStore("shape", spec, ParallelTopology(tp_size=1), WireMode.PULL)
    claim = encode_engine(EngineMetadata(header_src.header, "claims-2-40", "c0ffee", 1, spec,
                                         forged_topology(tp_size=2 ** 40), ()))
    hostile = _ClaimingSideChannel(claim)
    producer = _producer()
    consumer = EngineProcess(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1),
                                         PULL), name="consumer", call_timeout_s=20)
    try:
        bad, good = make_requests(2, prompt_tokens=48, max_tokens=2, seed=3, prefix="claim")
        bad_params = _prefill(producer, bad).transfer_params
        good_params = _prefill(producer, good).transfer_params
        assert bad_params is not None and good_params is not None
        rss_before = _status_kib(consumer._proc.pid, "VmRSS")
        consumer.submit([replace(bad, transfer_params=_pointing_at(
            bad_params, "claims-2-40", hostile.port))])
        consumer.submit([replace(good, transfer_params=good_params)])
        results = _results(consumer, {bad.request_id, good.request_id}, 60)
        loaded = results[good.request_id]
        _check_output(loaded, good)
        assert loaded.num_external_tokens > 0 and loaded.num_recomputed_tokens == 0
        refused = results[bad.request_id]
        _check_output(refused, bad)  # recomputed after the refused handshake
        assert refused.num_recomputed_tokens > 0
        assert hostile.served >= 1
        stats = consumer.stats()["stats"]["worker_stats"]
        assert stats["handshake_failures"] >= 1 and stats["loads_done"] == 1
        grown_mib = (_status_kib(consumer._proc.pid, "VmRSS") - rss_before) / 1024
        assert grown_mib < 100, f"consumer grew by {grown_mib:.0f} MiB"
    finally:
        hostile.close()
        producer.close()
        code = consumer.close()
    assert code == 0, f"consumer did not stop cleanly (exit {code})"


@pytest.fixture
def blocks_claim() -> Iterator[tuple[str, int]]:
    """A side channel advertising 2**22 blocks per layer for a real NIXL agent whose
    registration holds one MiB: yields (engine id, port)."""
    spec = load_spec(MODEL)
    topology = ParallelTopology(tp_size=1)
    transport = NixlTransport(f"kvb-claims-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    transport.register_regions([memory])
    shape = spec.rank_shapes(topology)[0]
    region = RegionMemory(shape.region.name,
                          tuple((i + 1) << 40 for i in range(len(shape.layer_ids))),
                          shape.block_bytes_per_layer, 1 << 22, shape.region.memory_order,
                          shape.region.block_size)
    engine_id = "claims-blocks"
    store = MetadataStore(engine_id, spec, topology, WireMode.PULL)
    store.publish(AgentMetadata(engine_id, transport.name, transport.agent_metadata(),
                                topology, (region,), spec))
    server = HandshakeServer(store, "127.0.0.1", 0).start()
    try:
        yield engine_id, server.port
    finally:
        server.stop()
        transport.close(strict=False)


#: forged params reach the worker's own checks only without a cluster secret: with one,
#: the consumer's scheduler refuses them before any I/O (test_sealed_params.py)
@pytest.mark.plaintext
def test_advertised_blocks_beyond_the_registration_allocate_nothing(blocks_claim) -> None:
    """Rows per advertised block are built only after NIXL accepted that the peer's
    registration covers them (before: 256 MiB of rows here, then NIXL refused)."""
    engine_id, port = blocks_claim
    producer = _producer()
    consumer = EngineProcess(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1),
                                         PULL), name="consumer", call_timeout_s=20)
    try:
        warm, bad, good = make_requests(3, prompt_tokens=48, max_tokens=2, seed=5,
                                        prefix="blocks")
        params = {s.request_id: _prefill(producer, s).transfer_params for s in (warm, bad, good)}
        consumer.submit([replace(warm, transfer_params=params[warm.request_id])])
        _check_output(_results(consumer, {warm.request_id}, 60)[warm.request_id], warm)
        peak_before = _status_kib(consumer._proc.pid, "VmHWM")
        bad_params = params[bad.request_id]
        assert bad_params is not None
        consumer.submit([replace(bad, transfer_params=_pointing_at(bad_params, engine_id,
                                                                   port))])
        refused = _results(consumer, {bad.request_id}, 60)[bad.request_id]
        _check_output(refused, bad)
        assert refused.num_recomputed_tokens > 0
        grown_mib = (_status_kib(consumer._proc.pid, "VmHWM") - peak_before) / 1024
        assert grown_mib < 64, f"consumer peak grew by {grown_mib:.0f} MiB"
        consumer.submit([replace(good, transfer_params=params[good.request_id])])
        loaded = _results(consumer, {good.request_id}, 60)[good.request_id]
        _check_output(loaded, good)
        assert loaded.num_external_tokens > 0
        stats = consumer.stats()["stats"]["worker_stats"]
        assert stats["handshake_failures"] == 1 and stats["loads_done"] == 2
    finally:
        producer.close()
        code = consumer.close()
    assert code == 0


def test_push_hello_claiming_two_to_the_forty_ranks_is_refused_and_push_goes_on() -> None:
    """The hello is refused by its decoder (counted as a bad notification); the
    producer neither freezes under its state lock nor stops serving pushes."""
    spec = load_spec(MODEL)
    producer = EngineProcess(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(tp_size=1),
                                         PUSH), name="producer", call_timeout_s=20)
    consumer = EngineProcess(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1),
                                         PUSH), name="consumer", call_timeout_s=20)
    transport = NixlTransport(f"kvb-claims-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    transport.register_regions([memory])
    try:
        assert producer.endpoint is not None and consumer.endpoint is not None
        doc = HandshakeClient(timeout_s=5.0, auth=resolve_auth()).fetch(f"127.0.0.1:{producer.endpoint[1]}").metadata
        target = doc.ranks[0]
        peer = transport.add_peer(target.agent_name, target.agent_blob)
        shape = spec.rank_shapes(ParallelTopology(tp_size=1))[0]
        layer_addrs = {layer: memory.data_ptr() + i * shape.block_bytes_per_layer
                       for i, layer in enumerate(shape.layer_ids)}
        meta = AgentMetadata.build("claims-push", transport.name, transport.agent_metadata(),
                                   spec, ParallelTopology(tp_size=1), layer_addrs, 1)
        # the claim is forged on the wire: kvbridge itself cannot build such a record
        record = msgpack.unpackb(encode_agent(meta), raw=False)
        record["topology"]["tp_size"] = 2 ** 40
        hello = msgpack.packb(record, use_bin_type=True)
        transport.send_notif(peer, messages.encode(member_hello(hello)))
        deadline = time.monotonic() + 30
        ticks = iter(range(1000))
        while producer.stats()["stats"]["worker_stats"].get("bad_notifs", 0) < 1:
            assert time.monotonic() < deadline, "the producer never refused the hello"
            transport.get_notifs()  # progresses our agent: the notification goes out
            # worker stats reach the engine when it steps: a tiny local request
            producer.submit([RequestSpec(f"tick-{next(ticks)}", (1, 2, 3), max_tokens=1)])
            time.sleep(0.05)
            producer.results()

        (request,) = make_requests(1, prompt_tokens=48, max_tokens=2, seed=9, prefix="push")
        params = TransferParams(
            mode=PUSH, producer_engine_id=producer.engine_id,
            producer_host=producer.endpoint[0], producer_port=producer.endpoint[1],
            producer_request_id=request.request_id, block_ids=(),
            producer_topology=ParallelTopology(tp_size=1), num_tokens=len(request.prompt),
            consumer_engine_id=consumer.engine_id, consumer_host=consumer.endpoint[0],
            consumer_port=consumer.endpoint[1], consumer_request_id=request.request_id,
            spec_fingerprint=spec.fingerprint())
        consumer.submit([replace(request, transfer_params=params)])
        producer.submit([replace(request, remote_decode=True, max_tokens=1,
                                 transfer_params=params)])
        pushed = _results(consumer, {request.request_id}, 60)[request.request_id]
        _check_output(pushed, request)
        assert pushed.num_external_tokens > 0 and pushed.num_recomputed_tokens == 0
    finally:
        transport.close(strict=False)
        codes = (producer.close(), consumer.close())
    assert codes == (0, 0)


def _with_bad_block(params: TransferParams) -> TransferParams:
    ids = [list(group) for group in params.block_ids]
    ids[0][-1] = 10 ** 6  # far past the producer's 32 blocks
    return replace(params, block_ids=tuple(tuple(group) for group in ids))


#: forged params reach the worker's own checks only without a cluster secret: with one,
#: the consumer's scheduler refuses them before any I/O (test_sealed_params.py)
@pytest.mark.plaintext
def test_a_bad_block_id_fails_its_request_only_and_keeps_the_session() -> None:
    producer = _producer()
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        warm, good, bad, again = make_requests(4, prompt_tokens=48, max_tokens=2, seed=21,
                                               prefix="badid")
        params: dict[str, Any] = {s.request_id: _prefill(producer, s).transfer_params
                                  for s in (warm, good, bad)}
        consumer.add_request(replace(warm, transfer_params=params[warm.request_id]))
        stepper.until(lambda: warm.request_id in stepper.results, 30, "warm-up load")
        # the good load first, the bad one in the same step: both use one session
        consumer.add_request(replace(good, transfer_params=params[good.request_id]))
        consumer.add_request(replace(bad, transfer_params=_with_bad_block(
            params[bad.request_id])))
        stepper.until(lambda: {good.request_id, bad.request_id} <= set(stepper.results), 60,
                      "both requests finished")
        loaded = stepper.results[good.request_id]
        _check_output(loaded, good)
        assert loaded.num_external_tokens > 0 and loaded.num_recomputed_tokens == 0
        _check_output(stepper.results[bad.request_id], bad)
        assert stepper.results[bad.request_id].num_recomputed_tokens > 0
        assert stepper.failed == {bad.request_id}
        # the bad request's blocks only: at most its prompt's blocks
        block_size = load_spec(MODEL).regions[0].block_size
        assert 0 < len(stepper.invalid) <= -(-len(bad.prompt) // block_size), stepper.invalid
        totals = _worker_totals(consumer)
        assert sum(t["sessions_dropped"] for t in totals) == 0
        assert sum(t["requests_refused"] for t in totals) == 1
        assert sum(t["handshakes"] for t in totals) == 1
        assert sum(t["loads_done"] for t in totals) == 2
        # its release names a record the producer never sealed (the ids were changed
        # after the seal): refused and counted; that hold ends by its lease
        _wait_producer(producer, "holds_refused", 1, 20)
        # a refused request never counted as using the session: it must not uncount
        # another load that does (the session's ``active`` gates its revalidation)
        worker = consumer.workers[0].connector
        assert worker is not None
        (session,) = worker.sessions.sessions.values()
        with worker.pump.lock:
            session.active += 1  # stands for a load in flight
        params[again.request_id] = _prefill(producer, again).transfer_params
        consumer.add_request(replace(again, transfer_params=_with_bad_block(
            params[again.request_id])))
        stepper.until(lambda: again.request_id in stepper.failed, 30, "second bad load")
        assert session.active == 1
    finally:
        producer.close()
        _shutdown_clean(consumer)


class _SilentSideChannel:
    """A ROUTER on 127.0.0.1 that takes requests and never answers."""

    def __init__(self) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def close(self) -> None:
        self.sock.close(linger=0)


#: forged params reach the worker's own checks only without a cluster secret: with one,
#: the consumer's scheduler refuses them before any I/O (test_sealed_params.py)
@pytest.mark.plaintext
def test_a_silent_peer_delays_only_its_own_handshake() -> None:
    """While one producer's side channel never answers, a load from another producer
    handshakes and completes (before: it queued behind the silent one on the only
    handshake thread and started only after that one had failed)."""
    silent = _SilentSideChannel()
    producer = _producer()
    consumer = _consumer(handshake_timeout_s=5.0, handshake_retries=0)
    stepper = Stepper(consumer)
    try:
        stuck, good = make_requests(2, prompt_tokens=48, max_tokens=2, seed=33, prefix="silent")
        stuck_params = _prefill(producer, stuck).transfer_params
        good_params = _prefill(producer, good).transfer_params
        assert stuck_params is not None
        consumer.add_request(replace(stuck, transfer_params=_pointing_at(
            stuck_params, "silent", silent.port)))
        stepper.step()  # its handshake starts first
        consumer.add_request(replace(good, transfer_params=good_params))
        stepper.until(lambda: good.request_id in stepper.results
                      or stuck.request_id in stepper.failed, 60, "a load settled")
        assert stuck.request_id not in stepper.failed, \
            "the silent peer's handshake ended before the other producer's load"
        loaded = stepper.results[good.request_id]
        _check_output(loaded, good)
        assert loaded.num_external_tokens > 0
        stepper.until(lambda: stuck.request_id in stepper.results, 60, "silent load settled")
        assert stuck.request_id in stepper.failed
        _check_output(stepper.results[stuck.request_id], stuck)
    finally:
        silent.close()
        producer.close()
        _shutdown_clean(consumer)


def test_a_handshake_past_its_deadline_fails_its_loads_and_is_abandoned() -> None:
    """Fault injection: the side-channel fetch of the first handshake blocks until
    released. Past the handshake deadline its load fails (not after the much longer
    transfer timeout), the next load to that producer handshakes afresh, and the
    abandoned handshake's session is closed once it finally completes."""
    producer = _producer()
    consumer = _consumer(handshake_timeout_s=1.0, handshake_retries=0,
                         transfer_timeout_s=120.0)
    stepper = Stepper(consumer)
    worker = consumer.workers[0].connector
    assert worker is not None
    release = threading.Event()
    real_fetch = worker.sessions.client.fetch
    calls = iter(range(1000))

    def wedged_fetch(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 0:
            release.wait(120)
        return real_fetch(*args, **kwargs)

    worker.sessions.client.fetch = wedged_fetch  # type: ignore[method-assign]
    try:
        first, second = make_requests(2, prompt_tokens=48, max_tokens=2, seed=35,
                                      prefix="wedge")
        params = {s.request_id: _prefill(producer, s).transfer_params for s in (first, second)}
        consumer.add_request(replace(first, transfer_params=params[first.request_id]))
        stepper.until(lambda: first.request_id in stepper.failed, 60, "wedged load failed")
        totals = worker.totals()
        assert totals["handshakes_abandoned"] == 1 and totals["loads_failed"] == 1
        consumer.add_request(replace(second, transfer_params=params[second.request_id]))
        stepper.until(lambda: second.request_id in stepper.results, 60, "fresh handshake")
        loaded = stepper.results[second.request_id]
        _check_output(loaded, second)
        assert loaded.num_external_tokens > 0
        release.set()  # the abandoned handshake now completes: its session is closed
        stepper.until(lambda: not worker.sessions.abandoned, 30, "abandoned handshake settled")
        assert worker.totals()["sessions"] == 1
    finally:
        release.set()
        producer.close()
        _shutdown_clean(consumer)
