"""The ``mooncake_te`` connector plugin (entry point ``kvbridge.connectors: mooncake_te``).

Owns what is Mooncake's in this PD connector: the factory that makes a rank's
transfer engine, the worker class that refuses KV the engine cannot move
(GPU memory), the settings it cannot honour (``lanes`` above 1), and the
plugin's name, description and conformance cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvbridge.connectors.api import (
    ConnectorContext,
    ConnectorPlugin,
    KVCaches,
    SchedulerConnector,
    WorkerConnector,
)
from kvbridge.connectors.config import KVRole
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.pd.scheduler import PdScheduler
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.pd.transport import PdTransport
from kvbridge.connectors.pd.worker import PdWorker


class MooncakeTeTransportFactory:
    """Makes one rank's :class:`~kvbridge.backends.mooncake.te.MooncakeTeTransport`."""

    name = "mooncake_te"

    def __call__(self, agent_name: str, settings: PdSettings) -> PdTransport:
        from kvbridge.backends.mooncake.te import MooncakeTeTransport  # loads Mooncake late

        return MooncakeTeTransport(agent_name)


class MooncakeTeWorker(PdWorker):
    """One rank's PD worker over Mooncake's transfer engine (host memory only)."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx, MooncakeTeTransportFactory())

    def register_kv_caches(self, caches: KVCaches) -> None:
        on_device = sorted({str(t.device) for t in caches.layers.values()
                            if t.device.type != "cpu"})
        if on_device:
            raise ConfigError("kv_connector", f"connector 'mooncake_te' moves host memory only; "
                                              f"this rank's KV is on {on_device} (use 'nixl')")
        super().register_kv_caches(caches)


class MooncakeTePlugin(ConnectorPlugin):
    """Prefill/decode KV transfer over Mooncake's transfer engine (tcp): pull or push.

    Extra settings: those of :class:`~kvbridge.connectors.pd.settings.PdSettings`, except
    ``lanes``, which is 1 (one engine per rank; TE has its own threads).
    """

    name: ClassVar[str] = "mooncake_te"
    description: ClassVar[str] = ("Mooncake transfer engine prefill->decode transfer (host "
                                  "memory, tcp): pull or push, leases, deadlines, "
                                  "heterogeneous TP/PP")
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    deprecated_roles: ClassVar[frozenset[KVRole]] = frozenset({KVRole.BOTH})
    backends: ClassVar[tuple[str, ...]] = ("mooncake", "zmq", "msgpack", "torch")

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> PdSettings:
        lanes = extra.get("lanes", 1)
        if lanes != 1 or isinstance(lanes, bool):
            raise ConfigError("kv_connector_extra_config.lanes",
                              f"connector 'mooncake_te' has one engine per rank: expected 1, "
                              f"got {lanes!r}")
        settings = PdSettings.parse({k: v for k, v in extra.items() if k != "lanes"},
                                    connector=cls.name)
        return dataclasses.replace(settings, lanes=1)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return PdScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return MooncakeTeWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> Sequence[Any]:
        try:
            from kvbridge.connectors.mooncake_te.conformance import cases
        except ImportError:  # the conformance suite is not installed with this build
            return ()
        return cases()
