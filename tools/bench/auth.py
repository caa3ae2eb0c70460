"""`kvbridge bench auth`: what the cluster secret costs, on and off in the same run.

Three measurements, each interleaved (off, on, off, on...) on this host:

* the side-channel handshake: a full metadata fetch and a conditional one
  ("unchanged") from a real :class:`~kvbridge.handshake.HandshakeServer` on
  127.0.0.1, each on a fresh connection as a connector does it;
* one seal + open of a request (the HMAC work alone);
* a NIXL transfer through the connector (`kvbridge bench nixl`'s measurement)
  with the secret set for both engines and without: the seal is on the side
  channel, control port and hello only, so the READs are the same and the
  ratio says how much noise the run has.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvbridge.auth import SECRET_ENV, SECRET_FILE_ENV, ClusterAuth, Label, Secret

_SECRET = "kvbridge-bench-auth-cluster-secret-0123456789"


@contextmanager
def _environment(secret: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (SECRET_ENV, SECRET_FILE_ENV)}
    os.environ.pop(SECRET_FILE_ENV, None)
    if secret is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = secret
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def handshake_times(fetches: int) -> dict[str, dict[str, float]]:
    """Median ms of a full and a conditional fetch, without and with a secret."""
    from kvbridge.handshake import HandshakeClient, HandshakeServer
    from kvbridge.handshake.example import example_store
    from kvbridge.layouts import ParallelTopology, load_spec

    auth = ClusterAuth(Secret.from_value(_SECRET))
    spec, topology = load_spec("tiny-gqa"), ParallelTopology(tp_size=2)
    samples: dict[str, dict[str, list[float]]] = {m: {"full": [], "conditional": []}
                                                  for m in ("off", "on")}
    servers = {}
    try:
        for mode in ("off", "on"):
            store = example_store(spec, topology, f"bench-{mode}")
            store.auth = auth if mode == "on" else None
            servers[mode] = HandshakeServer(store, "127.0.0.1", 0).start()
        clients = {"off": HandshakeClient(timeout_s=5, retries=0),
                   "on": HandshakeClient(timeout_s=5, retries=0, auth=auth)}
        for _ in range(fetches):
            for mode in ("off", "on"):
                address = f"127.0.0.1:{servers[mode].port}"
                for kind in ("full", "conditional"):
                    t0 = time.perf_counter()
                    result = clients[mode].fetch(address, use_cache=kind == "conditional")
                    samples[mode][kind].append((time.perf_counter() - t0) * 1000)
                    assert result.cached == (kind == "conditional")
    finally:
        for server in servers.values():
            server.stop()
    return {mode: {kind: statistics.median(v) for kind, v in kinds.items()}
            for mode, kinds in samples.items()}


def seal_open_us(rounds: int = 20_000, body_bytes: int = 64) -> float:
    auth = ClusterAuth(Secret.from_value(_SECRET))
    body = bytes(body_bytes)
    t0 = time.perf_counter()
    for _ in range(rounds):
        auth.open_request(Label.CONTROL, auth.seal_request(Label.CONTROL, body)[0])
    return (time.perf_counter() - t0) / rounds * 1e6


def nixl_with_and_without(patterns: Sequence[tuple[int, int]], iters: int
                          ) -> dict[str, list[dict[str, Any]]]:
    """`kvbridge bench nixl`'s rows for each pattern, engines without and with a secret."""
    from kvbridge.tools.bench.nixl import run_nixl_bench

    out: dict[str, list[dict[str, Any]]] = {}
    for mode, secret in (("off", None), ("on", _SECRET)):
        with _environment(secret):
            out[mode] = run_nixl_bench(tuple(patterns), iters=iters)["patterns"]
    return out



def params_seal_costs(prompt_tokens: Sequence[int] = (1024, 32768), rounds: int = 200
                      ) -> list[dict[str, Any]]:
    """What sealed transfer params cost per request (:mod:`kvbridge.connectors.sealing`).

    For each prompt length: the producer's seal (prompt chain from its 16-token
    block hashes, HMAC, record digest), the consumer's parse and check with the
    chain's links given (blocks of 16 tokens) and computed from the tokens (other
    block sizes), against parsing the same params unsealed; and the bytes the
    seal adds to the JSON a router forwards. Median microseconds.
    """
    secret = Secret.from_value(_SECRET)
    return [_params_cost(n, rounds, secret) for n in prompt_tokens]


def _median_us(fn: Any, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _params_cost(n: int, rounds: int, secret: Secret) -> dict[str, Any]:
    from kvbridge.connectors import TransferMode, TransferParams
    from kvbridge.connectors.sealing import (
        CHAIN_TOKENS,
        ParamsCheck,
        Sealer,
        prompt_chain,
        record_digest,
    )
    from kvbridge.layouts import ParallelTopology, hash_blocks

    tokens = list(range(7, 7 + n))
    links = hash_blocks(tokens, CHAIN_TOKENS)
    plain = TransferParams(mode=TransferMode.PULL, producer_engine_id="e" * 16,
                           producer_host="10.0.0.1", producer_port=5600,
                           producer_request_id="cmpl-" + "0" * 32,
                           block_ids=(tuple(range(n // 16)),),
                           producer_topology=ParallelTopology(tp_size=1), num_tokens=n)
    sealer, check = Sealer(secret), ParamsCheck(secret)
    sealed = sealer.seal(plain, prompt_chain(tokens, n, links=links))
    wire_plain, wire_sealed = plain.to_dict(), sealed.to_dict()
    return {
        "prompt_tokens": n,
        "seal_us": _median_us(lambda: record_digest(sealer.seal(
            plain, prompt_chain(tokens, n, links=links))), rounds),
        "parse_us": _median_us(lambda: TransferParams.from_dict(wire_plain), rounds),
        "parse_check_links_us": _median_us(lambda: check.check(
            "r", tokens, None, TransferParams.from_dict(wire_sealed), links), rounds),
        "parse_check_computed_us": _median_us(lambda: check.check(
            "r", tokens, None, TransferParams.from_dict(wire_sealed)), rounds),
        "json_bytes_plain": len(plain.to_json()),
        "json_bytes_sealed": len(sealed.to_json()),
    }
