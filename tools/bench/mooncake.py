"""``kvbridge bench mooncake``: the connector's put/get against Mooncake's own batch calls.

Same run, same bytes, same store: a one-layer model (``layers`` to change it)
whose block (of one layer) is exactly ``block_bytes``, a producer-side worker half whose KV tensor
is the source and a consumer-side worker half whose KV tensor is the
destination, both registered with one pooled client. Per round:

* **connector put**: ``wait_for_save`` with the step's metadata naming every
  block (keys built from the block hashes, one batch put, per-block results,
  KV events) -- the worker half's whole save path;
* **connector get**: ``start_load_kv`` with a synchronous load of every block
  (keys, bounds checks, one batch get, per-block results);
* **raw put / get**: ``MooncakeDistributedStore.batch_put_from`` /
  ``batch_get_into`` on the same tensors with pre-built keys of the same length.

The connector's put always includes its digest records (its readers need them: one
XXH3-64 per block and layer, put as a companion key by a call beside the KV's); its
get runs once per verification mode (``verify_modes``: a consumer half per
mode with its own destination tensor): ``off`` (no record fetched, nothing
checked), ``sample`` (the default fraction), ``full`` (every block checked).
``connector`` in the report is the connector's default mode
(:data:`~kvbridge.layouts.digests.DEFAULT_MODE`, ``sample``: what a user
gets); ``verify`` has every mode and ``verify_ratio`` each mode's throughput
over ``off``'s (paired per round like the headline ratio), i.e. what
verification costs. With
``layers`` > 1 every block is one object per layer (as in a real model), so a
record adds one key per ``layers`` objects instead of doubling the keys.

``device`` puts both workers' KV on that device (``"cuda"`` on a GPU host);
``guard`` wraps it as device KV (:func:`~kvbridge.layouts.kv_memory.guard_host_access`,
for a CPU run of the same path). KV the host cannot read goes through the
connector's staging buffer (:mod:`.staging`); Mooncake itself can only read host
memory, so the raw side then puts and gets pinned host copies of the same bytes:
the ratio is what staging costs over Mooncake at its best, and ``staged`` says
which path ran.

Every side uses fresh keys each round (a put on an existing key is a no-op)
and the order of the sides rotates each round; every get is verified byte for
byte outside the timing; keys are removed after each round. The headline ratio is the median of
per-round paired ratios (connector / raw), robust to drifting machine load;
the ratio of best rounds is reported next to it.
The scheduler half's bookkeeping (building the metadata) is not timed.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.backends.device.copy import host_buffer
from kvbridge.backends.mooncake.master import master_endpoint  # also applies env defaults
from kvbridge.connectors.api import ConnectorContext, KVCaches
from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.mooncake_store.settings import MAX_STAGING_BYTES, parse_settings
from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker
from kvbridge.events import BlockStored, Locality, Medium
from kvbridge.layouts import KVCacheSpec, ParallelTopology, RegionLayout, RegionSpec
from kvbridge.layouts.digests import DEFAULT_MODE, DigestMode
from kvbridge.layouts.kv_memory import guard_host_access
from kvbridge.tools.bench.rows import gbps, memcpy_seconds, paired_ratio, size_label

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_PATTERNS: tuple[tuple[int, int], ...] = ((64, 2 * MiB), (4096, 16 << 10))
_BLOCK_TOKENS = 16
_HEAD_DIM = 128
_ELEM = 2  # float16
VERIFY_MODES = tuple(m.value for m in DigestMode)  # off, sample, full


def bench_spec(block_bytes: int, layers: int = 1) -> KVCacheSpec:
    """A ``layers``-layer key+value float16 model whose per-layer block is ``block_bytes``."""
    unit = 2 * _BLOCK_TOKENS * _HEAD_DIM * _ELEM
    if block_bytes % unit:
        raise ValueError(f"block_bytes must be a multiple of {unit} bytes, got {block_bytes}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    region = RegionSpec(name="attn", layout=RegionLayout.SPLIT, layer_ids=tuple(range(layers)),
                        block_size=_BLOCK_TOKENS, num_kv_heads=block_bytes // unit,
                        head_dim=_HEAD_DIM, dtype="float16")
    return KVCacheSpec(model=f"kvbridge-bench-{block_bytes}-{layers}", regions=(region,))


def run_bench(patterns: Sequence[tuple[int, int]] = DEFAULT_PATTERNS, *, rounds: int = 7,
              master_address: str | None = None, metadata_server: str | None = None,
              verify_modes: Sequence[str] = VERIFY_MODES, layers: int = 1,
              device: str = "cpu", guard: bool = False) -> dict[str, Any]:
    """Measure connector and raw put/get GB/s per ``(num_blocks, block_bytes)`` pattern.

    Starts a local ``mooncake_master`` unless an address is given. Returns a
    JSON-ready dict (see the module doc); ``target_ratio`` is 0.9.
    ``verify_modes``: the connector's get is measured in each (the default always).
    ``layers``: layers of the model, each block one object per layer (a pattern's
    bytes are per layer; a block's digest record is one more key per block).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    modes = tuple(dict.fromkeys((*(DigestMode(m).value for m in verify_modes),
                                 DEFAULT_MODE.value)))
    max_bytes = max(n * b for n, b in patterns) * layers
    segment = max(64 * MiB, 3 * max_bytes)
    report: dict[str, Any] = {"rounds": rounds, "segment_bytes": segment, "target_ratio": 0.9,
                              "layers": layers, "device": device, "guard": guard,
                              "patterns": []}
    with master_endpoint(master_address, metadata_server) as (rpc, metadata, local):
        report["master"] = rpc
        report["local_master"] = local
        extra = {"master_address": rpc, "metadata_server": metadata,
                 "global_segment_size": segment, "local_buffer_size": 16 * MiB,
                 "op_timeout_s": 60.0, "load_async": False,
                 "client_scope": "engine"}
        for num_blocks, block_bytes in patterns:
            report["patterns"].append(_bench_pattern(extra, num_blocks, block_bytes, rounds,
                                                     modes, layers, device, guard))
    return report


def _worker(spec: KVCacheSpec, extra: dict[str, Any], role: KVRole, num_blocks: int,
            fill: bool, device: str = "cpu", guard: bool = False,
            ) -> tuple[MooncakeStoreWorker, Any]:
    import torch

    topology = ParallelTopology()
    config = ConnectorConfig("mooncake_store", role, extra=extra, engine_id="bench")
    ctx = ConnectorContext(spec=spec, topology=topology, config=config,
                           num_blocks=(num_blocks,), extra=parse_settings(extra),
                           rank=topology, worker_index=0)
    shape = spec.rank_shapes(topology)[0]
    # every layer in one allocation (layer-major): one tensor to fill, compare and copy
    tensor = torch.zeros((len(shape.layer_ids), *shape.tensor_shape(num_blocks)),
                         dtype=torch.float16)
    if fill:
        tensor.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    tensor = tensor.to(device)
    if guard:
        tensor = guard_host_access(tensor)
    worker = MooncakeStoreWorker(ctx)
    worker.register_kv_caches(KVCaches((shape,), (num_blocks,),
                                       {layer: tensor[i]
                                        for i, layer in enumerate(shape.layer_ids)}))
    return worker, tensor


def _bench_pattern(extra: dict[str, Any], num_blocks: int, block_bytes: int,
                   rounds: int, modes: Sequence[str], layers: int, device: str = "cpu",
                   guard: bool = False) -> dict[str, Any]:
    import torch

    spec = bench_spec(block_bytes, layers)
    total = num_blocks * block_bytes * layers
    if device != "cpu" or guard:  # staging: a bound that holds the whole pattern each way
        extra = {**extra, "staging_bytes": min(MAX_STAGING_BYTES, max(2 * total, 2 * MiB))}
    producer, src = _worker(spec, extra, KVRole.PRODUCER, num_blocks, fill=True,
                            device=device, guard=guard)
    consumers: dict[str, tuple[MooncakeStoreWorker, Any]] = {}
    try:
        for mode in modes:
            consumers[mode] = _worker(spec, {**extra, "verify": mode}, KVRole.CONSUMER,
                                      num_blocks, fill=False, device=device, guard=guard)
        return _measure(producer, src, consumers, num_blocks, block_bytes, rounds, total,
                        torch)
    finally:
        for consumer, _ in consumers.values():
            consumer.shutdown()
        producer.shutdown()


def _measure(producer: MooncakeStoreWorker, src: Any,
             consumers: dict[str, tuple[MooncakeStoreWorker, Any]], num_blocks: int,
             block_bytes: int, rounds: int, total: int, torch: Any) -> dict[str, Any]:
    client = producer.client
    assert client is not None and all(c.client is client for c, _ in consumers.values())
    staged = producer.staged is not None
    raw_src, raw_dst = src, consumers[DEFAULT_MODE.value][1]
    if staged:  # Mooncake reads host memory only: pinned host copies of the same bytes
        raw_src = host_buffer(total, src.device).copy_(src.view(-1).view(torch.uint8).cpu())
        raw_dst = host_buffer(total, src.device)
        for buffer in (raw_src, raw_dst):
            client.register_buffer(int(buffer.data_ptr()), total)
    try:
        return _rounds(producer, src, raw_src, raw_dst, consumers, num_blocks, block_bytes,
                       rounds, total, torch) | {"staged": staged}
    finally:
        if staged:
            for buffer in (raw_src, raw_dst):
                client.unregister_buffer(int(buffer.data_ptr()))


def _rounds(producer: MooncakeStoreWorker, src: Any, raw_src: Any, raw_dst: Any,
            consumers: dict[str, tuple[MooncakeStoreWorker, Any]], num_blocks: int,
            block_bytes: int, rounds: int, total: int, torch: Any) -> dict[str, Any]:
    client = producer.client
    assert client is not None
    raw = client.raw_store
    prefixes = [slot.prefix for slot in producer.plans[0].layers]
    record_prefix = producer.plans[0].digest_prefix
    layers = len(prefixes)
    layer_bytes = num_blocks * block_bytes
    src_ptrs = [raw_src.data_ptr() + layer * layer_bytes + i * block_bytes
                for layer in range(layers) for i in range(num_blocks)]
    dst_ptrs = [raw_dst.data_ptr() + layer * layer_bytes + i * block_bytes
                for layer in range(layers) for i in range(num_blocks)]
    sizes = [block_bytes] * (num_blocks * layers)
    names = ("raw", *(f"connector:{m}" for m in consumers))
    times: dict[str, dict[str, list[float]]] = {s: {"put": [], "get": []} for s in names}
    failures = dict.fromkeys(names, 0)
    mismatched = 0
    event = BlockStored(block_hashes=(b"",), parent_block_hash=None, token_ids=(),
                        block_size=_BLOCK_TOKENS, medium=Medium.STORAGE.value,
                        locality=Locality.REMOTE.value, group_idx=0)

    def connector_round(mode: str) -> tuple[float, float, bool, list[str]]:
        consumer = consumers[mode][0]
        hashes = [os.urandom(32) for _ in range(num_blocks)]
        save = StoreMetadata(saves=tuple(SaveBlock(0, i, h, event)
                                         for i, h in enumerate(hashes)))
        load = StoreMetadata(loads={"bench": tuple(LoadBlock(0, i, h)
                                                   for i, h in enumerate(hashes))})
        before = producer.get_stats()
        producer.bind_connector_metadata(save)
        t0 = time.perf_counter()
        producer.wait_for_save()
        t1 = time.perf_counter()
        producer.clear_connector_metadata()
        producer.take_events()
        checked_before = consumer.get_stats()
        consumer.bind_connector_metadata(load)
        t2 = time.perf_counter()
        consumer.start_load_kv()
        t3 = time.perf_counter()
        consumer.clear_connector_metadata()
        consumer.get_finished(frozenset())
        errors = consumer.get_block_ids_with_load_errors()
        after = producer.get_stats()
        checked = consumer.get_stats()
        ok = (not errors and after["put_failures"] == before["put_failures"]
              and checked["digest_mismatches"] == checked_before["digest_mismatches"])
        keys = [p + h.hex() for h in hashes for p in (*prefixes, record_prefix)]
        return t1 - t0, t3 - t2, ok, keys

    def raw_round() -> tuple[float, float, bool, list[str]]:
        suffixes = [os.urandom(32).hex() for _ in range(num_blocks)]
        keys = [p + h for p in prefixes for h in suffixes]
        t0 = time.perf_counter()
        put_ok = all(c == 0 for c in raw.batch_put_from(keys, src_ptrs, sizes))
        t1 = time.perf_counter()
        get_ok = all(c == block_bytes for c in raw.batch_get_into(keys, dst_ptrs, sizes))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, put_ok and get_ok, keys

    def run_side(name: str) -> tuple[float, float, bool, list[str]]:
        return raw_round() if name == "raw" else connector_round(name.split(":", 1)[1])

    def dst_of(name: str) -> Any:
        return raw_dst if name == "raw" else consumers[name.split(":", 1)[1]][1]

    def src_of(name: str) -> Any:
        return raw_src if name == "raw" else src

    for round_index in range(rounds + 1):  # round 0 warms up and is not recorded
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dst = dst_of(name)
            dst.zero_()
            put_s, get_s, ok, keys = run_side(name)
            src_bytes, dst_bytes = src_of(name).view(torch.uint8), dst.view(torch.uint8)
            verified = ok and bool(torch.equal(src_bytes, dst_bytes))
            if not verified:
                failures[name] += 1
                mismatched += int((src_bytes != dst_bytes).sum())
                logger.warning("bench %s round %d failed (ok=%s)", name, round_index, ok)
            client.remove(keys, force=True)
            if round_index > 0:
                times[name]["put"].append(put_s)
                times[name]["get"].append(get_s)
    memcpy_s = memcpy_seconds(raw_src, raw_dst, rounds)

    def side(name: str) -> dict[str, float]:
        return {"put_gbps": gbps(total, statistics.median(times[name]["put"])),
                "get_gbps": gbps(total, statistics.median(times[name]["get"]))}

    full = f"connector:{DEFAULT_MODE.value}"  # the headline: what a user gets
    off = "connector:off" if "connector:off" in times else None
    verify_ratio = {} if off is None else {
        name.split(":", 1)[1]: {op: paired_ratio(times[off][op], times[name][op])
                                for op in ("put", "get")}
        for name in names if name.startswith("connector:")}
    return {
        "num_blocks": num_blocks, "block_bytes": block_bytes, "layers": layers,
        "total_bytes": total,
        "raw": side("raw"), "connector": side(full),
        "ratio": {"put": paired_ratio(times["raw"]["put"], times[full]["put"]),
                  "get": paired_ratio(times["raw"]["get"], times[full]["get"]),
                  # best connector round over best raw round: what the code can do when
                  # the machine's other load does not interfere
                  "put_best": min(times["raw"]["put"]) / min(times[full]["put"]),
                  "get_best": min(times["raw"]["get"]) / min(times[full]["get"])},
        "verify": {name.split(":", 1)[1]: side(name) for name in names
                   if name.startswith("connector:")},
        "verify_ratio": verify_ratio,
        "memcpy_gbps": gbps(total, statistics.median(memcpy_s)),
        "failed_rounds": {"raw": failures["raw"],
                          "connector": sum(v for k, v in failures.items() if k != "raw")},
        "mismatched_bytes": mismatched,
        "verified": not any(failures.values()),
    }


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_bench`'s result."""
    lines = [f"kvbridge bench mooncake: connector vs raw Mooncake batch put/get, "
             f"{report['rounds']} rounds, master {report['master']} (v:MODE: the "
             f"connector with verify MODE; connector = v:{DEFAULT_MODE.value}, the default)"
             + (f"; KV on {report.get('device', 'cpu')}"
                f"{' guarded' if report.get('guard') else ''}, staged: raw = Mooncake "
                f"from pinned host copies" if any(p.get("staged") for p in report["patterns"])
                else ""),
             f"{'pattern':>14} {'side':>10} {'put GB/s':>9} {'get GB/s':>9}"]
    for p in report["patterns"]:
        pattern = f"{p['num_blocks']}x{size_label(p['block_bytes'])}"
        if p.get("layers", 1) > 1:
            pattern += f"x{p['layers']}L"
        for name in ("raw", "connector"):
            lines.append(f"{pattern:>14} {name:>10} {p[name]['put_gbps']:9.2f} "
                         f"{p[name]['get_gbps']:9.2f}")
        target = report["target_ratio"]
        marks = {k: "ok" if v >= target else "BELOW" for k, v in p["ratio"].items()}
        lines.append(f"{pattern:>14} {'ratio':>10} {p['ratio']['put']:9.3f} "
                     f"{p['ratio']['get']:9.3f}   (target >= {target}: put {marks['put']}, "
                     f"get {marks['get']}; memcpy {p['memcpy_gbps']:.1f} GB/s"
                     f"{'' if p['verified'] else '; VERIFY FAILED'})")
        lines.append(f"{pattern:>14} {'best':>10} {p['ratio']['put_best']:9.3f} "
                     f"{p['ratio']['get_best']:9.3f}   (best round over best round)")
        for mode, figures in p.get("verify", {}).items():
            ratio = p.get("verify_ratio", {}).get(mode)
            of_off = (f"   (/ verify off: put {ratio['put']:.3f}, get {ratio['get']:.3f})"
                      if ratio and mode != "off" else "")
            lines.append(f"{pattern:>14} {'v:' + mode:>10} {figures['put_gbps']:9.2f} "
                         f"{figures['get_gbps']:9.2f}{of_off}")
    return "\n".join(lines)
