"""What one transfer costs: kvbridge's transport against raw NIXL doing what one request does.

A request's transfer through :class:`~kvbridge.backends.nixl.NixlTransport` is
``post`` (checks, ``make_prepped_xfer`` on lists prepared once, ``transfer``)
then ``wait`` (polls until DONE, then reads NIXL's telemetry and releases the
handle). The fair raw baseline does the same NIXL calls per transfer on the
same prepared lists: ``make_prepped_xfer``, ``transfer``, ``check_xfer_state``
until DONE, ``release_xfer_handle`` (``raw_per_request``). The older baseline,
one handle made once and re-posted (``raw_reused_handle``), is kept beside them:
it is what NIXL costs when nothing is made or released per transfer.

Per pattern and op (READ and WRITE, in the same run, interleaved in rotating
order with a torch copy of the same bytes) :func:`run_nixl_cost_bench` reports
GB/s of each way, the paired ratio kvbridge / raw per request, the *excess* of
kvbridge over raw per request in µs (median of the per-iteration differences)
and each way's *fixed cost*: the median time of a one-descriptor transfer on
the same lists (``one_desc_us``; of a pattern with small descriptors, the copy
in it is a few µs at most), with kvbridge's paired excess over raw per request.

Patterns: ``(num_descs, desc_bytes)`` as before (64 x 2 MiB, 4096 x 16 KiB),
and request-sized ones from :func:`request_pattern`: the KV of one prompt of a
70B-class model (80 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks)
on one rank at tensor parallelism ``tp``: one descriptor per layer, K or V,
and block; the remote side's descriptors in a fixed random order, as a
request's blocks lie scattered in the producer's pool (so NIXL cannot merge
neighbours into one: the worst case for per-descriptor work).

``device`` "cuda[:N]" puts both buffers in GPU memory (VRAM; the peer's too);
the torch copy is then a device copy, synchronised. Nothing here is a test:
figures go to ``kvbridge bench nixl-cost`` and the GPU script.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.backends.nixl import NixlTransport, XferState, load_nixl_api, strided_descs
from kvbridge.tools.bench.nixl_peer import PeerProcess, pattern, wait_raw_transfer
from kvbridge.tools.bench.rows import paired_ratio

if TYPE_CHECKING:
    import torch

__all__ = ["CostPattern", "check_memory", "default_cost_patterns", "memory_needed",
           "request_pattern", "run_nixl_cost_bench"]

#: the 70B-class model of the request-sized patterns (Llama-3-70B's KV shape)
MODEL_LAYERS = 80
MODEL_KV_HEADS = 8
MODEL_HEAD_DIM = 128
MODEL_DTYPE_BYTES = 2  # bf16
BLOCK_TOKENS = 16
#: tensor parallelism of the request-sized patterns: 2 KV heads per rank
DEFAULT_TP = 4
#: one-descriptor transfers per way and iteration (the fixed cost's sample)
_SINGLE_REPEATS = 20


@dataclass(frozen=True)
class CostPattern:
    """``num_descs`` descriptors of ``desc_bytes`` each in one transfer; ``scattered``:
    the remote descriptors are taken in a fixed random order (no two neighbours)."""

    label: str
    num_descs: int
    desc_bytes: int
    scattered: bool = False

    @property
    def total_bytes(self) -> int:
        return self.num_descs * self.desc_bytes


def request_pattern(tokens: int, *, layers: int = MODEL_LAYERS, tp: int = DEFAULT_TP,
                    kv_heads: int = MODEL_KV_HEADS, head_dim: int = MODEL_HEAD_DIM,
                    dtype_bytes: int = MODEL_DTYPE_BYTES,
                    block_tokens: int = BLOCK_TOKENS) -> CostPattern:
    """One rank's transfer of a ``tokens``-token prompt's KV: ``layers`` x 2 (K, V) x
    blocks descriptors of ``block_tokens * kv_heads/tp * head_dim * dtype_bytes`` bytes.

    At the defaults (TP 4: 2 KV heads per rank) a 4k-token prompt is 40,960
    descriptors of 8 KiB (320 MiB) and a 32k-token one 327,680 (2.5 GiB).
    ``layers`` fewer scales a pattern down for a small host (the per-descriptor
    size stays the model's)."""
    if min(tokens, layers, tp, kv_heads, head_dim, dtype_bytes, block_tokens) < 1:
        raise ValueError("request_pattern: every size must be >= 1")
    if kv_heads % tp:
        raise ValueError(f"request_pattern: {kv_heads} KV heads do not split over TP {tp}")
    blocks = -(-tokens // block_tokens)
    desc_bytes = block_tokens * (kv_heads // tp) * head_dim * dtype_bytes
    label = f"{tokens // 1024}k-tok L{layers} TP{tp}" if tokens % 1024 == 0 else \
        f"{tokens}-tok L{layers} TP{tp}"
    return CostPattern(label, layers * 2 * blocks, desc_bytes, scattered=True)


def default_cost_patterns(layers: int = MODEL_LAYERS, tp: int = DEFAULT_TP,
                          quick: bool = False) -> tuple[CostPattern, ...]:
    """Today's block patterns and the 4k- and 32k-token requests (``quick``: small ones)."""
    if quick:
        return (CostPattern("16x64KiB", 16, 64 << 10),
                request_pattern(4096, layers=min(layers, 1), tp=tp))
    return (CostPattern("64x2MiB", 64, 2 << 20), CostPattern("4096x16KiB", 4096, 16 << 10),
            request_pattern(4096, layers=layers, tp=tp),
            request_pattern(32768, layers=layers, tp=tp))


#: bytes this process and its peer hold per byte of a pattern, at the peak: on the host
#: the peer's buffer, the local one, the copy's destination and the verification's
#: arrays (the peer's content, the expected bytes, a fresh pattern, where it lands);
#: with ``device`` CUDA the three buffers are on the device and the host keeps the rest
_HOST_COPIES = {"cpu": 7, "cuda": 5}
_DEVICE_COPIES = 3


def memory_needed(p: CostPattern, device: str = "cpu") -> tuple[int, int]:
    """``(host_bytes, device_bytes)`` a run of ``p`` holds at its peak."""
    on_cpu = device == "cpu"
    return (p.total_bytes * _HOST_COPIES["cpu" if on_cpu else "cuda"],
            0 if on_cpu else p.total_bytes * _DEVICE_COPIES)


def check_memory(patterns: Sequence[CostPattern], device: str,
                 host_available_bytes: int | None) -> None:
    """Refuse, before anything is allocated, a pattern that would not fit: the host's
    ``host_available_bytes`` (None: not checked) and the CUDA device's free memory."""
    free_device = None
    if device != "cpu":
        import torch

        free_device = int(torch.cuda.mem_get_info(torch.device(device))[0])
    for p in patterns:
        host, dev = memory_needed(p, device)
        if host_available_bytes is not None and host > host_available_bytes:
            raise ValueError(f"pattern {p.label} needs ~{host / 2**30:.1f} GiB of host memory "
                             f"({p.total_bytes / 2**30:.2f} GiB moved), "
                             f"{host_available_bytes / 2**30:.1f} GiB available: fewer layers "
                             f"(--layers) or a smaller --pattern")
        if free_device is not None and dev > free_device:
            raise ValueError(f"pattern {p.label} needs ~{dev / 2**30:.1f} GiB on {device}, "
                             f"{free_device / 2**30:.1f} GiB free: fewer layers (--layers)")


# ------------------------------------------------------------------ the ways


class _Raw:
    """Raw NIXL on its own agent: the same lists as kvbridge's, prepared once."""

    def __init__(self, peer: PeerProcess, local: torch.Tensor, descs: tuple[np.ndarray,
                 np.ndarray], mem_type: str, deadline_s: float) -> None:
        api = load_nixl_api()
        self.deadline_s = deadline_s
        self.agent = api.nixl_agent(f"raw-cost-{os.getpid()}-{time.monotonic_ns()}",
                                    api.nixl_agent_config(enable_prog_thread=False,
                                                          enable_listen_thread=False,
                                                          backends=["UCX"]))
        self.reg = self.agent.register_memory(local)
        self.remote = self.agent.add_remote_agent(peer.metadata)
        self.ldl = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs[0], mem_type, ["UCX"])
        self.rdl = self.agent.prep_xfer_dlist(self.remote, descs[1], mem_type, ["UCX"])
        self.reused: dict[tuple[str, int], Any] = {}

    def per_request(self, op: str, li: np.ndarray, ri: np.ndarray) -> None:
        """What one request does: make, post, wait, release."""
        t_end = time.monotonic() + self.deadline_s
        handle = self.agent.make_prepped_xfer(op, self.ldl, li, self.rdl, ri, b"", ["UCX"])
        try:
            wait_raw_transfer(self.agent, handle, self.agent.transfer(handle), t_end)
        finally:
            self.agent.release_xfer_handle(handle)

    def make_release(self, op: str, li: np.ndarray, ri: np.ndarray) -> None:
        """The part of a request's transfer that a reused handle skips: make and release."""
        self.agent.release_xfer_handle(
            self.agent.make_prepped_xfer(op, self.ldl, li, self.rdl, ri, b"", ["UCX"]))

    def reused_handle(self, op: str, li: np.ndarray, ri: np.ndarray) -> None:
        """One handle per (op, size), made the first time and re-posted."""
        key = (op, int(li.size))
        handle = self.reused.get(key)
        if handle is None:
            handle = self.reused[key] = self.agent.make_prepped_xfer(
                op, self.ldl, li, self.rdl, ri, b"", ["UCX"])
        wait_raw_transfer(self.agent, handle, self.agent.transfer(handle),
                  time.monotonic() + self.deadline_s)

    def close(self) -> None:
        for handle in self.reused.values():
            self.agent.release_xfer_handle(handle)
        self.agent.release_dlist_handle(self.ldl)
        self.agent.release_dlist_handle(self.rdl)
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.reg)


class _Kvbridge:
    """kvbridge's transport, as a connector uses it: lists prepared once, a ``post``
    and a ``wait`` per transfer."""

    def __init__(self, peer: PeerProcess, local: torch.Tensor, descs: tuple[np.ndarray,
                 np.ndarray], mem_type: str, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.transport = NixlTransport()  # one lane: raw NIXL runs on one agent too
        try:
            self.transport.register_regions([local])
            self.ldl = self.transport.prepare_local_descs(descs[0])
            ph = self.transport.add_peer(peer.name, peer.metadata)
            self.rdl = self.transport.prepare_remote(ph, descs[1], mem_type)
        except BaseException:
            self.transport.close(strict=False)
            raise

    def transfer(self, op: str, li: np.ndarray, ri: np.ndarray) -> None:
        t = self.transport
        xfer = t.post(op, self.ldl, li, self.rdl, ri, deadline_s=self.deadline_s)
        if t.wait(xfer) is not XferState.DONE:
            raise RuntimeError(f"kvbridge {op} {xfer.state.value}: {xfer.error}")

    def close(self) -> int:
        return self.transport.close().live


# ------------------------------------------------------------------ the bench


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize(torch.device(device))


def _host(local: torch.Tensor) -> np.ndarray:
    return np.asarray(local.cpu().numpy())


def _peer_matches(peer: PeerProcess, want: np.ndarray, total: int) -> bool:
    """Three 4 MiB samples of the peer's buffer (start, middle, end) equal ``want``."""
    chunk = min(total, 4 << 20)
    return all(peer.read(off, chunk) == want[off:off + chunk].tobytes()
               for off in sorted({0, (total - chunk) // 2, total - chunk}))


def _verify_ways(peer: PeerProcess, local: torch.Tensor, ways: dict[str, Callable[..., None]],
                 li: np.ndarray, ri: np.ndarray, desc_bytes: int, seed: int,
                 device: str) -> bool:
    """Each way once per op, its bytes checked: READ into a zeroed buffer equals the
    peer's (the remote order applied), WRITE of a fresh pattern lands at the peer."""
    import torch

    total = int(li.size) * desc_bytes
    at_peer = pattern(total, seed)  # the peer's content: each WRITE below changes it
    ok = True
    for k, (name, fn) in enumerate(ways.items()):
        local.zero_()
        _sync(device)
        fn("READ", li, ri)
        _sync(device)
        ok = ok and bool(np.array_equal(_host(local),
                                        at_peer.reshape(-1, desc_bytes)[ri].reshape(-1)))
        mine = pattern(total, seed + 1 + k)
        local.copy_(torch.from_numpy(mine).to(local.device))
        _sync(device)
        fn("WRITE", li, ri)
        landed = np.empty_like(mine).reshape(-1, desc_bytes)
        landed[ri] = mine.reshape(-1, desc_bytes)  # where each local descriptor went
        at_peer = landed.reshape(-1)
        ok = ok and _peer_matches(peer, at_peer, total)
        if not ok:
            raise RuntimeError(f"{name}: the bytes moved are wrong")
    return ok


def _step(fn: Callable[..., None], op: str, li: np.ndarray, ri: np.ndarray, repeats: int,
          device: str) -> Callable[[], None]:
    """``repeats`` transfers of one way (then the device synchronised) as one timed step."""
    def run() -> None:
        for _ in range(repeats):
            fn(op, li, ri)
        _sync(device)
    return run


def _one(p: CostPattern, *, device: str, min_iters: int, min_time_s: float,
         deadline_s: float) -> dict[str, Any]:
    import torch

    total = p.total_bytes
    seed = 11
    mem_type = "DRAM" if device == "cpu" else "VRAM"
    rng = np.random.default_rng(5)
    li = np.arange(p.num_descs, dtype=np.int32)
    ri = (rng.permutation(p.num_descs) if p.scattered
          else np.arange(p.num_descs)).astype(np.int32)  # its own array, as a connector's
    li1, ri1 = li[:1].copy(), ri[:1].copy()
    if device != "cpu":  # UCX's CUDA transports need a current CUDA context on this thread
        torch.cuda.set_device(torch.device(device))
    peer = PeerProcess(f"cost-peer-{os.getpid()}-{p.num_descs}x{p.desc_bytes}", total,
                       seed=seed, device=device)
    raw: _Raw | None = None
    kvb: _Kvbridge | None = None
    leaks = -1
    try:
        local = torch.zeros(total, dtype=torch.uint8, device=device)
        dev = (local.device.index or 0) if device != "cpu" else 0
        descs = (strided_descs(local.data_ptr(), p.desc_bytes, p.desc_bytes, p.num_descs, dev),
                 strided_descs(peer.addr, p.desc_bytes, p.desc_bytes, p.num_descs,
                               peer.device_id))
        raw = _Raw(peer, local, descs, mem_type, deadline_s)
        kvb = _Kvbridge(peer, local, descs, mem_type, deadline_s)
        ways: dict[str, Callable[..., None]] = {"raw_reused_handle": raw.reused_handle,
                                                "raw_per_request": raw.per_request,
                                                "kvbridge": kvb.transfer}
        verified = _verify_ways(peer, local, ways, li, ri, p.desc_bytes, seed, device)
        dst = torch.empty_like(local)
        dst.copy_(local)
        _sync(device)

        def copy() -> None:
            dst.copy_(local)
            _sync(device)

        steps: list[tuple[str, Callable[[], None]]] = [("torch_copy", copy)]
        for op in ("READ", "WRITE"):
            for name, fn in ways.items():
                steps.append((f"{name}:{op}", _step(fn, op, li, ri, 1, device)))
                steps.append((f"{name}:{op}:1", _step(fn, op, li1, ri1, _SINGLE_REPEATS,
                                                      device)))
            steps.append((f"make_release:{op}", _step(raw.make_release, op, li, ri, 1, device)))
        times: dict[str, list[float]] = {key: [] for key, _ in steps}
        t_stop = time.perf_counter() + min_time_s
        n = 0
        while n < min_iters or (time.perf_counter() < t_stop and n < 10_000):
            k = n % len(steps)  # rotate: no way always follows another
            for key, fn in steps[k:] + steps[:k]:
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                times[key].append(elapsed / _SINGLE_REPEATS if key.endswith(":1") else elapsed)
            n += 1
    finally:
        if raw is not None:
            raw.close()
        if kvb is not None:
            leaks = kvb.close()
        peer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ops: dict[str, Any] = {}
    for op in ("READ", "WRITE"):
        kv, req = times[f"kvbridge:{op}"], times[f"raw_per_request:{op}"]
        ops[op] = {
            "gbps": {name: round(total / med[f"{name}:{op}"] / 1e9, 3) for name in ways},
            # NIXL making and releasing the pattern's handle, nothing posted
            "raw_make_release_us": round(med[f"make_release:{op}"] * 1e6, 2),
            "one_desc_us": {name: round(med[f"{name}:{op}:1"] * 1e6, 2) for name in ways},
            "kvbridge_one_desc_excess_us": round(statistics.median(
                (k - r) * 1e6 for r, k in zip(times[f"raw_per_request:{op}:1"],
                                               times[f"kvbridge:{op}:1"], strict=True)), 2),
            # iterations run each way back to back: paired figures are steadier on a
            # shared host than the ratio or difference of two medians
            "kvbridge_over_raw_per_request": round(paired_ratio(req, kv), 3),
            "kvbridge_over_raw_reused_handle": round(
                paired_ratio(times[f"raw_reused_handle:{op}"], kv), 3),
            "kvbridge_excess_us": round(statistics.median(
                (k - r) * 1e6 for r, k in zip(req, kv, strict=True)), 2),
        }
    return {"pattern": p.label, "num_descs": p.num_descs, "desc_bytes": p.desc_bytes,
            "total_bytes": total, "scattered": p.scattered, "device": device,
            "torch_copy_gbps": round(total / med["torch_copy"] / 1e9, 3), "iters": n,
            "ops": ops, "verified": verified, "kvbridge_leaks": leaks}


def run_nixl_cost_bench(patterns: Sequence[CostPattern] | None = None, *,
                        device: str = "cpu", min_iters: int = 5, min_time_s: float = 2.0,
                        deadline_s: float = 60.0,
                        host_available_bytes: int | None = None) -> dict[str, Any]:
    """Per pattern: raw NIXL (handle reused; handle per request) and kvbridge's transport,
    READ and WRITE, and a torch copy of the same bytes, interleaved (module docstring).

    Each row: ``ops[op]["gbps"|"one_desc_us"][way]`` for the ways ``raw_reused_handle``,
    ``raw_per_request`` and ``kvbridge``; ``kvbridge_over_raw_per_request`` (the fair
    ratio) and ``..._reused_handle`` (paired medians); ``kvbridge_excess_us`` and
    ``kvbridge_one_desc_excess_us`` (kvbridge's time over raw per request, per transfer
    of the pattern and of one descriptor); ``raw_make_release_us`` (NIXL's
    ``make_prepped_xfer`` + ``release_xfer_handle`` of the pattern, nothing posted: what
    a reused handle saves); ``torch_copy_gbps``; ``verified``
    (every way's READ and WRITE bytes checked once before timing) and
    ``kvbridge_leaks`` (live NIXL objects at close: 0). A peer process per pattern,
    always reaped. Every pattern is checked against ``host_available_bytes`` (None:
    not checked) and a CUDA device's free memory before anything is allocated
    (:func:`check_memory`)."""
    chosen = tuple(patterns) if patterns is not None else default_cost_patterns()
    check_memory(chosen, device, host_available_bytes)
    rows = [_one(p, device=device, min_iters=min_iters, min_time_s=min_time_s,
                 deadline_s=deadline_s) for p in chosen]
    return {"device": device, "patterns": rows,
            "one_desc": "median time of a one-descriptor transfer on the same lists"}
