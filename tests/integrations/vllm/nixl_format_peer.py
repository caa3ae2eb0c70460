"""Producer process of ``test_vllm_formats.py``'s NIXL case (not a test module).

Allocates the producer ranks' KV caches with vLLM's ``allocate_kv_cache``, fills
them with the test's seeded logical K/V through vLLM's own reading, registers
each rank's backing storage with its own NIXL agent (as kvbridge's NIXL worker
does), prints one JSON line (agent metadata, layer memory, spec fingerprint),
then progresses its agents (the passive side of a READ must) until stdin says
``done`` or closes, or a 120 s deadline passes.

Usage: ``python nixl_format_peer.py '{"device": "cuda", "layout": "LBNHC", "tp": 2}'``
(optional ``"block"``: manager block tokens; ``"kernel"``: vLLM's kernel block size).
"""

from __future__ import annotations

import json
import select
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvbridge.backends.nixl import NixlTransport  # noqa: E402
from tests.integrations.vllm import test_vllm_formats as formats  # noqa: E402

DEADLINE_S = 120.0


def main(argv: list[str]) -> int:
    args = json.loads(argv[1])
    v = formats.load_vllm()
    block = int(args.get("block") or formats.TOKENS)
    kernel = None if args.get("kernel") is None else int(args["kernel"])
    ranks = formats.dense_engine(v, args["device"], args["layout"], int(args["tp"]),
                                 block=block, kernel=kernel)
    formats.fill_dense(v, ranks, args["device"], args["layout"], block=block)
    transports = []
    out = []
    try:
        for index, rank in enumerate(ranks):
            transport = NixlTransport(f"kvb-test-p{index}-{time.monotonic_ns()}")
            transports.append(transport)
            transport.register_regions(rank["kv"].backing_spans())
            out.append({"name": transport.name, "agent": transport.agent_metadata().hex(),
                        "memory": {str(lid): [m.base_addr, m.block_stride, m.num_blocks]
                                   for lid, m in rank["memory"].items()}})
        print(json.dumps({"fingerprint": ranks[0]["adapter"].spec.fingerprint(), "ranks": out}),
              flush=True)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 0.005)
            if ready:
                line = sys.stdin.readline()
                if not line or line.strip() == "done":
                    break
            for transport in transports:
                transport.get_notifs()
    finally:
        for transport in transports:
            transport.close(strict=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
