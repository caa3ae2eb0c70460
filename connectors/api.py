"""The engine-neutral, two-sided connector API.

A connector moves KV between an engine's paged KV cache and somewhere else (a
peer engine, a store, an offload tier). It has two halves, created by its
:class:`ConnectorPlugin` from a :class:`ConnectorContext`:

* :class:`SchedulerConnector` -- one per engine, on the scheduler thread
  (single-threaded: no hook is called concurrently with another).
* :class:`WorkerConnector` -- one per worker rank; it sees that rank's KV
  tensors (see :mod:`kvbridge.layouts.spec` for the memory model).

The scheduler tells the workers what to do each step through a
:class:`ConnectorMetadata` it builds; the workers report back through a
:class:`WorkerOutput` per rank, which the engine aggregates across ranks into
one :class:`ConnectorOutput` (:class:`OutputAggregator`).

Hook order, per engine step (what ``kvbridge.engine`` does, and what a real
engine adapter must do)::

    scheduler, for each waiting request it may schedule:
        get_num_new_matched_tokens(request, num_computed)   -> (n | None, async)
            None: "ask again next step" (async lookup in flight), nothing allocated
        allocate blocks for num_computed + n (+ tokens to compute now)
        update_state_after_alloc(request, block_ids, n)     (also when n == 0)
            async == True: the request waits (WAITING_FOR_REMOTE_KVS), not computed
    scheduler: meta = build_connector_meta(step)            (exactly once per step)
    each worker rank:
        bind_connector_metadata(meta)
        start_load_kv()
        for each layer of the rank: wait_for_layer_load(layer); <compute>; save_kv_layer(layer, kv)
        wait_for_save()
        get_finished(finished_request_ids) -> (done_sending, done_recving)
        get_failed_recving(); get_block_ids_with_load_errors(); get_stats(); take_events()
        clear_connector_metadata()
    engine: aggregate the WorkerOutputs of all ranks
    scheduler: update_connector_output(output)
    scheduler, for each request that finished (or was aborted) this step:
        request_finished(request, block_ids) -> (delay_free, transfer_params)
            delay_free: blocks stay allocated until the request shows up in a
            later output's finished_sending
    scheduler: take_events()

Rules a connector can rely on and must keep:

* Every request a worker is told to load is eventually reported in
  ``finished_recving`` by *every* rank (a rank with nothing to do reports it at
  once). A failed receive is reported in ``failed_recving`` *and* is finished;
  its local blocks that were not loaded are reported in
  ``get_block_ids_with_load_errors`` the same step. The engine then
  recomputes those blocks (never trusts their bytes).
* Every request for which ``request_finished`` returned ``delay_free=True`` is
  eventually reported in ``finished_sending`` by every rank (after a peer read
  it, or after the connector's own abort timeout).
* ``block_ids`` are local block ids per region (:data:`BlockIds`); a block of
  region ``r`` covers ``ctx.block_tokens(r)`` tokens of the request.
* Nothing here imports an engine; the types are kvbridge's own.

The records live in their own modules, re-exported here (import them from
here or from :mod:`kvbridge.connectors`): :mod:`kvbridge.connectors.step`
(requests and steps, as the scheduler half sees them),
:mod:`kvbridge.connectors.context` (:class:`ConnectorContext`, :class:`KVCaches`),
:mod:`kvbridge.connectors.outputs` (worker reports and their aggregation). This
module owns the contract itself: the two halves, the plugin, and
:class:`ConnectorMetadata` (its class path is part of the metadata wire format).
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvbridge.connectors.config import ConnectorConfig, KVRole, LoadFailurePolicy
from kvbridge.connectors.context import ConnectorContext, KVCaches
from kvbridge.connectors.errors import ConfigError, ContractError, RoleError
from kvbridge.connectors.outputs import (
    BlockRef,
    ConnectorOutput,
    OutputAggregator,
    WorkerOutput,
)
from kvbridge.connectors.outputs import Stats as Stats  # public here before the split
from kvbridge.connectors.params import BlockIds, TransferMode, TransferParams
from kvbridge.connectors.step import (
    ConnectorRequest,
    ScheduledRequest,
    SchedulerStep,
    block_range,
)
from kvbridge.events import EventBuffer, KVEvent

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BlockIds",
    "BlockRef",
    "ConnectorConfig",
    "ConnectorContext",
    "ConnectorMetadata",
    "ConnectorOutput",
    "ConnectorPlugin",
    "ConnectorRequest",
    "EventBuffer",
    "KVCaches",
    "KVRole",
    "LoadFailurePolicy",
    "OutputAggregator",
    "ScheduledRequest",
    "SchedulerConnector",
    "SchedulerStep",
    "TransferMode",
    "TransferParams",
    "WorkerConnector",
    "WorkerOutput",
    "block_range",
]


class ConnectorMetadata:
    """Base of the per-step message from a scheduler connector to its workers.

    Connectors subclass it as a dataclass. The engine passes the *same* object
    to every rank of the step; workers must treat it as read-only. The
    in-process reference engine never serializes it; adapters that cross
    processes send :func:`kvbridge.connectors.metadata_wire.encode_metadata`'s
    msgpack bytes, so its fields must be of the types that codec names.
    """


# --------------------------------------------------------------------------- the two halves


class SchedulerConnector(ABC):
    """Scheduler-side half: one per engine, called from the scheduler thread only."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` this connector can provide.

        Returns ``(num_tokens, load_async)``. ``num_tokens`` None means "not
        known yet, ask again next step" (an async lookup is in flight; the
        engine allocates nothing). ``load_async`` True: the load runs across
        steps and the request waits until it is in ``finished_recving``;
        False: the load completes inside the next step's forward
        (``start_load_kv`` / ``wait_for_layer_load``). May be called again for
        the same request in later steps (until it is scheduled).
        """

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Blocks were allocated for ``request``; called once per scheduling
        decision, also when ``num_external_tokens`` is 0 (e.g. a consumer with a
        full local prefix hit must still tell the producer to free).

        ``block_ids`` hold all of the request's blocks per region; the external
        tokens are ``[request.num_computed_tokens, + num_external_tokens)``
        (see :func:`block_range`).
        """

    @abstractmethod
    def build_connector_meta(self, step: SchedulerStep) -> ConnectorMetadata:
        """Called exactly once per step, after scheduling; resets per-step state."""

    def update_connector_output(self, output: ConnectorOutput) -> None:  # noqa: B027
        """The aggregated worker results of the step just run (default: ignore)."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        """``request`` finished or was aborted. Returns ``(delay_free, transfer_params)``.

        ``block_ids`` hold valid KV for ``request.num_computed_tokens`` tokens
        (a producer that prefilled a prompt and sampled one token has
        ``num_computed_tokens == num_prompt_tokens``; the sampled token has no
        KV yet). ``delay_free`` True: the engine keeps ``block_ids`` allocated
        until every rank reports the request in ``finished_sending``.
        ``transfer_params`` (producer): what the router forwards to the consumer.
        Called exactly once per request, also for aborted ones (a consumer
        aborted before it was scheduled must still let its producer free).
        """

    def take_events(self) -> list[KVEvent]:
        """KV events produced since the last call (default: drain ``ctx.events``)."""
        return self.ctx.events.take()

    def set_handshake_metadata(self, per_worker: Mapping[int, bytes]) -> None:  # noqa: B027
        """Each worker's ``get_handshake_metadata()`` (by worker index), given once
        after the workers registered their caches, so the scheduler side can
        serve them to peers (e.g. on a side channel)."""

    def endpoint(self) -> tuple[str, int] | None:
        """``(host, port)`` where peers reach this engine's connector, if any.

        Routers use it to fill ``producer_host``/``producer_port`` (or the
        consumer fields in push mode)."""
        return None

    def get_stats(self) -> dict[str, int | float]:
        """Scheduler-side counters (plain numbers a test or the CLI can read)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Release everything (threads, sockets, registrations). Idempotent."""


class WorkerConnector(ABC):
    """Worker-side half: one per rank. Sees the rank's KV tensors."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self._metadata: ConnectorMetadata | None = None

    @abstractmethod
    def register_kv_caches(self, caches: KVCaches) -> None:
        """Called once, before the first step, with the rank's KV tensors."""

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Called at the start of each step with the scheduler half's metadata."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called at the end of each step."""
        self._metadata = None

    @property
    def connector_metadata(self) -> ConnectorMetadata:
        if self._metadata is None:
            raise ContractError("connector_metadata", "no metadata bound: hooks that read it "
                                "run between bind_connector_metadata and clear")
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads (may return before they complete)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_id: int) -> None:
        """Block until synchronous loads into ``layer_id`` are done (before it is computed)."""

    @abstractmethod
    def save_kv_layer(self, layer_id: int, kv_layer: torch.Tensor) -> None:
        """``layer_id`` was just computed for this step; ``kv_layer`` is its tensor."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are safe (the engine may overwrite blocks next)."""

    @abstractmethod
    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` request ids since the last call.

        ``finished_request_ids``: requests the scheduler finished this step.
        A failed receive is included in ``done_recving`` (and in
        :meth:`get_failed_recving`).
        """

    def get_failed_recving(self) -> set[str]:
        """Requests whose receive failed since the last call (subset of done_recving)."""
        return set()

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        """``(region_index, block_id)`` of local blocks whose load failed since the last call."""

    def get_handshake_metadata(self) -> bytes | None:
        """Opaque bytes peers need to reach this rank (e.g. a NIXL agent's metadata)."""
        return None

    def get_stats(self) -> dict[str, int | float]:
        """This rank's cumulative counters (since creation; monotonic numbers).

        Reported every step; the engine keeps each rank's latest snapshot, so
        a counter is never double-counted.
        """
        return {}

    def take_events(self) -> list[KVEvent]:
        return self.ctx.events.take()

    @abstractmethod
    def shutdown(self) -> None:
        """Release every registration, handle, socket and thread. Idempotent."""

    def collect_output(self, finished_request_ids: frozenset[str]) -> WorkerOutput:
        """Call the reporting hooks in their fixed order and pack one :class:`WorkerOutput`.

        Order: get_finished, get_failed_recving, get_block_ids_with_load_errors,
        get_stats, take_events.
        """
        done_sending, done_recving = self.get_finished(finished_request_ids)
        failed = self.get_failed_recving()
        invalid = self.get_block_ids_with_load_errors()
        index = self.ctx.worker_index if self.ctx.worker_index is not None else 0
        return WorkerOutput(
            worker_index=index,
            finished_sending=frozenset(done_sending or ()),
            finished_recving=frozenset(done_recving or ()),
            failed_recving=frozenset(failed or ()),
            invalid_block_ids=frozenset(invalid or ()),
            stats=self.get_stats(),
            events=tuple(self.take_events()),
        )


# --------------------------------------------------------------------------- plugins


class ConnectorPlugin(ABC):
    """One registered connector: how to build its two halves and what it supports.

    Register a subclass under the entry-point group ``kvbridge.connectors``
    (``name = "package.module:PluginClass"``). The registry checks the role
    against ``supported_roles`` (:class:`RoleError` if not supported) and warns
    for ``deprecated_roles``; then calls ``parse_extra(config.extra)`` once and
    puts the result in ``ConnectorContext.extra``.

    ``backends`` names what ``kvbridge doctor`` must check for this connector
    (``"torch"``, ``"zmq"``, ``"msgpack"``, ``"nixl"``, ``"mooncake"``).
    ``conformance_cases()`` returns the cases with which the conformance suite
    (``kvbridge.connectors.testing``) exercises this connector.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    deprecated_roles: ClassVar[frozenset[KVRole]] = frozenset()
    backends: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> Any:
        """Validate connector-specific config; raise :class:`ConfigError` naming the key.

        Default: the connector takes no extra settings.
        """
        if extra:
            key = sorted(extra)[0]
            raise ConfigError(f"kv_connector_extra_config.{key}",
                              f"connector {cls.name!r} takes no extra settings")
        return None

    @classmethod
    def check_role(cls, role: KVRole) -> None:
        """Raise for an unsupported role, warn for a deprecated one."""
        if role not in cls.supported_roles:
            raise RoleError("kv_role", f"connector {cls.name!r} supports "
                                       f"{sorted(r.value for r in cls.supported_roles)}, "
                                       f"not {role.value!r}")
        if role in cls.deprecated_roles:
            message = (f"kv_role {role.value!r} is deprecated for connector {cls.name!r}: "
                       f"use kv_producer on prefill engines and kv_consumer on decode engines")
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            logger.warning(message)

    @classmethod
    @abstractmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        """The scheduler-side half for one engine."""

    @classmethod
    @abstractmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        """The worker-side half for one rank (``ctx.rank`` set)."""

    @classmethod
    def conformance_cases(cls) -> Sequence[Any]:
        """``kvbridge.connectors.testing.ConformanceCase`` objects; none by default."""
        return ()
