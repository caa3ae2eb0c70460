"""`kvbridge bench PATH`: the benchmark suite -- kvbridge against the raw library, same run.

The suite lives in :mod:`kvbridge.tools.bench.suite` (paths ``nixl``,
``mooncake``, ``offload``, ``events``, ``lookup`` and ``all``; one row shape,
one JSON file, ``--plot``). This module only registers it as the ``bench``
command; ``parse_pattern`` stays importable from here.
"""

from __future__ import annotations

from kvbridge.tools.bench.suite import PATHS, parse_pattern, register, run

__all__ = ["PATHS", "parse_pattern", "register", "run"]
