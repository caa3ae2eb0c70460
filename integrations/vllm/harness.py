"""Run real vLLM API servers on this machine and drive prefill/decode through them.

Used by the vLLM integration tests and the side-by-side benchmark. It needs no
vLLM import itself (it talks HTTP to ``python -m vllm.entrypoints.openai.api_server``
processes started with the vLLM venv's interpreter), so it type-checks and
imports anywhere.

Rules it keeps, because a stray server would eat one of this machine's two
cores for every later test:

- every server listens on 127.0.0.1 on a port that was free a moment ago, and
  every side channel (vLLM's NIXL side channel, kvbridge's) too;
- every server runs in its own process group (``start_new_session``) and
  :meth:`VllmServer.stop` signals the whole group (API server, engine core,
  worker), TERM then KILL, with a bounded wait; :class:`ServerGroup` stops
  them all on exit, also on an exception;
- every wait is bounded, and a server that exits while we wait for it raises
  with the tail of its log;
- each server can be pinned to one core with ``taskset`` (``VLLM_CPU_OMP_THREADS_BIND``
  set to the same core), so a producer and a consumer do not fight for it.

vLLM facts encoded here (0.32, CPU build): the ``vllm`` console command fails
for the ``vllm-cpu`` distribution, so the module entry point is used; the CPU
attention backend needs a block size that is a multiple of 32; the CPU KV
cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB); ``VLLM_HOST_IP`` is set
to 127.0.0.1 so nothing picks the machine's LAN address.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.connectors.params import TRANSFER_PARAMS_VERSION

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: The CPU attention backend refuses other block sizes.
CPU_BLOCK_SIZE_MULTIPLE = 32
#: vLLM CPU's MLA backend (CPU_MLA) runs this block size only.
CPU_MLA_BLOCK_SIZE = 16


class HarnessError(RuntimeError):
    """A server failed to start, exited, or answered something unexpected."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def vllm_python() -> str:
    """The interpreter that has vLLM: ``$KVBRIDGE_VLLM_PYTHON``, else this one."""
    return os.environ.get("KVBRIDGE_VLLM_PYTHON", sys.executable)


@dataclass(frozen=True)
class ServerSpec:
    """What one vLLM API server runs with.

    ``kv_transfer_config`` is passed verbatim as ``--kv-transfer-config``;
    ``env`` is added to the inherited environment (e.g. a NIXL side-channel
    port). ``core`` pins the server to one CPU with ``taskset``.
    """

    name: str
    model: str
    port: int
    block_size: int = 32
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    core: int | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0
    #: ``--dtype``: float32 for the dense and hybrid models; float16 for MLA (vLLM CPU's
    #: MLA backend wants 16-bit weights; bf16 kernels die on this project's machines).
    dtype: str = "float32"
    #: Engine core and worker inside the API server process (``uni`` executor,
    #: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): starts in ~45 s instead of ~95 s
    #: on one core here, with the same connector code paths (both halves of a
    #: connector still get their own instances, scheduler and worker role).
    in_process: bool = True

    def __post_init__(self) -> None:
        if self.block_size % CPU_BLOCK_SIZE_MULTIPLE and self.block_size != CPU_MLA_BLOCK_SIZE:
            raise HarnessError(f"block_size: the CPU backend needs a multiple of "
                               f"{CPU_BLOCK_SIZE_MULTIPLE} ({CPU_MLA_BLOCK_SIZE} for MLA), "
                               f"got {self.block_size}")

    def argv(self, python: str) -> list[str]:
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", "tiny",
            "--host", LOOPBACK, "--port", str(self.port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--enforce-eager",
            "--seed", str(self.seed),
            "--max-num-seqs", "16",
        ]
        if self.in_process:
            cmd += ["--distributed-executor-backend", "uni"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        cmd += list(self.extra_args)
        if self.core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(self.core), *cmd]
        return cmd

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_HOST_IP": LOOPBACK,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # exposes /reset_prefix_cache
            "DO_NOT_TRACK": "1",
            "UCX_MODULES": env.get("UCX_MODULES", "^ib"),
            "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"),
            "PYTHONUNBUFFERED": "1",
        })
        if self.in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        env.update(self.env)
        return env


class VllmServer:
    """One API server process group, with its log file."""

    def __init__(self, spec: ServerSpec, log_dir: Path, python: str | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self._python = python or vllm_python()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._rpc_dir: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.spec.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> VllmServer:
        if self._proc is not None:
            raise HarnessError(f"{self.spec.name}: already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = self.spec.environ()
        if "VLLM_RPC_BASE_PATH" not in self.spec.env:
            # vLLM's ZMQ ipc sockets (one file per socket, /tmp by default) are not
            # removed when the server is stopped: give each server a directory of its
            # own (short: a socket path has at most 107 bytes), removed in stop()
            self._rpc_dir = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="kvb-vllm-")
        self._proc = subprocess.Popen(
            self.spec.argv(self._python), env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        logger.info("started %s (pid %d, port %d)", self.spec.name, self._proc.pid,
                    self.spec.port)
        return self

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_chars:].decode("utf-8", "replace")

    def exited(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200; returns seconds waited."""
        start = time.monotonic()
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            rc = self.exited()
            if rc is not None:
                raise HarnessError(f"{self.spec.name} exited with {rc} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise HarnessError(f"{self.spec.name} not ready after {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP the whole process group (API server, engine core): it uses no CPU
        until :meth:`resume`. Only between requests: nothing may be waiting on it."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGCONT)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by the live processes of its group."""
        if self._proc is None:
            return 0.0
        group, total = self._proc.pid, 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == group:  # pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout_s: float = 20.0) -> None:
        """TERM the process group, then KILL it; bounded (a paused group is resumed)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                    if sig is signal.SIGTERM:
                        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on it
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            # Children (engine core, workers) share the group; make sure none is left.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    # -- HTTP -----------------------------------------------------------------

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> Any:
        data = json.dumps(dict(body)).encode()
        req = urllib.request.Request(self.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:2000]
            raise HarnessError(f"{self.spec.name} {path}: HTTP {exc.code}: {detail}") from None

    def try_complete(self, prompt_token_ids: Sequence[int], max_tokens: int,
                     kv_transfer_params: Any = None, timeout_s: float = 120.0,
                     ) -> tuple[int, Completion | str]:
        """Like :meth:`complete`, for requests that may be refused: ``(200, Completion)``
        or ``(HTTP status, the error body)``; ``kv_transfer_params`` is sent as given
        (any JSON value: a hostile client's)."""
        body: dict[str, Any] = {"model": "tiny", "prompt": list(prompt_token_ids),
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True,
                                "kv_transfer_params": kv_transfer_params}
        req = urllib.request.Request(self.base_url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")[:2000]
        choice = out["choices"][0]
        return 200, Completion(token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
                               kv_transfer_params=out.get("kv_transfer_params"),
                               latency_s=time.perf_counter() - start)

    def complete(self, prompt_token_ids: Sequence[int], max_tokens: int,
                 kv_transfer_params: Mapping[str, Any] | None = None,
                 timeout_s: float = 120.0, *, logprobs: int | None = None) -> Completion:
        """Greedy completion of token ids; with ``logprobs``, the top-``logprobs``
        distribution of each generated token comes back in
        ``Completion.top_logprobs``, keyed by token id."""
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = dict(kv_transfer_params)
        if logprobs is not None:
            body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
        start = time.perf_counter()
        out = self.post("/v1/completions", body, timeout_s)
        elapsed = time.perf_counter() - start
        choice = out["choices"][0]
        tops = (choice.get("logprobs") or {}).get("top_logprobs") or ()
        return Completion(token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
                          kv_transfer_params=out.get("kv_transfer_params"),
                          latency_s=elapsed,
                          top_logprobs=tuple(_token_id_keys(t) for t in tops))

    def reset_prefix_cache(self, reset_external: bool = False, timeout_s: float = 30.0) -> None:
        """Drop the engine's prefix cache (and the connector's, with ``reset_external``).

        vLLM refuses while blocks are held (running requests, in-flight
        transfers); that is retried until ``timeout_s``.
        """
        query = "?reset_external=true" if reset_external else ""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.post("/reset_prefix_cache" + query, {}, timeout_s=30.0)
            if out.get("success"):
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.spec.name}: reset_prefix_cache kept failing "
                                   f"for {timeout_s:.0f} s")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """Prometheus counters summed over label sets, keyed ``name{source=..}``."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode())

    def metrics_once_grown(self, before: Mapping[str, float], key: str,
                           timeout_s: float = 10.0) -> dict[str, float]:
        """:meth:`metrics` once ``key`` has grown past ``before`` (a connector's stats
        reach /metrics with the engine's step outputs, a moment after the answer),
        or as they are at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            after = self.metrics()
            if after.get(key, 0) > before.get(key, 0) or time.monotonic() > deadline:
                return after
            time.sleep(0.2)


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    kv_transfer_params: dict[str, Any] | None
    latency_s: float
    #: per generated token, token id -> logprob of the top tokens and of the
    #: token picked; empty unless ``logprobs`` was asked for
    top_logprobs: tuple[dict[int, float] | None, ...] = ()


def _token_id_keys(top: Mapping[str, float] | None) -> dict[int, float] | None:
    """``{"token_id:17": -0.3}`` (``return_tokens_as_token_ids``) -> ``{17: -0.3}``."""
    if top is None:
        return None
    return {int(key.rpartition(":")[2]): float(value) for key, value in top.items()}


@dataclass(frozen=True)
class GreedyComparison:
    """How two greedy runs of one prompt compare (``compare_greedy``)."""

    #: the largest logprob difference, in nats, over the tokens both runs list,
    #: at every position up to and including the first divergence
    max_apart: float
    #: first position where the tokens differ (at a near tie), None if none
    diverged_at: int | None

    def within(self, tolerance: float) -> bool:
        return self.max_apart <= tolerance


def compare_greedy(run: Completion, reference: Completion, tolerance: float) -> GreedyComparison:
    """Compare two greedy runs of one prompt by their distributions, not only tokens.

    Position by position while the tokens agree, the two top-k distributions
    must agree within ``tolerance`` (a run on wrong KV differs at once, by far
    more). Where the tokens differ, both runs must list both tokens and see
    them within ``tolerance`` of each other (a near tie that kernel rounding
    flipped); a divergence that is not such a tie counts as infinitely apart.
    After a divergence the runs condition on different tokens, so the
    comparison stops there.
    """
    if len(run.top_logprobs) != len(run.token_ids) or \
            len(reference.top_logprobs) != len(reference.token_ids):
        raise HarnessError("compare_greedy: both runs need logprobs (complete(logprobs=k))")
    worst = 0.0
    pairs = zip(run.top_logprobs, reference.top_logprobs, strict=False)
    for pos, (mine, ref) in enumerate(pairs):
        if mine is None or ref is None:
            return GreedyComparison(math.inf, None)
        shared = mine.keys() & ref.keys()
        if not shared:
            return GreedyComparison(math.inf, pos)
        worst = max(worst, *(abs(mine[t] - ref[t]) for t in shared))
        a, b = run.token_ids[pos], reference.token_ids[pos]
        if a != b:
            tie = all(t in d for d in (mine, ref) for t in (a, b)) and \
                abs(mine[a] - mine[b]) <= tolerance and abs(ref[a] - ref[b]) <= tolerance
            return GreedyComparison(worst if tie else math.inf, pos)
    if len(run.token_ids) != len(reference.token_ids):
        return GreedyComparison(math.inf, min(len(run.token_ids), len(reference.token_ids)))
    return GreedyComparison(worst, None)


_METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)')
_KEPT_LABEL = re.compile(r'(source|reason)="([^"]*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum samples per metric name (and per ``source`` or ``reason`` label, when there
    is one: ``name{source=local_compute}``, ``name{reason=seal}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        kept = _KEPT_LABEL.search(labels)
        key = f"{name}{{{kept.group(1)}={kept.group(2)}}}" if kept else name
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out


class ServerGroup:
    """Start several servers together and stop every one of them on exit."""

    def __init__(self, log_dir: Path, python: str | None = None) -> None:
        self.log_dir = Path(log_dir)
        self._python = python
        self.servers: list[VllmServer] = []

    def start(self, *specs: ServerSpec, timeout_s: float = 300.0) -> list[VllmServer]:
        started = [VllmServer(s, self.log_dir, self._python).start() for s in specs]
        self.servers.extend(started)
        deadline = time.monotonic() + timeout_s
        for server in started:
            server.wait_ready(max(1.0, deadline - time.monotonic()))
        return started

    def stop_all(self) -> None:
        while self.servers:
            self.servers.pop().stop()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


#: vLLM's prompt-token counters by source (a consumer's /metrics)
LOCAL_TOKENS = "vllm:prompt_tokens_by_source_total{source=local_compute}"
EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


#: a kvbridge consumer's refused transfer params (all, and per reason)
REFUSED_PARAMS = "vllm:kvbridge_refused_params_total"


def refused_params_by(reason: str) -> str:
    """The key of ``vllm:kvbridge_refused_params_by_reason_total{reason=...}``."""
    return f"vllm:kvbridge_refused_params_by_reason_total{{reason={reason}}}"


def prompt_token_sources(metrics: Mapping[str, float]) -> tuple[float, float]:
    """(computed locally, loaded through the KV connector) prompt tokens of a server."""
    return metrics.get(LOCAL_TOKENS, 0), metrics.get(EXTERNAL_TOKENS, 0)


@contextlib.contextmanager
def server_group(log_dir: Path, python: str | None = None) -> Iterator[ServerGroup]:
    group = ServerGroup(log_dir, python)
    try:
        yield group
    finally:
        group.stop_all()


def producer_params() -> dict[str, Any]:
    """What a PD proxy sends to the producer: prefill only, keep the KV for a decoder."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def disaggregated(producer: VllmServer, consumer: VllmServer, prompt: Sequence[int],
                  max_tokens: int, timeout_s: float = 120.0, *,
                  logprobs: int | None = None) -> tuple[Completion, Completion]:
    """Prefill on ``producer`` (one token), decode on ``consumer`` with its params
    (``logprobs``: the decode's, see ``VllmServer.complete``)."""
    first = producer.complete(prompt, 1, producer_params(), timeout_s)
    if not first.kv_transfer_params:
        raise HarnessError(f"{producer.spec.name} returned no kv_transfer_params")
    second = consumer.complete(prompt, max_tokens, first.kv_transfer_params, timeout_s,
                               logprobs=logprobs)
    return first, second


def make_prompts(num_prompts: int, num_tokens: int, vocab_size: int = 1024,
                 seed: int = 7) -> list[list[int]]:
    """Distinct deterministic prompts of token ids (ids 3.. avoid the special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(num_tokens)]
            for _ in range(num_prompts)]


def kvbridge_push_params(*, producer_engine_id: str, producer_port: int,
                         consumer_engine_id: str, consumer_port: int, request_id: str,
                         num_tokens: int) -> dict[str, Any]:
    """A push-mode record as a router builds it before either engine has the request.

    Push needs both kvbridge side channels at known addresses (``port`` in
    each engine's ``kv_connector_extra_config``) and engine ids (``engine_id``
    in ``--kv-transfer-config``); ``request_id`` is the router's id, which the
    adapter uses as the producer's kvbridge request id. Nothing seals it (no producer
    has the request yet): the consumer's registration carries its prompt chain, and
    the producer writes only KV of the same tokens.
    """
    return {
        "version": TRANSFER_PARAMS_VERSION, "mode": "push",
        "producer_engine_id": producer_engine_id, "producer_host": LOOPBACK,
        "producer_port": producer_port, "producer_request_id": request_id,
        "block_ids": [], "producer_topology": {"tp_size": 1, "pp_size": 1, "dcp_size": 1,
                                               "pcp_size": 1},
        "num_tokens": num_tokens,
        "consumer_engine_id": consumer_engine_id, "consumer_host": LOOPBACK,
        "consumer_port": consumer_port, "consumer_request_id": request_id,
    }


def disaggregated_push(producer: VllmServer, consumer: VllmServer, prompt: Sequence[int],
                       max_tokens: int, params: Mapping[str, Any],
                       timeout_s: float = 120.0, *,
                       logprobs: int | None = None) -> tuple[Completion, Completion]:
    """Push: the consumer gets the request first (it allocates and registers), the
    producer prefills and writes; both run concurrently, each bounded."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        decode = pool.submit(consumer.complete, prompt, max_tokens, {"kvbridge": dict(params)},
                             timeout_s, logprobs=logprobs)
        first = producer.complete(prompt, 1, {"do_remote_decode": True,
                                              "kvbridge": dict(params)}, timeout_s)
        second = decode.result(timeout=timeout_s)
    return first, second
