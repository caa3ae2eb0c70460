"""`kvbridge doctor`: what this machine can run, checked for real, with how to fix it.

Each backend is exercised, not just imported: torch allocates and copies a
tensor; ZeroMQ does a REQ/REP round trip on 127.0.0.1; msgpack round-trips a
record; NIXL creates an agent with the UCX backend and registers memory *in a
child process with a timeout* (a broken UCX can hang or crash the process that
loads it); Mooncake's store module is imported in a child process and
``mooncake_master`` is located. Every registered connector is loaded and
matched against the backends it declares, and listed with where it came from
(built-in, entry point of a distribution, or registered in-process); an entry
point the registry ignores (its name belongs to a built-in) is a warning.

Required: torch, pyzmq, msgpack, NIXL (kvbridge's dependencies) and every
backend a registered connector declares. Exit 1 if a required check fails.

It also says which NIXL build loaded and why (``nixl._api`` of the meta
package, else the ``nixl_cu13`` / ``nixl_cu12`` wheel matching torch's CUDA),
and which build torch's CUDA wants, warning (check ``nixl-build``, not
required) when they differ (:func:`nixl_build`: e.g. ``nixl_cu12`` beside a
CUDA 13 torch, fixed by ``pip install 'kvbridge[cu13]'``). It prints every UCX
setting in force, and warns (check ``rdma``, not required) when the host has
InfiniBand/RoCE devices but UCX is held to TCP (``UCX_MODULES=^ib``, or a
``UCX_TLS`` without an RDMA transport).

Check ``mooncake-listen`` (not required) says on which addresses a Mooncake
master's ports listen: the master given with ``--mooncake-master`` (and its
``--mooncake-metadata`` URL), else one kvbridge starts for the check. For a
port on this host it reads ``/proc/net/tcp{,6}`` and tries to connect on each
of the host's addresses; it fails (warns) when a port listens on every
interface, e.g. the metadata port of a ``mooncake_master`` run with its
embedded HTTP metadata server, which binds 0.0.0.0 whatever host it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.progress import Progress

EPILOG = """\
examples:
  kvbridge doctor
  kvbridge doctor --json
  kvbridge doctor --timeout 60
  kvbridge doctor --mooncake-master 127.0.0.1:50051 --mooncake-metadata http://127.0.0.1:8080/metadata

--json prints {"ok", "checks": [{"name", "ok", "required", "detail", "fix",
"seconds"}], "connectors": [{"name", "origin" (module:Class), "source"
("built-in", "entry point" or "in-process"), "distribution" (of an entry
point, else null), "loaded", "roles", "backends", "usable", ...}],
"environment": {...}, "ucx": {"settings": {UCX_*: value},
"infiniband_devices", "nvidia_gpus", "tcp_only"}, "mooncake_listen": [{"name",
"host", "port", "listening", "accepts", "every_interface"}], "nixl_build":
{"loaded", "wanted", "torch_cuda_major", "mismatch"} (null if NIXL did not
load), "python"}.

exit codes: 0 every required check passed, 1 a required check failed, 2 usage error
"""

CORE_BACKENDS = ("torch", "zmq", "msgpack", "nixl")

_NIXL_PROBE = """
import json, sys
import kvbridge.backends  # UCX_MODULES=^ib before the first agent
import torch
from kvbridge.backends.nixl import NixlTransport, load_nixl_api, loaded_nixl
from kvbridge.backends.nixl.load import torch_cuda_major
api = load_nixl_api()
transport = NixlTransport("kvbridge-doctor")
buf = torch.zeros(4096, dtype=torch.uint8)
transport.register_regions([buf])
metadata = transport.agent_metadata()
transport.close()
module, why = loaded_nixl()
# api.__name__ is the build behind the meta package's nixl._api alias too
print(json.dumps({"module": module, "why": why, "metadata_bytes": len(metadata),
                  "build_module": api.__name__, "torch_cuda_major": torch_cuda_major()}))
sys.stdout.flush()
"""

_MOONCAKE_PROBE = """
import json
import kvbridge.backends
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
print(json.dumps({"store": type(store).__name__}))
"""

_FIXES = {
    "torch": "install a CPU build of torch first: pip install torch==2.13.0 "
             "--index-url https://download.pytorch.org/whl/cpu (or run `make setup`)",
    "zmq": "pip install 'pyzmq>=25' into this environment",
    "msgpack": "pip install 'msgpack>=1.0' into this environment",
    "nixl": "pip install nixl-cu12==1.5.1 after torch, or with a CUDA 13 torch nixl-cu13==1.5.1 "
            "(pip install 'kvbridge[cu13]'; an unpinned `nixl` pulls both builds and a CUDA "
            "torch); on a host without InfiniBand keep "
            "UCX_MODULES=^ib (kvbridge sets it there unless you override it) and check "
            "UCX_TLS if you set it",
    "rdma": "this host has InfiniBand/RoCE devices: unset UCX_MODULES (or drop ib from its "
            "exclusions) and let UCX_TLS include rc/ud/dc (or leave it unset), else every "
            "transfer goes over TCP",
    "mooncake-listen": "a master kvbridge starts (`kvbridge mooncake master --host ADDR`) binds "
                       "every port to ADDR only: it turns Mooncake's embedded metadata server off "
                       "(that one binds 0.0.0.0) and serves the protocol itself. For a master "
                       "started otherwise: run it with --enable_http_metadata_server=false and "
                       "`kvbridge mooncake master --metadata-only --host ADDR --http-port P` beside it, or firewall "
                       "the port. Clients' transfer-engine ports also listen on every interface: "
                       "firewall them on shared networks",
    "fs-reads": "install a C compiler and Python's headers (apt-get install gcc python3-dev) "
                "and reinstall kvbridge (pip install -e .): the fs tier then loads and stores "
                "without per-block Python work (it works without, slower)",
    "auth": "make a secret once (`kvbridge auth new-secret --out FILE`, mode 0600), copy it to "
            "every host and set KVBRIDGE_SECRET_FILE=FILE (or the connector's "
            "auth_secret_file); `kvbridge auth show` compares fingerprints",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda (no GPU driver) or "
                "mooncake-transfer-engine (with libcuda.so.1), then apt-get install "
                "libibverbs1 librdmacm1 libnuma1 libcurl4",
}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    required: bool
    detail: str
    fix: str = ""
    seconds: float = 0.0


def _timed(name: str, required: bool, fn: Callable[[], str], fix: str) -> Check:
    start = time.monotonic()
    try:
        detail = fn()
        return Check(name, True, required, detail, "", time.monotonic() - start)
    except Exception as exc:
        return Check(name, False, required, f"{type(exc).__name__}: {exc}", fix,
                     time.monotonic() - start)


def check_auth() -> str:
    """Which cluster secret this host's engines would use (never the secret itself)."""
    from kvbridge.auth import INSECURE_ENV, insecure_from_env, resolve_secret

    secret = resolve_secret()  # raises on a misconfigured one: the check fails
    if secret is not None:
        return (f"cluster secret from {secret.source}, fingerprint {secret.fingerprint}: "
                "side channel, control port, events replay and NIXL hellos take members only")
    if insecure_from_env():
        raise RuntimeError(f"{INSECURE_ENV}=1 without a cluster secret: engines serve "
                           "strangers on any address they are given")
    return ("no cluster secret: engines serve loopback only, unauthenticated (a "
            "non-loopback bind is refused)")


def check_fs_reads() -> str:
    """Which path the fs tier's loads and stores take: the C extension (GIL-free batch I/O) or
    one Python call per block; fails (not required) when the extension is missing."""
    from kvbridge.offload import fs_fast

    if not fs_fast.available():
        raise RuntimeError(f"fs tier loads and stores: {fs_fast.active_path()}")
    return f"fs tier loads and stores: {fs_fast.active_path()}"


def check_torch() -> str:
    import torch

    a = torch.arange(1 << 16, dtype=torch.float16)
    b = torch.empty_like(a)
    b.copy_(a)
    if not torch.equal(a, b):
        raise RuntimeError("tensor copy mismatch")
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def check_zmq() -> str:
    import zmq

    context = zmq.Context()
    try:
        rep = context.socket(zmq.REP)
        req = context.socket(zmq.REQ)
        for sock in (rep, req):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 2000)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        rep.send(rep.recv())
        if req.recv() != b"ping":
            raise RuntimeError("REQ/REP round trip returned other bytes")
        rep.close()
        req.close()
    finally:
        context.term()
    return f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), loopback round trip ok"


def check_msgpack() -> str:
    import msgpack

    record = {"version": 1, "block_ids": [[1, 2], [3]], "blob": b"\x00\x01"}
    if msgpack.unpackb(msgpack.packb(record, use_bin_type=True), raw=False) != record:
        raise RuntimeError("round trip changed the record")
    return f"msgpack {'.'.join(map(str, msgpack.version))}"


def _probe(code: str, timeout_s: float) -> dict[str, object]:
    env = dict(os.environ)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no answer within {timeout_s:.0f} s (hung while loading or "
                           f"creating the backend)") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        signal_note = ""
        if proc.returncode < 0 or proc.returncode >= 128:
            signal_note = " (killed by a signal: a native library crashed)"
        raise RuntimeError(f"probe exited with {proc.returncode}{signal_note}: "
                           + " | ".join(tail))
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):
            return data
    raise RuntimeError("probe printed no result")


def check_nixl(timeout_s: float, found: dict[str, object] | None = None) -> str:
    """Create a NIXL agent in a child process; ``found`` gets the probe's answer."""
    data = _probe(_NIXL_PROBE, timeout_s)
    if found is not None:
        found.update(data)
    return (f"{data['module']} loaded ({data.get('why', '')}): agent with UCX created, "
            f"4 KiB registered, {data['metadata_bytes']} B of agent metadata")


#: NIXL's per-CUDA builds: module -> (kvbridge's extra that installs it, its wheel)
NIXL_BUILDS = {"nixl_cu12": ("cu12", "nixl-cu12"), "nixl_cu13": ("cu13", "nixl-cu13")}


def nixl_build(loaded_module: str, cuda_major: int | None) -> dict[str, object]:
    """The NIXL build that loaded against the one torch's CUDA wants (pure).

    ``loaded_module`` is the ``_api`` module that loaded (``nixl_cu12._api``;
    the meta package's ``nixl._api`` is an alias whose ``__name__`` is the
    build's), ``cuda_major`` torch's CUDA major (None: a CPU build). The wanted
    build is the first per-CUDA wheel :func:`~kvbridge.backends.nixl.load.nixl_candidates`
    tries for that CUDA. ``mismatch`` only with a CUDA torch and a known build:
    on host memory (a CPU torch) either build works.
    """
    from kvbridge.backends.nixl.load import nixl_candidates

    names, _ = nixl_candidates(cuda_major, from_torch=False)
    wanted = names[1].split(".")[0]
    loaded = loaded_module.split(".")[0]
    return {"loaded": loaded, "wanted": wanted, "torch_cuda_major": cuda_major,
            "mismatch": cuda_major is not None and loaded in NIXL_BUILDS and loaded != wanted}


def check_nixl_build(build: dict[str, object] | None) -> str:
    """Says which NIXL build loaded and which torch wants; raises when they differ."""
    if build is None:
        return "not checked: NIXL did not load (see the nixl check)"
    major = build["torch_cuda_major"]
    torch_says = (f"torch is built for CUDA {major}, wants {build['wanted']}" if major is not None
                  else f"torch has no CUDA (CPU build): either build serves host memory, "
                       f"{build['wanted']} is the one tested")
    if build["loaded"] not in NIXL_BUILDS:
        return f"{build['loaded']} loaded (a build of unknown CUDA); {torch_says}"
    if build["mismatch"]:
        raise RuntimeError(f"{build['loaded']} loaded but {torch_says}: NIXL links another "
                           "CUDA runtime than torch (GPU memory transfers may fail)")
    return f"{build['loaded']} loaded; {torch_says}"


def _nixl_build_fix(build: dict[str, object] | None) -> str:
    if build is None or build["wanted"] not in NIXL_BUILDS:
        return ("pip install 'kvbridge[cuN]' for torch's CUDA major N (12 or 13), or run "
                ".ci/setup.sh, which asks torch")
    extra, wheel = NIXL_BUILDS[str(build["wanted"])]
    return (f"pip install 'kvbridge[{extra}]' (adds {wheel}, the build for torch's CUDA, which "
            "kvbridge then loads first), or run .ci/setup.sh, which asks torch")


def ucx_report(root: str = "/") -> dict[str, object]:
    """UCX settings in force, the host's RDMA devices and GPUs, and why UCX is held to
    TCP if it is (``tcp_only`` None otherwise)."""
    from kvbridge.backends import infiniband_devices, nvidia_gpus, tcp_only

    return {"settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
            "infiniband_devices": infiniband_devices(root), "nvidia_gpus": nvidia_gpus(root),
            "tcp_only": tcp_only(os.environ)}


def check_rdma(root: str = "/") -> str:
    """Fails when the host has RDMA devices but UCX may only use TCP."""
    ucx = ucx_report(root)
    devices = ucx["infiniband_devices"]
    assert isinstance(devices, list)
    if not devices:
        return "no InfiniBand/RoCE device on this host (TCP / shared memory only)"
    if ucx["tcp_only"]:
        raise RuntimeError(f"host has RDMA devices {devices} but {ucx['tcp_only']}: "
                           "transfers would go over TCP")
    return f"RDMA devices {devices} usable by UCX"


def check_mooncake(timeout_s: float) -> str:
    data = _probe(_MOONCAKE_PROBE, timeout_s)
    from kvbridge.backends.mooncake.master import find_master_binary

    master = find_master_binary()
    return f"mooncake.store imports ({data['store']}); mooncake_master at {master}"


class ListensEverywhere(RuntimeError):
    """A Mooncake port listens on every interface (0.0.0.0 or ::)."""


def _endpoint_form_problem(master_address: str, metadata_url: str | None) -> str:
    """What is wrong with the forms of ``--mooncake-master`` / ``--mooncake-metadata`` ("" if nothing)."""
    from urllib.parse import urlsplit

    host, _, port = master_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--mooncake-master must be HOST:PORT, got {master_address!r}"
    if metadata_url is not None and metadata_url.startswith("http://"):
        try:
            parts = urlsplit(metadata_url)
            ok = parts.hostname is not None and parts.port is not None
        except ValueError:
            ok = False
        if not ok:
            return f"--mooncake-metadata must be http://HOST:PORT/metadata, got {metadata_url!r}"
    return ""


def check_mooncake_listen(timeout_s: float, master_address: str | None,
                          metadata_url: str | None, rows: list[dict[str, object]]) -> str:
    """Where the given master's ports listen, or those of one kvbridge starts; fills ``rows``.

    Raises when a port listens on every interface (the check then warns).
    """
    from kvbridge.backends.mooncake.master import MooncakeMaster, master_exposure

    if master_address is not None:
        exposures = master_exposure(master_address, metadata_url)
        whose = f"master {master_address} (given)"
    else:
        with MooncakeMaster(start_timeout_s=timeout_s) as master:
            exposures = master_exposure(master.rpc_address, master.metadata_url,
                                        master.metrics_port)
        whose = "a master kvbridge started"
    rows.extend(asdict(e) for e in exposures)
    detail = f"{whose}: " + "; ".join(e.describe() for e in exposures)
    if any(e.every_interface for e in exposures):
        raise ListensEverywhere(detail)
    return detail


def check_connectors() -> tuple[list[dict[str, object]], set[str], list[Check]]:
    """Registered connectors (with where each came from), the backends they need, and a
    check per unloadable one (required) or ignored entry point (a warning)."""
    from kvbridge.connectors import registry

    rows: list[dict[str, object]] = []
    needed: set[str] = set()
    problems: list[Check] = []
    for name, source in registry.sources().items():
        # "origin" keeps its first meaning (the module:Class target); "source" says where from
        where = {"name": name, "origin": source.target, "source": source.origin.value,
                 "distribution": source.distribution}
        try:
            plugin = registry.load(name)
        except Exception as exc:
            rows.append({**where, "loaded": False, "error": str(exc)})
            provider = (f"the package {source.distribution}" if source.distribution
                        else "kvbridge" if source.origin is registry.Origin.BUILTIN
                        else f"the code registering {source.target}")
            problems.append(Check(f"connector {name}", False, True, str(exc),
                                  f"fix or reinstall {provider}"))
            continue
        backends = [b for b in plugin.backends]
        needed.update(backends)
        rows.append({**where, "loaded": True,
                     "roles": sorted(r.value for r in plugin.supported_roles),
                     "deprecated_roles": sorted(r.value for r in plugin.deprecated_roles),
                     "backends": backends, "description": plugin.description})
    for item in registry.shadowed():
        problems.append(Check(f"connector {item.name}", False, False, item.describe(),
                              f"rename the entry point in {item.distribution} (or uninstall "
                              f"it); to replace {item.name!r} on purpose, call "
                              "kvbridge.connectors.registry.register() in-process"))
    return rows, needed, problems


def run_checks(timeout_s: float, mooncake_master: str | None = None,
               mooncake_metadata: str | None = None) -> dict[str, object]:
    connectors, needed, connector_problems = check_connectors()
    nixl_found: dict[str, object] = {}
    required = set(CORE_BACKENDS) | needed
    checks = [
        _timed("torch", "torch" in required, check_torch, _FIXES["torch"]),
        _timed("zmq", "zmq" in required, check_zmq, _FIXES["zmq"]),
        _timed("msgpack", "msgpack" in required, check_msgpack, _FIXES["msgpack"]),
        _timed("nixl", "nixl" in required, lambda: check_nixl(timeout_s, nixl_found),
               _FIXES["nixl"]),
        _timed("mooncake", "mooncake" in required, lambda: check_mooncake(timeout_s),
               _FIXES["mooncake"]),
        _timed("rdma", False, check_rdma, _FIXES["rdma"]),
        _timed("auth", False, check_auth, _FIXES["auth"]),
        _timed("fs-reads", False, check_fs_reads, _FIXES["fs-reads"]),
    ]
    build = (nixl_build(str(nixl_found["build_module"]),
                        _int_or_none(nixl_found.get("torch_cuda_major")))
             if "build_module" in nixl_found else None)
    checks.insert(4, _timed("nixl-build", False, lambda: check_nixl_build(build),
                            _nixl_build_fix(build)))
    listen_rows: list[dict[str, object]] = []
    if mooncake_master is None and not next(c for c in checks if c.name == "mooncake").ok:
        checks.append(Check("mooncake-listen", True, False,
                            "not checked: Mooncake is not usable here (see the mooncake check)"))
    else:
        checks.append(_timed("mooncake-listen", False,
                             lambda: check_mooncake_listen(timeout_s, mooncake_master,
                                                           mooncake_metadata, listen_rows),
                             _FIXES["mooncake-listen"]))
    checks.extend(connector_problems)
    status = {c.name: c.ok for c in checks}
    for row in connectors:
        if row.get("loaded"):
            backends = row.get("backends")
            assert isinstance(backends, list)
            missing = [b for b in backends if not status.get(b, True)]
            row["usable"] = not missing
            if missing:
                row["missing_backends"] = missing
    ok = all(c.ok for c in checks if c.required)
    return {"ok": ok, "checks": [asdict(c) for c in checks], "connectors": connectors,
            "environment": {k: os.environ.get(k) for k in
                            ("UCX_MODULES", "UCX_TLS", "NIXL_LOG_LEVEL", "MC_LOG_LEVEL",
                             "MC_TCP_BIND_ADDRESS")},
            "ucx": ucx_report(),
            "mooncake_listen": listen_rows,
            "nixl_build": build,
            "python": sys.version.split()[0]}


def _where(row: dict[str, object]) -> str:
    """A connector row's origin in words: built-in, entry point of DIST, registered in-process."""
    if row.get("distribution"):
        return f"{row['source']} of {row['distribution']}"
    return "registered in-process" if row.get("source") == "in-process" else str(row["source"])


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check this machine's backends and registered connectors",
        description="Exercise every backend for real (torch, ZeroMQ, msgpack, NIXL/UCX, "
                    "Mooncake) and list registered connectors; says how to fix what fails.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds allowed for each child-process probe (default 60)")
    parser.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                        help="check where this master's ports listen (default: start one)")
    parser.add_argument("--mooncake-metadata", default=None, metavar="URL",
                        help="its HTTP metadata server, e.g. http://127.0.0.1:8080/metadata")
    parser.add_argument("--progress", action="store_true",
                        help="progress on stderr even when it is not a terminal")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kvbridge.backends  # noqa: F401  (env defaults, as every kvbridge process has them)

    if not args.timeout > 0:
        print(f"kvbridge doctor: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return EXIT_USAGE
    if args.mooncake_metadata is not None and args.mooncake_master is None:
        print("kvbridge doctor: --mooncake-metadata needs --mooncake-master", file=sys.stderr)
        return EXIT_USAGE
    if args.mooncake_master is not None:
        problem = _endpoint_form_problem(args.mooncake_master, args.mooncake_metadata)
        if problem:
            print(f"kvbridge doctor: {problem}", file=sys.stderr)
            return EXIT_USAGE
    with Progress("doctor", force=args.progress).ticking("checking backends"):
        report = run_checks(args.timeout, args.mooncake_master, args.mooncake_metadata)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        checks = report["checks"]
        assert isinstance(checks, list)
        for check in checks:
            mark = "ok  " if check["ok"] else ("FAIL" if check["required"] else "warn")
            print(f"[{mark}] {check['name']:<10} {check['detail']} ({check['seconds']:.1f} s)")
            if not check["ok"]:
                print(f"       fix: {check['fix']}")
        ucx = report["ucx"]
        assert isinstance(ucx, dict)
        settings = ucx["settings"]
        assert isinstance(settings, dict)
        print("ucx settings in force: " + (", ".join(f"{k}={v}" for k, v in settings.items())
                                           or "none (UCX defaults)"))
        connectors = report["connectors"]
        assert isinstance(connectors, list)
        print(f"connectors ({len(connectors)} registered):")
        for row in connectors:
            if not row.get("loaded"):
                print(f"  {row['name']:<16} {_where(row)}; cannot load: {row.get('error')}")
                continue
            usable = "usable" if row.get("usable") else \
                f"needs {', '.join(row.get('missing_backends', []))}"
            print(f"  {row['name']:<16} {_where(row)}; roles {','.join(row['roles'])}; "
                  f"backends {','.join(row['backends']) or '-'}; {usable}")
        print("doctor: all required checks passed" if report["ok"]
              else "doctor: a required check failed (see fix lines above)")
    return EXIT_OK if report["ok"] else EXIT_FAILURE
