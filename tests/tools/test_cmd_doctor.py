"""`kvbridge doctor`: real checks, JSON shape, failure reporting with a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.tools.cli import main
from kvbridge.tools.commands import doctor as cmd_doctor
from tests.conftest import missing_backend


def test_doctor_json_reports_backends_and_connectors(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json", "--timeout", "120"])
    report = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in report["checks"]}
    assert {"torch", "zmq", "msgpack", "nixl", "mooncake"} <= set(names)
    assert names["torch"]["ok"] and names["zmq"]["ok"] and names["msgpack"]["ok"]
    assert code == (0 if report["ok"] else 1)
    assert report["ok"] == all(c["ok"] for c in report["checks"] if c["required"])
    connectors = {c["name"]: c for c in report["connectors"]}
    assert connectors["shared_storage"]["loaded"] and connectors["shared_storage"]["usable"]
    for name in ("shared_storage", "nixl", "mooncake_store", "offloading", "multi"):
        assert connectors[name]["source"] == "built-in", connectors[name]
        assert connectors[name]["distribution"] is None
        assert connectors[name]["origin"].startswith(f"kvbridge.connectors.{name}:")
    assert "nixl-build" in names and not names["nixl-build"]["required"]
    if names["nixl"]["ok"]:  # which build loaded, beside what this host's torch wants
        from kvbridge.backends.nixl.load import torch_cuda_major

        build = report["nixl_build"]
        assert build["loaded"] in ("nixl_cu12", "nixl_cu13")
        assert build["torch_cuda_major"] == torch_cuda_major()
        assert build == cmd_doctor.nixl_build(build["loaded"], torch_cuda_major())
        assert names["nixl-build"]["ok"] == (not build["mismatch"])
        assert build["loaded"] in names["nixl-build"]["detail"]
    assert report["environment"]["UCX_MODULES"]  # kvbridge's default applies
    for backend in ("nixl", "mooncake"):  # exercised for real: a broken one must not pass
        if not names[backend]["ok"]:
            missing_backend(f"doctor's {backend} check failed: {names[backend]}")


def test_failed_probe_names_the_cause() -> None:
    with pytest.raises(RuntimeError, match="exited with 3"):
        cmd_doctor._probe("import sys; print('boom', file=sys.stderr); sys.exit(3)", 30)
    with pytest.raises(RuntimeError, match="killed by a signal"):
        cmd_doctor._probe("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 30)
    with pytest.raises(RuntimeError, match="no answer within"):
        cmd_doctor._probe("import time; time.sleep(30)", 0.5)


def test_a_failing_required_check_exits_1_with_a_fix(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> str:
        raise ImportError("No module named 'zmq'")

    monkeypatch.setattr(cmd_doctor, "check_zmq", broken)
    monkeypatch.setattr(cmd_doctor, "check_nixl",
                        lambda timeout_s, found=None: "skipped in this test")
    monkeypatch.setattr(cmd_doctor, "check_mooncake", lambda timeout_s: "skipped in this test")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] zmq" in out and "pip install 'pyzmq>=25'" in out


def _skip_backend_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cmd_doctor, "check_nixl",
                        lambda timeout_s, found=None: "skipped in this test")
    monkeypatch.setattr(cmd_doctor, "check_mooncake", lambda timeout_s: "skipped in this test")


def test_doctor_prints_the_ucx_settings_in_force(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _skip_backend_probes(monkeypatch)
    monkeypatch.setenv("UCX_TLS", "tcp,cma")
    main(["doctor"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("ucx settings in force: "))
    assert "UCX_TLS=tcp,cma" in line and "UCX_MODULES=" in line
    assert "[ok  ] rdma" in out  # this host has no InfiniBand device: nothing to flag


def test_doctor_flags_tcp_only_on_a_host_with_rdma_devices(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setenv("UCX_MODULES", "^ib")
    with pytest.raises(RuntimeError, match=r"RDMA devices \['mlx5_0'\].*UCX_MODULES=\^ib"):
        cmd_doctor.check_rdma(str(tmp_path))
    monkeypatch.setenv("UCX_MODULES", "")
    monkeypatch.setenv("UCX_TLS", "tcp")
    with pytest.raises(RuntimeError, match="UCX_TLS=tcp has no RDMA transport"):
        cmd_doctor.check_rdma(str(tmp_path))
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy")
    assert "usable" in cmd_doctor.check_rdma(str(tmp_path))
    report = cmd_doctor.ucx_report(str(tmp_path))
    assert report["infiniband_devices"] == ["mlx5_0"] and report["tcp_only"] is None
    assert report["settings"]["UCX_TLS"] == "rc,cuda_copy"


def test_doctor_says_which_nixl_build_loaded_and_why() -> None:
    from tests.conftest import require

    require("nixl_cu12._api", "NIXL")
    detail = cmd_doctor.check_nixl(120)
    assert "._api loaded (nixl._api (meta package) first, then " in detail


def test_nixl_build_wants_the_build_for_torchs_cuda_major() -> None:
    """Pure: the build that loaded against the one torch's CUDA wants (no CUDA faked)."""
    wrong = cmd_doctor.nixl_build("nixl_cu12._api", 13)
    assert wrong == {"loaded": "nixl_cu12", "wanted": "nixl_cu13", "torch_cuda_major": 13,
                     "mismatch": True}
    with pytest.raises(RuntimeError, match=r"nixl_cu12 loaded but torch is built for CUDA 13, "
                                           r"wants nixl_cu13"):
        cmd_doctor.check_nixl_build(wrong)
    assert "pip install 'kvbridge[cu13]' (adds nixl-cu13" in cmd_doctor._nixl_build_fix(wrong)
    assert cmd_doctor.nixl_build("nixl_cu13._api", 12)["wanted"] == "nixl_cu12"
    assert cmd_doctor.nixl_build("nixl_cu13._api", 12)["mismatch"] is True
    assert "'kvbridge[cu12]'" in cmd_doctor._nixl_build_fix(
        cmd_doctor.nixl_build("nixl_cu13._api", 12))
    for module, major in (("nixl_cu13._api", 13), ("nixl_cu12._api", 12)):
        match = cmd_doctor.nixl_build(module, major)
        assert match["mismatch"] is False
        assert cmd_doctor.check_nixl_build(match) == (
            f"{module.split('.')[0]} loaded; torch is built for CUDA {major}, "
            f"wants {match['wanted']}")
    cpu = cmd_doctor.nixl_build("nixl_cu13._api", None)  # host memory: either build serves
    assert cpu["mismatch"] is False and cpu["wanted"] == "nixl_cu12"
    assert "torch has no CUDA" in cmd_doctor.check_nixl_build(cpu)
    unknown = cmd_doctor.nixl_build("nixl._api", 13)  # a single-build source install
    assert unknown["mismatch"] is False
    assert "unknown CUDA" in cmd_doctor.check_nixl_build(unknown)
    assert cmd_doctor.check_nixl_build(None).startswith("not checked")


def test_the_extras_doctor_names_exist_in_pyproject() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml")
                            .read_text())["project"]
    for module, (extra, wheel) in cmd_doctor.NIXL_BUILDS.items():
        assert wheel == module.replace("_", "-")
        assert [r for r in project["optional-dependencies"][extra] if r.startswith(wheel)], extra
    assert any(r.startswith("nixl-cu12") for r in project["dependencies"])
    assert not any(r.startswith(("nixl-cu13", "nixl>", "nixl=", "nixl["))
                   for r in project["dependencies"])


# ---- where a Mooncake master's ports listen (real masters, real sockets) --------------------
def _mooncake_ready() -> None:
    from tests.conftest import require

    require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")


def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests probe 127.0.0.1 only: doctor's connect attempts on this host's other
    addresses are left out (what /proc says is still read for real)."""
    from kvbridge.backends.mooncake import exposure as mooncake_exposure
    monkeypatch.setattr(mooncake_exposure, "local_addresses", lambda: ["127.0.0.1"])


def test_doctor_says_a_master_kvbridge_starts_listens_on_its_host_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _mooncake_ready()
    _loopback_only(monkeypatch)
    rows: list[dict[str, object]] = []
    detail = cmd_doctor.check_mooncake_listen(60, None, None, rows)
    assert detail.startswith("a master kvbridge started: ")
    assert [r["name"] for r in rows] == ["rpc", "metadata", "metrics"]
    for row in rows:
        assert row["listening"] == ["127.0.0.1"] and row["every_interface"] is False
        assert row["accepts"] == {"127.0.0.1": True}
    assert detail.count("listens on 127.0.0.1 only") == 3


def test_doctor_flags_a_metadata_server_on_every_interface(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """What Mooncake's own embedded metadata server does (it binds 0.0.0.0 whatever host
    it is given): a real listener on 127.0.0.1 stands in for it, and the kernel's table
    that doctor reads is the real parser over a copy of /proc/net/tcp in which that
    port's listener is 0.0.0.0 (tests never listen beyond loopback)."""
    import socket

    from kvbridge.backends.mooncake import exposure as mooncake_exposure
    _mooncake_ready()
    _loopback_only(monkeypatch)
    _skip_backend_probes(monkeypatch)
    with MooncakeMaster() as master, socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen(4)
        port = fake.getsockname()[1]
        proc_net = tmp_path / "net"
        proc_net.mkdir()
        real_tcp = Path("/proc/net/tcp").read_text().splitlines()
        local = f"0100007F:{port:04X}"
        rows = [real_tcp[0]] + [line.replace(local, f"00000000:{port:04X}")
                                for line in real_tcp[1:]]
        (proc_net / "tcp").write_text("\n".join(rows) + "\n")
        real = mooncake_exposure.listening_addresses

        def listening(p: int, proc: object = "/proc/net") -> list[str] | None:
            return real(p, proc_net) if p == port else real(p)

        monkeypatch.setattr(mooncake_exposure, "listening_addresses", listening)
        url = f"http://127.0.0.1:{port}/metadata"
        assert main(["doctor", "--json", "--mooncake-master", master.rpc_address,
                     "--mooncake-metadata", url]) in (0, 1)
        report = json.loads(capsys.readouterr().out)
        check = next(c for c in report["checks"] if c["name"] == "mooncake-listen")
        assert not check["ok"] and not check["required"]
        assert f"metadata 127.0.0.1:{port} listens on EVERY interface (0.0.0.0)" in \
            check["detail"]
        assert f"rpc {master.rpc_address} listens on 127.0.0.1 only" in check["detail"]
        assert "kvbridge mooncake master --host" in check["fix"]
        listed = {r["name"]: r for r in report["mooncake_listen"]}
        assert listed["metadata"]["every_interface"] is True
        main(["doctor", "--mooncake-master", master.rpc_address, "--mooncake-metadata", url])
        out = capsys.readouterr().out
        assert "[warn] mooncake-listen" in out and "EVERY interface" in out


def test_doctor_mooncake_flags_are_checked_before_anything_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--mooncake-metadata", "http://127.0.0.1:1/metadata"]) == 2
    assert main(["doctor", "--mooncake-master", "nohost"]) == 2
    assert main(["doctor", "--mooncake-master", "127.0.0.1:1",
                 "--mooncake-metadata", "http://127.0.0.1:x/metadata"]) == 2
    err = capsys.readouterr().err
    assert "needs --mooncake-master" in err and "HOST:PORT" in err and "http://HOST:PORT" in err


def test_doctor_names_the_fs_tiers_read_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.offload import fs_fast

    if fs_fast.available():
        assert "c-extension" in cmd_doctor.check_fs_reads()
    monkeypatch.setattr(fs_fast, "_module", None)
    monkeypatch.setattr(fs_fast, "_why_not", "no C compiler at install time")
    check = cmd_doctor._timed("fs-reads", False, cmd_doctor.check_fs_reads,
                              cmd_doctor._FIXES["fs-reads"])
    assert not check.ok and not check.required
    assert "python (one call per block: no C compiler at install time)" in check.detail
    assert "gcc" in check.fix
