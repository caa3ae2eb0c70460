"""Hostile input on a served engine's control port: an error reply naming the field, and
the engine keeps serving (a valid request still runs to completion) with bounded memory.

One real ``kvbridge serve`` (NIXL producer) on 127.0.0.1 for the module; each test
ends by checking it still answers, and the last one that its RSS stayed bounded.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvbridge.auth import HEADER_BYTES
from kvbridge.connectors.params import TRANSFER_PARAMS_VERSION
from kvbridge.engine.control import (
    ControlLimits,
    ProtocolError,
    Submit,
    decode_frames,
    decode_message,
    split_submit,
)
from kvbridge.engine.request import RequestSpec
from tests.conftest import free_port, plaintext_env, ready_line, require, stop_process

#: raw frames below the cluster secret's seal (tests/engine/test_control_auth.py: above it)
pytestmark = pytest.mark.plaintext

NUM_BLOCKS = 32  # tiny-gqa: 16 tokens a block, so the pool holds 512 tokens of one request
POOL_TOKENS = NUM_BLOCKS * 16


class Served:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port
        self.context = zmq.Context()

    def socket(self, timeout_s: float = 20) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock

    def send_frames(self, frames: list[bytes], timeout_s: float = 20) -> Any:
        """One message of these raw frames -> the unpacked reply (None: no reply)."""
        sock = self.socket(timeout_s)
        try:
            sock.send_multipart(frames)
            return msgpack.unpackb(sock.recv(), raw=False)
        except zmq.Again:
            return None
        finally:
            sock.close(linger=0)

    def call(self, message: Any) -> Any:
        return self.send_frames([msgpack.packb(message, use_bin_type=True)])

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def assert_serving(self) -> None:
        """The engine is alive and runs a valid request to completion (bounded wait)."""
        assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}"
        request_id = f"ok-{uuid.uuid4().hex[:8]}"
        reply = self.call({"op": "submit", "requests": [
            {"request_id": request_id, "prompt": list(range(1, 40)), "max_tokens": 3}]})
        assert _accepted(reply) == 1, reply
        token = reply["token"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = self.call({"op": "results", "token": token})
            assert reply is not None and reply["ok"], reply
            done = [r for r in reply["results"] if r["request_id"] == request_id]
            if done:
                assert done[0]["state"] == "finished_length" and len(done[0]["output"]) == 3
                assert self.proc.poll() is None
                return
            time.sleep(0.05)
        raise AssertionError(f"request {request_id} not finished within 60 s")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    control = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.tools.cli", "serve", "--role", "producer",
         "--port", str(free_port()), "--control-port", str(control),
         "--num-blocks", str(NUM_BLOCKS), "--json"],
        stdout=subprocess.PIPE, text=True, env=plaintext_env())
    try:
        ready = ready_line(proc)
        assert ready["control"] == f"127.0.0.1:{control}"
        served = Served(proc, control)
        yield served
        served.context.term()
    finally:
        assert stop_process(proc) == 0


def _error(reply: Any) -> str:
    assert isinstance(reply, dict) and reply["ok"] is False, reply
    assert "Error:" not in reply["error"] and reply["error"] != "'request_id'", reply
    return str(reply["error"])


def _accepted(reply: Any) -> int:
    """How many requests a submit reply accepted; it carries the submitter's token."""
    assert isinstance(reply, dict) and reply["ok"] is True, reply
    assert isinstance(reply["token"], str) and len(reply["token"]) == 64, reply
    return int(reply["accepted"])


def _submit(served: Served, request_id: str, token: str | None = None) -> str:
    message: dict[str, Any] = {"op": "submit", "requests": [
        {"request_id": request_id, "prompt": list(range(1, 40)), "max_tokens": 3}]}
    if token is not None:
        message["token"] = token
    reply = served.call(message)
    assert _accepted(reply) == 1
    return str(reply["token"])


def _results(served: Served, token: str, want: set[str]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while not want <= set(got):
        assert time.monotonic() < deadline, f"only {sorted(got)} of {sorted(want)}"
        reply = served.call({"op": "results", "token": token})
        assert reply["ok"], reply
        got.update((r["request_id"], r) for r in reply["results"])
        time.sleep(0.05)
    return got


def test_results_and_aborts_belong_to_the_client_that_submitted(served: Served) -> None:
    """Before: ``results`` popped every finished result for whoever asked first (a
    second router got ``[]``), and anyone could abort any request by id."""
    router_a = _submit(served, "a-1")
    assert _submit(served, "a-2", router_a) == router_a  # the same client's requests
    router_b = _submit(served, "b-1")
    assert router_b != router_a
    got_b = _results(served, router_b, {"b-1"})
    assert set(got_b) == {"b-1"}  # a's results wait for a
    got_a = _results(served, router_a, {"a-1", "a-2"})
    assert set(got_a) == {"a-1", "a-2"}
    assert served.call({"op": "results", "token": router_a})["results"] == []  # each once
    # b cannot abort a's request; a can (a long one, so that it is still running)
    long_request = {"request_id": "a-long", "prompt": list(range(1, 40)), "max_tokens": 200}
    assert _accepted(served.call({"op": "submit", "token": router_a,
                                  "requests": [long_request]})) == 1
    reply = served.call({"op": "abort", "request_id": "a-long", "token": router_b})
    assert _error(reply).startswith("request_id: 'a-long' was submitted by another client")
    assert served.call({"op": "abort", "request_id": "a-long", "token": router_a}) == {
        "ok": True, "aborted": True}
    assert _results(served, router_a, {"a-long"})["a-long"]["state"] == "finished_aborted"
    # a token this engine did not issue, of the right form, gets nothing
    forged = router_a[:-1] + ("0" if router_a[-1] != "0" else "1")
    assert _error(served.call({"op": "results", "token": forged})).startswith(
        "token: not issued by this engine")
    served.assert_serving()


def test_a_two_frame_message_gets_an_error_reply(served: Served) -> None:
    """Before: recv() took frame 1, the reply raised EFSM and killed serve."""
    reply = served.send_frames([msgpack.packb({"op": "info"}), b"second frame"])
    assert _error(reply).startswith("message: expected one frame")
    assert reply["type"] == "ProtocolError"
    served.assert_serving()


def test_a_token_id_beyond_64_bits_is_refused_at_submit(served: Served) -> None:
    """Before: a sub-block prompt with 2**63 was accepted; hashing its first full block
    in the step loop raised and serve exited with code 2."""
    for bad in (2**63, -1, True, 1.5):
        reply = served.call({"op": "submit", "requests": [
            {"request_id": f"big-{bad}", "prompt": [5, bad], "max_tokens": 20}]})
        assert _error(reply).startswith("requests[0].prompt[1]: expected a token id in "
                                        "[0, 2**63)"), reply
    served.assert_serving()


def test_a_request_bigger_than_the_block_pool_is_refused(served: Served) -> None:
    """Before: neither refused nor run, it starved every later request (FIFO)."""
    reply = served.call({"op": "submit", "requests": [
        {"request_id": "huge", "prompt": [7] * (POOL_TOKENS + 1), "max_tokens": 1}]})
    assert _error(reply).startswith("requests[0].prompt: ")
    assert str(POOL_TOKENS) in reply["error"]
    # a prompt that fits, but whose generated tokens would not
    reply = served.call({"op": "submit", "requests": [
        {"request_id": "long", "prompt": [7] * POOL_TOKENS, "max_tokens": 2}]})
    assert _error(reply).startswith("requests[0].max_tokens: ")
    # exactly the pool: accepted and run
    reply = served.call({"op": "submit", "requests": [
        {"request_id": "full", "prompt": [7] * POOL_TOKENS, "max_tokens": 1}]})
    assert _accepted(reply) == 1
    served.assert_serving()


def test_error_replies_name_the_field_not_a_raw_exception(served: Served) -> None:
    """Before: ``{"type": "KeyError", "error": "'request_id'"}``."""
    cases: list[tuple[Any, str]] = [
        ({"op": "submit", "requests": [{"prompt": [1]}]}, "requests[0].request_id: "),
        ({"op": "submit", "requests": [{"request_id": "a"}]}, "requests[0].prompt: "),
        ({"op": "submit", "requests": [{"request_id": "a", "prompt": [1], "max_tokens": "9"}]},
         "requests[0].max_tokens: "),
        ({"op": "submit", "requests": [{"request_id": "a", "prompt": [1], "nope": 1}]},
         "requests[0].nope: unknown field"),
        ({"op": "submit", "requests": [{"request_id": "a", "prompt": [1],
                                        "transfer_params": {"version": 1}}]},
         "requests[0].transfer_params."),
        ({"op": "submit", "requests": [{"request_id": "a", "prompt": [1]},
                                       {"request_id": "a", "prompt": [2]}]},
         "requests: duplicate request id 'a'"),
        ({"op": "abort"}, "request_id: "),
        ({"op": "abort", "request_id": ["x"]}, "request_id: "),
        ({"op": "abort", "request_id": "x"}, "token: expected the 64 hex characters"),
        ({"op": "results"}, "token: expected the 64 hex characters"),
        ({"op": "results", "token": "ab" * 32}, "token: not issued by this engine"),
        ({"op": "submit", "token": "x", "requests": []}, "token: "),
        ({"op": "explode"}, "op: unknown op 'explode'"),
        ({"op": "stats", "extra": 1}, "message.extra: unknown field"),
        ([1, 2], "message: expected a map"),
    ]
    for message, prefix in cases:
        reply = served.call(message)
        assert _error(reply).startswith(prefix), (message, reply)
    # all or nothing: the second request is refused by the engine (two regions of block
    # ids for a one-region model), the first is not queued
    reply = served.call({"op": "submit", "requests": [
        {"request_id": "first", "prompt": [1, 2], "max_tokens": 1},
        {"request_id": "second", "prompt": [1, 2], "max_tokens": 1, "transfer_params": {
            "version": TRANSFER_PARAMS_VERSION, "mode": "pull", "producer_engine_id": "p",
            "producer_host": "h",
            "producer_port": 1, "producer_request_id": "r", "block_ids": [[0], [1]],
            "producer_topology": {"tp_size": 1}, "num_tokens": 2}}]})
    assert _error(reply).startswith("requests[1].transfer_params.block_ids"), reply
    token = served.call({"op": "submit", "requests": [
        {"request_id": "other", "prompt": [1, 2], "max_tokens": 1}]})["token"]
    assert served.call({"op": "abort", "request_id": "first", "token": token}) == {
        "ok": True, "aborted": False}
    served.assert_serving()


def test_an_oversized_message_is_answered_with_the_limit_unread_and_memory_stays_bounded(
        served: Served) -> None:
    """Before: a REP socket with MAXMSGSIZE dropped a frame over the limit with its
    connection, unanswered: the client saw only its own timeout. (And before that: no
    bound; a 400 MB frame was parsed, RSS +800 MB, kept.)"""
    served.assert_serving()
    limits = ControlLimits.from_dict(served.call({"op": "info"})["limits"])
    assert limits == ControlLimits.for_pools(NUM_BLOCKS, [16])
    rss_before = served.rss_bytes()
    just_over = msgpack.packb({"op": "info", "pad": b"\0" * (limits.max_message_bytes
                                                             + HEADER_BYTES)},
                              use_bin_type=True)
    pad = 64 << 20
    assert pad > 4 * limits.max_message_bytes
    huge = msgpack.packb({"op": "info", "pad": b"\0" * pad}, use_bin_type=True)
    for frame in (just_over, huge, huge, huge):
        reply = served.send_frames([frame], timeout_s=20)
        assert reply is not None, "no answer: the client would only see its own timeout"
        error = _error(reply)
        assert reply["type"] == "ProtocolError", reply
        assert error.startswith("message: over ") and f"this engine takes at most " \
            f"{limits.max_message_bytes} per message" in error, error
    # the sealed form: the engine has no secret here, but the size is refused first
    sealed = b"KVA1" + bytes(56) + huge
    assert "this engine takes at most" in _error(served.send_frames([sealed], timeout_s=20))
    del just_over, huge, sealed
    served.assert_serving()
    # far less than one such message: the bodies were dropped as they arrived
    assert served.rss_bytes() - rss_before < 16 << 20


def test_a_message_in_many_frames_past_the_limit_is_answered_and_the_client_goes_on(
        served: Served) -> None:
    """The bound is the whole message's, not each frame's: many frames each under the
    limit but together over it get the same answer, and the connection serves on."""
    limits = ControlLimits.from_dict(served.call({"op": "info"})["limits"])
    part = b"\0" * (limits.max_message_bytes // 3)
    sock = served.socket()
    try:
        sock.send_multipart([part] * 5)
        error = _error(msgpack.unpackb(sock.recv(), raw=False))
        assert error.startswith("message: over "), error
        sock.send(msgpack.packb({"op": "info"}))        # the same connection goes on
        assert msgpack.unpackb(sock.recv(), raw=False)["ok"] is True
    finally:
        sock.close(linger=0)
    served.assert_serving()


# ---------------------------------------------------------------------------- the decoder

LIMITS = ControlLimits.for_pools(8, [16, 16])


def test_decoder_bounds_follow_the_engine() -> None:
    assert LIMITS.max_request_tokens == 128
    assert LIMITS.max_submit_tokens == 8 * 128
    small = ControlLimits.for_pools(8, [16, 4])  # the smallest pool bounds a request
    assert small.max_request_tokens == 32
    assert ControlLimits.for_pools(4096, [64]).max_message_bytes > \
        ControlLimits.for_pools(32, [64]).max_message_bytes


def test_decoder_refuses_what_does_not_fit_one_message() -> None:
    frame = msgpack.packb({"op": "stats"})
    tight = ControlLimits(16, 4, 64, len(frame) - 1)
    with pytest.raises(ProtocolError, match=r"^message: \d+ bytes; this engine takes at most"):
        decode_frames([frame], tight)
    with pytest.raises(ProtocolError, match="^message: not one msgpack map"):
        decode_frames([b"\x91" * 5000 + b"\xc0"], LIMITS)  # nested past msgpack's stack
    many = [{"request_id": str(i), "prompt": [1]} for i in range(LIMITS.max_submit_requests + 1)]
    with pytest.raises(ProtocolError, match=r"^requests: \d+ requests in one submit"):
        decode_message({"op": "submit", "requests": many}, LIMITS)
    heavy = [{"request_id": str(i), "prompt": [1] * 128, "max_tokens": 1} for i in range(9)]
    with pytest.raises(ProtocolError, match="^requests: more than 1024 prompt tokens"):
        decode_message({"op": "submit", "requests": heavy}, LIMITS)
    with pytest.raises(ProtocolError, match=r"^requests\[0\].request_id: .* 256 characters"):
        decode_message({"op": "submit", "requests": [{"request_id": "x" * 257,
                                                      "prompt": [1]}]}, LIMITS)


def test_split_submit_makes_messages_the_decoder_takes() -> None:
    specs = [RequestSpec(str(i), tuple(range(1, 101)), max_tokens=2) for i in range(30)]
    chunks = split_submit(specs, LIMITS)
    assert [s for c in chunks for s in c] == specs and len(chunks) == 3
    for chunk in chunks:
        raw = msgpack.packb({"op": "submit", "requests": [s.to_dict() for s in chunk]})
        assert len(raw) <= LIMITS.max_message_bytes
        decoded = decode_frames([raw], LIMITS)
        assert isinstance(decoded, Submit) and list(decoded.requests) == chunk
