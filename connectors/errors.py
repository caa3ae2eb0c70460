"""kvbridge's error hierarchy for connectors, their configuration and transfer params.

Every error names the offending ``field`` and says what was ``expected`` so the
CLI, a router or an operator can point at the exact setting. Validation happens
before anything is applied: a constructor or parser that raises has changed no
state (no half-applied config, no half-registered connector).
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of kvbridge's connector-level errors.

    ``field`` names what was wrong (``"kv_role"``, ``"transfer_params.block_ids[1]"``),
    ``reason`` says what was expected instead.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ConfigError(KVBridgeError, ValueError):
    """A connector configuration (dict, JSON or CLI flags) is malformed or inconsistent."""


class UnknownConnectorError(ConfigError):
    """No connector is registered under the requested name; ``available`` lists those that are."""

    def __init__(self, name: str, available: list[str], detail: str = "") -> None:
        listing = ", ".join(available) if available else "(none registered)"
        extra = f" ({detail})" if detail else ""
        super().__init__("kv_connector",
                         f"unknown connector {name!r}{extra}; available: {listing}; "
                         f"or give a 'module:Class' path")
        self.name = name
        self.available = available


class TransferParamsError(KVBridgeError, ValueError):
    """Transfer params from a router or a peer do not follow the versioned record."""


class RoleError(KVBridgeError):
    """A connector was asked for something its ``KVRole`` does not allow."""


class ContractError(KVBridgeError, RuntimeError):
    """A connector or engine broke the connector API contract (a bug, not bad input).

    Example: a worker reports a finished receive for a request it was never told
    about, or a scheduler connector returns a negative token count.
    """


class TransferError(KVBridgeError, RuntimeError):
    """A transfer failed at runtime (peer gone, deadline passed, backend error).

    Connectors usually turn these into failed receives / load-error block ids
    instead of raising to the engine; the type exists so that their internals
    and logs share one vocabulary.
    """
