"""The two-sided connector API, its registry, and kvbridge's connector plugins.

Import the API from here::

    from kvbridge.connectors import (ConnectorPlugin, SchedulerConnector,
                                     WorkerConnector, ConnectorConfig, TransferParams)

See :mod:`kvbridge.connectors.api` for the hooks and the order an engine calls
them in, and :mod:`kvbridge.connectors.registry` for how plugins are found.
"""

from kvbridge.connectors.api import (
    BlockIds,
    BlockRef,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorPlugin,
    ConnectorRequest,
    EventBuffer,
    KVCaches,
    OutputAggregator,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerStep,
    WorkerConnector,
    WorkerOutput,
    block_range,
)
from kvbridge.connectors.config import ConnectorConfig, KVRole, LoadFailurePolicy
from kvbridge.connectors.errors import (
    ConfigError,
    ContractError,
    KVBridgeError,
    RoleError,
    TransferError,
    TransferParamsError,
    UnknownConnectorError,
)
from kvbridge.connectors.params import TRANSFER_PARAMS_VERSION, TransferMode, TransferParams
from kvbridge.connectors.registry import (
    ENTRY_POINT_GROUP,
    ResolvedConnector,
    available,
    load,
    resolve,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "TRANSFER_PARAMS_VERSION",
    "BlockIds",
    "BlockRef",
    "ConfigError",
    "ConnectorConfig",
    "ConnectorContext",
    "ConnectorMetadata",
    "ConnectorOutput",
    "ConnectorPlugin",
    "ConnectorRequest",
    "ContractError",
    "EventBuffer",
    "KVBridgeError",
    "KVCaches",
    "KVRole",
    "LoadFailurePolicy",
    "OutputAggregator",
    "ResolvedConnector",
    "RoleError",
    "ScheduledRequest",
    "SchedulerConnector",
    "SchedulerStep",
    "TransferError",
    "TransferMode",
    "TransferParams",
    "TransferParamsError",
    "UnknownConnectorError",
    "WorkerConnector",
    "WorkerOutput",
    "available",
    "block_range",
    "load",
    "registry",
    "resolve",
]
