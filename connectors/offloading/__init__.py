"""``offloading``: the connector over the local tiered store (``kvbridge.offload``).

``kv_both`` only, best effort: prefix hits load from the store (CPU slots;
blocks found only in ``fs`` / ``obj`` are promoted into CPU first), newly
computed blocks are stored (CPU, then cascaded to every secondary tier), and a
failed load makes the engine recompute instead of failing the request. See
:mod:`.scheduler` for the hook mapping and the no-livelock argument.
"""

from kvbridge.connectors.offloading.parts import Part, PartTable, build_part_table, pool_fingerprint
from kvbridge.connectors.offloading.plugin import (
    OffloadingPlugin,
    fail_worker_loads,
    offloading_cases,
)
from kvbridge.connectors.offloading.scheduler import CopyItem, OffloadingScheduler, OffloadMetadata
from kvbridge.connectors.offloading.settings import OffloadSettings, parse_settings
from kvbridge.connectors.offloading.worker import OffloadingWorker

__all__ = [
    "CopyItem", "OffloadMetadata", "OffloadSettings", "OffloadingPlugin", "OffloadingScheduler",
    "OffloadingWorker", "Part", "PartTable", "build_part_table", "fail_worker_loads",
    "offloading_cases", "parse_settings", "pool_fingerprint",
]
