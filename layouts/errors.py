"""The one error type of the layouts package."""

from __future__ import annotations


class LayoutError(ValueError):
    """A topology, region spec or plan request is invalid or cannot be served.

    ``field`` names the offending setting (``"tp_size"``, ``"regions[1].block_size"``,
    ``"consumer.dcp_size"``) so callers and the CLI can point at it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message
