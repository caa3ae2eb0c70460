"""UCX/NIXL environment defaults per host: InfiniBand present or not, GPUs present or not.

A temporary directory stands in for the host's ``/`` (``sys/class/infiniband``,
``proc/driver/nvidia/gpus``, ``dev/nvidia<N>``), so both kinds of host are
checked on this one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.backends import env_defaults, infiniband_devices, nvidia_gpus, tcp_only
from kvbridge.backends.nixl import nixl_candidates


def _host(tmp_path: Path, *, ib: bool = False, gpus: bool = False, dev_only: bool = False
          ) -> Path:
    (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)
    if ib:
        (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir()
    if gpus and not dev_only:
        (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:3b:00.0").mkdir(parents=True)
    if gpus and dev_only:
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev" / "nvidia0").touch()
        (tmp_path / "dev" / "nvidiactl").touch()
    return tmp_path


def test_without_infiniband_ib_is_switched_off(tmp_path: Path) -> None:
    root = _host(tmp_path)
    assert infiniband_devices(root) == [] and nvidia_gpus(root) == []
    out = env_defaults({}, root)
    assert out["UCX_MODULES"] == "^ib" and out["NIXL_LOG_LEVEL"] == "WARN"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in out and "UCX_TLS" not in out
    assert env_defaults({}, tmp_path / "no-such-root")["UCX_MODULES"] == "^ib"


def test_with_infiniband_nothing_disables_rdma(tmp_path: Path) -> None:
    root = _host(tmp_path, ib=True)
    assert infiniband_devices(root) == ["mlx5_0"]
    out = env_defaults({}, root)
    assert "UCX_MODULES" not in out and "UCX_TLS" not in out
    assert tcp_only({**out}) is None


def test_user_settings_win(tmp_path: Path) -> None:
    root = _host(tmp_path)
    out = env_defaults({"UCX_MODULES": "", "NIXL_LOG_LEVEL": "DEBUG"}, root)
    assert "UCX_MODULES" not in out and "NIXL_LOG_LEVEL" not in out
    assert out["UCX_DEBUG_SIGNO"] == "0"  # UCX would take SIGHUP
    assert "UCX_DEBUG_SIGNO" not in env_defaults({"UCX_DEBUG_SIGNO": "SIGUSR2"}, root)


@pytest.mark.parametrize("dev_only", [False, True])
def test_gpu_host_gets_cuda_transports(tmp_path: Path, dev_only: bool) -> None:
    root = _host(tmp_path, ib=True, gpus=True, dev_only=dev_only)
    assert nvidia_gpus(root)
    out = env_defaults({}, root)
    assert out["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert out["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    assert "UCX_TLS" not in out  # UCX's default (all) already has cuda_copy
    assert env_defaults({"UCX_TLS": "rc,tcp"}, root)["UCX_TLS"] == "rc,tcp,cuda_copy"
    assert env_defaults({"UCX_TLS": "^cuda_copy,tcp"}, root)["UCX_TLS"] == "^tcp"
    assert env_defaults({"UCX_TLS": "^cuda_copy"}, root)["UCX_TLS"] == "all"
    assert "UCX_TLS" not in env_defaults({"UCX_TLS": "rc,cuda_copy,cuda_ipc"}, root)
    assert "UCX_TLS" not in env_defaults({"UCX_TLS": "^tcp"}, root)
    keep = env_defaults({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, root)
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in keep


def test_tcp_only_names_the_setting() -> None:
    assert "UCX_MODULES=^ib" in (tcp_only({"UCX_MODULES": "^ib"}) or "")
    assert "UCX_MODULES=^ib,cma" in (tcp_only({"UCX_MODULES": "^ib,cma"}) or "")
    assert "UCX_MODULES=uct_cuda" in (tcp_only({"UCX_MODULES": "uct_cuda"}) or "")
    assert tcp_only({"UCX_MODULES": "ib,uct_cuda"}) is None
    assert "UCX_TLS=tcp,sm" in (tcp_only({"UCX_TLS": "tcp,sm"}) or "")
    assert tcp_only({"UCX_TLS": "rc,tcp"}) is None
    assert tcp_only({"UCX_TLS": "^tcp"}) is None
    assert tcp_only({}) is None


def test_nixl_build_order_follows_torchs_cuda() -> None:
    names, why = nixl_candidates(13)
    assert names == ["nixl._api", "nixl_cu13._api", "nixl_cu12._api"] and "CUDA 13" in why
    names, why = nixl_candidates(12)
    assert names == ["nixl._api", "nixl_cu12._api", "nixl_cu13._api"] and "CUDA 12" in why
    names, why = nixl_candidates(None, from_torch=False)
    assert names == ["nixl._api", "nixl_cu12._api", "nixl_cu13._api"] and "CPU" in why


def test_the_loaded_build_is_reported_with_its_reason() -> None:
    from tests.conftest import require

    require("nixl_cu12._api", "NIXL")
    from kvbridge.backends.nixl import load_nixl_api, loaded_nixl

    api = load_nixl_api()
    loaded = loaded_nixl()
    assert loaded is not None and loaded[0] == api.__name__
    assert loaded[0] in nixl_candidates()[0] and "first" in loaded[1]
