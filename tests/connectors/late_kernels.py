"""A fence over kernels that have not run yet, for CPU tests of the GPU fence.

On a GPU, the hooks that record a fence run while the kernels writing the KV
are only queued: the memory still holds older bytes. :class:`LateKernels`
plays both parts on host memory: when recorded it puts the KV's real bytes
aside and leaves stale ones (``STALE``) in the tensors; the "kernels" finish
on the ``polls``-th ``done()``, which writes the real bytes back and passes.
A put or copy issued before the fence passed therefore reads stale bytes,
which the engine's byte check of a later load reports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

STALE = 0x5A


class LateKernels:
    def __init__(self, tensors: Iterable[torch.Tensor], polls: int) -> None:
        self.tensors = [t.view(-1).view(torch.uint8) for t in tensors]
        self.output = [t.clone() for t in self.tensors]  # what the kernels will write
        for t in self.tensors:
            t.fill_(STALE)
        self.polls_left = polls
        self.polls = 0
        self.passed = False

    def done(self) -> bool:
        self.polls += 1
        if not self.passed and self.polls >= self.polls_left:
            for t, out in zip(self.tensors, self.output, strict=True):
                t.copy_(out)
            self.passed = True
        return self.passed


class NeverDone:
    """A fence whose kernels never finish (a hung GPU)."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        return False


def install(worker: Any, layers: Iterable[torch.Tensor], polls: int,
            log: list[LateKernels]) -> None:
    """Make ``worker.record_fence`` record a :class:`LateKernels` over ``layers``."""
    kv = list(layers)

    def record(_tensor: Any) -> LateKernels:
        fence = LateKernels(kv, polls)
        log.append(fence)
        return fence

    worker.record_fence = record
