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

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from kvbridge.connectors import TransferParams, TransferParamsError
from kvbridge.layouts import block_extra_keys, hash_block, root_hash
from kvbridge.layouts.hashing import Feature

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


def identity_of(request: Any) -> tuple[str | None, str | None, tuple[Feature, ...],
                                      bytes | None]:
    """``(cache_salt, lora, features, embeds)`` of a vLLM request: what besides its
    token ids decides its KV, as vLLM's own prefix-cache hash counts it (LoRA name
    and path, multimodal identifiers at their offsets, prompt embeddings)."""
    lora_request = getattr(request, "lora_request", None)
    lora = (f"{lora_request.lora_name}\0{getattr(lora_request, 'lora_path', '')}"
            if lora_request else None)
    features: list[Feature] = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        features.append((int(position.offset), int(position.length), str(feature.identifier)))
    embeds = None
    prompt_embeds = getattr(request, "prompt_embeds", None)
    if prompt_embeds is not None:  # once per request; placeholder tokens do not say which
        import torch

        raw = prompt_embeds.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        embeds = hashlib.sha256(raw.numpy().tobytes()).digest()
    return getattr(request, "cache_salt", None), lora, tuple(features), embeds


class _HashChain:
    """Chained block hashes of one request, extended as its tokens grow."""

    __slots__ = ("embeds", "features", "hashes", "lora", "salt")

    def __init__(self, num_regions: int, salt: str | None, lora: str | None = None,
                 features: tuple[Feature, ...] = (), embeds: bytes | None = None) -> None:
        self.hashes: list[list[bytes]] = [[] for _ in range(num_regions)]
        self.salt = salt
        self.lora = lora
        self.features = features
        self.embeds = embeds

    def update(self, token_ids: list[int], block_tokens: list[int]) -> tuple[tuple[bytes, ...], ...]:
        plain = (self.salt,) if self.salt else ()
        rich = bool(self.lora or self.features or self.embeds)
        out = []
        for r, size in enumerate(block_tokens):
            chain = self.hashes[r]
            parent = chain[-1] if chain else root_hash()
            for start in range(len(chain) * size, len(token_ids) - size + 1, size):
                extra = block_extra_keys(start, start + size, self.salt, self.lora,
                                         self.features, self.embeds) if rich else plain
                parent = hash_block(parent, token_ids[start:start + size], extra)
                chain.append(parent)
            out.append(tuple(chain))
        return tuple(out)
