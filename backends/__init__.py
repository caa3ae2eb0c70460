"""Thin adapters around the real transport libraries (NIXL, Mooncake).

These modules import nothing else of kvbridge, so `offload` (whose `obj` tier
needs Mooncake) and `connectors` can both use them without an upward import.
"""

from __future__ import annotations

import os

# Must be set before the first UCX agent is created: without it every process
# that made a UCX agent segfaults at interpreter exit (see BACKENDS.md).
_ENV_DEFAULTS = {
    "UCX_MODULES": "^ib",
    "NIXL_LOG_LEVEL": "WARN",
    "MC_LOG_LEVEL": "WARNING",
}


def apply_env_defaults() -> None:
    """Set the backend environment defaults unless the user chose otherwise."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


apply_env_defaults()
