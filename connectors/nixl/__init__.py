"""The NIXL prefill/decode connector: pull and push over one NIXL agent per worker rank.

Modules: :mod:`.settings` (extra config), :mod:`.messages` (notification
records), :mod:`.routing` (pure index math), :mod:`.leases` (pure lease
bookkeeping), :mod:`.state` (per-request receive state machine),
:mod:`.session` (handshaken peers), :mod:`.verify` (pure digest planning and
checks), :mod:`.transport` (what the connector needs of a transport, a
protocol), :mod:`.observe` (the worker's observer protocol, for tracing),
:mod:`.scheduler` and :mod:`.worker` (the two halves; the worker is a facade
over its parts: :mod:`.worker_state` (their shared context), :mod:`.sessions`,
:mod:`.loads`, :mod:`.load_checks`, :mod:`.push_consumer`, :mod:`.holds`,
:mod:`.hold_digests`, :mod:`.push`, :mod:`.pump`), :mod:`.faults` (fault
injection for tests, a transport wrapper), :mod:`.conformance` (its conformance
cases), :mod:`.plugin` (the registered plugin).
"""

from kvbridge.connectors.nixl.leases import LeaseTable, Verdict, VerdictKind
from kvbridge.connectors.nixl.plugin import NixlPlugin
from kvbridge.connectors.nixl.scheduler import NixlMetadata, NixlScheduler
from kvbridge.connectors.nixl.settings import NixlSettings
from kvbridge.connectors.nixl.state import RecvState, RecvTransfer
from kvbridge.connectors.nixl.worker import NixlWorker, TransferRecord

__all__ = [
    "LeaseTable",
    "NixlMetadata",
    "NixlPlugin",
    "NixlScheduler",
    "NixlSettings",
    "NixlWorker",
    "RecvState",
    "RecvTransfer",
    "TransferRecord",
    "Verdict",
    "VerdictKind",
]
