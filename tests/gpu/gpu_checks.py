"""GPU checks of kvbridge with its KV in GPU memory, run by ``run_gpu_checks.sh``.

Not part of the default test suite (no ``test_`` prefix, and CI has no GPU):
run it on a host with an NVIDIA GPU. Each check prints one line and adds a
record to the JSON report; a failed check does not stop the others; the exit
code is 1 if any check failed, 2 for usage errors or no CUDA.

Checks (``--checks`` selects; default all, in this order):

* ``env``        -- torch/CUDA/GPU, the NIXL build kvbridge loaded and why, the
  UCX settings kvbridge put in force (``cuda_copy``, CUDA IPC zero-copy).
* ``cuda_ipc``   -- CUDA IPC between two processes on one GPU, through torch's
  storage IPC handles (the fields travel as msgpack): the child reads the
  parent's bytes and writes its own back.
* ``transfers``  -- VRAM -> VRAM between two processes through
  :class:`~kvbridge.backends.nixl.NixlTransport` (a peer process registers a CUDA
  buffer, this one too): READ and WRITE, strided lists, every byte verified; GB/s
  of kvbridge, raw NIXL on the same descriptors, and a device-to-device torch
  copy of the same bytes. Runs in a child with ``UCX_PROTO_INFO=y``; the UCX
  protocol lines it printed are summarised (``cuda_ipc`` / ``cuda_copy`` /
  ``tcp`` ...).
* ``cost``       -- kvbridge's NIXL transport per transfer against raw NIXL doing what
  one request does (make, post, wait, release) and against one re-posted handle,
  VRAM to VRAM, READ and WRITE: GB/s, the one-descriptor fixed cost, kvbridge's
  excess in µs, NIXL's own make + release, a device copy of the same bytes; the
  4k- and 32k-token requests of a 70B-class model (:mod:`kvbridge.tools.bench.nixl_cost`).
* ``connector``  -- the ``nixl`` connector end to end, pull and push, and pull at
  TP 1 -> 2 (head slices), producer and consumer reference engines in two
  processes with their KV caches on the GPU (the engine's ``device`` setting;
  on the host, a dry run, guarded against host reads instead); outputs verified, the
  producer's handshake must announce VRAM; the consumer verifies every block
  (``verify: full``, ``torch-mix64-v1`` and its slice digests): every loaded
  block verified, none mismatched or unverified; the producer's digest GB/s.
* ``digests``    -- ``torch-mix64-v1`` block digests of KV on the device
  equal those of a CPU copy of the same bytes and the numpy reference (padded
  pages, a tail word, an unaligned span), a bit flipped on the device changes
  exactly its block's digest; ``torch-mix64-v1-slices`` head-slice digests
  (ranges gathered on the device as words, and as bytes inside words) equal the
  CPU's and the reference; GB/s on the device against XXH3-64 of host bytes (with
  triton, the fused kernel's rows beside the torch ops').
* ``stores``     -- the offloading connector's batched GPU <-> pinned CPU slot copies
  (the device's copy stream) against a plain pinned torch copy, each way; the
  Mooncake store's staged puts and gets of device KV where its wheel loads.
* ``demos``      -- ``kvbridge demo --device cuda`` for every connector (nixl pull and
  push, mooncake when its wheel loads, offload), each model preset, and TP 1 -> 2,
  2 -> 1 and PP 2 -> 1, ``--jobs`` at once; each must verify bytes and find none
  wrong; the first transfer's time (the cold peer) is reported.

``--doc FILE.md`` writes the report as markdown (``docs/gpu.md``); one table of
every check and case is printed at the end.

Usage: ``python3 tests/gpu/gpu_checks.py [--checks env,cuda_ipc,...] [--json FILE]
[--quick]`` from the repository root with ``kvbridge`` importable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CHECKS = ("env", "cuda_ipc", "transfers", "cost", "connector", "digests", "stores", "demos")
#: (num_blocks, block_bytes) moved by the transfers check
PATTERNS = ((64, 2 << 20), (4096, 16 << 10))
QUICK_PATTERNS = ((16, 1 << 20),)
#: UCX transports whose names are looked for in UCX_PROTO_INFO output
UCX_TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "rc_mlx5", "dc_mlx5", "ud_mlx5",
                  "rc_verbs", "tcp", "cma", "posix", "sysv", "self")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_checks.py", description=__doc__.split("\n")[0])
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--quick", action="store_true", help="one small pattern, fewer iters")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per pattern")
    parser.add_argument("--device", default="cuda:0",
                        help="CUDA device (default cuda:0); cpu runs the transfers check on "
                             "host memory (a dry run of the script's logic)")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="demos run at once by the demos check (default: cores / 4, "
                             "at most 4)")
    parser.add_argument("--demo-timeout", type=float, default=150.0, metavar="S",
                        help="each demo's --timeout (default 150 s)")
    parser.add_argument("--doc", metavar="FILE.md",
                        help="also write the report as markdown (docs/gpu.md): date, "
                             "device, driver, every figure")
    # internal: the transfers check re-runs this script in a child under UCX_PROTO_INFO=y
    parser.add_argument("--child-transfers", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown or not chosen:
        parser.error(f"--checks: unknown {unknown}; expected a subset of {list(CHECKS)}")
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    args.checks = chosen
    return args


def ucx_protocols(text: str) -> dict[str, int]:
    """Count UCX_PROTO_INFO lines naming each transport (the protocol UCX selected)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if "UCX" not in line and "|" not in line:
            continue
        for tl in UCX_TRANSPORTS:
            if re.search(rf"\b{tl}\b", line):
                counts[tl] = counts.get(tl, 0) + 1
    return counts


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    """GB/s of the median of ``seconds``."""
    ordered = sorted(seconds)
    return nbytes / ordered[len(ordered) // 2] / 1e9


# ------------------------------------------------------------------ checks


def check_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import kvbridge.backends as backends
    from kvbridge.backends.nixl import load_nixl_api, loaded_nixl

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    load_nixl_api()
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(args.device),
            "gpus_seen_by_driver": backends.nvidia_gpus(),
            "infiniband_devices": backends.infiniband_devices(),
            "driver": driver_version(),
            "nixl": loaded_nixl(),
            "ucx": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}}


def driver_version() -> str | None:
    """The NVIDIA driver's version (``/proc/driver/nvidia/version``, else nvidia-smi)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


_IPC_CHILD = r"""
import sys, msgpack, torch
h = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
torch.cuda.set_device(h["device"])
storage = torch.UntypedStorage._new_shared_cuda(*h["handle"])
t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage)
ok = int(t[: h["nbytes"]].to(torch.int64).sum().item()) == h["checksum"]
t[: h["nbytes"]].fill_(7)
torch.cuda.synchronize()
print("ok" if ok else "mismatch")
"""


def check_cuda_ipc(args: argparse.Namespace) -> dict[str, Any]:
    import msgpack
    import torch

    nbytes = 64 << 20
    device = torch.device(args.device)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    checksum = int(t.to(torch.int64).sum().item())
    handle = list(t.untyped_storage()._share_cuda_())
    payload = msgpack.packb({"device": device.index or 0, "handle": handle, "nbytes": nbytes,
                             "checksum": checksum}, use_bin_type=True)
    proc = subprocess.run([sys.executable, "-c", _IPC_CHILD], input=payload,
                          capture_output=True, timeout=120)
    answer = proc.stdout.decode().strip()
    torch.cuda.synchronize()
    written = bool((t == 7).all().item())
    if proc.returncode != 0 or answer != "ok" or not written:
        raise RuntimeError(f"child rc {proc.returncode} said {answer!r}, wrote back {written}: "
                           f"{proc.stderr.decode()[-500:]}")
    return {"bytes": nbytes, "child_read": True, "child_wrote": True}


def _wait(transport: Any, xfer: Any) -> None:
    from kvbridge.backends.nixl import XferState

    if transport.wait(xfer) is not XferState.DONE:
        raise RuntimeError(f"transfer {xfer.op.value} {xfer.state.value}: {xfer.error}")


def run_transfers(args: argparse.Namespace) -> dict[str, Any]:
    """The body of the transfers check (in the child that has UCX_PROTO_INFO=y)."""
    import numpy as np
    import torch

    from kvbridge.backends.nixl import NixlTransport, load_nixl_api, strided_descs
    from kvbridge.tools.bench.nixl_peer import PeerProcess, pattern

    api = load_nixl_api()
    device = torch.device(args.device)
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"  # --device cpu: a dry run
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = []
    for num_blocks, block_bytes in (QUICK_PATTERNS if args.quick else PATTERNS):
        total = num_blocks * block_bytes
        seed = 1000 + num_blocks
        with PeerProcess(f"gpu-peer-{uuid.uuid4().hex[:8]}", total, seed=seed, timeout_s=120,
                         device=str(device)) as peer:
            if peer.mem_type != mem_type:
                raise RuntimeError(f"peer registered {peer.mem_type}, expected {mem_type}")
            local = torch.zeros(total, dtype=torch.uint8, device=device)
            t = NixlTransport(f"gpu-local-{uuid.uuid4().hex[:8]}")
            try:
                (region,) = t.register_regions([local])
                if region.mem_type != mem_type:
                    raise RuntimeError(f"registered {region}, expected {mem_type}")
                dev = region.device_id
                ldl = t.prepare_local_descs(strided_descs(local.data_ptr(), block_bytes,
                                                          block_bytes, num_blocks, dev))
                ph = t.add_peer(peer.name, peer.metadata)
                rdl = t.prepare_remote(ph, strided_descs(peer.addr, block_bytes, block_bytes,
                                                         num_blocks, peer.device_id), mem_type)
                idx = np.arange(num_blocks)
                want = pattern(total, seed)
                x = t.post("READ", ldl, idx, rdl, idx, deadline_s=60)
                _wait(t, x)
                _sync(device)
                read_ok = bool(np.array_equal(local.cpu().numpy(), want))
                read_s = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    _wait(t, t.post("READ", ldl, idx, rdl, idx, deadline_s=60))
                    read_s.append(time.perf_counter() - t0)
                mine = torch.from_numpy(pattern(total, seed + 1)).to(device)
                local.copy_(mine)
                _sync(device)
                write_s = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    _wait(t, t.post("WRITE", ldl, idx, rdl, idx, deadline_s=60))
                    write_s.append(time.perf_counter() - t0)
                write_ok = write_verified(peer.read, mine.cpu().numpy().tobytes())
                raw_s = _raw_read(api, peer, local, num_blocks, block_bytes, dev, args.iters,
                                  mem_type)
                copy_s = _d2d_copy(local, args.iters)
            finally:
                final = t.close(strict=False)
        results.append({
            "num_blocks": num_blocks, "block_bytes": block_bytes, "read_verified": read_ok,
            "write_verified": write_ok, "kvbridge_read_gbps": round(gbps(total, read_s), 3),
            "kvbridge_write_gbps": round(gbps(total, write_s), 3),
            "raw_nixl_read_gbps": round(gbps(total, raw_s), 3),
            "torch_d2d_copy_gbps": round(gbps(total, copy_s), 3), "leaks": final.live})
    return {"patterns": results}


def write_verified(read: Any, want: bytes, chunk: int = 1 << 20) -> bool:
    """Every byte of the peer's buffer equals ``want``: ``read(offset, length)`` in
    pieces of at most ``chunk`` bytes (one peer call each), all of the buffer."""
    return all(read(off, min(chunk, len(want) - off)) == want[off:off + chunk]
               for off in range(0, len(want), chunk))


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_read(api: Any, peer: Any, local: Any, num_blocks: int, block_bytes: int, dev: int,
              iters: int, mem_type: str) -> list[float]:
    import numpy as np

    from kvbridge.backends.nixl import strided_descs

    agent = api.nixl_agent(f"gpu-raw-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
    reg = agent.register_memory(local)  # a CUDA tensor: NIXL takes VRAM and its device
    remote = agent.add_remote_agent(peer.metadata)
    ldl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided_descs(
        local.data_ptr(), block_bytes, block_bytes, num_blocks, dev), mem_type, ["UCX"])
    rdl = agent.prep_xfer_dlist(remote, strided_descs(
        peer.addr, block_bytes, block_bytes, num_blocks, peer.device_id), mem_type, ["UCX"])
    idx = np.arange(num_blocks, dtype=np.int32)
    handle = agent.make_prepped_xfer("READ", ldl, idx, rdl, idx, b"", ["UCX"])
    out = []
    try:
        for i in range(iters + 1):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ {state}")
            if i:
                out.append(time.perf_counter() - t0)
    finally:
        handle.release()
        ldl.release()
        rdl.release()
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
    return out


def _d2d_copy(src: Any, iters: int) -> list[float]:
    import torch

    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(src.device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        out.append(time.perf_counter() - t0)
    return out


def check_transfers(args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child-transfers", "--iters", str(args.iters),
            "--device", args.device] + (["--quick"] if args.quick else [])
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    text = proc.stdout + proc.stderr
    report = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            report = json.loads(line)
            break
    if proc.returncode != 0 or report is None:
        raise RuntimeError(f"transfers child exited {proc.returncode}: {text[-1500:]}")
    report["ucx_protocols"] = ucx_protocols(text)
    report["ucx_proto_lines"] = [x for x in text.splitlines() if "cuda" in x][:20]
    bad = [p for p in report["patterns"]
           if not (p["read_verified"] and p["write_verified"]) or p["leaks"]]
    if bad:
        raise RuntimeError(f"bytes or leaks wrong: {bad}")
    return report


#: the connector check's cases: (name, mode, consumer TP); the producer has TP 1. TP 1 -> 2
#: reads head slices, verified with ``torch-mix64-v1-slices`` (both consumer ranks on
#: the same device)
CONNECTOR_CASES = (("pull", "pull", 1), ("push", "push", 1), ("pull-tp1-tp2", "pull", 2))


def check_connector(args: argparse.Namespace) -> dict[str, Any]:
    from kvbridge.connectors import ConnectorConfig, KVRole, TransferMode
    from kvbridge.engine.core import EngineConfig
    from kvbridge.engine.harness import EngineProcess
    from kvbridge.engine.workload import check_outputs, make_requests
    from kvbridge.handshake import HandshakeClient, format_address
    from kvbridge.layouts import ParallelTopology, load_spec
    from kvbridge.tools.demo.nixl import Router

    # the engines' own device setting puts each rank's KV on the GPU; a dry run on the
    # host guards its KV against host reads, so it takes the GPU ranks' paths
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    expected_mem = "DRAM" if device == "cpu" else "VRAM"
    out: dict[str, Any] = {}
    for name, mode_name, consumer_tp in CONNECTOR_CASES:
        mode = TransferMode(mode_name)

        def config(role: KVRole, tp: int, mode: TransferMode = mode) -> EngineConfig:
            # the consumer checks every block (verify: full) with the digests a GPU rank
            # offers: torch-mix64-v1, and its slice digests at another TP
            extra = {"mode": mode.value, "transfer_timeout_s": 30.0,
                     "verify_algorithms": ["torch-mix64-v1"]}
            if role is KVRole.CONSUMER:
                extra["verify"] = "full"
            return EngineConfig(spec=load_spec("tiny-gqa"),
                                topology=ParallelTopology(tp_size=tp),
                                num_blocks=64, max_num_batched_tokens=2048, max_num_seqs=16,
                                connector=ConnectorConfig("nixl", role, extra=extra),
                                remote_kv_timeout_s=60.0, device=device,
                                kv_host_guard=device == "cpu")

        with EngineProcess(config(KVRole.PRODUCER, 1), name="gpu-producer",
                           start_timeout_s=180) as producer, \
                EngineProcess(config(KVRole.CONSUMER, consumer_tp), name="gpu-consumer",
                              start_timeout_s=180) as consumer:
            host, port = producer.endpoint or ("", 0)
            rank = HandshakeClient(timeout_s=10).fetch(format_address(host, port)).metadata
            mem = [(m.mem_type, m.device_id) for m in rank.ranks]
            router = Router(producer, consumer, mode, ParallelTopology(),
                            load_spec("tiny-gqa").fingerprint())
            specs = make_requests(4, prompt_tokens=40, max_tokens=2, seed=5,
                                  prefix=f"gpu-{name}")
            router.submit(specs)
            deadline = time.monotonic() + 120
            while not router.done:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: {len(router.results)} of {len(specs)} "
                                       "requests done in 120 s")
                if not router.poll():
                    time.sleep(0.01)
            results = list(router.results.values())
            wrong = check_outputs(results, specs)
            moved = [r.num_external_tokens for r in results]
            if wrong or not all(moved) or any(r.mismatched_bytes for r in results):
                raise RuntimeError(f"{name}: wrong outputs {wrong}, external tokens {moved}")
            if any(m != expected_mem for m, _ in mem):
                raise RuntimeError(f"{name}: producer ranks announce {mem}, not {expected_mem}")
            out[name] = {"requests": len(results), "external_tokens": sum(moved),
                         "producer_memory": mem,
                         **verified_kv(producer.stats(), consumer.stats(), name)}
    return out


def check_cost(args: argparse.Namespace) -> dict[str, Any]:
    """kvbridge's NIXL transport against raw NIXL doing what one request does (make, post,
    wait, release), and against one re-posted handle, on the device's memory (VRAM to
    VRAM between two processes), READ and WRITE: GB/s, the fixed cost of a one-
    descriptor transfer, kvbridge's excess per transfer, NIXL's own make + release,
    and a device copy of the same bytes; the 4k- and 32k-token requests of a 70B-class
    model at TP 4 (``--quick``: small patterns)."""
    from kvbridge.tools.bench.nixl_cost import default_cost_patterns, run_nixl_cost_bench

    device = args.device if args.device.startswith("cuda") else "cpu"
    report = run_nixl_cost_bench(default_cost_patterns(quick=args.quick), device=device,
                                 min_iters=args.iters, min_time_s=0.3 if args.quick else 1.0,
                                 deadline_s=60.0)
    rows = []
    for p in report["patterns"]:
        if not p["verified"] or p["kvbridge_leaks"]:
            raise RuntimeError(f"{p['pattern']}: verified {p['verified']}, "
                               f"leaks {p['kvbridge_leaks']}")
        for op, o in p["ops"].items():
            rows.append({"case": f"{p['pattern']} {op}", "descs": p["num_descs"],
                         "kvbridge_gbps": o["gbps"]["kvbridge"],
                         "raw_per_request_gbps": o["gbps"]["raw_per_request"],
                         "raw_reused_gbps": o["gbps"]["raw_reused_handle"],
                         "device_copy_gbps": p["torch_copy_gbps"],
                         "kvbridge_over_raw": o["kvbridge_over_raw_per_request"],
                         "kvbridge_over_copy": round(o["gbps"]["kvbridge"]
                                                     / p["torch_copy_gbps"], 3)
                         if p["torch_copy_gbps"] else None,
                         "excess_us": o["kvbridge_excess_us"],
                         "one_desc_us": o["one_desc_us"]["kvbridge"],
                         "one_desc_raw_us": o["one_desc_us"]["raw_per_request"],
                         "make_release_us": o["raw_make_release_us"]})
    return {"device": device, "rows": rows}


#: (num_blocks, block_bytes) of the stores check: a block's bytes across its layers
STORE_PATTERNS = ((64, 2 << 20), (1024, 256 << 10))
QUICK_STORE_PATTERNS = ((16, 1 << 20),)


def check_stores(args: argparse.Namespace) -> dict[str, Any]:
    """The offloading connector's batched copies between the device's KV and pinned CPU
    slots (on the device's copy stream) against a plain pinned torch copy of the same
    bytes, each way, bytes verified; and the Mooncake store's staged puts and gets of
    device KV against raw Mooncake, where Mooncake's wheel loads (else: not run)."""
    from kvbridge.tools.bench.offload_copy import run_copy_bench

    device = args.device if args.device.startswith("cuda") else "cpu"
    rows: list[dict[str, Any]] = []
    for num_blocks, block_bytes in (QUICK_STORE_PATTERNS if args.quick else STORE_PATTERNS):
        r = run_copy_bench(device, num_blocks=num_blocks, block_bytes=block_bytes,
                           rounds=max(2, args.iters))
        if not r["verified"]:
            raise RuntimeError(f"offload copies {num_blocks}x{block_bytes}: bytes differ")
        rows.append({"case": f"offload {num_blocks}x{block_bytes >> 10}KiB",
                     "slots_pinned": r["slots_pinned"],
                     "store_gbps": round(r["store_gbps"], 2),
                     "plain_d2h_gbps": round(r["plain_d2h_gbps"], 2),
                     "store_ratio": round(r["store_ratio"], 3),
                     "load_gbps": round(r["load_gbps"], 2),
                     "plain_h2d_gbps": round(r["plain_h2d_gbps"], 2),
                     "load_ratio": round(r["load_ratio"], 3)})
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # the wheel is missing, or cannot load without its CUDA
        rows.append({"case": "mooncake staged", "ok": None,
                     "not_run": f"Mooncake not importable here: {exc!r}"[:200]})
    else:
        from kvbridge.tools.bench.mooncake import run_bench

        report = run_bench(((16, 1 << 20),) if args.quick else ((64, 2 << 20),),
                           rounds=max(2, args.iters), device=device,
                           guard=device == "cpu")
        for p in report["patterns"]:
            if not p["verified"] or p["mismatched_bytes"]:
                raise RuntimeError(f"mooncake staged {p['num_blocks']}x{p['block_bytes']}: "
                                   f"{p['mismatched_bytes']} bytes differ")
            rows.append({"case": f"mooncake {p['num_blocks']}x{p['block_bytes'] >> 10}KiB",
                         "staged": p.get("staged"),
                         "put_gbps": round(p["connector"]["put_gbps"], 2),
                         "raw_put_gbps": round(p["raw"]["put_gbps"], 2),
                         "get_gbps": round(p["connector"]["get_gbps"], 2),
                         "raw_get_gbps": round(p["raw"]["get_gbps"], 2),
                         "put_ratio": round(p["ratio"]["put"], 3),
                         "get_ratio": round(p["ratio"]["get"], 3)})
    return {"device": device, "rows": rows}


#: the demos check's cases: (name, ``kvbridge demo`` arguments). Every connector with its KV
#: on the device, each model preset, and TP 1 -> 2, 2 -> 1 and PP 2 -> 1 over NIXL
DEMO_CASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nixl-pull", ("--connector", "nixl", "--mode", "pull")),
    ("nixl-push", ("--connector", "nixl", "--mode", "push")),
    ("nixl-tiny-mla-push", ("--connector", "nixl", "--mode", "push", "--model", "tiny-mla")),
    ("nixl-tiny-hybrid", ("--connector", "nixl", "--model", "tiny-hybrid")),
    ("nixl-tiny-gqa-nhd", ("--connector", "nixl", "--model", "tiny-gqa-nhd")),
    ("nixl-bench-gqa", ("--connector", "nixl", "--model", "bench-gqa")),
    ("nixl-tp1-tp2", ("--connector", "nixl", "--producer", "tp=1", "--consumer", "tp=2")),
    ("nixl-tp2-tp1", ("--connector", "nixl", "--producer", "tp=2", "--consumer", "tp=1")),
    ("nixl-hybrid-tp2-tp1", ("--connector", "nixl", "--model", "tiny-hybrid",
                             "--producer", "tp=2", "--consumer", "tp=1")),
    ("nixl-pp2-tp1", ("--connector", "nixl", "--producer", "tp=1,pp=2", "--consumer", "tp=1")),
    ("mooncake", ("--connector", "mooncake")),
    ("offload", ("--connector", "offload")),
)
QUICK_DEMO_CASES = ("nixl-pull", "offload")


def demo_command(device: str, case: Sequence[str], requests: int, timeout_s: float
                 ) -> list[str]:
    """The ``kvbridge demo`` command line of one case (run from the repository root)."""
    return [sys.executable, "-m", "kvbridge.tools.cli", "demo", "--device", device,
            "--requests", str(requests), "--timeout", str(int(timeout_s)), "--json", *case]


def demo_row(name: str, rc: int, stdout: str, stderr: str, seconds: float) -> dict[str, Any]:
    """One demo's row: ok only when it exited 0 having verified bytes and none differed."""
    row: dict[str, Any] = {"case": name, "rc": rc, "seconds": round(seconds, 1)}
    try:
        summary = json.loads(stdout) if stdout.strip() else {}
    except ValueError:
        summary = {}
    for key in ("requests", "failed_requests", "verified_bytes", "mismatched_bytes",
                "first_transfer_ms", "throughput_gbps"):
        if key in summary:
            row[key] = summary[key]
    if isinstance(summary.get("latency_ms"), dict):
        row["p50_ms"] = summary["latency_ms"].get("p50")
    row["ok"] = (rc == 0 and int(summary.get("verified_bytes", 0)) > 0
                 and int(summary.get("mismatched_bytes", 1)) == 0)
    if not row["ok"]:
        row["error"] = (stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return row


def check_demos(args: argparse.Namespace) -> dict[str, Any]:
    """``kvbridge demo --device`` for every case, ``--jobs`` at a time (each case is its own
    producer and consumer processes, all on the device). A case whose connector's
    library is not on this host (Mooncake's wheel) is reported as not run, not failed.
    On the host (``--device cpu``, a dry run) the KV carries the host-access guard."""
    from concurrent.futures import ThreadPoolExecutor

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    env = dict(os.environ)
    if device == "cpu":
        env["KVBRIDGE_KV_HOST_GUARD"] = "1"
    chosen = [c for c in DEMO_CASES if not args.quick or c[0] in QUICK_DEMO_CASES]
    not_run: dict[str, str] = {}
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # the wheel is missing, or cannot load without its CUDA
        not_run["mooncake"] = f"Mooncake not importable here: {exc!r}"[:200]
    requests = 4 if args.quick else 8

    def one(case: tuple[str, tuple[str, ...]]) -> dict[str, Any]:
        name, argv = case
        started = time.monotonic()
        try:
            done = subprocess.run(demo_command(device, argv, requests, args.demo_timeout),
                                  capture_output=True, text=True, env=env,
                                  timeout=args.demo_timeout + 60)
        except subprocess.TimeoutExpired:
            return {"case": name, "ok": False, "rc": None,
                    "error": f"no answer in {args.demo_timeout + 60:.0f} s",
                    "seconds": round(time.monotonic() - started, 1)}
        return demo_row(name, done.returncode, done.stdout, done.stderr,
                        time.monotonic() - started)

    runnable = [c for c in chosen if c[0] not in not_run]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, runnable))
    rows += [{"case": name, "ok": None, "not_run": why} for name, why in not_run.items()
             if any(c[0] == name for c in chosen)]
    failed = [r["case"] for r in rows if r.get("ok") is False]
    if failed:
        raise RuntimeError(f"demos failed: {failed}: " + json.dumps(
            [r for r in rows if r.get("ok") is False])[:1500])
    return {"device": device, "rows": rows}


def verified_kv(producer: dict[str, Any], consumer: dict[str, Any], name: str
                ) -> dict[str, Any]:
    """The consumer's verification counters (every loaded block verified, none wrong or
    unverified, else RuntimeError) and the producer's digest rate on the device, from
    each engine's ``stats`` call."""
    got = consumer.get("stats", {}).get("worker_stats", {})
    counts = {k: int(got.get(k, 0)) for k in ("blocks_verified", "digest_mismatches",
                                              "blocks_unverified")}
    if not counts["blocks_verified"] or counts["digest_mismatches"] or \
            counts["blocks_unverified"]:
        raise RuntimeError(f"{name}: verified KV counters {counts}")
    made = producer.get("stats", {}).get("worker_stats", {})
    seconds, nbytes = float(made.get("digest_time_s", 0.0)), int(made.get("digest_bytes", 0))
    return {**counts, "producer_digest_bytes": nbytes,
            "producer_digest_gbps": round(nbytes / seconds / 1e9, 3) if seconds else None}


def check_digests(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvbridge.layouts.digests import mix64_combine, mix64_digest
    from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester
    from kvbridge.tools.bench.digests import digest_rates

    device = torch.device(args.device)
    rng = np.random.default_rng(18)
    cases = {"page": (0, 256, 320), "tail": (0, 253, 320), "unaligned": (3, 248, 319)}
    num_blocks, ids = 8, [5, 0, 3, 7, 1]
    for name, (offset, block_bytes, stride) in cases.items():
        raw = rng.integers(0, 256, size=offset + num_blocks * stride + 8, dtype=np.uint8)
        host = torch.from_numpy(raw)[offset:]
        here = host.to(device)

        def digester(t: Any, stride: int = stride, nbytes: int = block_bytes
                     ) -> TorchBlockDigester:
            return TorchBlockDigester({0: TensorSpan(t, stride, nbytes, num_blocks),
                                       1: TensorSpan(t, stride, nbytes, num_blocks)}, [(0, 1)])

        want = [mix64_combine([mix64_digest(raw[offset + b * stride:offset + b * stride
                                                + block_bytes].tobytes())] * 2) for b in ids]
        on_device, on_cpu = digester(here).block_digests(0, ids), digester(host).block_digests(0, ids)
        if not on_device == on_cpu == want:
            raise RuntimeError(f"{name}: device {on_device} cpu {on_cpu} reference {want}")
        here[3 * stride + block_bytes - 1] ^= 0x80  # last byte of block 3 (a tail byte)
        flipped = digester(here).block_digests(0, ids)
        changed = [b for b, x, y in zip(ids, on_device, flipped, strict=True) if x != y]
        if changed != [3]:
            raise RuntimeError(f"{name}: a bit flipped in block 3 changed blocks {changed}")
        # head-slice digests (torch-mix64-v1-slices): word-aligned ranges and ranges
        # inside words, gathered on the device, against the CPU and the reference
        here = host.to(device)
        for layers in (((0, ((8, 64), (128, 16))), (1, ((0, 8),))),
                       ((0, ((3, 29), (200, 1))), (1, ((block_bytes - 6, 6),)))):
            want = [mix64_combine([mix64_digest(b"".join(
                raw[offset + b * stride + o:offset + b * stride + o + n].tobytes()
                for o, n in ranges)) for _layer, ranges in layers]) for b in ids]
            got = digester(here).slice_digests(layers, ids)
            if not got == digester(host).slice_digests(layers, ids) == want:
                raise RuntimeError(f"{name}: slice digests {layers}: device {got} "
                                   f"reference {want}")
    patterns = QUICK_PATTERNS if args.quick else ((4096, 16 << 10), (64, 2 << 20))
    rates = [digest_rates(nb, bb, iters=args.iters, device=args.device) for nb, bb in patterns]
    if not all(r["same_on_cpu"] for r in rates):
        raise RuntimeError(f"device digests differ from the CPU's: {rates}")
    return {"device": str(device), "cases": sorted(cases), "slices": True, "rates": [
        {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rates]}


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "env": check_env, "cuda_ipc": check_cuda_ipc, "transfers": check_transfers,
    "cost": check_cost, "connector": check_connector, "digests": check_digests,
    "stores": check_stores, "demos": check_demos}


# ------------------------------------------------------------------ the report


def _figures(value: Any, prefix: str = "", limit: int = 12) -> list[str]:
    """``key=value`` of the numbers, booleans and short strings in ``value`` (nested
    keys joined by '.'), at most ``limit``: one table cell of figures."""
    out: list[str] = []

    def walk(v: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, bool | int | float) or (isinstance(v, str) and len(v) <= 40):
            out.append(f"{path}={v}")
        elif isinstance(v, list) and v and all(isinstance(x, int | float | str) for x in v):
            out.append(f"{path}={','.join(str(x) for x in v[:6])}")

    walk(value, prefix)
    return out


def report_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """``(check, case, result, figures)`` per check, and per case where a check has
    cases (the demos' rows, the connector's cases, the transfer patterns)."""
    rows: list[tuple[str, str, str, str]] = []
    for name, entry in report["checks"].items():
        result = "ok" if entry["ok"] else "FAIL"
        if not entry["ok"]:
            rows.append((name, "", result, str(entry.get("error", ""))[:300]))
            continue
        detail = entry.get("detail") or {}
        cases = detail.get("rows") if isinstance(detail, dict) else None
        if name == "connector" and isinstance(detail, dict):
            cases = [{"case": k, **v} for k, v in detail.items() if isinstance(v, dict)]
        if isinstance(cases, list) and cases and all(isinstance(c, dict) for c in cases):
            for case in cases:
                state = ("not run" if case.get("ok") is None and "not_run" in case
                         else "ok" if case.get("ok", True) else "FAIL")
                label = str(case.get("case") or case.get("pattern") or case.get("name") or "")
                rest = {k: v for k, v in case.items() if k not in ("case", "ok")}
                rows.append((name, label, state, " ".join(_figures(rest))))
        else:
            rows.append((name, "", result, " ".join(_figures(detail, limit=16))))
    return rows


def format_table(report: dict[str, Any]) -> str:
    rows = [("check", "case", "result", "figures"), *report_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
                     for r in rows)


def format_markdown(report: dict[str, Any]) -> str:
    """docs/gpu.md: when, where (device, driver, torch, NIXL), and every figure."""
    env = report["checks"].get("env", {}).get("detail") or {}
    lines = ["# kvbridge on a GPU: the last run of tests/gpu/run_gpu_checks.sh", "",
             "Written by `tests/gpu/gpu_checks.py --doc`; do not edit by hand: run the script "
             "on a GPU host (see its `--help`) and commit what it writes.", "",
             f"- date: {report.get('date', '?')}",
             f"- device: {env.get('gpu', '?')} (driver {env.get('driver', '?')}); "
             f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')})",
             f"- NIXL: {env.get('nixl', '?')}",
             f"- command: `{report.get('command', '?')}`", "",
             "| check | case | result | figures |", "| --- | --- | --- | --- |"]
    for check, case, result, figures in report_rows(report):
        lines.append(f"| {check} | {case} | {result} | {figures.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_transfers:
        print(json.dumps(run_transfers(args)))
        return 0
    try:
        import torch

        if args.device != "cpu" and not torch.cuda.is_available():
            print("gpu_checks: torch sees no CUDA device: run this on a GPU host",
                  file=sys.stderr)
            return 2
    except ImportError:
        print("gpu_checks: torch is not importable", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"checks": {}, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime()),
                              "command": " ".join(["gpu_checks.py", *(argv or sys.argv[1:])])}
    failed = False
    for name in args.checks:
        t0 = time.monotonic()
        try:
            detail = RUNNERS[name](args)
            entry = {"ok": True, "detail": detail}
        except Exception as exc:
            failed = True
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        entry["seconds"] = round(time.monotonic() - t0, 2)
        report["checks"][name] = entry
        shown = json.dumps(entry.get("detail", entry.get("error")))[:2000]
        print(f"[{'ok  ' if entry['ok'] else 'FAIL'}] {name} ({entry['seconds']} s): {shown}",
              flush=True)
    print()
    print(format_table(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.doc:
        Path(args.doc).write_text(format_markdown(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
