"""What a scheduler connector is told about requests and about each step.

Owns: :class:`ConnectorRequest` (the immutable view of a request a hook gets),
:class:`ScheduledRequest` and :class:`SchedulerStep` (the argument of
``build_connector_meta``), and :func:`block_range` (which blocks hold a token
range). Plain frozen records, built by the engine (or an engine adapter) per hook
call. May not touch: a connector or an engine; the hooks and their order are in
:mod:`kvbridge.connectors.api`, which re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.connectors.params import BlockIds, TransferParams
from kvbridge.layouts import BlockHash, ExtraKey, block_extra_keys
from kvbridge.layouts.hashing import Feature


def block_range(block_tokens: int, start_token: int, end_token: int) -> range:
    """Indices (into a request's block list of one region) of the blocks that hold
    tokens ``[start_token, end_token)`` when each block covers ``block_tokens`` tokens."""
    if end_token <= start_token:
        return range(0)
    return range(start_token // block_tokens, -(-end_token // block_tokens))


@dataclass(frozen=True)
class ConnectorRequest:
    """What a connector sees of a request: an immutable view built per hook call.

    ``token_ids`` are all tokens so far (prompt, then generated ones).
    ``block_hashes[r]`` are the chained hashes (``kvbridge.layouts.hash_blocks``)
    of every *full* key of region ``r`` over ``token_ids``, where a key covers
    ``ctx.block_tokens(r)`` tokens (``block_size * dcp_size`` for token-sharded
    regions); each key's extra keys are :meth:`extra_keys` (the cache salt, and what
    an engine adapter knows beyond token ids: ``lora``, multimodal ``features``, a
    digest of prompt ``embeds``), so two requests share a key only when they
    share the KV.
    ``num_computed_tokens`` is how many leading tokens have valid KV in this
    engine (local prefix-cache hits and computed tokens) when the view was made.

    ``transfer_params``: where this request's KV comes from (consumer; pull or
    push), or, on a producer in push mode, where to write it.
    ``remote_decode``: the router asked this engine (a producer) to prefill and
    hand the KV to a remote decoder: ``request_finished`` should hold the
    blocks (pull) and return the ``TransferParams`` for the router.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_hashes: tuple[tuple[BlockHash, ...], ...]
    num_computed_tokens: int = 0
    transfer_params: TransferParams | None = None
    remote_decode: bool = False
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter's name and path
    features: tuple[Feature, ...] = ()  # multimodal inputs: (offset, length, identifier)
    embeds: bytes | None = None  # a digest of the prompt's embeddings, if it came as them

    def extra_keys(self, start: int, end: int) -> tuple[ExtraKey, ...]:
        """The extra keys of this request's block of tokens ``[start, end)``."""
        return block_extra_keys(start, end, self.cache_salt, self.lora, self.features,
                                self.embeds)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[:self.num_prompt_tokens]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in a step, as the scheduler connector sees it.

    ``block_ids``: all blocks of the request now, per region.
    ``num_computed_tokens``: tokens with valid KV before this step's compute
    (including tokens a connector loads synchronously this step).
    ``num_scheduled_tokens``: tokens computed this step, from
    ``num_computed_tokens`` on. ``is_new``: first schedule (or first after a
    preemption, which dropped the old blocks): ``block_ids`` are a fresh list.
    """

    request: ConnectorRequest
    block_ids: BlockIds
    num_computed_tokens: int
    num_scheduled_tokens: int
    is_new: bool


@dataclass(frozen=True)
class SchedulerStep:
    """What the scheduler decided this step (the argument of ``build_connector_meta``)."""

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()
