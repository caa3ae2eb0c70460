"""The control port with a cluster secret: members drive the engine,
strangers, other secrets and replayed messages get an ``AuthError`` reply and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from kvbridge.auth import ClusterAuth, Label, Secret
from kvbridge.engine.core import EngineConfig
from kvbridge.engine.harness import EngineProcess, connect_control, control_exchange
from kvbridge.engine.workload import make_requests
from kvbridge.layouts import load_spec

SECRET = "control-port-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    with EngineProcess(EngineConfig(load_spec("tiny-gqa"), num_blocks=16), name="secured",
                       call_timeout_s=20, env={"KVBRIDGE_SECRET": SECRET,
                                               "KVBRIDGE_SECRET_FILE": ""}) as proc:
        yield proc


def _raw(port: int, frames: list[bytes]) -> bytes:
    context = zmq.Context()
    sock = connect_control(context, "127.0.0.1", port, 20.0)
    try:
        sock.send_multipart(frames)
        return sock.recv()
    finally:
        sock.close(linger=0)
        context.term()


def _results(engine: EngineProcess, count: int) -> list:
    got: list = []
    deadline = time.monotonic() + 60
    while len(got) < count:
        assert time.monotonic() < deadline, "the member's requests did not finish"
        got += engine.results()
        time.sleep(0.01)
    return got


def test_a_member_drives_the_engine(engine: EngineProcess) -> None:
    assert engine.auth is not None  # the harness found the secret in the child's env
    assert engine.call("info")["engine_id"] == engine.engine_id
    engine.submit(make_requests(2, prompt_tokens=20, max_tokens=2, prefix="member"))
    assert len(_results(engine, 2)) == 2


def test_strangers_get_an_auth_error_and_nothing_runs(engine: EngineProcess) -> None:
    before = engine.call("stats")["stats"]
    for frames in ([msgpack.packb({"op": "shutdown"})],              # no seal
                   [msgpack.packb({"op": "info"}), b"second"],         # two frames
                   [b"KVA1" + bytes(80)]):                             # a broken seal
        reply = msgpack.unpackb(_raw(engine.port, frames), raw=False)
        assert reply["ok"] is False and reply["type"] == "AuthError", reply
        assert engine.engine_id not in str(reply)
    other = ClusterAuth(Secret.from_value("another-secret-0123456789abcdef"))
    context = zmq.Context()
    sock = connect_control(context, "127.0.0.1", engine.port, 20.0)
    try:
        refused = control_exchange(sock, other, "abort", {"request_id": "x"})
    finally:
        sock.close(linger=0)
        context.term()
    assert refused["type"] == "AuthError" and "tag does not match" in refused["error"]
    assert engine.alive and engine.call("info")["engine_id"] == engine.engine_id
    after = engine.call("stats")["stats"]
    assert after["steps"] == before["steps"] and after["aborted"] == before["aborted"]


def test_a_captured_message_cannot_be_sent_again(engine: EngineProcess) -> None:
    auth = ClusterAuth(Secret.from_value(SECRET))
    wire, nonce = auth.seal_request(Label.CONTROL, msgpack.packb({"op": "info"}))
    first = _raw(engine.port, [wire])
    assert msgpack.unpackb(auth.open_reply(Label.CONTROL, nonce, first),
                           raw=False)["engine_id"] == engine.engine_id
    again = msgpack.unpackb(_raw(engine.port, [wire]), raw=False)
    assert again["type"] == "AuthError" and "replayed" in again["error"]


def test_a_sealed_body_that_is_not_msgpack_is_refused_with_its_reason(
        engine: EngineProcess) -> None:
    """Before: a member's sealed body that msgpack refuses without a message (a type byte
    it never uses, nesting past its stack) was answered "not one msgpack map (FormatError: )"."""
    auth = ClusterAuth(Secret.from_value(SECRET))
    for body, says in ((b"\xc1", "no msgpack type"),
                       (b"\x91" * 5000 + b"\xc0", "nested deeper"),
                       (b"\x80junk", "bytes after the first msgpack object")):
        wire, nonce = auth.seal_request(Label.CONTROL, body)
        reply = msgpack.unpackb(auth.open_reply(Label.CONTROL, nonce,
                                                _raw(engine.port, [wire])), raw=False)
        assert reply["ok"] is False and reply["type"] == "ProtocolError", reply
        assert reply["error"].startswith("message: not one msgpack map (") and says in \
            reply["error"], reply
        assert not reply["error"].endswith(": )"), reply
    assert engine.call("info")["engine_id"] == engine.engine_id


def test_a_sealed_message_over_the_limit_is_answered_with_the_limit(
        engine: EngineProcess) -> None:
    """Before: no reply at all (the client's own timeout). It is refused on its size
    before anything is read, so the answer is unsealed, and the member's client takes
    a refusal unsealed (never a success)."""
    limit = engine.call("info")["limits"]["max_message_bytes"]
    auth = ClusterAuth(Secret.from_value(SECRET))
    context = zmq.Context()
    sock = connect_control(context, "127.0.0.1", engine.port, 20.0)
    try:
        reply = control_exchange(sock, auth, "info", {"pad": b"\0" * (limit + (1 << 20))})
    finally:
        sock.close(linger=0)
        context.term()
    assert reply["ok"] is False and reply["type"] == "ProtocolError", reply
    assert f"this engine takes at most {limit} per message" in reply["error"], reply
    assert engine.call("info")["engine_id"] == engine.engine_id


def test_a_refused_bind_is_refused_before_any_engine_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.connectors import ConfigError
    from kvbridge.engine import server

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("serve built an engine before checking its bind address")

    monkeypatch.setattr(server, "Engine", no_engine)
    with pytest.raises(ConfigError) as info:
        server.serve(EngineConfig(load_spec("tiny-gqa"), num_blocks=16), host="192.0.2.1")
    assert info.value.field == "control_port"
    assert "refusing to listen on 192.0.2.1 without a cluster secret" in str(info.value)
