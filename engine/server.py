"""One reference engine in its own process, controlled with msgpack over ZeroMQ.

Run as ``python -m kvbridge.engine.server --config JSON`` (what
:class:`kvbridge.engine.harness.EngineProcess` does). The process binds a REP
socket on 127.0.0.1 (a free port), prints one JSON line
``{"ready": true, "port": P, "engine_id": ..., "endpoint": [host, port] | null,
"events": {"endpoint", "replay_endpoint"} | null}`` on stdout, then serves
requests while stepping the engine whenever it has work.

With ``--events JSON`` (an :class:`~kvbridge.engine.kv_events.EngineEventsConfig`)
the engine publishes its KV events (block pool and connectors, one batch per
step) on a ZMQ PUB socket bound there; ``events`` in the ready line says
where (a ``*`` port resolved). Without it, events are dropped.

Control protocol (each message one msgpack map in one frame; never pickle), decoded
and bounded by :mod:`kvbridge.engine.control` before anything else happens:

* ``{"op": "info"}`` -> ``{"ok": true, "engine_id", "endpoint", "topology", "fingerprint",
  "limits"}`` (``limits``: what one message may carry, :class:`ControlLimits`)
* ``{"op": "submit", "requests": [RequestSpec.to_dict(), ...], "token"?: T}`` ->
  ``{"ok": true, "accepted": n, "token": T}`` (all or nothing: every request is
  validated before any is queued; one that could never fit the block pool is
  refused). Without ``token`` the reply carries a new one: the client's
  capability to its requests (:mod:`kvbridge.engine.owners`); with it, the
  requests join that client's.
* ``{"op": "results", "token": T}`` -> ``{"ok": true, "results": [RequestResult.to_dict(), ...]}``:
  the finished results of ``T``'s requests, each given once, to nobody else
* ``{"op": "abort", "request_id": id, "token": T}`` -> ``{"ok": true, "aborted": bool}``
  (a request of another client is an error)
* ``{"op": "stats"}`` -> ``{"ok": true, "stats": {...}, "idle_problems": [...]}``
* ``{"op": "reset_prefix_cache"}`` -> ``{"ok": true, "blocks": n}`` (unreferenced cached
  blocks forgotten; published as ``AllBlocksCleared`` when none is left)
* ``{"op": "shutdown"}`` -> ``{"ok": true}``, then the engine shuts down and the process exits.

Errors are ``{"ok": false, "type": "ProtocolError", "error": "requests[0].prompt: reason"}``
(``type`` is the kvbridge error's class; ``InternalError`` for a bug, whose traceback
goes to the log, not to the client); the server keeps serving. A message larger than
``limits.max_message_bytes`` (plus the seal's header) is answered with the limit as
soon as its frame header arrives (``{"ok": false, "type": "ProtocolError", "error":
"message: over N bytes ...; this engine takes at most L per message ..."}``, unsealed:
nothing of it was read), and the rest of it is dropped as it arrives, never buffered
(:class:`ControlPort`). An engine process of the harness also exits when its
parent dies; ``kvbridge serve`` (``exit_with_parent=False``) does not.

What a client may do (a design choice): anyone who reaches the port may submit,
read and abort its own requests (by the token of its submits), read stats and
reset the prefix cache -- the port is a router's, firewall it to the routers you
trust; the port does not authenticate its clients.
Bounds hold per message and per connection (one message in progress of at most
``max_message_bytes`` and the seal, in at most ``MAX_CONTROL_FRAMES`` frames, the
whole message bounded, not each frame) and per client population
(``MAX_CONTROL_CONNECTIONS``).
``shutdown`` is honoured when ``allow_shutdown`` (the default for the engine
processes a harness starts; ``kvbridge serve`` decides by its listening address).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack
import zmq

import kvbridge.backends  # noqa: F401  (UCX/NIXL env defaults before any agent exists)
from kvbridge.auth import (
    HEADER_BYTES,
    AuthError,
    ClusterAuth,
    Label,
    check_bind,
    is_sealed,
    resolve_auth,
)
from kvbridge.connectors import ConfigError, ConnectorConfig
from kvbridge.connectors.errors import KVBridgeError
from kvbridge.engine.control import (
    Abort,
    ControlLimits,
    ControlMessage,
    Info,
    ProtocolError,
    ResetPrefixCache,
    Results,
    Shutdown,
    Stats,
    Submit,
    TransferRecords,
    decode_frames,
    decode_message,
)
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.kv_events import EngineEventsConfig, active_publishing
from kvbridge.engine.owners import ResultOwners
from kvbridge.events import EventSink, KVEventPublisher, NullEventSink
from kvbridge.handshake.zmtp import (
    Oversized,
    ZmtpConnection,
    ZmtpError,
    server_greeting,
)
from kvbridge.handshake.zmtp import encode_message as zmtp_message
from kvbridge.layouts import KVCacheSpec, LayoutError, ParallelTopology, load_spec
from kvbridge.layouts.kv_memory import guard_from_env

logger = logging.getLogger(__name__)


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    """Plain form of an :class:`EngineConfig` (inverse: :func:`config_from_dict`)."""
    return {
        "spec": config.spec.to_dict(),
        "topology": config.topology.sizes().to_dict(),
        "num_blocks": config.num_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "connector": config.connector.to_dict() if config.connector else None,
        "enable_prefix_caching": config.enable_prefix_caching,
        "verify_loads": config.verify_loads,
        "remote_kv_timeout_s": config.remote_kv_timeout_s,
        "engine_id": config.engine_id,
        "enable_kv_cache_events": config.enable_kv_cache_events,
        "sorted_allocation": config.sorted_allocation,
        "device": config.device,
        "kv_host_guard": config.kv_host_guard,
    }


def config_from_dict(data: dict[str, Any]) -> EngineConfig:
    spec_data = data["spec"]
    spec = load_spec(spec_data) if isinstance(spec_data, str) else KVCacheSpec.from_dict(spec_data)
    connector = data.get("connector")
    return EngineConfig(
        spec=spec,
        topology=ParallelTopology.from_dict(data.get("topology", {})),
        num_blocks=int(data.get("num_blocks", 256)),
        max_num_batched_tokens=int(data.get("max_num_batched_tokens", 512)),
        max_num_seqs=int(data.get("max_num_seqs", 32)),
        connector=ConnectorConfig.from_dict(connector) if connector else None,
        enable_prefix_caching=bool(data.get("enable_prefix_caching", True)),
        verify_loads=bool(data.get("verify_loads", True)),
        remote_kv_timeout_s=float(data.get("remote_kv_timeout_s", 60.0)),
        engine_id=data.get("engine_id"),
        enable_kv_cache_events=bool(data.get("enable_kv_cache_events", False)),
        sorted_allocation=bool(data.get("sorted_allocation", True)),
        device=str(data.get("device", "cpu")),
        kv_host_guard=bool(data.get("kv_host_guard", guard_from_env())),
    )


#: Control clients connected at once; one more is disconnected at once. Each holds at
#: most one message in progress (``max_message_bytes`` and the seal), so this bounds
#: what the port can make the engine buffer.
MAX_CONTROL_CONNECTIONS = 256
#: Frames in one control message: a REQ client's empty delimiter and the map; more
#: (up to this) are answered with an error, past it the client is disconnected.
MAX_CONTROL_FRAMES = 16
#: Chunks read from the control socket per turn of the serving loop (libzmq hands a
#: STREAM socket's bytes over in chunks of up to 8 KiB), so a flood cannot keep the
#: engine from stepping.
CONTROL_READS_PER_TURN = 256


class ControlPort:
    """The control port's socket: ZeroMQ REQ and DEALER clients, ZMTP framed here.

    libzmq owns TCP (a STREAM socket); :mod:`kvbridge.handshake.zmtp` frames each
    client's bytes, so a message over the bound is seen on its frame header: it is
    answered with the limit at once and the rest of it dropped as it arrives (a REP
    socket with ``MAXMSGSIZE`` dropped it with its connection, and the client only saw
    its own timeout). A reply goes back with the envelope its request came with.
    """

    def __init__(self, context: zmq.Context[Any], limits: ControlLimits) -> None:
        self.limits = limits
        #: a sealed message carries the seal's header on top of the body's bound
        self.max_frame_bytes = limits.max_message_bytes + HEADER_BYTES
        self.socket: zmq.Socket[Any] = context.socket(zmq.STREAM)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 64)   # chunks of <= 8 KiB, per connection
        self._peers: dict[bytes, ZmtpConnection] = {}
        #: counters a test can read
        self.oversized_answered = 0
        self.peers_dropped = 0

    def bind(self, host: str, port: int) -> int:
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            return port
        return int(self.socket.bind_to_random_port(f"tcp://{host}"))

    def receive(self) -> list[tuple[bytes, list[bytes] | Oversized]]:
        """What clients sent since the last call: (client, the message's frames, or an
        :class:`Oversized` to answer with the limit), at most ``CONTROL_READS_PER_TURN``
        chunks' worth."""
        out: list[tuple[bytes, list[bytes] | Oversized]] = []
        for _ in range(CONTROL_READS_PER_TURN):
            try:
                peer, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:   # not [id, data]: cannot come from a STREAM socket
                continue
            conn = self._peers.get(peer)
            if conn is None:
                if not data:     # a new connection (an empty chunk announces it)
                    if len(self._peers) >= MAX_CONTROL_CONNECTIONS:
                        self._disconnect(peer, "too many connections")
                        continue
                    self._peers[peer] = ZmtpConnection(self.max_frame_bytes,
                                                       MAX_CONTROL_FRAMES,
                                                       answer_oversized=True)
                    self._send(peer, server_greeting())
                continue
            if not data:         # the client disconnected
                del self._peers[peer]
                continue
            try:
                out.extend((peer, item) for item in conn.feed_items(data))
            except ZmtpError as exc:
                self._disconnect(peer, str(exc))
        return out

    def reply(self, peer: bytes, envelope: Sequence[bytes], data: bytes) -> None:
        self._send(peer, zmtp_message([*envelope, data]))

    def _disconnect(self, peer: bytes, reason: str) -> None:
        self._peers.pop(peer, None)
        self.peers_dropped += 1
        logger.debug("control port: disconnecting a client: %s", reason)
        self._send(peer, b"")    # an empty send closes a STREAM connection

    def _send(self, peer: bytes, data: bytes) -> None:
        try:
            self.socket.send_multipart([peer, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:   # a client not reading (high-water mark), or gone
            logger.debug("control port: a reply was dropped: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)


def _split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(envelope, body) of a client's message: a REQ client (or a DEALER speaking to a
    REP) puts an empty delimiter before the body."""
    try:
        split = frames.index(b"") + 1
    except ValueError:
        split = 0
    return frames[:split], frames[split:]


def _refuse_oversized(over: Oversized, port: ControlPort) -> bytes:
    """The answer to a message over the bound, sent before its body is read (so never
    sealed: nothing of it was authenticated; it tells no more than ``info`` does)."""
    limit = port.limits.max_message_bytes
    return msgpack.packb(_error("ProtocolError", f"message: over {port.max_frame_bytes} "
                                f"bytes ({over.announced_bytes} announced, not read); this "
                                f"engine takes at most {limit} per message (split the "
                                f"submit)"), use_bin_type=True)

#: How long the control loop waits between steps that made no progress (see ``serve``).
IDLE_STEP_WAIT_MS = 1


def _transfer_records(engine: Engine) -> list[dict[str, Any]]:
    """Every rank's finished transfers, for connectors that keep them (``records()``).

    Start times are this process's ``time.monotonic()``, shared by all its ranks,
    so a client can merge the intervals into the time anything was in flight."""
    out: list[dict[str, Any]] = []
    for worker in engine.workers:
        records = getattr(worker.connector, "records", None)
        if not callable(records):
            continue
        for r in records():
            out.append({"worker": worker.worker_index, "request_id": str(r.request_id),
                        "ok": bool(r.ok), "nbytes": int(r.nbytes),
                        "duration_s": float(r.duration_s),
                        "started_at": float(getattr(r, "started_at", 0.0))})
    return out


_OWNERS: weakref.WeakKeyDictionary[Engine, ResultOwners] = weakref.WeakKeyDictionary()


def owners_of(engine: Engine) -> ResultOwners:
    """The control clients' ownership of ``engine``'s requests (one per engine)."""
    owners = _OWNERS.get(engine)
    if owners is None:
        owners = _OWNERS[engine] = ResultOwners()
    return owners


def _handle(engine: Engine, message: Any,
            limits: ControlLimits | None = None) -> tuple[dict[str, Any], bool]:
    """One unpacked control map -> (reply, stop). Never raises for what a client sent."""
    try:
        decoded = decode_message(message, limits or engine.control_limits())
    except ProtocolError as exc:
        return _error("ProtocolError", str(exc)), False
    return _run(engine, decoded, limits)


def _handle_frames(engine: Engine, frames: list[bytes], limits: ControlLimits, *,
                   allow_shutdown: bool = True) -> tuple[dict[str, Any], bool]:
    """One ZeroMQ message as received (every frame) -> (reply, stop)."""
    try:
        decoded = decode_frames(frames, limits)
    except ProtocolError as exc:
        return _error("ProtocolError", str(exc)), False
    if isinstance(decoded, Shutdown) and not allow_shutdown:
        return _error("ProtocolError", "op: shutdown is not accepted over this control port "
                                       "(it listens beyond loopback); stop the engine with "
                                       "SIGTERM or Ctrl-C, or start `kvbridge serve` with "
                                       "--allow-remote-shutdown"), False
    return _run(engine, decoded, limits)


def _answer(engine: Engine, frames: list[bytes], limits: ControlLimits,
            auth: ClusterAuth | None, allow_shutdown: bool) -> tuple[bytes, bool]:
    """The reply bytes to one received message (sealed for a member) and whether to stop."""
    if auth is None:
        if len(frames) == 1 and is_sealed(frames[0]):
            refusal = _error("AuthError", "this engine has no cluster secret configured")
            return msgpack.packb(refusal, use_bin_type=True), False
        reply, stop = _handle_frames(engine, frames, limits, allow_shutdown=allow_shutdown)
        return msgpack.packb(reply, use_bin_type=True), stop
    if len(frames) != 1:
        refusal = _error("AuthError", f"authentication required: expected one sealed frame, "
                                      f"got {len(frames)}")
        return msgpack.packb(refusal, use_bin_type=True), False
    try:
        opened = auth.open_request(Label.CONTROL, frames[0])
    except AuthError as exc:
        return msgpack.packb(_error("AuthError", exc.reason), use_bin_type=True), False
    reply, stop = _handle_frames(engine, [opened.body], limits, allow_shutdown=allow_shutdown)
    return auth.seal_reply(Label.CONTROL, opened.nonce,
                           msgpack.packb(reply, use_bin_type=True)), stop


def _error(kind: str, text: str) -> dict[str, Any]:
    return {"ok": False, "type": kind, "error": text}


def _run(engine: Engine, message: ControlMessage,
         limits: ControlLimits | None) -> tuple[dict[str, Any], bool]:
    """Carry out one decoded message. An error the engine raises names its field (kvbridge
    errors do); anything else is a bug: logged with its traceback, answered without it."""
    try:
        if isinstance(message, Info):
            endpoint = engine.endpoint()
            return {"ok": True, "engine_id": engine.engine_id,
                    "endpoint": list(endpoint) if endpoint else None,
                    "topology": engine.sizes.to_dict(),
                    "fingerprint": engine.spec.fingerprint(),
                    "limits": (limits or engine.control_limits()).to_dict()}, False
        owners = owners_of(engine)
        if isinstance(message, Submit | Results | Abort) and message.token is not None \
                and not owners.valid(message.token):
            return _error("ProtocolError", "token: not issued by this engine (a submit "
                                           "without a token gets one)"), False
        if isinstance(message, Submit):
            for index, spec in enumerate(message.requests):  # all or nothing
                try:
                    engine.check_request(spec)
                except (KVBridgeError, LayoutError) as exc:
                    raise type(exc)(f"requests[{index}].{exc.field}", exc.reason) from None
            token = message.token or owners.issue()
            for spec in message.requests:
                engine.add_request(spec)
            owners.submitted(token, (spec.request_id for spec in message.requests))
            return {"ok": True, "accepted": len(message.requests), "token": token}, False
        if isinstance(message, Results):
            owners.collect(engine.pop_results())
            return {"ok": True, "results": [r.to_dict() for r in owners.take(message.token)]
                    }, False
        if isinstance(message, Abort):
            owner = owners.owner(message.request_id)
            if owner is not None and owner != message.token:
                return _error("ProtocolError", f"request_id: {message.request_id[:64]!r} "
                                               f"was submitted by another client"), False
            return {"ok": True, "aborted": owner is not None
                    and engine.abort(message.request_id)}, False
        if isinstance(message, Stats):
            return {"ok": True, "stats": engine.stats(),
                    "idle_problems": engine.idle_problems()}, False
        if isinstance(message, TransferRecords):
            return {"ok": True, "records": _transfer_records(engine)}, False
        if isinstance(message, ResetPrefixCache):
            return {"ok": True, "blocks": engine.reset_prefix_cache()}, False
        if isinstance(message, Shutdown):
            return {"ok": True}, True
        raise AssertionError(f"unhandled control message {message!r}")
    except (KVBridgeError, LayoutError) as exc:  # they name the field
        return _error(type(exc).__name__, str(exc)), False
    except Exception as exc:  # the server keeps serving after a bad request
        logger.exception("engine %s: %s failed", engine.engine_id, type(message).__name__)
        return _error("InternalError", f"{type(message).__name__.lower()}: internal error "
                                       f"({type(exc).__name__}); see the engine's log"), False


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0,
          ready_stream: Any = None, events: EngineEventsConfig | None = None,
          event_sink: EventSink | None = None, allow_shutdown: bool = True,
          exit_with_parent: bool = True, auth: ClusterAuth | None = None,
          insecure_no_auth: bool = False) -> None:
    """Run the engine and its control socket until a ``shutdown`` op or parent death.

    ``auth``: the cluster secret's seal (:mod:`kvbridge.auth`). With it, every
    control message must be sealed with it (a fresh nonce each, within the clock
    window) and every reply is sealed bound to its request; anything else gets
    one unsealed ``AuthError`` reply and is not decoded. Without it the control
    port binds loopback only, unless ``insecure_no_auth``.

    ``exit_with_parent=False`` (``kvbridge serve``, an operator's process that may
    outlive the shell that started it): keep serving when the parent exits.

    ``allow_shutdown=False``: a ``shutdown`` op gets an error reply (stop the
    process with a signal instead).

    KV events go to ``event_sink`` (the caller closes it; a ``KVEventPublisher``
    given here is announced in the ready line), or to a publisher the engine
    binds at ``events`` or, inside ``publish_engine_events``, at the next
    engine's endpoints (closed at shutdown), or nowhere. Each but the last turns
    the block pool's events on. Nothing accumulates in memory in a long run.
    """
    try:  # before the engine exists: a refused bind allocates nothing
        check_bind(host, auth is not None, insecure_no_auth, "the control port")
    except ValueError as exc:
        raise ConfigError("control_port", str(exc)) from None
    parent = os.getppid()
    if event_sink is not None:
        config = replace(config, enable_kv_cache_events=True)
    elif events is None and active_publishing() is None:
        event_sink = NullEventSink()
    engine = Engine(config, event_sink, events=events, keep_events=False)
    publisher = engine.publisher or (event_sink if isinstance(event_sink, KVEventPublisher)
                                     else None)
    limits = engine.control_limits()
    context = zmq.Context()
    control = ControlPort(context, limits)
    try:
        try:
            port = control.bind(host, port)
        except zmq.ZMQError as exc:
            raise ConfigError("control_port", f"cannot listen on tcp://{host}:{port or '*'}: "
                                              f"{exc.strerror}; choose a free port") from None
        endpoint = engine.endpoint()
        line = json.dumps({"ready": True, "port": port, "engine_id": engine.engine_id,
                           "endpoint": list(endpoint) if endpoint else None,
                           "events": ({"endpoint": publisher.endpoint,
                                       "replay_endpoint": publisher.replay_endpoint}
                                      if publisher is not None else None)})
        stream = ready_stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()
        poller = zmq.Poller()
        poller.register(control.socket, zmq.POLLIN)
        last_parent_check = time.monotonic()
        stalled = False  # the last step scheduled nothing and finished nothing
        while True:
            # A busy engine whose requests all wait (for remote KV, a handshake, a
            # peer's ack) must not spin: a 0 ms poll loop holds the GIL, so the
            # connector's handshake and pump threads only get it at the interpreter's
            # switch interval (5 ms per hand-off), and it takes a core from the
            # peer engine. Waiting up to IDLE_STEP_WAIT_MS on the control socket
            # releases both and still wakes at once on a control message.
            busy_wait_ms = IDLE_STEP_WAIT_MS if stalled else 0
            timeout_ms = busy_wait_ms if engine.has_work() else 20
            stop = False
            if poller.poll(timeout_ms):
                for peer, message in control.receive():
                    if isinstance(message, Oversized):
                        control.oversized_answered += 1
                        # the frames before the one that went over: the envelope, and
                        # any body frames of a multipart message (not sent back)
                        envelope, _ = _split_envelope(list(message.envelope))
                        control.reply(peer, envelope, _refuse_oversized(message, control))
                        continue
                    envelope, body = _split_envelope(message)
                    out, stop = _answer(engine, body, limits, auth, allow_shutdown)
                    control.reply(peer, envelope, out)
                    if stop:
                        break
            if stop:
                break
            if engine.has_work():
                report = engine.step()
                stalled = (report.num_scheduled == 0 and not report.finished
                           and (report.output is None or report.output.is_empty))
            now = time.monotonic()
            if now - last_parent_check > 0.5:
                last_parent_check = now
                if exit_with_parent and os.getppid() != parent:
                    logger.error("engine %s: parent process died; shutting down",
                                 engine.engine_id)
                    break
    finally:
        engine.shutdown()
        control.close()
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.engine.server")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", default=None, metavar="JSON",
                        help="EngineEventsConfig as JSON: publish KV events there")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(1)  # many engine processes share few cores
    events = EngineEventsConfig.from_dict(json.loads(args.events)) if args.events else None
    # the secret of the environment the harness started us in (it seals with the same)
    serve(config_from_dict(json.loads(args.config)), port=args.port, events=events,
          auth=resolve_auth())
    return 0


if __name__ == "__main__":
    sys.exit(main())
