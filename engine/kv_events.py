"""Where an engine publishes its KV events, and how a command hands that to its engines.

An engine with an :class:`EngineEventsConfig` owns a
:class:`kvbridge.events.KVEventPublisher` bound there, turns on its block
pool's events (medium GPU, as vLLM's ``enable_kv_cache_events``) and
publishes each step's events -- block pool and connectors -- as one batch.

A command that starts several engines (``kvbridge demo``: a producer and a
consumer) takes one endpoint from the operator. Every engine gets its own
publisher, as every vLLM instance does (subscribers track one sequence per
stream, so two engines cannot share one): the ``index``-th engine started
binds the endpoint with its TCP port plus ``index`` (vLLM's
``offset_endpoint_port`` for data-parallel ranks), the replay endpoint
likewise; a ``*`` port binds a free port per engine. The resolved endpoints
are reported by :class:`EnginePublishing`.

The runners behind ``kvbridge demo`` build their engines themselves, so
:func:`publish_engine_events` sets a process-wide default for the duration
of a ``with`` block: every :class:`~kvbridge.engine.core.Engine` built in
this process and every :class:`~kvbridge.engine.harness.EngineProcess`
started in it without an explicit event sink publishes at the next offset.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvbridge.auth import BindRefused, insecure_from_env, resolve_auth
from kvbridge.connectors import ConfigError
from kvbridge.events import KVEventPublisher, PublisherConfig

_TCP = re.compile(r"^tcp://(?P<host>.+):(?P<port>\*|\d{1,5})$")


def offset_endpoint(endpoint: str, index: int) -> str:
    """``endpoint`` for the ``index``-th engine: TCP port + index (``*`` stays ``*``),
    ``ipc://`` and ``inproc://`` names get ``-index`` appended (index 0: unchanged)."""
    if index < 0:
        raise ValueError(f"index: expected >= 0, got {index}")
    match = _TCP.match(endpoint)
    if match is not None:
        port = match.group("port")
        if port != "*" and not 0 < int(port) <= 65535:
            raise ConfigError("events_endpoint", f"{endpoint}: port outside 1..65535")
        if port == "*" or index == 0:
            return endpoint
        new_port = int(port) + index
        if new_port > 65535:
            raise ConfigError("events_endpoint", f"{endpoint}: port + {index} exceeds 65535")
        return f"tcp://{match.group('host')}:{new_port}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if index == 0 else f"{endpoint}-{index}"
    raise ConfigError("events_endpoint", f"expected tcp://HOST:PORT (PORT may be *), ipc://PATH "
                                         f"or inproc://NAME, got {endpoint!r}")


def _fixed(endpoint: str) -> bool:
    """An endpoint that names one address (two engines binding it would collide)."""
    return not endpoint.endswith(":*")


@dataclass(frozen=True)
class EngineEventsConfig:
    """Where one engine (or, through :meth:`for_engine`, a group of engines) publishes.

    ``endpoint``: the PUB socket (bound). ``replay_endpoint``: the replay
    ROUTER (bound), or None for none. ``topic``: the first frame of every
    message (vLLM's default is empty). ``close_timeout_s``: how long shutdown
    waits for queued batches to go out.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        offset_endpoint(self.endpoint, 0)  # validates the scheme
        if self.replay_endpoint is not None:
            try:
                offset_endpoint(self.replay_endpoint, 0)
            except ConfigError as exc:
                raise ConfigError("events_replay_endpoint", exc.reason) from None
            if _fixed(self.endpoint) and self.endpoint == self.replay_endpoint:
                raise ConfigError("events_replay_endpoint",
                                  f"{self.replay_endpoint} is also the events endpoint; the "
                                  f"PUB and replay ROUTER sockets need different addresses")
        if self.close_timeout_s < 0:
            raise ConfigError("close_timeout_s", "expected >= 0 seconds")

    def for_engine(self, index: int) -> EngineEventsConfig:
        """The endpoints of the ``index``-th engine of a command (see the module docs)."""
        replay = (offset_endpoint(self.replay_endpoint, index)
                  if self.replay_endpoint is not None else None)
        return EngineEventsConfig(offset_endpoint(self.endpoint, index), replay, self.topic,
                                  self.close_timeout_s)

    def endpoints(self) -> tuple[str, ...]:
        return (self.endpoint,) if self.replay_endpoint is None else (
            self.endpoint, self.replay_endpoint)

    def publisher_config(self) -> PublisherConfig:
        return PublisherConfig(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                               topic=self.topic)

    def make_publisher(self) -> KVEventPublisher:
        """A publisher bound here; ConfigError naming the endpoint it cannot bind."""
        try:
            # the replay socket takes the cluster secret of the environment (kvbridge.auth)
            return KVEventPublisher(self.publisher_config(), auth=resolve_auth(),
                                    insecure_no_auth=insecure_from_env())
        except BindRefused as exc:
            raise ConfigError("events_replay_endpoint", str(exc)) from None
        except zmq.ZMQError as exc:
            # pyzmq names the address in the message: which of the two binds failed
            replay = (self.replay_endpoint is not None
                      and f"addr='{self.replay_endpoint}'" in str(exc))
            field_name = "events_replay_endpoint" if replay else "events_endpoint"
            where = self.replay_endpoint if replay else self.endpoint
            reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise ConfigError(field_name, f"cannot bind {where}: {reason}; "
                                          f"give an address of this host and a free "
                                          f"port") from None

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic, "close_timeout_s": self.close_timeout_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineEventsConfig:
        if not isinstance(data.get("endpoint"), str):
            raise ConfigError("events.endpoint", "expected a ZMQ endpoint string")
        return cls(endpoint=data["endpoint"], replay_endpoint=data.get("replay_endpoint"),
                   topic=str(data.get("topic", "")),
                   close_timeout_s=float(data.get("close_timeout_s", 5.0)))


@dataclass(frozen=True)
class PublishedEngine:
    """One engine that publishes its events: where a subscriber connects."""

    name: str
    engine_id: str
    endpoint: str
    replay_endpoint: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "engine_id": self.engine_id, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint}


@dataclass
class EnginePublishing:
    """Hands out per-engine endpoints in start order and records where each engine
    ended up (a ``*`` port resolves to the port bound)."""

    base: EngineEventsConfig
    engines: list[PublishedEngine] = field(default_factory=list)
    #: called with each engine as it starts publishing (e.g. to tell the operator where)
    on_record: Callable[[PublishedEngine], None] | None = None
    _next_index: int = 0
    _taken: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def assign(self) -> EngineEventsConfig:
        """The next engine's endpoints. Raises :class:`ConfigError` when an offset
        endpoint is one an earlier engine already binds (e.g. the replay port is
        the events port + 1 and a second engine starts)."""
        with self._lock:
            index = self._next_index
            config = self.base.for_engine(index)
            for endpoint in config.endpoints():
                if _fixed(endpoint) and endpoint in self._taken:
                    raise ConfigError("events_replay_endpoint",
                                      f"engine {index} would bind {endpoint}, which engine "
                                      f"{self._taken[endpoint]} already binds (each engine "
                                      f"adds its index to both ports): choose a replay port "
                                      f"further from the events port, or port *")
            for endpoint in config.endpoints():
                self._taken[endpoint] = index
            self._next_index += 1
            return config

    def record(self, name: str, engine_id: str, endpoint: str,
               replay_endpoint: str | None) -> None:
        engine = PublishedEngine(name, engine_id, endpoint, replay_endpoint)
        with self._lock:
            self.engines.append(engine)
        if self.on_record is not None:
            self.on_record(engine)

    def summary(self) -> list[dict[str, Any]]:
        with self._lock:
            return [engine.to_dict() for engine in self.engines]


_active: EnginePublishing | None = None
_active_lock = threading.Lock()


def active_publishing() -> EnginePublishing | None:
    """The publishing default of the enclosing :func:`publish_engine_events`, if any."""
    return _active


@contextmanager
def publish_engine_events(config: EngineEventsConfig) -> Iterator[EnginePublishing]:
    """Within the block, engines built without an explicit sink publish per ``config``
    (the ``i``-th at ``config.for_engine(i)``). Not nestable."""
    global _active
    publishing = EnginePublishing(config)
    with _active_lock:
        if _active is not None:
            raise RuntimeError("publish_engine_events: already active in this process")
        _active = publishing
    try:
        yield publishing
    finally:
        with _active_lock:
            _active = None
