"""Sealed, prompt-bound transfer params: the KV a request loads is its own.

Whoever can send a request to a consumer engine also chooses its transfer
params. Without more, an API client could name another request's blocks (or
its own blocks with another prompt) and decode on KV that is not this
prompt's. So the producer *seals* the params it returns, and both ends check
them:

* ``prompt_chain``: kvbridge's chained block hash (:mod:`kvbridge.layouts.hashing`,
  the hashes the store keys and KV events use) over the prompt's first
  ``num_tokens`` tokens, in links of :data:`CHAIN_TOKENS` tokens, with one more
  link for a partial last block; each link's extra keys are the request's (the
  cache salt, and from vLLM its LoRA adapter, multimodal inputs and prompt
  embeddings). The consumer recomputes it from its own request: other tokens
  (or another image), another chain.
* ``hold_id``: 128 random bits naming this one hold. The producer answers a
  ``begin``, ``read`` or release only for its exact hold, from one consumer
  engine, each consumer rank once; the consumer refuses a hold id it already
  loaded for another request.
* ``incarnation``: the producer engine's start (its block ids mean nothing
  after a restart).
* ``seal``: HMAC-SHA256 over the canonical record (:func:`canonical_record`:
  every field but the seal). The key is the cluster secret's when one is
  configured (``seal_key = "cluster"``): every member can check it. Without
  one it is a per-engine key (``"engine"``): only the producer can. Either
  way the consumer names the record by its digest (:func:`record_digest`) in
  every ``begin``, ``read`` and release, and the producer compares it with the
  record it sealed.

Refusals happen on the consumer's scheduler, before anything is allocated or
read, and the request recomputes locally (:class:`ParamsCheck`); a producer's
refusal (the record is not the one it sealed, the hold is another engine's, a
rank begins twice) fails the load closed: its blocks are load errors, never
served. With a cluster secret a forged record never gets as far as a READ;
with a per-engine key the READ may already be in flight when the producer's
refusal comes, and its bytes are thrown away with the load.

Push params are written by the router before either engine has the request,
so nothing seals them; the consumer's ``register`` carries its prompt chain
instead, and the producer writes only when it equals the chain of the prompt
it computed.

Cost per request (``kvbridge bench auth``): docs/nixl.md, "Sealed, prompt-bound params".
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgpack

from kvbridge.auth import Secret
from kvbridge.connectors.errors import TransferParamsError
from kvbridge.connectors.params import TransferMode, TransferParams
from kvbridge.layouts.hashing import ExtraKey, hash_block, root_hash

#: Tokens per link of a prompt chain. A fixed size, so both ends compute the same
#: chain whatever their block sizes; a region whose keys cover this many tokens
#: gives it for free (its block hashes are the chain's links).
CHAIN_TOKENS = 16
#: Links the consumer computes at most for one request (bounded work on a peer's say:
#: ``num_tokens`` is already bounded by the prompt, this by a constant).
MAX_CHAIN_LINKS = 1 << 17
#: Bytes of a record digest (:func:`record_digest`) on the wire.
RECORD_DIGEST_BYTES = 16
#: Consumer hold ids remembered to refuse a replay (oldest forgotten first; the
#: producer refuses a reused hold too, so forgetting one only moves the refusal there).
MAX_USED_HOLDS = 1 << 16

SEAL_KEYS = ("cluster", "engine")
_SEAL_DOMAIN = b"kvbridge-params-seal-v2\0"
_RECORD_DOMAIN = b"kvbridge-params-record-v2\0"
_TAIL_KEY = "kvbridge-partial-block"


#: The extra keys of a request's block of tokens ``[start, end)``
#: (``ConnectorRequest.extra_keys``: the salt, LoRA, multimodal inputs, embeddings).
ExtraKeys = Callable[[int, int], tuple[ExtraKey, ...]]


def prompt_chain(token_ids: Sequence[int], num_tokens: int, cache_salt: str | None = None,
                 links: Sequence[bytes] = (), extra_keys: ExtraKeys | None = None) -> bytes:
    """The chain over ``token_ids[:num_tokens]`` (32 bytes).

    ``extra_keys``: each link's extra keys (default: the cache salt alone), the same
    as the request's block hashes use, so what decides the KV besides the tokens
    (an adapter, an image) decides the chain too.

    ``links``: chained hashes of this request's full keys of :data:`CHAIN_TOKENS`
    tokens already computed (a region's ``block_hashes`` when its keys are that
    size); the rest is hashed here. Raises :class:`TransferParamsError` on
    ``num_tokens`` past the tokens given or needing more than
    :data:`MAX_CHAIN_LINKS` links.
    """
    if num_tokens < 0 or num_tokens > len(token_ids):
        raise TransferParamsError("transfer_params.num_tokens",
                                  f"{num_tokens} tokens for a prompt of {len(token_ids)}")
    full, tail = divmod(num_tokens, CHAIN_TOKENS)
    if full + 1 > MAX_CHAIN_LINKS:
        raise TransferParamsError("transfer_params.num_tokens",
                                  f"{num_tokens} tokens: a prompt chain has at most "
                                  f"{MAX_CHAIN_LINKS} links of {CHAIN_TOKENS}")
    if extra_keys is None:
        plain = (cache_salt,) if cache_salt else ()

        def extra_keys(_start: int, _end: int) -> tuple[ExtraKey, ...]:
            return plain

    have = min(full, len(links))
    parent = links[have - 1] if have else root_hash()
    for index in range(have, full):
        start = index * CHAIN_TOKENS
        parent = hash_block(parent, token_ids[start:start + CHAIN_TOKENS],
                            extra_keys(start, start + CHAIN_TOKENS))
    if tail:
        start = full * CHAIN_TOKENS
        parent = hash_block(parent, token_ids[start:num_tokens],
                            (*extra_keys(start, num_tokens), _TAIL_KEY))
    return parent


def canonical_record(params: TransferParams) -> bytes:
    """The bytes a seal covers: every field of the record but ``seal``, in a fixed order."""
    topo = params.producer_topology
    fields = [
        params.version, params.mode.value, params.producer_engine_id, params.incarnation,
        params.producer_host, params.producer_port, params.producer_request_id,
        [list(group) for group in params.block_ids],
        [topo.tp_size, topo.pp_size, topo.dcp_size, topo.pcp_size],
        params.num_tokens, params.consumer_engine_id, params.consumer_host,
        params.consumer_port, params.consumer_request_id, params.spec_fingerprint,
        sorted(params.extra.items()), params.hold_id, params.prompt_chain, params.seal_key,
    ]
    return msgpack.packb(fields, use_bin_type=True)


def record_digest(params: TransferParams) -> bytes:
    """What a consumer names its record by in ``begin`` and ``read`` (16 bytes)."""
    return hashlib.sha256(_RECORD_DOMAIN + canonical_record(params)).digest()[
        :RECORD_DIGEST_BYTES]


def _tag(key: Secret, params: TransferParams) -> str:
    return key.mac(_SEAL_DOMAIN, canonical_record(params)).hex()


def sealed(key: Secret, params: TransferParams) -> TransferParams:
    """``params`` (every sealed field set) with its seal under ``key``."""
    return replace(params, seal=_tag(key, replace(params, seal=None)))


class Sealer:
    """The producer's side: seals the params it returns (one per scheduler).

    ``cluster``: the cluster secret, when configured (members can check the
    seal); otherwise a random per-engine key, alive as long as this object.
    """

    def __init__(self, cluster: Secret | None = None) -> None:
        self.key_kind = "cluster" if cluster is not None else "engine"
        self._key = cluster if cluster is not None else Secret(secrets.token_bytes(32),
                                                               "per-engine params key")
        self.incarnation = secrets.token_hex(8)

    def seal(self, params: TransferParams, chain: bytes) -> TransferParams:
        """``params`` with a fresh hold id, this engine's incarnation, ``chain`` and the seal."""
        return sealed(self._key, replace(
            params, hold_id=secrets.token_hex(16), incarnation=self.incarnation,
            prompt_chain=chain.hex(), seal_key=self.key_kind, seal=None))

    def verify(self, params: TransferParams) -> bool:
        return params.seal is not None and hmac.compare_digest(
            params.seal, _tag(self._key, replace(params, seal=None)))


def verify_cluster_seal(secret: Secret, params: TransferParams) -> bool:
    """Whether ``params``' seal is the cluster secret's over exactly this record."""
    return params.seal is not None and hmac.compare_digest(
        params.seal, _tag(secret, replace(params, seal=None)))


class ParamsCheck:
    """The consumer's side: a pull record is this prompt's, sealed, and not reused.

    :meth:`check` raises :class:`TransferParamsError` naming the field; the
    scheduler then refuses the params (the request recomputes). Counted by the
    caller per :attr:`TransferParamsError.field`.
    """

    def __init__(self, cluster: Secret | None = None) -> None:
        self.cluster = cluster
        #: hold ids (with their producer engine) loaded, and the request that loaded each
        self._used: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._by_request: dict[str, tuple[str, str]] = {}  # loads in flight

    def check(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None,
              params: TransferParams, links: Sequence[bytes] = (),
              extra_keys: ExtraKeys | None = None) -> None:
        self._not_reused(request_id, params)
        if params.mode is not TransferMode.PULL:
            return  # push: the producer compares the register's chain with its own
        if params.seal is None or params.hold_id is None or params.prompt_chain is None:
            raise TransferParamsError("transfer_params.seal",
                                      "unsealed pull params: only the producer's own "
                                      "(sealed) params are loaded")
        if self.cluster is not None:
            if params.seal_key != "cluster":
                raise TransferParamsError("transfer_params.seal_key",
                                          f"{params.seal_key!r}: this engine has a cluster "
                                          f"secret and loads only params sealed with it")
            if not verify_cluster_seal(self.cluster, params):
                raise TransferParamsError("transfer_params.seal",
                                          "does not verify under the cluster secret (the "
                                          "record was changed, or sealed elsewhere)")
        chain = prompt_chain(token_ids, params.num_tokens, cache_salt, links, extra_keys)
        if not hmac.compare_digest(chain.hex(), params.prompt_chain):
            raise TransferParamsError("transfer_params.prompt_chain",
                                      "not this request's prompt: the producer held the KV "
                                      "of other tokens")

    @staticmethod
    def _key(params: TransferParams) -> tuple[str, str]:
        """A pull hold by its id; a push transfer (unsealed) by its producer request."""
        if params.hold_id is not None:
            return params.producer_engine_id, params.hold_id
        return params.producer_engine_id, "push " + params.producer_request_id

    def _not_reused(self, request_id: str, params: TransferParams) -> None:
        user = self._used.get(self._key(params))
        if user is not None and user != request_id:
            raise TransferParamsError("transfer_params.hold_id",
                                      f"already loaded by request {user[:64]!r}: a hold is "
                                      f"used once")

    def used(self, request_id: str, params: TransferParams) -> None:
        """``params``' hold is now this request's (its load or release was ordered)."""
        key = self._key(params)
        self._used[key] = request_id
        self._used.move_to_end(key)
        self._by_request[request_id] = key
        while len(self._used) > MAX_USED_HOLDS:
            _key, user = self._used.popitem(last=False)
            self._by_request.pop(user, None)

    def failed(self, request_id: str) -> None:
        """``request_id``'s load failed: its hold is not used up by it. (A record the
        producer refused names a hold that may be another request's; the producer
        answers that hold's own load as ever.)"""
        key = self._by_request.pop(request_id, None)
        if key is not None and self._used.get(key) == request_id:
            del self._used[key]

    def finished(self, request_id: str) -> None:
        """``request_id`` is done loading: its hold stays used (by it), unindexed."""
        self._by_request.pop(request_id, None)


def chain_links(block_hashes: Sequence[Sequence[bytes]],
                tokens_per_key: Sequence[int]) -> Sequence[bytes]:
    """A region's block hashes that are prompt-chain links (its keys cover
    :data:`CHAIN_TOKENS` tokens), else nothing: the chain is then computed."""
    for hashes, tokens in zip(block_hashes, tokens_per_key, strict=False):
        if tokens == CHAIN_TOKENS:
            return hashes
    return ()

