"""``multi``: several connectors in order on one engine (e.g. NIXL for PD, offloading for reuse).

Settings (``kv_connector_extra_config``)::

    {"connectors": [
        {"connector": "nixl", "extra": {...}},
        {"connector": "offloading", "role": "kv_both", "extra": {"fs_dir": "/cache"}}]}

Each child gets its own context (its own config: the engine's role unless
``role`` is given, the engine's id, its own parsed extra and event buffer).

Rules (as vLLM's MultiConnector):

* **Lookups**: every child is asked; if one answers None ("ask again") the
  answer is None; otherwise the *first* child with tokens > 0 owns the
  request's load. ``update_state_after_alloc`` gives the owner the external
  tokens and every other child 0 (so e.g. a PD consumer still frees its
  producer's blocks).
* **Saves** go to every child (each sees the whole step).
* **Outputs** are merged: receives are reported by the one child that loads;
  a request whose free was delayed by ``k`` children is reported in
  ``finished_sending`` once, after all ``k`` finished (the count travels to
  the workers in the next step's metadata); stats are prefixed with
  ``<index>.<connector>.``; events, load errors and failed receives are unions.
* ``transfer_params``: the first child's that returns some.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgpack

from kvbridge.connectors import registry
from kvbridge.connectors.api import (
    BlockIds,
    BlockRef,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorPlugin,
    ConnectorRequest,
    KVCaches,
    SchedulerConnector,
    SchedulerStep,
    WorkerConnector,
)
from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.errors import ConfigError, ContractError
from kvbridge.connectors.params import TransferParams
from kvbridge.events import EventBuffer, KVEvent

_FIELD = "kv_connector_extra_config.connectors"


@dataclass(frozen=True)
class ChildSpec:
    connector: str
    plugin: type[ConnectorPlugin]
    extra: Mapping[str, Any]
    parsed: Any
    role: KVRole | None = None


@dataclass(frozen=True)
class MultiSettings:
    children: tuple[ChildSpec, ...]


@dataclass(frozen=True)
class MultiMetadata(ConnectorMetadata):
    children: tuple[ConnectorMetadata, ...]
    #: requests whose free was delayed by more than zero children -> how many
    delayed: Mapping[str, int] = field(default_factory=dict)


def _child_context(ctx: ConnectorContext, index: int, child: ChildSpec) -> ConnectorContext:
    role = child.role or ctx.role
    child.plugin.check_role(role)
    config = ConnectorConfig(child.connector, role, engine_id=ctx.engine_id,
                             extra=dict(child.extra),
                             load_failure_policy=ctx.config.load_failure_policy)
    return replace(ctx, config=config, extra=child.parsed, events=EventBuffer())


_Half = TypeVar("_Half", SchedulerConnector, WorkerConnector)


def _create_children(ctx: ConnectorContext,
                     create: Callable[[ChildSpec, ConnectorContext], _Half]) -> list[_Half]:
    """Every child's half, in order; when one cannot be made, those made are shut down."""
    settings: MultiSettings = ctx.extra
    made: list[_Half] = []
    try:
        for index, child in enumerate(settings.children):
            made.append(create(child, _child_context(ctx, index, child)))
    except BaseException:
        for half in made:
            half.shutdown()
        raise
    return made


class MultiScheduler(SchedulerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: MultiSettings = ctx.extra
        self.names = [c.connector for c in settings.children]
        self.children: list[SchedulerConnector] = _create_children(
            ctx, lambda child, child_ctx: child.plugin.create_scheduler(child_ctx))
        self._owner: dict[str, int] = {}
        self._delayed: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = (0, False)
        owner: int | None = None
        for index, child in enumerate(self.children):
            tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                answer = (None, False)
                owner = None
                break
            if owner is None and tokens > 0:
                owner, answer = index, (tokens, load_async)
        if owner is None:
            self._owner.pop(request.request_id, None)
        else:
            self._owner[request.request_id] = owner
        return answer

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        owner = self._owner.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids,
                                           num_external_tokens if index == owner else 0)

    def build_connector_meta(self, step: SchedulerStep) -> MultiMetadata:
        metas = tuple(child.build_connector_meta(step) for child in self.children)
        delayed, self._delayed = self._delayed, {}
        return MultiMetadata(metas, delayed)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for child in self.children:
            child.update_connector_output(output)

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        self._owner.pop(request.request_id, None)
        delays = 0
        params: TransferParams | None = None
        for child in self.children:
            delay, child_params = child.request_finished(request, block_ids)
            delays += bool(delay)
            if params is None:
                params = child_params
        if delays:
            self._delayed[request.request_id] = delays
        return delays > 0, params

    def take_events(self) -> list[KVEvent]:
        events = self.ctx.events.take()
        for child in self.children:
            events.extend(child.take_events())
        return events

    def set_handshake_metadata(self, per_worker: Mapping[int, bytes]) -> None:
        split: list[dict[int, bytes]] = [{} for _ in self.children]
        for worker, blob in per_worker.items():
            for index, part in enumerate(_unpack_blobs(blob, len(self.children))):
                if part is not None:
                    split[index][worker] = part
        for child, blobs in zip(self.children, split, strict=True):
            child.set_handshake_metadata(blobs)

    def endpoint(self) -> tuple[str, int] | None:
        for child in self.children:
            found = child.endpoint()
            if found is not None:
                return found
        return None

    def get_stats(self) -> dict[str, int | float]:
        return _prefixed(self.names, [c.get_stats() for c in self.children])

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()


class MultiWorker(WorkerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: MultiSettings = ctx.extra
        self.names = [c.connector for c in settings.children]
        self.children: list[WorkerConnector] = _create_children(
            ctx, lambda child, child_ctx: child.plugin.create_worker(child_ctx))
        self._expected: dict[str, int] = {}   # delayed request -> children that delay it
        self._sent: dict[str, int] = {}       # delayed request -> children that reported it
        self._closed = False

    def register_kv_caches(self, caches: KVCaches) -> None:
        for child in self.children:
            child.register_kv_caches(caches)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if not isinstance(metadata, MultiMetadata) or \
                len(metadata.children) != len(self.children):
            raise ContractError("metadata", "expected a MultiMetadata with one entry per child")
        for request_id, count in metadata.delayed.items():
            self._expected[request_id] = count
        for child, meta in zip(self.children, metadata.children, strict=True):
            child.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        for child in self.children:
            child.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        for child in self.children:
            child.start_load_kv()

    def wait_for_layer_load(self, layer_id: int) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_id)

    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None:
        for child in self.children:
            child.save_kv_layer(layer_id, kv_layer)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        for child in self.children:
            sending, recving = child.get_finished(finished_request_ids)
            for request_id in sending or ():
                self._sent[request_id] = self._sent.get(request_id, 0) + 1
            done_recving |= set(recving or ())
        for request_id, count in list(self._sent.items()):
            expected = self._expected.get(request_id)
            if expected is not None and count >= expected:
                del self._sent[request_id]
                del self._expected[request_id]
                done_sending.add(request_id)
        return done_sending, done_recving

    def get_failed_recving(self) -> set[str]:
        out: set[str] = set()
        for child in self.children:
            out |= set(child.get_failed_recving() or ())
        return out

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        out: set[BlockRef] = set()
        for child in self.children:
            out |= set(child.get_block_ids_with_load_errors() or ())
        return out

    def get_handshake_metadata(self) -> bytes | None:
        blobs = [child.get_handshake_metadata() for child in self.children]
        if all(b is None for b in blobs):
            return None
        packed: bytes = msgpack.packb(blobs, use_bin_type=True)
        return packed

    def get_stats(self) -> dict[str, int | float]:
        return _prefixed(self.names, [c.get_stats() for c in self.children])

    def take_events(self) -> list[KVEvent]:
        events = self.ctx.events.take()
        for child in self.children:
            events.extend(child.take_events())
        return events

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for child in self.children:
            child.shutdown()


def _unpack_blobs(blob: bytes, count: int) -> list[bytes | None]:
    try:
        parts = msgpack.unpackb(blob, raw=False)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ContractError("handshake_metadata", f"not a multi connector blob: {exc}") from None
    if not isinstance(parts, list) or len(parts) != count or \
            not all(p is None or isinstance(p, bytes) for p in parts):
        raise ContractError("handshake_metadata",
                            f"expected a list of {count} byte strings or nils")
    return parts


def _prefixed(names: Sequence[str], stats: Sequence[Mapping[str, int | float]]
              ) -> dict[str, int | float]:
    out: dict[str, int | float] = {}
    for index, (name, child) in enumerate(zip(names, stats, strict=True)):
        for key, value in child.items():
            out[f"{index}.{name}.{key}"] = value
    return out


class MultiPlugin(ConnectorPlugin):
    name = "multi"
    description = "several connectors in order: first lookup hit loads, saves go to all"
    supported_roles = frozenset(KVRole)
    backends = ()

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> MultiSettings:
        unknown = sorted(set(extra) - {"connectors"})
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}",
                              "unknown setting; expected 'connectors'")
        items = extra.get("connectors")
        if not isinstance(items, list | tuple) or not items:
            raise ConfigError(_FIELD, "expected a non-empty list of {connector, extra, role}")
        children = []
        for index, item in enumerate(items):
            name = f"{_FIELD}[{index}]"
            if not isinstance(item, Mapping):
                raise ConfigError(name, f"expected an object, got {item!r}")
            bad = sorted(set(item) - {"connector", "extra", "role"})
            if bad:
                raise ConfigError(f"{name}.{bad[0]}", "unknown key; expected connector, "
                                                      "extra or role")
            connector = item.get("connector")
            if not isinstance(connector, str) or not connector:
                raise ConfigError(f"{name}.connector", "expected a registered connector name")
            if connector == cls.name:
                raise ConfigError(f"{name}.connector", "a multi connector cannot nest itself")
            child_extra = item.get("extra", {})
            if not isinstance(child_extra, Mapping):
                raise ConfigError(f"{name}.extra", "expected an object")
            role = KVRole.parse(item["role"], f"{name}.role") if "role" in item else None
            plugin = registry.load(connector)
            try:
                parsed = plugin.parse_extra(child_extra)
            except ConfigError as exc:
                sub = exc.field.removeprefix("kv_connector_extra_config.")
                raise ConfigError(f"{name}.extra.{sub}", exc.reason) from None
            children.append(ChildSpec(connector, plugin, dict(child_extra), parsed, role))
        return MultiSettings(tuple(children))

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return MultiScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return MultiWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> tuple[Any, ...]:
        from kvbridge.connectors.offloading.plugin import multi_cases

        return multi_cases()
