"""The ``nixl`` connector plugin (entry point ``kvbridge.connectors: nixl``): the PD core
(:mod:`kvbridge.connectors.pd`) over :class:`~kvbridge.backends.nixl.NixlTransport`.

Owns what is NIXL's in the PD connector: the factory that makes a rank's NIXL
agent (with its lanes), the worker class that uses it, and the plugin's name,
description and conformance cases. The protocol, the parts and the settings are
the core's.
"""

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
from kvbridge.connectors.pd.scheduler import PdScheduler
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.pd.transport import PdTransport
from kvbridge.connectors.pd.worker import PdWorker


class NixlTransportFactory:
    """Makes one rank's :class:`~kvbridge.backends.nixl.NixlTransport` (``lanes`` agents)."""

    name = "nixl"

    def __call__(self, agent_name: str, settings: PdSettings) -> PdTransport:
        from kvbridge.backends.nixl import NixlTransport  # loads NIXL: only when a rank registers

        return NixlTransport(agent_name, lanes=settings.lanes)


class NixlWorker(PdWorker):
    """One rank's PD worker over NIXL (one agent per rank, plus its lanes)."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx, NixlTransportFactory())


class NixlPlugin(ConnectorPlugin):
    """Prefill/decode KV transfer over NIXL (UCX): pull (consumer READs) or push (producer WRITEs).

    Extra settings: see :class:`~kvbridge.connectors.pd.settings.PdSettings` (``mode``,
    ``lease_s``, ``transfer_timeout_s``, ``handshake_timeout_s``, ``host``, ``port`` ...).
    """

    name: ClassVar[str] = "nixl"
    description: ClassVar[str] = ("NIXL prefill->decode transfer: pull (READ + notify) or push "
                                  "(WRITE per layer), leases, deadlines, heterogeneous TP/PP")
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    deprecated_roles: ClassVar[frozenset[KVRole]] = frozenset({KVRole.BOTH})
    backends: ClassVar[tuple[str, ...]] = ("nixl", "zmq", "msgpack", "torch")

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> PdSettings:
        return PdSettings.parse(extra, connector=cls.name)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return PdScheduler(ctx)

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
