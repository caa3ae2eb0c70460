"""Helpers of the NIXL connector tests: engine host processes and a router over them."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kvbridge.connectors import ConnectorConfig, KVRole, TransferMode
from kvbridge.engine.core import EngineConfig
from kvbridge.engine.harness import ControlCalls, connect_control, read_ready_line
from kvbridge.engine.server import config_to_dict
from kvbridge.layouts import ParallelTopology, load_spec

HOST_SCRIPT = Path(__file__).with_name("engine_host.py")


def nixl_config(model: str, role: KVRole, topology: ParallelTopology, mode: TransferMode,
                *, num_blocks: int = 32, host_kv: bool = False, **extra: Any) -> EngineConfig:
    """``host_kv``: the ranks' KV is host-readable memory whatever the environment says (a
    test about host ranks: XXH3-64 digests); otherwise ``KVBRIDGE_KV_HOST_GUARD`` decides
    (CI runs the suite once with it, every rank then taking a GPU rank's paths)."""
    settings = {"mode": mode.value, "transfer_timeout_s": 10.0, **extra}
    guard = {"kv_host_guard": False} if host_kv else {}
    return EngineConfig(spec=load_spec(model), topology=topology, num_blocks=num_blocks,
                        max_num_batched_tokens=2048, max_num_seqs=64,
                        connector=ConnectorConfig("nixl", role, extra=settings),
                        remote_kv_timeout_s=60.0, **guard)


class EngineHost:
    """A child process hosting several named engines (``engine_host.py``)."""

    def __init__(self, engines: dict[str, EngineConfig], *, start_timeout_s: float = 180.0,
                 call_timeout_s: float = 60.0) -> None:
        payload = json.dumps({n: config_to_dict(c) for n, c in engines.items()})
        self.proc = subprocess.Popen([sys.executable, str(HOST_SCRIPT), "--engines", payload],
                                     stdout=subprocess.PIPE, text=True)
        self.context = zmq.Context()
        self.call_timeout_s = call_timeout_s
        self.sock: zmq.Socket[bytes] | None = None
        self._clients: dict[str, HostedEngine] = {}
        try:
            ready = read_ready_line(self.proc, start_timeout_s, "engine host")
            self.port = int(ready["port"])
            self.engines: dict[str, dict[str, Any]] = ready["engines"]
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = connect_control(self.context, "127.0.0.1", self.port, self.call_timeout_s)

    def call(self, engine: str, op: str, **fields: Any) -> dict[str, Any]:
        assert self.sock is not None
        try:
            self.sock.send(msgpack.packb({"engine": engine, "op": op, **fields},
                                         use_bin_type=True))
            reply = msgpack.unpackb(self.sock.recv(), raw=False)
        except zmq.Again:
            self._connect()
            raise RuntimeError(f"engine host: no reply to {op} within {self.call_timeout_s} s"
                               ) from None
        if not reply.get("ok"):
            raise RuntimeError(f"engine host: {op} on {engine}: {reply}")
        return dict(reply)

    def engine(self, name: str) -> HostedEngine:
        """The client of one hosted engine: one per name, so that every caller shares
        its control token (results go to the client that submitted)."""
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = HostedEngine(self, name)
        return client

    def close(self) -> int | None:
        if self.sock is not None and self.proc.poll() is None:
            with contextlib.suppress(RuntimeError):
                self.call("*", "shutdown")
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.context.term()
        return self.proc.returncode


class HostedEngine(ControlCalls):
    """One engine of an :class:`EngineHost` (the interface ``tools.demo_nixl.Router`` uses)."""

    def __init__(self, host: EngineHost, name: str) -> None:
        self.host, self.name = host, name
        info = host.engines[name]
        self.engine_id = str(info["engine_id"])
        ep = info.get("endpoint") or []
        self.endpoint = (str(ep[0]), int(ep[1])) if ep else None

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.host.call(self.name, op, **fields)

    def close(self, timeout_s: float = 15.0) -> int | None:
        return None


def member_hello(agent_doc: bytes) -> Any:
    """A ``hello`` carrying ``agent_doc``, sealed with the environment's cluster secret when
    there is one (``make test-auth``): a hostile *member*, so the checks behind the seal
    are what a test exercises in both modes."""
    from kvbridge.auth import Label, resolve_auth
    from kvbridge.connectors.pd import messages

    auth = resolve_auth()
    sealed = agent_doc if auth is None else auth.seal_request(Label.NIXL_HELLO, agent_doc)[0]
    return messages.Hello(sealed)
