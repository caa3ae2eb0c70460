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
    from kvbridge.tools.bench_nixl import run_nixl_bench

    out: dict[str, list[dict[str, Any]]] = {}
    for mode, secret in (("off", None), ("on", _SECRET)):
        with _environment(secret):
            out[mode] = run_nixl_bench(tuple(patterns), iters=iters)["patterns"]
    return out
