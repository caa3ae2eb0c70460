"""Two pieces of a vLLM request's kvbridge view that need no vLLM: its transfer
params and its chained block hashes.

Owns: ``kv_transfer_params["kvbridge"]`` <-> :class:`TransferParams`
(:func:`parse_transfer_params` logs and ignores malformed ones: the request
recomputes; :func:`wrap_transfer_params` is what a producer returns to the
router) and :class:`_HashChain` (one request's chained block hashes per region,
extended as its tokens grow). May not touch: vLLM's request objects, block ids
or the connector halves (:mod:`kvbridge.integrations.vllm.connector` builds each
hook's :class:`ConnectorRequest` from these).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvbridge.connectors import TransferParams, TransferParamsError
from kvbridge.layouts import hash_block, root_hash

logger = logging.getLogger(__name__)

#: Key of kvbridge's TransferParams inside vLLM's ``kv_transfer_params``.
PARAMS_KEY = "kvbridge"


def parse_transfer_params(raw: Mapping[str, Any] | None) -> tuple[TransferParams | None, bool]:
    """``(params, remote_decode)`` from a request's ``kv_transfer_params``.

    Malformed kvbridge params are logged and ignored (the request recomputes):
    raising here would stop the engine for one bad request.
    """
    if not raw:
        return None, False
    remote_decode = bool(raw.get("do_remote_decode"))
    data = raw.get(PARAMS_KEY)
    if data is None:
        return None, remote_decode
    try:
        return TransferParams.from_dict(data), remote_decode
    except TransferParamsError as exc:
        logger.warning("kvbridge: ignoring malformed kv_transfer_params: %s", exc)
        return None, remote_decode


def wrap_transfer_params(params: TransferParams) -> dict[str, Any]:
    """What a producer returns to the router: vLLM's PD flags plus kvbridge's record."""
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: params.to_dict()}


class _HashChain:
    """Chained block hashes of one request, extended as its tokens grow."""

    __slots__ = ("hashes", "salt")

    def __init__(self, num_regions: int, salt: str | None) -> None:
        self.hashes: list[list[bytes]] = [[] for _ in range(num_regions)]
        self.salt = salt

    def update(self, token_ids: list[int], block_tokens: list[int]) -> tuple[tuple[bytes, ...], ...]:
        extra = (self.salt,) if self.salt else ()
        out = []
        for r, size in enumerate(block_tokens):
            chain = self.hashes[r]
            parent = chain[-1] if chain else root_hash()
            for start in range(len(chain) * size, len(token_ids) - size + 1, size):
                parent = hash_block(parent, token_ids[start:start + size], extra)
                chain.append(parent)
            out.append(tuple(chain))
        return tuple(out)
