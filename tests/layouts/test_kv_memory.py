"""The host-access guard: device KV's rules on a CPU host (layouts.kv_memory)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from kvbridge.layouts.kv_memory import (
    HostAccessError,
    all_host_readable,
    guard_from_env,
    guard_host_access,
    host_readable,
)


@pytest.fixture
def guarded() -> torch.Tensor:
    return guard_host_access(torch.arange(64, dtype=torch.float32).view(4, 16))


@pytest.mark.parametrize("read", [
    lambda t: t.numpy(),
    lambda t: t.tolist(),
    lambda t: np.asarray(t),
    lambda t: pickle.dumps(t),
    lambda t: list(t),
    lambda t: t[1].view(torch.uint8).numpy(),  # a view of device KV is device KV
    lambda t: t.index_select(0, torch.tensor([0, 2])).numpy(),
], ids=["numpy", "tolist", "asarray", "pickle", "iter", "view", "gather"])
def test_host_only_reads_refuse(guarded: torch.Tensor, read) -> None:
    with pytest.raises(HostAccessError, match="not host-readable"):
        read(guarded)


def test_the_buffer_protocol_refuses(guarded: torch.Tensor) -> None:
    with pytest.raises(TypeError):
        memoryview(guarded)  # type: ignore[arg-type]


def test_torch_ops_registration_and_explicit_copies_work(guarded: torch.Tensor) -> None:
    plain = torch.arange(64, dtype=torch.float32).view(4, 16)
    assert guarded.data_ptr() != 0 and not host_readable(guarded)
    assert torch.equal(guarded, plain) and bool((guarded[1] == plain[1]).all().item())
    host = guarded.cpu()
    assert host_readable(host) and host.numpy()[2, 3] == 35.0
    host[0, 0] = -1.0  # a copy, as from a GPU: the KV keeps its bytes
    assert guarded[0, 0].item() == 0.0
    assert host_readable(guarded.to("cpu")) and not host_readable(guarded.to(torch.uint8))
    into = torch.zeros(4, 16)
    into.copy_(guarded)
    assert host_readable(into) and into.numpy()[3, 15] == 63.0
    guarded[2].copy_(torch.full((16,), 7.0))  # writes into the guarded storage
    assert plain.data_ptr() != guarded.data_ptr() and guarded.cpu()[2, 0] == 7.0


def test_host_readable_of_plain_tensors_and_the_switch(monkeypatch) -> None:
    assert host_readable(torch.zeros(2)) and all_host_readable([torch.zeros(1), b"x"])
    assert not all_host_readable([torch.zeros(1), guard_host_access(torch.zeros(1))])
    monkeypatch.setenv("KVBRIDGE_KV_HOST_GUARD", "1")
    assert guard_from_env()
    monkeypatch.setenv("KVBRIDGE_KV_HOST_GUARD", "0")
    assert not guard_from_env()
