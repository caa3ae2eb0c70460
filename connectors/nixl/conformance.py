"""The NIXL connector's conformance cases: the PD core's cases
(:mod:`kvbridge.connectors.pd.conformance`) with real NIXL agents, one per rank; the
doomed loads lose their NIXL peers (``remove_remote_agent``) just before posting.
"""

from __future__ import annotations

from kvbridge.connectors.pd.conformance import pd_cases
from kvbridge.connectors.testing import ConformanceCase


def cases() -> tuple[ConformanceCase, ...]:
    return pd_cases("nixl", ("nixl_cu12",))
