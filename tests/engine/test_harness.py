"""Multi-process harness: producer and consumer engines in their own processes, a router
between them, msgpack over ZeroMQ for control."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zmq

from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.engine import EngineConfig
from kvbridge.engine.harness import EngineProcess, EngineProcessError, run_pd_processes
from kvbridge.engine.server import config_from_dict, config_to_dict
from kvbridge.engine.workload import make_requests
from kvbridge.layouts import ParallelTopology, load_spec


def test_config_round_trips_through_plain_dicts(tmp_path: Path) -> None:
    config = EngineConfig(load_spec("tiny-hybrid"), ParallelTopology(tp_size=2, dcp_size=2),
                          num_blocks=17, connector=ConnectorConfig(
                              "shared_storage", KVRole.CONSUMER, engine_id="e1",
                              extra={"path": str(tmp_path)}))
    assert config_from_dict(msgpack.unpackb(msgpack.packb(config_to_dict(config)))) == config


def test_pd_through_two_processes(tmp_path: Path) -> None:
    spec = load_spec("tiny-gqa")
    store = str(tmp_path / "store")
    producer = EngineConfig(spec, ParallelTopology(tp_size=2), num_blocks=64,
                            connector=ConnectorConfig("shared_storage", KVRole.PRODUCER,
                                                      extra={"path": store}))
    consumer = EngineConfig(spec, ParallelTopology(tp_size=2), num_blocks=64,
                            connector=ConnectorConfig("shared_storage", KVRole.CONSUMER,
                                                      extra={"path": store,
                                                             "load_async": True}))
    requests = make_requests(6, prompt_tokens=70, max_tokens=4)
    result, stats = run_pd_processes(requests, producer, consumer, timeout_s=120)
    assert result.requests == 6 and result.failed_requests == 0 and not result.wrong_outputs
    assert result.external_tokens == 6 * 64  # every full prompt block came from the producer
    assert result.verified_bytes > 0 and result.mismatched_bytes == 0
    assert stats["producer"]["idle_problems"] == [] and stats["consumer"]["idle_problems"] == []


@pytest.mark.plaintext  # raw garbage below the seal
def test_server_answers_bad_requests_and_keeps_serving() -> None:
    with EngineProcess(EngineConfig(load_spec("tiny-gqa"), num_blocks=16), name="solo",
                       call_timeout_s=20) as proc:
        with pytest.raises(EngineProcessError, match="unknown op"):
            proc.call("explode")
        with pytest.raises(EngineProcessError, match="requests"):
            proc.call("submit", requests="not a list")
        # raw garbage on the wire gets an error reply, not a crash
        context = zmq.Context()
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 20000)
        sock.connect(f"tcp://127.0.0.1:{proc.port}")
        sock.send(b"\xc1\xc1")
        reply = msgpack.unpackb(sock.recv(), raw=False)
        sock.close()
        context.term()
        assert reply["ok"] is False and reply["type"] == "ProtocolError"
        info = proc.call("info")
        assert info["engine_id"] == proc.engine_id and info["endpoint"] is None
        proc.submit(make_requests(2, prompt_tokens=20, max_tokens=2))
        results: list = []
        for _ in range(500):
            results += proc.results()
            if len(results) == 2:
                break
        assert len(results) == 2
        assert proc.alive
    assert not proc.alive
