"""Chained, seeded, versioned block hashes.

A block's hash covers its parent's hash, its token ids and extra keys (cache
salt, LoRA name, multimodal hashes), so equal hashes mean equal prefixes. The
encoding is explicit (little-endian int64 tokens, msgpack extra keys, sha256),
never Python's ``hash()``: the same tokens hash the same in every process,
whatever ``PYTHONHASHSEED`` is.

Only *full* blocks are hashed. ``block_tokens`` is the number of tokens a key
covers: ``block_size`` normally, ``block_size * dcp_size`` for token-sharded
regions under DCP (see ``RegionSpec.tokens_per_key``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgpack

from kvbridge.layouts.errors import LayoutError

#: Bump when the encoding changes: old keys then never match new ones.
HASH_VERSION = 1
HASH_BYTES = 32
DEFAULT_SEED = b"kvbridge"

BlockHash = bytes
ExtraKey = str | int | bytes


def root_hash(seed: bytes = DEFAULT_SEED) -> BlockHash:
    """The parent hash of a request's first block."""
    return hashlib.sha256(b"kvbridge-block-hash-v%d\x00" % HASH_VERSION + seed).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int],
               extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    if len(parent) != HASH_BYTES:
        raise LayoutError("parent_hash", f"expected {HASH_BYTES} bytes, got {len(parent)}")
    try:
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise LayoutError("token_ids", f"expected 64-bit integers: {exc}") from None
    for key in extra_keys:
        if not isinstance(key, str | int | bytes) or isinstance(key, bool):
            raise LayoutError("extra_keys", f"expected str, int or bytes, got {key!r}")
    digest = hashlib.sha256()
    digest.update(parent)
    digest.update(struct.pack("<I", len(token_ids)))
    digest.update(tokens)
    digest.update(msgpack.packb(list(extra_keys), use_bin_type=True))
    return digest.digest()


#: A multimodal input's place in a prompt: ``(offset, length, identifier)``; its
#: placeholder tokens are the same for every image, the identifier is not.
Feature = tuple[int, int, str]


def block_extra_keys(start: int, end: int, cache_salt: str | None = None,
                     lora: str | None = None, features: Sequence[Feature] = (),
                     embeds: bytes | None = None) -> tuple[ExtraKey, ...]:
    """The extra keys of the block of tokens ``[start, end)``: what besides its token
    ids decides its KV. The cache salt; the LoRA adapter (name and path); each
    multimodal input whose placeholder overlaps the block, with its offset in it
    (the chain carries it to every later block); a digest of the prompt's
    embeddings when the prompt came as embeddings. With none but a salt this is
    ``(salt,)``: such keys are the ones they always were.
    """
    keys: list[ExtraKey] = [cache_salt] if cache_salt else []
    if lora:
        keys.append("lora\0" + lora)
    if embeds:
        keys.append(b"embeds\0" + embeds)
    for offset, length, identifier in features:
        if offset < end and offset + length > start:
            keys.append(f"mm\0{identifier}\0{offset - start}")
    return tuple(keys)


def hash_blocks(token_ids: Sequence[int], block_tokens: int,
                extra_keys: Sequence[ExtraKey] = (), seed: bytes = DEFAULT_SEED,
                ) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is not)."""
    if block_tokens < 1:
        raise LayoutError("block_tokens", f"expected >= 1, got {block_tokens}")
    hashes: list[BlockHash] = []
    parent = root_hash(seed)
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash_block(parent, token_ids[start:start + block_tokens], extra_keys)
        hashes.append(parent)
    return hashes
