"""Reference-engine KV that refuses host access, as KV in GPU memory does, on a CPU host.

:func:`guard_engine_kv` makes every reference-engine worker created while it is
in force hand its connector KV tensors wrapped by
:func:`kvbridge.layouts.kv_memory.guard_host_access`: the same storage, torch
ops and ``data_ptr()`` work, ``.numpy()`` / ``tolist`` / the buffer protocol /
pickling / iteration raise :class:`~kvbridge.layouts.kv_memory.HostAccessError`.
The engine's own compute and byte check use torch ops only, so they run
unchanged. It wraps the tensors where the engine allocated them (the name
``KVCaches`` in :mod:`kvbridge.engine.worker`), leaving the engine's code alone,
and sets the engine's own switch (``KVBRIDGE_KV_HOST_GUARD``) too.
:func:`host_engine_kv` clears that switch for tests that need host KV.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

import kvbridge.engine.worker as engine_worker
from kvbridge.connectors import KVCaches
from kvbridge.layouts import RankRegionShape
from kvbridge.layouts.kv_memory import GUARD_ENV, guard_host_access, host_readable


def guard_engine_kv(monkeypatch: pytest.MonkeyPatch) -> list[KVCaches]:
    """Guard the KV of every engine worker made from now on (until the test ends);
    the returned list fills with each worker's caches, in creation order."""
    made: list[KVCaches] = []

    def guarded(shapes: tuple[RankRegionShape, ...], num_blocks: tuple[int, ...],
                layers: Mapping[int, torch.Tensor]) -> KVCaches:
        caches = KVCaches(shapes, num_blocks,
                          {layer: guard_host_access(t) for layer, t in layers.items()})
        assert not any(host_readable(t) for t in caches.layers.values())
        made.append(caches)
        return caches

    monkeypatch.setattr(engine_worker, "KVCaches", guarded)
    monkeypatch.setenv(GUARD_ENV, "1")  # the engine's own switch, where it has one
    return made


def host_engine_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made from now on keep plain host KV, also in a run under the guard switch."""
    monkeypatch.delenv(GUARD_ENV, raising=False)


def kv_pointers(caches: Sequence[KVCaches]) -> set[int]:
    """The start address of every KV tensor of ``caches``."""
    return {int(t.data_ptr()) for c in caches for t in c.layers.values()}
