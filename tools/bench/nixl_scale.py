"""`kvbridge bench nixl-scale`: set-up cost at a real cache size, kvbridge vs raw NIXL.

A real KV cache is tens of layers x ~10^5 blocks per rank. What has to happen
before the first transfer to a new peer -- register the memory, build the
handshake document, prepare both sides' descriptor lists, post the first
transfer -- must not grow with blocks x layers. This bench does those steps
at that size (default 64 layers x 100,000 blocks per rank, host memory) two
ways, one after the other in one process, against one peer process that holds
the producer's cache (one registered allocation, every layer a slice of it, as
vLLM allocates it):

* **kvbridge** -- :class:`~kvbridge.backends.nixl.NixlTransport` registers the
  consumer's cache (one flat tensor, a view per layer: one registration);
  the handshake document is the consumer rank's own ``AgentMetadata`` built and
  encoded, plus the producer rank's document decoded; the lists are the
  transfer plan's tables prepared in NIXL's strided form (one row per layer
  descriptor) on both sides; the first transfer is a READ of ``request_blocks``
  random blocks of every layer, indices built by the connector's routing.
* **raw NIXL** -- the library called directly doing the same: one agent,
  ``register_memory`` of the same kind of tensor, ``get_agent_metadata``,
  hand-built strided ``(addr, len, dev, stride, count)`` arrays, the same READ.
* optionally (``per_block=True``, one round) kvbridge with **per-block
  lists**: what kvbridge prepared before strided lists (one row per block and
  layer).

Each round creates new agents on both sides (so the first transfer is always
to a new peer), the side that goes first alternating between rounds; a step's
figure is the median over rounds.

Per step: wall time and peak memory above the step's start (``VmHWM``, reset
through ``/proc/self/clear_refs`` before each step, so NIXL's own C++
allocations count too). Block bytes are tiny by default (16 B) so the cache
fits a small machine: set-up cost depends on the number of blocks, not their
size, and every byte registered is real memory that NIXL registers. The
first READ is verified byte for byte against the peer's pattern.
"""

from __future__ import annotations

import gc
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.backends.nixl import NixlTransport, XferState, load_nixl_api, strided_descs
from kvbridge.connectors.pd.routing import consumer_table, producer_table, pull_indices
from kvbridge.handshake import AgentMetadata, decode_agent, encode_agent
from kvbridge.layouts import (
    KVCacheSpec,
    ParallelTopology,
    RegionLayout,
    RegionSpec,
    plan_transfer,
    rank_memory,
)
from kvbridge.tools.bench.nixl_peer import PeerProcess
from kvbridge.tools.bench.nixl_peer import pattern as np_pattern

MIB = 1 << 20
STEPS = ("register", "handshake_doc", "prepare_lists", "first_transfer")
_SEED = 29


def scale_spec(num_layers: int, block_bytes: int) -> KVCacheSpec:
    """``num_layers`` fp16 K+V layers whose block of one layer is ``block_bytes``."""
    for block_size in (16, 8, 4, 2, 1):
        head_dim, rest = divmod(block_bytes, 2 * 2 * block_size)  # K and V, fp16
        if rest == 0 and head_dim >= 1:
            return KVCacheSpec(f"scale-{num_layers}x{block_bytes}", (
                RegionSpec("attn", RegionLayout.SPLIT, tuple(range(num_layers)),
                           block_size=block_size, num_kv_heads=1, head_dim=head_dim,
                           dtype="float16"),))
    raise ValueError(f"block_bytes must be a multiple of 4, got {block_bytes}")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class _Steps:
    """Times and peak memory of named steps."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.peak_mib: dict[str, float | None] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        exact = _reset_peak()
        base = _status_kib("VmRSS")
        t0 = time.perf_counter()
        out = fn()
        self.ms[name] = (time.perf_counter() - t0) * 1e3
        self.peak_mib[name] = (max(0, _status_kib("VmHWM") - base) / 1024) if exact else None
        return out


def _wait(poll: Callable[[], str], deadline_s: float) -> str:
    end = time.monotonic() + deadline_s
    state = poll()
    while state == "PROC" and time.monotonic() < end:
        state = poll()
    return state


def _run_kvbridge(spec: KVCacheSpec, peer: PeerProcess, num_blocks: int, block_ids: np.ndarray,
                  producer_ids: np.ndarray, per_block: bool, peer_bytes: np.ndarray
                  ) -> dict[str, Any]:
    import torch

    topo = ParallelTopology()
    shape = spec.rank_shapes(topo)[0]
    bpl = shape.block_bytes_per_layer
    layers = shape.layer_ids
    flat = torch.zeros(len(layers) * num_blocks * bpl, dtype=torch.uint8)
    steps = _Steps()
    transport: NixlTransport | None = None
    out: dict[str, Any] = {}
    try:
        def register() -> NixlTransport:
            t = NixlTransport(f"scale-kvb-{uuid.uuid4().hex[:8]}")
            t.register_regions([flat[i * num_blocks * bpl:(i + 1) * num_blocks * bpl]
                                for i in range(len(layers))])
            return t

        transport = steps.run("register", register)
        t = transport
        addrs = {layer: flat.data_ptr() + i * num_blocks * bpl for i, layer in enumerate(layers)}
        peer_addrs = {layer: peer.addr + i * num_blocks * bpl for i, layer in enumerate(layers)}
        # the producer rank's document as it would publish it (built here from its address)
        peer_doc = encode_agent(AgentMetadata.build("producer", peer.name, peer.metadata, spec,
                                                    topo, peer_addrs, num_blocks))

        def handshake_doc() -> tuple[bytes, AgentMetadata]:
            mem_type, device_id = t.memory_type
            own = encode_agent(AgentMetadata.build("consumer", t.name, t.agent_metadata(), spec,
                                                   topo, addrs, num_blocks, mem_type=mem_type,
                                                   device_id=device_id))
            return own, decode_agent(peer_doc)

        own_doc, producer = steps.run("handshake_doc", handshake_doc)

        def prepare() -> tuple[Any, ...]:
            rank_plan = plan_transfer(spec, producer.topology, topo).for_consumer(0)
            local = consumer_table(rank_plan, rank_memory(spec, topo, addrs, num_blocks))
            remote = producer_table(rank_plan.for_producer(0), producer.layer_memory())
            ph = t.add_peer(producer.agent_name, producer.agent_blob)
            if per_block:
                ldl = t.prepare_local_descs(local.rows)
                rdl = t.prepare_remote(ph, remote.rows, producer.mem_type)
            else:
                ldl = t.prepare_local_descs(local.strided(t.memory_type[1]))
                rdl = t.prepare_remote(ph, remote.strided(producer.device_id), producer.mem_type)
            return rank_plan, local, remote, ldl, rdl

        rank_plan, local, remote, ldl, rdl = steps.run("prepare_lists", prepare)

        def first() -> Any:
            lidx, ridx, _ = pull_indices(rank_plan, local, remote, 0, (block_ids.tolist(),),
                                         (producer_ids.tolist(),))
            xfer = t.post("READ", ldl, lidx, rdl, ridx, deadline_s=60)
            t.wait(xfer)
            return xfer

        xfer = steps.run("first_transfer", first)
        got = flat.numpy().reshape(len(layers), num_blocks, bpl)[:, block_ids]
        want = peer_bytes.reshape(len(layers), num_blocks, bpl)[:, producer_ids]
        out = {"ms": steps.ms, "peak_mib": steps.peak_mib,
               "handshake_doc_bytes": len(own_doc), "agent_metadata_bytes": len(peer.metadata),
               "list_rows": 2 * (local.num_rows if per_block else local.num_descs),
               "descriptors": 2 * local.num_rows,
               "verified": xfer.state is XferState.DONE and bool(np.array_equal(got, want)),
               "error": xfer.error}
    finally:
        if transport is not None:
            transport.close(strict=False)
    return out


def _run_raw(spec: KVCacheSpec, peer: PeerProcess, num_blocks: int, block_ids: np.ndarray,
             producer_ids: np.ndarray, peer_bytes: np.ndarray) -> dict[str, Any]:
    import torch

    api = load_nixl_api()
    shape = spec.rank_shapes(ParallelTopology())[0]
    bpl, num_layers = shape.block_bytes_per_layer, len(shape.layer_ids)
    span = num_blocks * bpl
    flat = torch.zeros(num_layers * span, dtype=torch.uint8)
    steps = _Steps()
    held: dict[str, Any] = {}
    out: dict[str, Any] = {}

    def register() -> None:
        held["agent"] = api.nixl_agent(f"scale-raw-{uuid.uuid4().hex[:8]}", api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        held["reg"] = held["agent"].register_memory(flat)

    try:
        steps.run("register", register)
        agent = held["agent"]
        md = steps.run("handshake_doc", lambda: bytes(agent.get_agent_metadata()))

        def prepare() -> None:
            starts = np.arange(num_layers, dtype=np.uint64) * np.uint64(span)
            rows_l = np.concatenate([strided_descs(int(flat.data_ptr() + s), bpl, bpl,
                                                   num_blocks) for s in starts.tolist()])
            rows_r = np.concatenate([strided_descs(int(peer.addr + s), bpl, bpl, num_blocks)
                                     for s in starts.tolist()])
            held["ldl"] = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows_l, "DRAM", ["UCX"])
            held["remote"] = agent.add_remote_agent(peer.metadata)
            held["rdl"] = agent.prep_xfer_dlist(held["remote"], rows_r, "DRAM", ["UCX"])

        steps.run("prepare_lists", prepare)

        def first() -> str:
            layer_base = (np.arange(num_layers, dtype=np.int64) * num_blocks)[:, None]
            li = (layer_base + block_ids[None, :]).ravel().astype(np.int32)
            ri = (layer_base + producer_ids[None, :]).ravel().astype(np.int32)
            handle = agent.make_prepped_xfer("READ", held["ldl"], li, held["rdl"], ri, b"",
                                             ["UCX"])
            held["handle"] = handle
            state = agent.transfer(handle)
            return state if state != "PROC" else _wait(lambda: agent.check_xfer_state(handle),
                                                       60)

        state = steps.run("first_transfer", first)
        got = flat.numpy().reshape(num_layers, num_blocks, bpl)[:, block_ids]
        want = peer_bytes.reshape(num_layers, num_blocks, bpl)[:, producer_ids]
        out = {"ms": steps.ms, "peak_mib": steps.peak_mib, "agent_metadata_bytes": len(md),
               "verified": state == "DONE" and bool(np.array_equal(got, want))}
    finally:
        agent = held.get("agent")
        if agent is not None:
            for key in ("handle", "ldl", "rdl"):
                if key in held:
                    held[key].release()
            if "remote" in held:
                agent.remove_remote_agent(held["remote"])
            if "reg" in held:
                agent.deregister_memory(held["reg"])
    return out


def _median_side(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median ms and max peak per step over rounds; sizes from the first, verified by all."""
    out = dict(samples[0])
    out["ms"] = {k: statistics.median(s["ms"][k] for s in samples) for k in STEPS}
    peaks = {k: [s["peak_mib"][k] for s in samples] for k in STEPS}
    out["peak_mib"] = {k: None if None in v else max(v) for k, v in peaks.items()}
    out["ms_samples"] = {k: [round(s["ms"][k], 3) for s in samples] for k in STEPS}
    out["verified"] = all(s["verified"] for s in samples)
    return out


def run_nixl_scale_bench(num_layers: int = 64, num_blocks: int = 100_000,
                         block_bytes: int = 16, request_blocks: int = 64,
                         per_block: bool = False, rounds: int = 3) -> dict[str, Any]:
    """Both ways (and per-block lists if asked, once) against one peer; see the module
    docstring. Each round runs both sides with new agents (new peers), the side that goes
    first alternating; a step's figure is the median of the rounds, its peak the maximum.

    Returns ``{"num_layers", "num_blocks", "block_bytes", "request_blocks", "rounds",
    "kvbridge": {...}, "raw_nixl": {...}[, "kvbridge_per_block": {...}]}``; each
    side has ``ms``, ``ms_samples`` and ``peak_mib`` per step, ``verified`` and sizes.
    """
    spec = scale_spec(num_layers, block_bytes)
    bpl = spec.rank_shapes(ParallelTopology())[0].block_bytes_per_layer
    rng = np.random.default_rng(_SEED)
    consumer_ids = rng.choice(num_blocks, size=min(request_blocks, num_blocks), replace=False)
    producer_ids = rng.choice(num_blocks, size=consumer_ids.size, replace=False)
    NixlTransport(f"scale-warmup-{uuid.uuid4().hex[:8]}").close()  # plugins loaded, untimed
    with PeerProcess(f"scale-peer-{uuid.uuid4().hex[:8]}", num_layers * num_blocks * bpl,
                     seed=_SEED, timeout_s=120) as peer:
        peer_bytes = np_pattern(peer.nbytes, _SEED)
        out: dict[str, Any] = {"num_layers": num_layers, "num_blocks": num_blocks,
                               "block_bytes": bpl, "request_blocks": int(consumer_ids.size),
                               "rounds": rounds}
        samples: dict[str, list[dict[str, Any]]] = {"raw_nixl": [], "kvbridge": []}

        def raw() -> None:
            samples["raw_nixl"].append(_run_raw(spec, peer, num_blocks, consumer_ids,
                                                producer_ids, peer_bytes))

        def kvb() -> None:
            samples["kvbridge"].append(_run_kvbridge(spec, peer, num_blocks, consumer_ids,
                                                     producer_ids, False, peer_bytes))

        for r in range(max(1, rounds)):
            for side in ((raw, kvb) if r % 2 == 0 else (kvb, raw)):
                side()
        out["raw_nixl"] = _median_side(samples["raw_nixl"])
        out["kvbridge"] = _median_side(samples["kvbridge"])
        if per_block:
            out["kvbridge_per_block"] = _median_side([_run_kvbridge(
                spec, peer, num_blocks, consumer_ids, producer_ids, True, peer_bytes)])
    return out
