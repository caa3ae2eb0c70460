"""Memory type and device id through registration, descriptor lists and threads.

A host tensor runs on real NIXL all the way. A CUDA tensor cannot exist on this
machine, so a *description* of one (an object with the attributes the
transport reads: ``device``, ``data_ptr``, ``untyped_storage`` ...) is
registered through an agent wrapper that records the arguments NIXL would get
and forwards every DRAM call to the real agent; ``set_cuda_device`` is
recorded in place of torch's.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import numpy as np
import pytest

from tests.conftest import require

torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends import nixl as nixl_mod  # noqa: E402
from kvbridge.backends.nixl import (  # noqa: E402
    DRAM,
    VRAM,
    NixlTransport,
    NixlTransportError,
    memory_of,
    strided_descs,
)


class _Storage:
    def __init__(self, addr: int, nbytes: int) -> None:
        self._addr, self._nbytes = addr, nbytes

    def data_ptr(self) -> int:
        return self._addr

    def nbytes(self) -> int:
        return self._nbytes


class CudaTensorDescription:
    """What the transport reads of a contiguous uint8 CUDA tensor (a view of a storage)."""

    def __init__(self, addr: int, nbytes: int, device_index: int, storage: _Storage) -> None:
        self.device = torch.device("cuda", device_index)
        self._addr, self._nbytes, self._storage = addr, nbytes, storage

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self._addr

    def numel(self) -> int:
        return self._nbytes

    def element_size(self) -> int:
        return 1

    def untyped_storage(self) -> _Storage:
        return self._storage


class _FakeHandle:
    def release(self) -> None:
        pass


class RecordingAgent:
    """Records register/prep arguments; DRAM goes to the real agent, VRAM stops here."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[Any, ...]] = []
        self._fake_regs: list[Any] = []

    def register_memory(self, descs: Any, mem_type: str, *rest: Any) -> Any:
        self.calls.append(("register_memory", list(descs), mem_type))
        if mem_type == DRAM:
            return self.real.register_memory(descs, mem_type, *rest)
        reg = ("fake-registration", tuple(descs))
        self._fake_regs.append(reg)
        return reg

    def deregister_memory(self, reg: Any, *rest: Any) -> None:
        if reg in self._fake_regs:
            self._fake_regs.remove(reg)
            return
        self.real.deregister_memory(reg, *rest)

    def prep_xfer_dlist(self, target: str, arr: np.ndarray, mem_type: str, backends: Any) -> Any:
        self.calls.append(("prep_xfer_dlist", target, np.array(arr), mem_type))
        if mem_type == DRAM:
            return self.real.prep_xfer_dlist(target, arr, mem_type, backends)
        return _FakeHandle()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    devices: list[tuple[int, int]] = []  # (thread id, device) per set_cuda_device call
    monkeypatch.setattr(nixl_mod, "set_cuda_device",
                        lambda device: devices.append((threading.get_ident(), device)))
    t = NixlTransport(f"memtype-{uuid.uuid4().hex[:8]}")
    agent = RecordingAgent(t._agent)
    t._agent = agent
    yield t, agent, devices
    final = t.close(strict=False)
    assert final.live == 0, final


def test_host_tensor_registers_as_dram_on_real_nixl(recorded) -> None:
    t, agent, devices = recorded
    flat = torch.zeros(4096, dtype=torch.uint8)
    regions = t.register_regions([flat[:2048], flat[2048:]])  # two layers, one allocation
    assert [(r.mem_type, r.device_id) for r in regions] == [(DRAM, 0), (DRAM, 0)]
    assert agent.calls == [("register_memory", [(flat.data_ptr(), 4096, 0, "")], DRAM)]
    assert t.counters().registrations == 1 and t.memory_type == (DRAM, 0)
    dl = t.prepare_local_descs(strided_descs(flat.data_ptr() + 2048, 256, 512, 4))
    _, target, arr, mem_type = agent.calls[-1]
    assert (target, mem_type, arr.tolist()) == (
        "NIXL_INIT_AGENT", DRAM, [[flat.data_ptr() + 2048, 256, 0, 512, 4]])
    assert dl.num_descs == 4 and devices == []  # host memory: no CUDA context is made
    info = memory_of(flat[16:32])
    assert (info.mem_type, info.device_id, info.storage_addr, info.storage_nbytes) == (
        DRAM, 0, flat.data_ptr(), 4096)


def test_cuda_tensor_description_registers_as_vram_with_its_device(recorded) -> None:
    t, agent, devices = recorded
    storage = _Storage(0x7F0000000000, 1 << 20)
    views = [CudaTensorDescription(storage.data_ptr() + i * (256 << 10), 256 << 10, 3, storage)
             for i in range(4)]
    regions = t.register_regions(views)
    assert [(r.mem_type, r.device_id) for r in regions] == [(VRAM, 3)] * 4
    # the one backing storage, once, as VRAM on device 3
    assert agent.calls == [("register_memory", [(storage.data_ptr(), 1 << 20, 3, "")], VRAM)]
    assert t.memory_type == (VRAM, 3)
    me = threading.get_ident()
    assert devices == [(me, 3)]  # the registering thread has the device's context

    # local lists: the device column is the registration's, the memory type VRAM
    t.prepare_local_descs(np.array([[views[1].data_ptr(), 4096]], dtype=np.uint64))
    _, _, arr, mem_type = agent.calls[-1]
    assert mem_type == VRAM and arr.tolist() == [[views[1].data_ptr(), 4096, 3]]
    t.prepare_local_descs(strided_descs(views[0].data_ptr(), 4096, 8192, 32, device_id=3))
    assert agent.calls[-1][3] == VRAM and agent.calls[-1][2][0, 2] == 3
    with pytest.raises(NixlTransportError, match="registered on device 3"):
        t.prepare_local_descs(strided_descs(views[0].data_ptr(), 4096, 8192, 2, device_id=1))

    # every other thread that enters the transport gets the context first, once
    def other() -> None:
        t.agent_metadata()
        t.get_notifs()

    worker = threading.Thread(target=other)
    worker.start()
    worker.join(10)
    assert [d for _, d in devices] == [3, 3] and devices[1][0] == worker.ident
    t.get_notifs()
    assert len(devices) == 2  # the first thread is not set again


def test_remote_lists_are_prepared_with_the_peers_memory_type(recorded) -> None:
    t, agent, _devices = recorded
    peer = NixlTransport(f"memtype-peer-{uuid.uuid4().hex[:8]}")
    try:
        buf = torch.zeros(4096, dtype=torch.uint8)
        peer.register_regions([buf])
        ph = t.add_peer(peer.name, peer.agent_metadata())
        remote_vram = strided_descs(0x7E0000000000, 4096, 4096, 16, device_id=5)
        dl = t.prepare_remote(ph, remote_vram, VRAM)
        assert agent.calls[-1][1:] == (peer.name, agent.calls[-1][2], VRAM)
        np.testing.assert_array_equal(agent.calls[-1][2], remote_vram)
        assert dl.num_descs == 16
        t.prepare_remote(ph, strided_descs(buf.data_ptr(), 1024, 1024, 4))  # real, DRAM
        assert agent.calls[-1][3] == DRAM
        with pytest.raises(NixlTransportError, match="mem_type"):
            t.prepare_remote(ph, remote_vram, "HBM")
    finally:
        peer.close(strict=False)


def test_mixed_or_multi_device_memory_is_refused(recorded) -> None:
    t, _agent, _devices = recorded
    s1, s2 = _Storage(0x7F0000000000, 1 << 16), _Storage(0x7F1000000000, 1 << 16)
    with pytest.raises(NixlTransportError, match="several CUDA devices"):
        t.register_regions([CudaTensorDescription(s1.data_ptr(), 1 << 16, 0, s1),
                            CudaTensorDescription(s2.data_ptr(), 1 << 16, 1, s2)])
    assert t.counters().registrations == 0
    host = torch.zeros(1024, dtype=torch.uint8)
    t.register_regions([host, CudaTensorDescription(s1.data_ptr(), 1 << 16, 0, s1)])
    with pytest.raises(NixlTransportError, match="mixes"):
        _ = t.memory_type
    with pytest.raises(NixlTransportError, match="expected host"):
        memory_of(torch.empty(4, device="meta"))
    with pytest.raises(NixlTransportError, match="device_id must be"):
        memory_of((host.data_ptr(), 16, DRAM, 2))
