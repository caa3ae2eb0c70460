"""The NIXL prefill/decode connector: the PD core over one NIXL agent per worker rank.

The protocol, its parts and its settings are transport-neutral and live in
:mod:`kvbridge.connectors.pd`; this package is NIXL's adapter of it:
:mod:`.plugin` (the registered plugin, the transport factory and
:class:`NixlWorker`), :mod:`.faults` (fault injection for tests: a transport
wrapper that removes NIXL peers), :mod:`.conformance` (its conformance cases).
The names below are the ones users and tests have imported from here; the
``Nixl*`` records are the core's under their old names.
"""

from kvbridge.connectors.nixl.plugin import NixlPlugin, NixlTransportFactory, NixlWorker
from kvbridge.connectors.pd.leases import LeaseTable, Verdict, VerdictKind
from kvbridge.connectors.pd.scheduler import PdMetadata, PdScheduler
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.connectors.pd.state import RecvState, RecvTransfer
from kvbridge.connectors.pd.worker import TransferRecord

#: the core's classes under the names they had when they were NIXL's
NixlMetadata = PdMetadata
NixlScheduler = PdScheduler
NixlSettings = PdSettings

__all__ = [
    "LeaseTable",
    "NixlMetadata",
    "NixlPlugin",
    "NixlScheduler",
    "NixlSettings",
    "NixlTransportFactory",
    "NixlWorker",
    "RecvState",
    "RecvTransfer",
    "TransferRecord",
    "Verdict",
    "VerdictKind",
]
