"""The ``nixl`` connector plugin (entry point ``kvbridge.connectors: nixl``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvbridge.connectors.api import (
    ConnectorContext,
    ConnectorPlugin,
    SchedulerConnector,
    WorkerConnector,
)
from kvbridge.connectors.config import KVRole
from kvbridge.connectors.nixl.scheduler import NixlScheduler
from kvbridge.connectors.nixl.settings import NixlSettings
from kvbridge.connectors.nixl.worker import NixlWorker


class NixlPlugin(ConnectorPlugin):
    """Prefill/decode KV transfer over NIXL (UCX): pull (consumer READs) or push (producer WRITEs).

    Extra settings: see :class:`NixlSettings` (``mode``, ``lease_s``,
    ``transfer_timeout_s``, ``handshake_timeout_s``, ``host``, ``port`` ...).
    """

    name: ClassVar[str] = "nixl"
    description: ClassVar[str] = ("NIXL prefill->decode transfer: pull (READ + notify) or push "
                                  "(WRITE per layer), leases, deadlines, heterogeneous TP/PP")
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    deprecated_roles: ClassVar[frozenset[KVRole]] = frozenset({KVRole.BOTH})
    backends: ClassVar[tuple[str, ...]] = ("nixl", "zmq", "msgpack", "torch")

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> NixlSettings:
        return NixlSettings.parse(extra)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return NixlScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return NixlWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> Sequence[Any]:
        try:
            from kvbridge.connectors.nixl.conformance import cases
        except ImportError:  # the conformance suite is not installed with this build
            return ()
        return cases()
