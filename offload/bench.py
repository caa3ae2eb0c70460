"""Only :func:`~kvbridge.offload.testing.bench_workdir`, under the name it had here.

The offload benches moved to :mod:`kvbridge.tools.bench.offload`; the temp-store
helper to :mod:`kvbridge.offload.testing`. ``integrations/vllm/bench_fs.py`` and
``bench_tiering.py`` still import it from this module: delete this file once they
import it from ``kvbridge.offload.testing``.
"""

from __future__ import annotations

from kvbridge.offload.testing import bench_workdir

__all__ = ["bench_workdir"]
