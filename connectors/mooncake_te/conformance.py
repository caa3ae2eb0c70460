"""The ``mooncake_te`` connector's conformance cases: the PD core's cases
(:mod:`kvbridge.connectors.pd.conformance`, the same models, topologies and modes
as NIXL's), one transfer engine per rank. The doomed loads' peers are removed
through the transport protocol (``remove_peer``), which this adapter implements
too, so the loads fail through the adapter's own path (a send to a removed peer
raises).
"""

from __future__ import annotations

from kvbridge.connectors.pd.conformance import pd_cases
from kvbridge.connectors.testing import ConformanceCase


def cases() -> tuple[ConformanceCase, ...]:
    return pd_cases("mooncake_te", ("mooncake.engine",))
