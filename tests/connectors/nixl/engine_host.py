"""Several reference engines in one process, for the NIXL multi-process tests.

``python engine_host.py --engines JSON`` where JSON maps a name to an
``EngineConfig`` dict (``kvbridge.engine.server.config_to_dict``). Prints one
ready line ``{"ready": true, "port": P, "engines": {name: {"engine_id",
"endpoint"}}}`` and serves the control protocol of ``kvbridge.engine.server``
with one extra key, ``"engine": name``, on every message. Engines with work
are stepped round-robin; the process exits on ``shutdown`` or parent death.

Hosting many engines per process keeps the topology matrix fast on two cores
(process start-up and torch import are paid once per side, not per pair),
while producer and consumer still live in different processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import msgpack
import zmq

import kvbridge.backends  # noqa: F401  (UCX/NIXL env defaults before any agent exists)
from kvbridge.engine.core import Engine
from kvbridge.engine.server import _handle, config_from_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s host %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(1)
    parent = os.getppid()
    engines: dict[str, Engine] = {}
    try:
        for name, data in json.loads(args.engines).items():
            engines[name] = Engine(config_from_dict(data))
        context = zmq.Context()
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        info = {name: {"engine_id": e.engine_id, "endpoint": list(e.endpoint() or ())}
                for name, e in engines.items()}
        print(json.dumps({"ready": True, "port": port, "engines": info}), flush=True)
        last_check = time.monotonic()
        while True:
            busy = any(e.has_work() for e in engines.values())
            if sock.poll(0 if busy else 10):
                message = msgpack.unpackb(sock.recv(), raw=False)
                name = message.pop("engine", None) if isinstance(message, dict) else None
                reply: dict[str, Any]
                stop = False
                if name == "*" and message.get("op") == "shutdown":
                    reply, stop = {"ok": True}, True
                elif name == "*" and message.get("op") == "totals":
                    reply = {"ok": True, "totals": {
                        n: [w.connector.totals() for w in e.workers]  # type: ignore[union-attr]
                        for n, e in engines.items()}}
                elif name not in engines:
                    reply = {"ok": False, "type": "ProtocolError", "error": f"engine {name!r}"}
                else:
                    reply, _ = _handle(engines[name], message)
                sock.send(msgpack.packb(reply, use_bin_type=True))
                if stop:
                    break
            for engine in engines.values():
                if engine.has_work():
                    engine.step()
            if time.monotonic() - last_check > 0.5:
                last_check = time.monotonic()
                if os.getppid() != parent:
                    break
        sock.close(linger=0)
        context.term()
    finally:
        for engine in engines.values():
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
