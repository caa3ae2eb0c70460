"""The ``mooncake_te`` demo runner: the NIXL runner's two engine processes and router, with
the PD core over Mooncake's transfer engine (``kvbridge demo --connector mooncake_te``).

The connectors share the PD core, so they share the runner: only the connector name
differs (``DemoOptions.connector``). Host memory only (``--device cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.tools.demo import nixl as _pd

CONNECTOR = "mooncake_te"


@dataclass(frozen=True)
class DemoOptions(_pd.DemoOptions):
    connector: str = CONNECTOR


run_demo = _pd.run_demo
