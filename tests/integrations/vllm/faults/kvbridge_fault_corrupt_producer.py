"""Test-only vLLM connector (loaded by ``kv_connector_module_path``): kvbridge's NIXL
connector on a producer whose KV memory gets one byte flipped after its digests.

The fault wraps the real thing: the worker's own digest taking runs as ever
(its digests are of the right bytes); right after it, one byte of block
``BLOCK_INDEX`` of the held request (region 0, its first layer on this rank) is
flipped in the producer's KV memory, so the consumer's real NIXL READ moves a
wrong byte. A verifying consumer must fail that block and recompute it.
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvbridge.integrations.vllm.connector import KVBridgeNixlConnector

BLOCK_INDEX = 2


class CorruptingNixlConnector(KVBridgeNixlConnector):
    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker: Any = self._worker
        real = worker.hold_digests.take

        def take(request_id: str, block_ids: Any, consumers: Any) -> None:
            real(request_id, block_ids, consumers)
            if len(block_ids[0]) <= BLOCK_INDEX:
                return
            layer = worker.ctx.spec.rank_shapes(worker.rank)[0].layer_ids[0]
            memory = worker.memory[layer]
            addr = memory.base_addr + block_ids[0][BLOCK_INDEX] * memory.block_stride + 5
            byte = ctypes.c_uint8.from_address(addr)
            byte.value ^= 0x40

        worker.hold_digests.take = take
