"""The Mooncake store demo: a producer and a consumer engine process sharing one store.

``kvbridge demo --connector mooncake [--master HOST:PORT [--metadata URL]] [--json]``

The producer engine prefills each request and its connector puts every
computed block into the Mooncake store; when the producer finishes a request
the router hands the prompt to the consumer engine, whose connector looks the
blocks up (asynchronously) and loads them zero-copy. The consumer verifies
every loaded byte against the content function, so ``mismatched_bytes`` must
be 0. Without ``--master`` a local ``mooncake_master`` is started on free
127.0.0.1 ports and stopped afterwards.

Both engines must use the same model and parallel sizes for blocks to hit:
store keys name the layout and the ranks (see ``kvbridge.layouts.namespaces``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole, TransferMode
from kvbridge.connectors.mooncake_store.worker import latency_percentile
from kvbridge.engine.core import EngineConfig
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestResult
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.tools.demo.nixl import Router
from kvbridge.tools.demo.pd_report import (
    check_connector_settings,
    idle_problems,
    request_fields,
    route_all,
)

CONNECTOR = "mooncake"
PLUGIN = "mooncake_store"
DEFAULT_METADATA_PORT = 8080  # mooncake_master's default --http_metadata_server_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mooncake (--connector mooncake)")
    group.add_argument("--master", metavar="HOST:PORT",
                       help="a running mooncake_master's RPC address (default: start a local one)")
    group.add_argument("--metadata", metavar="URL",
                       help="its HTTP metadata server (default http://HOST:8080/metadata)")


@dataclass(frozen=True)
class StoreDemoOptions:
    model: str = "tiny-gqa"
    producer: ParallelTopology = field(default_factory=ParallelTopology)
    consumer: ParallelTopology = field(default_factory=ParallelTopology)
    requests: int = 16
    prompt_tokens: int = 64
    max_tokens: int = 2
    num_blocks: int = 256
    timeout_s: float = 300.0
    seed: int = 0
    master: str | None = None
    metadata: str | None = None
    connector_extra: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # the engines' KV device: EngineConfig.device


def run_cli(args: argparse.Namespace, progress: Callable[[str], None] | None) -> dict[str, Any]:
    extra = json.loads(args.kv_config) if args.kv_config else {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_config", "expected a JSON object")
    if args.metadata and not args.master:
        raise ConfigError("metadata", "--metadata needs --master (a local master serves its own)")
    opts = StoreDemoOptions(
        model=args.model, producer=ParallelTopology.parse(args.producer, "producer"),
        consumer=ParallelTopology.parse(args.consumer, "consumer"), requests=args.requests,
        prompt_tokens=args.prompt_tokens, num_blocks=args.num_blocks, timeout_s=args.timeout,
        master=args.master, metadata=args.metadata, connector_extra=extra,
        device=args.device)
    return run_store_demo(opts, progress)


@contextlib.contextmanager
def _store(opts: StoreDemoOptions) -> Iterator[tuple[str, str]]:
    if opts.master:
        host = opts.master.rpartition(":")[0] or "127.0.0.1"
        yield opts.master, opts.metadata or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        return
    import kvbridge.backends  # noqa: F401  (Mooncake env defaults)
    from kvbridge.backends.mooncake.master import MooncakeMaster

    with MooncakeMaster() as master:
        yield master.rpc_address, master.metadata_url


def _engine_config(opts: StoreDemoOptions, role: KVRole, topology: ParallelTopology,
                   master: str, metadata: str) -> EngineConfig:
    settings = {"master_address": master, "metadata_server": metadata, **opts.connector_extra}
    return EngineConfig(spec=load_spec(opts.model), topology=topology,
                        num_blocks=opts.num_blocks, max_num_batched_tokens=4096,
                        max_num_seqs=64, connector=ConnectorConfig(PLUGIN, role, extra=settings),
                        remote_kv_timeout_s=opts.timeout_s, device=opts.device)


def run_store_demo(opts: StoreDemoOptions, progress: Callable[[str], None] | None = None,
                   ) -> dict[str, Any]:
    """Run the demo; returns the summary dict (the keys ``kvbridge demo`` prints).

    Raises ConfigError (a usage error) for a bad ``--kv-config`` setting before a
    master or an engine process starts (placeholder addresses stand in for them)."""
    check_connector_settings(lambda role: _engine_config(
        opts, role, ParallelTopology(), "127.0.0.1:1", "http://127.0.0.1:1/metadata"))
    spec = load_spec(opts.model)
    spec.validate_topology(opts.producer, "producer")
    spec.validate_topology(opts.consumer, "consumer")
    requests = make_requests(opts.requests, prompt_tokens=opts.prompt_tokens,
                             max_tokens=opts.max_tokens, seed=opts.seed, prefix="demo")
    engines: list[EngineProcess] = []
    with _store(opts) as (master, metadata):
        try:
            producer = EngineProcess(_engine_config(opts, KVRole.PRODUCER, opts.producer,
                                                    master, metadata), name="producer")
            engines.append(producer)
            consumer = EngineProcess(_engine_config(opts, KVRole.CONSUMER, opts.consumer,
                                                    master, metadata), name="consumer")
            engines.append(consumer)
            router = Router(producer, consumer, TransferMode.PULL, opts.producer,
                            spec.fingerprint())
            elapsed = route_all(router, requests, opts.timeout_s, progress)
            producer_stats = producer.stats()
            consumer_stats = consumer.stats()
        finally:
            for engine in reversed(engines):
                with contextlib.suppress(Exception):
                    engine.close()
    results = [router.results[s.request_id] for s in requests]
    wrong = check_outputs(results, requests)
    return summarize(opts, master, results, wrong, elapsed, producer_stats, consumer_stats)


def summarize(opts: StoreDemoOptions, master: str, results: list[RequestResult],
              wrong: list[str], elapsed: float, producer_stats: dict[str, Any],
              consumer_stats: dict[str, Any]) -> dict[str, Any]:
    cons = consumer_stats["stats"]
    prod = producer_stats["stats"]
    cw = cons.get("worker_stats", {})
    pw = prod.get("worker_stats", {})
    nbytes = int(cw.get("get_bytes", 0))
    busy_s = float(cw.get("get_time_s", 0.0))
    return {
        "connector": CONNECTOR,
        "mode": "store",
        "model": opts.model,
        "master": master if opts.master else f"local {master}",
        "producer": opts.producer.describe(),
        "consumer": opts.consumer.describe(),
        **request_fields(results, wrong, elapsed, nbytes, busy_s),
        "blocks": int(cons.get("connector_stats", {}).get("load_blocks", 0)),
        "transfers": int(cw.get("get_calls", 0)),
        "bytes": nbytes,
        "descriptors": int(cw.get("get_keys", 0)),
        "put_bytes": int(pw.get("put_bytes", 0)),
        "put_failures": int(pw.get("put_failures", 0)),
        "load_errors": int(cw.get("load_errors", 0)),
        "latency_ms": {f"p{int(q * 100)}": latency_percentile(cw, q) for q in (0.5, 0.9, 0.99)},
        "notes": ([] if opts.producer.sizes() == opts.consumer.sizes() else
                  ["producer and consumer parallel sizes differ: store keys name them, so "
                   "no block can hit (every consumer request is computed)"]),
        "idle_problems": idle_problems(producer_stats, consumer_stats),
    }
