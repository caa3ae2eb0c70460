"""Multi-process harness: engines in their own processes, and a PD router between them.

:class:`EngineProcess` starts ``python -m kvbridge.engine.server`` (one engine
with all its ranks), waits for its ready line (bounded), and talks to it with
msgpack over a ZeroMQ REQ socket on 127.0.0.1 with a timeout on every call.
:func:`run_pd_processes` runs a producer process and a consumer process and
routes requests between them the way a PD proxy does (pull: prefill on the
producer with ``remote_decode``, forward its ``TransferParams`` dict with the
prompt to the consumer; push: send to both with push params built from the
engines' connector endpoints).

Everything is bounded: start-up, each call, the whole workload, shutdown
(``shutdown`` op, then SIGTERM, then SIGKILL).

KV events: an engine process given an ``EngineEventsConfig`` (or started inside
:func:`kvbridge.engine.kv_events.publish_engine_events`, at the next engine's
endpoints) publishes its events itself; ``EngineProcess.events_endpoint`` and
``events_replay_endpoint`` say where (a ``*`` port resolved).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import zmq

from kvbridge.auth import AuthError, ClusterAuth, Label, is_sealed, resolve_auth
from kvbridge.connectors import TransferMode, TransferParams
from kvbridge.engine.control import ControlLimits, split_submit
from kvbridge.engine.core import EngineConfig
from kvbridge.engine.kv_events import EngineEventsConfig, active_publishing
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.server import config_to_dict
from kvbridge.engine.workload import WorkloadResult, check_outputs


def connect_control(context: zmq.Context[Any], host: str, port: int,
                    timeout_s: float) -> zmq.Socket[bytes]:
    """A REQ socket to an engine control socket at ``host:port``.

    Every send and receive on it gives up after ``timeout_s`` (``zmq.Again``),
    and closing it drops what is queued (no linger). A REQ socket that timed out
    is stuck mid-exchange: the caller closes it and connects a fresh one.
    """
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = int(timeout_s * 1000)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.connect(f"tcp://{host}:{port}")
    return sock


def control_exchange(sock: zmq.Socket[bytes], auth: ClusterAuth | None, op: str,
                     fields: dict[str, Any]) -> Any:
    """Send one control message on ``sock`` and return the decoded reply.

    With ``auth`` the message is sealed and the reply must be sealed bound to it;
    an engine that refuses us, or answers unsealed, comes back as an error reply
    (``type`` ``AuthError``, or ``ProtocolError`` for a message over the engine's
    limit, refused before it was read) like any other. ``zmq.Again`` on a timeout.
    """
    body = msgpack.packb({"op": op, **fields}, use_bin_type=True)
    if auth is None:
        sock.send(body)
        return msgpack.unpackb(sock.recv(), raw=False)
    wire, nonce = auth.seal_request(Label.CONTROL, body)
    sock.send(wire)
    raw = sock.recv()
    if not is_sealed(raw):
        try:
            reply = msgpack.unpackb(raw, raw=False)
        except Exception:
            reply = None
        # the engine's refusal of our request: that it is unsealed costs nothing (a forged
        # refusal only fails the call, as dropping it would); an unsealed success is not
        # taken. ProtocolError: a message over the limit, answered before it was read.
        if isinstance(reply, dict) and reply.get("ok") is False \
                and reply.get("type") in ("AuthError", "ProtocolError"):
            return reply
        return {"ok": False, "type": "AuthError",
                "error": "the engine answered without authentication: it has no cluster "
                         "secret, or it is not a member"}
    try:
        return msgpack.unpackb(auth.open_reply(Label.CONTROL, nonce, raw), raw=False)
    except AuthError as exc:
        return {"ok": False, "type": "AuthError", "error": exc.reason}


def read_ready_line(proc: subprocess.Popen[str], timeout_s: float, name: str) -> dict[str, Any]:
    """The first JSON object with ``"ready"`` that ``proc`` prints on stdout (bounded wait).

    Other lines (a library's stray print) are skipped. Raises
    :class:`EngineProcessError` naming ``name`` when the process exits first or
    ``timeout_s`` passes.
    """
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineProcessError(f"{name}: no ready line within {timeout_s} s")
            if not selector.select(timeout=min(left, 0.5)):
                if proc.poll() is not None:
                    raise EngineProcessError(f"{name}: exited with code "
                                             f"{proc.returncode} before ready")
                continue
            line = proc.stdout.readline()
            if not line:
                proc.wait(timeout=5)
                raise EngineProcessError(f"{name}: exited with code "
                                         f"{proc.returncode} before ready")
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print from a library
            if isinstance(data, dict) and data.get("ready"):
                return data
    finally:
        selector.close()


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or answered with an error."""


class ControlCalls:
    """The engine control operations (``kvbridge.engine.server``) over a subclass's ``call``.

    Shared by the local :class:`EngineProcess` and the demo's client of a remote
    ``kvbridge serve``, so the op names and reply fields are written once.
    """

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request/reply with the engine's control socket."""
        raise NotImplementedError

    _limits: ControlLimits | None = None
    #: the cluster secret's seal every call is sent with (None: unauthenticated)
    auth: ClusterAuth | None = None
    #: this client's capability to its requests, from its first submit's reply
    token: str | None = None

    def control_limits(self) -> ControlLimits:
        """What one message to this engine may carry (from its ``info``; asked once)."""
        if self._limits is None:
            self._limits = ControlLimits.from_dict(self.call("info").get("limits"))
        return self._limits

    def submit(self, specs: list[RequestSpec]) -> None:
        """Queue ``specs``, in as many ``submit`` messages as the engine's limits need
        (each message is all or nothing; an error leaves the earlier ones queued)."""
        for chunk in split_submit(specs, self.control_limits()):
            fields: dict[str, Any] = {"requests": [s.to_dict() for s in chunk]}
            if self.token is not None:
                fields["token"] = self.token
            self.token = str(self.call("submit", **fields)["token"])

    def results(self) -> list[RequestResult]:
        """Finished results of the requests this client submitted (each once)."""
        if self.token is None:
            return []
        return [RequestResult.from_dict(r)
                for r in self.call("results", token=self.token)["results"]]

    def abort(self, request_id: str) -> bool:
        """Abort one of this client's requests; False if it already finished."""
        if self.token is None:
            return False
        return bool(self.call("abort", request_id=request_id, token=self.token)["aborted"])

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def transfer_records(self) -> list[dict[str, Any]]:
        """Finished transfers of every rank (``request_id``, ``ok``, ``nbytes``,
        ``duration_s``, ``started_at`` on the engine's monotonic clock)."""
        return list(self.call("transfer_records")["records"])


class EngineProcess(ControlCalls):
    """A reference engine in a child process. Use as a context manager."""

    def __init__(self, config: EngineConfig, *, start_timeout_s: float = 60.0,
                 call_timeout_s: float = 30.0, name: str = "engine",
                 env: dict[str, str] | None = None,
                 events: EngineEventsConfig | None = None) -> None:
        self.name = name
        self.call_timeout_s = call_timeout_s
        publishing = active_publishing() if events is None else None
        if publishing is not None:
            events = publishing.assign()
        self.events_endpoint: str | None = None
        self.events_replay_endpoint: str | None = None
        child_env = dict(os.environ)
        child_env.update(env or {})
        #: the secret the child finds in the same environment (kvbridge.auth)
        self.auth = resolve_auth(environ=child_env)
        argv = [sys.executable, "-m", "kvbridge.engine.server",
                "--config", json.dumps(config_to_dict(config))]
        if events is not None:
            argv += ["--events", json.dumps(events.to_dict())]
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, env=child_env,
                                      text=True)
        self._context = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        try:
            ready = read_ready_line(self._proc, start_timeout_s, self.name)
            self.port = int(ready["port"])
            self.engine_id = str(ready["engine_id"])
            self.endpoint: tuple[str, int] | None = (
                (ready["endpoint"][0], int(ready["endpoint"][1])) if ready.get("endpoint")
                else None)
            published = ready.get("events")
            if isinstance(published, dict):
                self.events_endpoint = str(published["endpoint"])
                replay = published.get("replay_endpoint")
                self.events_replay_endpoint = str(replay) if replay else None
            if publishing is not None and self.events_endpoint is not None:
                publishing.record(name, self.engine_id, self.events_endpoint,
                                  self.events_replay_endpoint)
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = connect_control(self._context, "127.0.0.1", self.port, self.call_timeout_s)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request/reply; raises :class:`EngineProcessError` on error or timeout."""
        if self._sock is None:
            raise EngineProcessError(f"{self.name}: closed")
        try:
            reply = control_exchange(self._sock, self.auth, op, fields)
        except zmq.Again:
            self._connect()  # a REQ socket is stuck after a timeout
            alive = self._proc.poll() is None
            raise EngineProcessError(f"{self.name}: no reply to {op!r} within "
                                     f"{self.call_timeout_s} s (process "
                                     f"{'alive' if alive else 'dead'})") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            detail = reply.get("error") if isinstance(reply, dict) else reply
            kind = reply.get("type") if isinstance(reply, dict) else "?"
            raise EngineProcessError(f"{self.name}: {op} failed: {kind}: {detail}")
        return reply

    def reset_prefix_cache(self) -> int:
        return int(self.call("reset_prefix_cache")["blocks"])

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout_s: float = 15.0) -> int | None:
        """Shut the engine down (bounded). Returns the exit code."""
        if self._sock is not None and self._proc.poll() is None:
            with contextlib.suppress(EngineProcessError):
                self.call("shutdown")
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._context.term()
        return self._proc.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_pd_processes(requests: list[RequestSpec], producer: EngineConfig,
                     consumer: EngineConfig, *, mode: TransferMode = TransferMode.PULL,
                     timeout_s: float = 120.0, poll_interval_s: float = 0.01,
                     on_progress: Callable[[int, int], None] | None = None,
                     events: EngineEventsConfig | None = None,
                     ) -> tuple[WorkloadResult, dict[str, Any]]:
    """Producer and consumer engines in two processes, routed as a PD proxy does.

    Returns the workload result and ``{"producer": stats, "consumer": stats}``
    (each with ``idle_problems`` after the workload drained). ``on_progress(done,
    total)`` is called whenever more requests finished (for a progress line).
    ``events``: the producer publishes its KV events at ``events.for_engine(0)``,
    the consumer at ``events.for_engine(1)``.
    """
    specs = {s.request_id: s for s in requests}
    with EngineProcess(producer, name="producer",
                       events=events.for_engine(0) if events else None) as prod, \
            EngineProcess(consumer, name="consumer",
                          events=events.for_engine(1) if events else None) as cons:
        start = time.monotonic()
        if mode is TransferMode.PULL:
            prod.submit([replace(s, remote_decode=True, max_tokens=1, transfer_params=None)
                         for s in requests])
        else:
            if prod.endpoint is None or cons.endpoint is None:
                raise EngineProcessError("push mode needs both connectors to expose endpoints")
            push = []
            for s in requests:
                params = TransferParams(
                    mode=TransferMode.PUSH, producer_engine_id=prod.engine_id,
                    producer_host=prod.endpoint[0], producer_port=prod.endpoint[1],
                    producer_request_id=s.request_id, block_ids=(),
                    producer_topology=producer.topology.sizes(), num_tokens=len(s.prompt),
                    consumer_engine_id=cons.engine_id, consumer_host=cons.endpoint[0],
                    consumer_port=cons.endpoint[1], consumer_request_id=s.request_id,
                    spec_fingerprint=producer.spec.fingerprint())
                push.append(params)
            cons.submit([replace(s, transfer_params=p)
                         for s, p in zip(requests, push, strict=True)])
            prod.submit([replace(s, remote_decode=True, max_tokens=1, transfer_params=p)
                         for s, p in zip(requests, push, strict=True)])
        producer_results: list[RequestResult] = []
        results: list[RequestResult] = []
        done: set[str] = set()
        deadline = start + timeout_s
        while len(done) < len(requests):
            if time.monotonic() > deadline:
                raise TimeoutError(f"PD processes: {len(done)}/{len(requests)} requests done "
                                   f"after {timeout_s} s")
            forward = []
            for result in prod.results():
                producer_results.append(result)
                if result.state is not RequestState.FINISHED_LENGTH:
                    results.append(result)
                    done.add(result.request_id)
                elif mode is TransferMode.PULL:
                    out = result.transfer_params
                    # the wire form a router sees, parsed again at the consumer's edge
                    forward.append(replace(specs[result.request_id], transfer_params=(
                        TransferParams.from_dict(out.to_dict()) if out else None)))
            if forward:
                cons.submit(forward)
            before = len(done)
            for result in cons.results():
                if result.request_id not in done:
                    results.append(result)
                    done.add(result.request_id)
            if on_progress is not None and len(done) != before:
                on_progress(len(done), len(requests))
            if not forward:
                time.sleep(poll_interval_s)
        elapsed = time.monotonic() - start
        # let delayed frees drain before reading the final state (bounded)
        drain_deadline = time.monotonic() + min(30.0, timeout_s)
        while True:
            prod_stats, cons_stats = prod.stats(), cons.stats()
            if (not prod_stats["idle_problems"] and not cons_stats["idle_problems"]) or \
                    time.monotonic() > drain_deadline:
                break
            time.sleep(poll_interval_s)
    workload = WorkloadResult(results=results, producer_results=producer_results,
                              wrong_outputs=check_outputs(results, requests), elapsed_s=elapsed,
                              engine_stats=cons_stats["stats"],
                              producer_stats=prod_stats["stats"])
    return workload, {"producer": prod_stats, "consumer": cons_stats}
