"""`kvbridge bench nixl`: raw NIXL vs the kvbridge connector end to end vs a torch copy.

The same held producer blocks are moved four ways, interleaved, in one run:

* **raw NIXL** -- the library called directly (its own agent, the producer
  rank's metadata from the handshake) with one prepared READ of all blocks
  into a fresh buffer, re-posted each iteration;
* **raw NIXL into the KV cache** -- the same raw READ, but into the very
  blocks of the consumer engine's KV tensor that the connector's load gets;
* **kvbridge** -- the ``nixl`` connector end to end: a producer engine process
  holds the request's blocks (prefilled once, then prefix-cached, so every
  iteration is a fresh held request), and a consumer engine in this process
  loads them through the connector. One sample is a request's load on the
  consumer rank, from the step that ordered it to the producer's ack: index
  arrays built from the block ids, the READ (indices into lists prepared at
  handshake time), the ReadDone notification and the lease ack;
* **torch copy** of the same number of bytes in one process: the memory
  bandwidth limit.

The connector's load runs three times per iteration, each on its own held
request: with its default verification (``sample``: 1/16 of the blocks
checked against the producer's digests; the ``kvbridge`` column), ``full`` and
``off``; the ratios of the first two to ``off`` are the cost of verified KV on
the consumer. The producer takes its
digests when a hold starts, off the consumer's clock: its rate is reported
from its own counters (``producer_digest_gbps``).

Block order matters with many small blocks: NIXL merges descriptors that are
contiguous on both sides into one, and merged 16 KiB blocks move about twice
as fast as unmerged ones. ``block_order="sorted"`` (the reference engine's
default) hands each request ascending blocks; ``"vllm"`` keeps the free
queue's order, where a request's blocks run downwards once a finished
request freed its blocks tail first (the connector still sorts each request's
block pairs, which merges runs that descend on both sides, not runs that
ascend on one side and descend on the other).

A one-layer spec makes one block exactly ``block_bytes`` (one descriptor per
block on both paths). The first iteration (handshake, first READ) is verified
byte for byte against the content function and not timed.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from kvbridge.connectors import ConnectorConfig, KVRole, TransferMode
from kvbridge.engine.content import VOCAB_SIZE
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.layouts import KVCacheSpec, ParallelTopology, RegionLayout, RegionSpec
from kvbridge.layouts.digests import DigestMode
from kvbridge.tools.bench.nixl_peer import wait_raw_transfer
from kvbridge.tools.bench.rows import paired_ratio

DEFAULT_PATTERNS = ((64, 2 << 20), (4096, 16 << 10))
BLOCK_ORDERS = ("sorted", "vllm")


def bench_spec(block_bytes: int) -> KVCacheSpec:
    """A one-layer fp16 K+V spec whose block is exactly ``block_bytes`` (HND)."""
    head_dim = 128
    per_token_head = 2 * head_dim * 2  # K and V, fp16
    for block_size in (64, 32, 16, 8, 4, 2, 1):
        heads, rest = divmod(block_bytes, per_token_head * block_size)
        if rest == 0 and heads >= 1:
            return KVCacheSpec(f"bench-{block_bytes}", (
                RegionSpec("attn", RegionLayout.SPLIT, (0,), block_size=block_size,
                           num_kv_heads=heads, head_dim=head_dim, dtype="float16"),))
    raise ValueError(f"block_bytes {block_bytes} is not a multiple of {per_token_head} B")


def _config(spec: KVCacheSpec, role: KVRole, num_blocks: int, tokens: int,
            sorted_allocation: bool = True, **extra: Any) -> EngineConfig:
    return EngineConfig(spec=spec, topology=ParallelTopology(), num_blocks=num_blocks,
                        max_num_batched_tokens=tokens + 64, max_num_seqs=4,
                        sorted_allocation=sorted_allocation,
                        connector=ConnectorConfig("nixl", role, extra={
                            "mode": TransferMode.PULL.value, "transfer_timeout_s": 60.0,
                            **extra}),
                        remote_kv_timeout_s=120.0)


def _prefill(producer: EngineProcess, spec: RequestSpec, timeout_s: float) -> RequestResult:
    producer.submit([replace(spec, remote_decode=True, max_tokens=1)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in producer.results():
            if result.state is not RequestState.FINISHED_LENGTH or not result.transfer_params:
                raise RuntimeError(f"producer prefill of {spec.request_id} failed: {result}")
            return result
        time.sleep(0.005)
    raise TimeoutError(f"producer prefill of {spec.request_id} not done in {timeout_s} s")


class _RawReader:
    """The NIXL library called directly: the producer rank's metadata from the handshake,
    one prepared READ of the held blocks into a local buffer. ``lanes`` > 1: kvbridge's
    transport setting done by hand (``backends.nixl.lanes``): that many agents, each
    reading a contiguous part of the blocks, the parts posted at once from threads."""

    def __init__(self, address: str, total: int, into: Any = None, lanes: int = 1) -> None:
        import torch

        from kvbridge.auth import resolve_auth
        from kvbridge.backends.nixl import load_nixl_api
        from kvbridge.handshake import HandshakeClient

        api = load_nixl_api()
        self.meta = HandshakeClient(timeout_s=5, auth=resolve_auth()).fetch(address).metadata.rank(0)
        # ``into``: read into that tensor (the consumer engine's KV cache) instead of a
        # fresh buffer: the same destination memory the connector writes
        self.buf = torch.zeros(total, dtype=torch.uint8) if into is None else into
        self.agents: list[Any] = []
        self.regs: list[Any] = []
        self.remotes: list[Any] = []
        for k in range(lanes):
            agent = api.nixl_agent(f"raw-bench-{time.monotonic_ns()}-{k}",
                                   api.nixl_agent_config(enable_prog_thread=False,
                                                         backends=["UCX"]))
            self.agents.append(agent)
            self.regs.append(agent.register_memory(self.buf))
            self.remotes.append(agent.add_remote_agent(self.meta.agent_blob))
        self.handles: list[Any] = []
        self.dlists: list[tuple[Any, Any]] = []
        self._pool = ThreadPoolExecutor(lanes - 1) if lanes > 1 else None

    def prepare(self, block_ids: tuple[int, ...], block_bytes: int,
                local_ids: list[int] | None = None) -> None:
        """Prepare the READ of producer ``block_ids`` into local blocks ``local_ids``
        (default: the first ``len(block_ids)`` blocks of the buffer, in order)."""
        import numpy as np

        self.release()
        memory = self.meta.layer_memory()[0]
        remote = np.zeros((len(block_ids), 3), dtype=np.uint64)
        remote[:, 0] = [memory.base_addr + b * memory.block_stride for b in block_ids]
        remote[:, 1] = block_bytes
        ids = range(len(block_ids)) if local_ids is None else local_ids
        local = np.zeros((len(block_ids), 3), dtype=np.uint64)
        local[:, 0] = [self.buf.data_ptr() + b * block_bytes for b in ids]
        local[:, 1] = block_bytes
        n = len(self.agents)
        bounds = [len(block_ids) * k // n for k in range(n + 1)]
        for agent, peer, a, b in zip(self.agents, self.remotes, bounds, bounds[1:],
                                     strict=False):
            ldl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local[a:b], "DRAM")
            rdl = agent.prep_xfer_dlist(peer, remote[a:b], "DRAM")
            self.dlists.append((ldl, rdl))
            idx = np.arange(b - a, dtype=np.int32)
            self.handles.append(agent.make_prepped_xfer("READ", ldl, idx, rdl, idx))

    def _read(self, lane: int, t_end: float) -> None:
        agent, handle = self.agents[lane], self.handles[lane]
        wait_raw_transfer(agent, handle, agent.transfer(handle), t_end, "READ")

    def once(self, deadline_s: float = 60.0) -> None:
        t_end = time.monotonic() + deadline_s
        others = [] if self._pool is None else [
            self._pool.submit(self._read, k, t_end) for k in range(1, len(self.agents))]
        self._read(0, t_end)
        for future in others:
            future.result(timeout=deadline_s)

    def release(self) -> None:
        for agent, handle in zip(self.agents, self.handles, strict=False):
            agent.release_xfer_handle(handle)
        self.handles = []
        for agent, (ldl, rdl) in zip(self.agents, self.dlists, strict=False):
            agent.release_dlist_handle(ldl)
            agent.release_dlist_handle(rdl)
        self.dlists = []

    def close(self) -> None:
        self.release()
        for agent, peer, reg in zip(self.agents, self.remotes, self.regs, strict=True):
            agent.remove_remote_agent(peer)
            agent.deregister_memory(reg)
        if self._pool is not None:
            self._pool.shutdown()


def compare_bench(num_blocks: int, block_bytes: int, *, iters: int = 5,
                  timeout_s: float = 300.0, block_order: str = "sorted") -> dict[str, Any]:
    """Interleaved raw NIXL / kvbridge connector / torch copy of the same held blocks.

    ``block_order``: how both engines hand out blocks (``sorted``, the reference
    engine's default, or ``vllm``: free-queue order, see
    :attr:`EngineConfig.sorted_allocation`)."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order: expected one of {BLOCK_ORDERS}, got {block_order!r}")
    ordered = block_order == "sorted"
    import torch

    spec = bench_spec(block_bytes)
    tokens = num_blocks * spec.regions[0].block_size
    rng = random.Random(5)
    prompt = tuple(rng.randrange(VOCAB_SIZE) for _ in range(tokens))
    pool = num_blocks + 4
    total = num_blocks * block_bytes
    times: dict[str, list[float]] = {"raw": [], "raw_kv": [], "raw_lanes": [], "kvbridge": [],
                                     "copy": [], "kvbridge_off": [], "kvbridge_full": []}
    verified = mismatched = 0
    nbytes = descs = runs = 0
    raw_ok = raw_lanes_ok = True
    src = torch.ones(total, dtype=torch.uint8)
    dst = torch.empty_like(src)
    producer = EngineProcess(_config(spec, KVRole.PRODUCER, pool, tokens, ordered),
                             name="bench-producer",
                             call_timeout_s=120)
    consumer: Engine | None = None
    raw: _RawReader | None = None
    raw_kv: _RawReader | None = None
    raw_lanes: _RawReader | None = None
    try:
        cfg = replace(_config(spec, KVRole.CONSUMER, pool, tokens, ordered),
                      enable_prefix_caching=False)
        consumer = Engine(cfg)
        worker = consumer.workers[0].connector
        assert worker is not None and producer.endpoint is not None
        address = f"{producer.endpoint[0]}:{producer.endpoint[1]}"
        raw = _RawReader(address, total)
        kv_tensor = consumer.workers[0].caches.layers[0]
        raw_kv = _RawReader(address, total, into=kv_tensor)
        default_settings = worker.settings  # type: ignore[attr-defined]
        lanes = default_settings.lanes
        raw_lanes = _RawReader(address, total, lanes=lanes)
        verify_settings = {
            "kvbridge": default_settings,
            "kvbridge_off": replace(default_settings, verify=DigestMode.OFF),
            "kvbridge_full": replace(default_settings, verify=DigestMode.FULL)}
        for i in range(iters + 1):
            rid = f"bench-{i}"
            held = {way: _prefill(producer, RequestSpec(f"{rid}-{way}", prompt, max_tokens=1),
                                  timeout_s) for way in verify_settings}
            result = held["kvbridge"]
            assert result.transfer_params is not None
            raw.prepare(result.transfer_params.block_ids[0], block_bytes)
            raw_lanes.prepare(result.transfer_params.block_ids[0], block_bytes)
            # the very blocks the engine will give the connector's load (its free queue):
            # the same destination pattern (a freed request's blocks come back reversed)
            next_ids = consumer.pools[0].next_allocation(num_blocks)
            raw_kv.prepare(result.transfer_params.block_ids[0], block_bytes, next_ids)
            if i == 1:  # verified once (the warm-up); not while timing
                consumer.set_verify_loads(False)

            def load(rid: str, result: RequestResult) -> RequestResult:
                assert consumer is not None
                consumer.add_request(RequestSpec(rid, prompt, max_tokens=1,
                                                 transfer_params=result.transfer_params))
                deadline = time.monotonic() + timeout_s
                while True:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"consumer load {rid} not done in {timeout_s} s")
                    consumer.step()
                    done = consumer.pop_results()
                    if done:
                        return done[0]

            order = ["raw", "copy", "raw_kv", "raw_lanes", "kvbridge", "kvbridge_off",
                     "kvbridge_full"]
            k = i % len(order)
            for way in order[k:] + order[:k]:
                t0 = time.perf_counter()
                if way == "raw":
                    raw.once()
                    elapsed = time.perf_counter() - t0
                elif way == "raw_kv":
                    raw_kv.once()  # same bytes into blocks 0..n-1 of the KV cache
                    elapsed = time.perf_counter() - t0
                elif way == "raw_lanes":
                    raw_lanes.once()
                    elapsed = time.perf_counter() - t0
                elif way == "copy":
                    dst.copy_(src)
                    elapsed = time.perf_counter() - t0
                else:
                    worker.settings = verify_settings[way]  # type: ignore[attr-defined]
                    final = load(f"{rid}-{way}", held[way])
                    if final.num_recomputed_tokens or \
                            final.state is not RequestState.FINISHED_LENGTH:
                        raise RuntimeError(f"connector load {rid} failed: {final}")
                    record = worker.records()[-1]  # type: ignore[attr-defined]
                    elapsed = record.duration_s
                    if way == "kvbridge":
                        nbytes, descs, runs = record.nbytes, record.num_descs, record.num_runs
                    if i == 0 and way == "kvbridge":
                        verified, mismatched = final.verified_bytes, final.mismatched_bytes
                        # the raw READ (first this iteration) got the bytes the connector
                        # verified; checked now: the other loads reuse these blocks
                        landed = _consumer_bytes(consumer, num_blocks, block_bytes)
                        raw_ok = bool(torch.equal(raw.buf, landed))
                        raw_lanes_ok = bool(torch.equal(raw_lanes.buf, landed))
                if i > 0:
                    times[way].append(elapsed)
        totals = worker.totals()  # type: ignore[attr-defined]
        producer_stats = dict(producer.stats()["stats"]["worker_stats"])
    finally:
        if raw_lanes is not None:
            raw_lanes.close()
        if raw_kv is not None:
            raw_kv.close()
        if raw is not None:
            raw.close()
        if consumer is not None:
            consumer.shutdown()
        producer.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    # the four ways of one iteration run back to back: the median of per-iteration
    # ratios is steadier than the ratio of medians on a noisy (shared, virtual) host
    paired = paired_ratio(times["raw"], times["kvbridge"])
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    produced_s = float(producer_stats.get("digest_time_s", 0.0))
    produced_gbps = (float(producer_stats.get("digest_bytes", 0)) / produced_s / 1e9
                     if produced_s > 0 else None)
    return {"num_blocks": num_blocks, "block_bytes": block_bytes, "total_bytes": total,
            "iters": iters, "block_order": block_order,
            "raw_nixl_gbps": round(gbps["raw"], 3),
            "raw_nixl_into_kv_cache_gbps": round(gbps["raw_kv"], 3),
            # raw NIXL with kvbridge's transport setting: ``lanes`` agents at once
            "lanes": lanes,
            "raw_nixl_lanes_gbps": round(gbps["raw_lanes"], 3),
            "kvbridge_over_raw_lanes": round(gbps["kvbridge"] / gbps["raw_lanes"], 3),
            "raw_lanes_over_memcpy": round(gbps["raw_lanes"] / gbps["copy"], 3),
            "kvbridge_over_memcpy": round(gbps["kvbridge"] / gbps["copy"], 3),
            "kvbridge_gbps": round(gbps["kvbridge"], 3),
            "torch_copy_gbps": round(gbps["copy"], 3),
            "kvbridge_over_raw": round(gbps["kvbridge"] / gbps["raw"], 3),
            "kvbridge_over_raw_paired": round(paired, 3),
            "raw_over_memcpy": round(gbps["raw"] / gbps["copy"], 3),
            "kvbridge_over_raw_same_destination": round(gbps["kvbridge"] / gbps["raw_kv"], 3),
            # verified KV: the connector's load with verification full / the default
            # (sample), over off
            "verify_default": default_settings.verify.value,
            "kvbridge_verify_off_gbps": round(gbps["kvbridge_off"], 3),
            "kvbridge_verify_full_gbps": round(gbps["kvbridge_full"], 3),
            # paired like kvbridge_over_raw_paired: the median of per-iteration ratios
            "verify_full_over_off": round(paired_ratio(times["kvbridge_off"],
                                                       times["kvbridge_full"]), 3),
            "verify_sample_over_off": round(paired_ratio(times["kvbridge_off"],
                                                         times["kvbridge"]), 3),
            "blocks_verified": int(totals.get("blocks_verified", 0)),
            "consumer_digest_gbps": (round(totals["digest_bytes"] / totals["digest_time_s"] / 1e9,
                                           3) if totals.get("digest_time_s") else None),
            "producer_digest_gbps": (round(produced_gbps, 3) if produced_gbps else None),
            "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            "kvbridge_bytes": nbytes, "kvbridge_descriptors": descs,
            "kvbridge_descriptor_runs": runs,
            "verified_bytes": verified, "mismatched_bytes": mismatched,
            "raw_matches_connector": raw_ok and raw_lanes_ok,
            "nixl_live_handles_after": totals.get("nixl_xfer_handles", -1)}


def _consumer_bytes(consumer: Engine, num_blocks: int, block_bytes: int) -> Any:
    """The first ``num_blocks`` blocks the consumer loaded, as bytes (blocks are allocated
    in order on a fresh pool, so they are blocks 0..n-1)."""
    tensor = consumer.workers[0].caches.layers[0]
    return tensor.view(-1).view(dtype=__import__("torch").uint8)[: num_blocks * block_bytes]


def run_nixl_bench(patterns: tuple[tuple[int, int], ...] = DEFAULT_PATTERNS, *,
                   iters: int = 5, timeout_s: float = 300.0,
                   block_order: str = "sorted") -> dict[str, Any]:
    """:func:`compare_bench` for each pattern (target: kvbridge_over_raw >= 0.9)."""
    rows = [compare_bench(nb, bb, iters=iters, timeout_s=timeout_s, block_order=block_order)
            for nb, bb in patterns]
    return {"op": "READ", "block_order": block_order, "patterns": rows,
            "target_kvbridge_over_raw": 0.9}
