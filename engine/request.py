"""Requests of the reference engine: what a client submits, the engine's state, results."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors import ConnectorRequest, TransferParams
from kvbridge.engine.content import extend_prefix_seeds
from kvbridge.layouts import BlockHash, KVCacheSpec, hash_block, root_hash

#: Token ids are 64-bit signed in the block hashes (``layouts.hashing``); negative
#: ids mean nothing, so a prompt holds ids in ``[0, MAX_TOKEN_ID]``.
MAX_TOKEN_ID = 2**63 - 1


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_LOOKUP = "waiting_for_lookup"  # the connector said "ask again next step"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # async load in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in (RequestState.FINISHED_LENGTH, RequestState.FINISHED_ABORTED,
                        RequestState.FINISHED_ERROR)


@dataclass(frozen=True)
class RequestSpec:
    """A client request: prompt tokens, how many to generate, and PD routing fields."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 4
    transfer_params: TransferParams | None = None
    remote_decode: bool = False
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r}: prompt: expected >= 1 token")
        bad = next((t for t in self.prompt if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise ValueError(f"request {self.request_id!r}: prompt: token id {bad} outside "
                             f"[0, 2**63)")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens: expected >= 1")

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt": list(self.prompt),
                "max_tokens": self.max_tokens,
                "transfer_params": (self.transfer_params.to_dict()
                                    if self.transfer_params else None),
                "remote_decode": self.remote_decode, "cache_salt": self.cache_salt}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestSpec:
        params = data.get("transfer_params")
        return cls(request_id=str(data["request_id"]), prompt=tuple(data["prompt"]),
                   max_tokens=int(data.get("max_tokens", 4)),
                   transfer_params=TransferParams.from_dict(params) if params else None,
                   remote_decode=bool(data.get("remote_decode", False)),
                   cache_salt=data.get("cache_salt"))


@dataclass(frozen=True)
class RequestResult:
    """What the engine reports for a finished request."""

    request_id: str
    state: RequestState
    output: tuple[int, ...]
    num_prompt_tokens: int
    num_local_hit_tokens: int
    num_external_tokens: int
    num_recomputed_tokens: int
    verified_bytes: int
    mismatched_bytes: int
    transfer_params: TransferParams | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "state": self.state.value,
                "output": list(self.output), "num_prompt_tokens": self.num_prompt_tokens,
                "num_local_hit_tokens": self.num_local_hit_tokens,
                "num_external_tokens": self.num_external_tokens,
                "num_recomputed_tokens": self.num_recomputed_tokens,
                "verified_bytes": self.verified_bytes, "mismatched_bytes": self.mismatched_bytes,
                "transfer_params": (self.transfer_params.to_dict()
                                    if self.transfer_params else None),
                "error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestResult:
        params = data.get("transfer_params")
        return cls(request_id=data["request_id"], state=RequestState(data["state"]),
                   output=tuple(data["output"]), num_prompt_tokens=data["num_prompt_tokens"],
                   num_local_hit_tokens=data["num_local_hit_tokens"],
                   num_external_tokens=data["num_external_tokens"],
                   num_recomputed_tokens=data["num_recomputed_tokens"],
                   verified_bytes=data["verified_bytes"],
                   mismatched_bytes=data["mismatched_bytes"],
                   transfer_params=TransferParams.from_dict(params) if params else None,
                   error=data.get("error"))


@dataclass
class EngineRequest:
    """Mutable engine-side state of one request (owned by the scheduler thread).

    Its fields change only through the methods below, one per thing that happens
    to a request (queued, preempted, parked for remote KV, a load settled, ended,
    ...), so every write to a request is in this class; the engine's parts call
    them (``tests/engine/test_state_owners.py`` checks that no other module
    writes a field). The block lists are the block space's
    (:class:`~kvbridge.engine.blocks.BlockSpace`): only it calls the block methods.
    """

    spec: RequestSpec
    num_regions: int
    token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: int = 0
    hashes: list[list[BlockHash]] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    # blocks of this request that already took a prefix-cache reference
    num_local_hit_tokens: int = 0
    num_external_tokens: int = 0
    num_recomputed_tokens: int = 0
    pending_external_tokens: int = 0  # async load in flight: tokens it will provide
    verified_bytes: int = 0
    mismatched_bytes: int = 0
    transfer_params_out: TransferParams | None = None
    delay_free: bool = False
    abort_requested: bool = False
    connector_done: bool = False  # engine gave up on the connector for this request
    error: str | None = None
    waiting_since: float = 0.0
    # sync load this step: token range [start, end) loaded by the connector
    sync_load: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.spec.prompt)
        if not self.block_ids:
            self.block_ids = [[] for _ in range(self.num_regions)]
        if not self.hashes:
            self.hashes = [[] for _ in range(self.num_regions)]

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def update_hashes(self, spec: KVCacheSpec, dcp_size: int) -> None:
        """Extend each region's chained hashes over newly completed keys."""
        extra = (self.spec.cache_salt,) if self.spec.cache_salt else ()
        for index, region in enumerate(spec.regions):
            tokens_per_key = region.tokens_per_key(dcp_size)
            hashes = self.hashes[index]
            parent = hashes[-1] if hashes else root_hash()
            while (len(hashes) + 1) * tokens_per_key <= len(self.token_ids):
                start = len(hashes) * tokens_per_key
                parent = hash_block(parent, self.token_ids[start:start + tokens_per_key], extra)
                hashes.append(parent)

    def update_seeds(self) -> list[int]:
        return extend_prefix_seeds(self.seeds, self.token_ids)

    def view(self, num_computed_tokens: int | None = None) -> ConnectorRequest:
        return ConnectorRequest(
            request_id=self.request_id,
            token_ids=tuple(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            block_hashes=tuple(tuple(h) for h in self.hashes),
            num_computed_tokens=(self.num_computed_tokens if num_computed_tokens is None
                                 else num_computed_tokens),
            transfer_params=self.spec.transfer_params,
            remote_decode=self.spec.remote_decode,
            cache_salt=self.spec.cache_salt,
        )

    def frozen_block_ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(ids) for ids in self.block_ids)

    # ------------------------------------------------------------------ scheduling

    def queue(self, now: float) -> None:
        """Submitted: waiting since ``now`` (monotonic s)."""
        self.waiting_since = now

    def preempt(self, now: float) -> None:
        """Out of the running batch (its blocks are freed): recompute from token 0."""
        self.num_computed_tokens = 0
        self.state = RequestState.PREEMPTED
        self.waiting_since = now

    def defer_lookup(self, now: float) -> None:
        """The connector answered "ask again": waiting for a lookup since the first time."""
        if self.state is not RequestState.WAITING_FOR_LOOKUP:
            self.waiting_since = now
        self.state = RequestState.WAITING_FOR_LOOKUP

    def take_local_hit(self, num_tokens: int) -> None:
        self.num_local_hit_tokens = num_tokens

    def await_remote(self, num_computed_tokens: int, num_external_tokens: int,
                     now: float) -> None:
        """An async load of ``num_external_tokens`` after ``num_computed_tokens`` started:
        parked until its receive ends."""
        self.num_computed_tokens = num_computed_tokens
        self.pending_external_tokens = num_external_tokens
        self.state = RequestState.WAITING_FOR_REMOTE_KVS
        self.waiting_since = now

    def run(self, num_computed_tokens: int) -> None:
        """Scheduled into the running batch, its first ``num_computed_tokens`` done."""
        self.num_computed_tokens = num_computed_tokens
        self.state = RequestState.RUNNING

    def advance(self, num_tokens: int) -> None:
        """This step computed ``num_tokens`` more tokens."""
        self.num_computed_tokens += num_tokens

    def append_token(self, token_id: int) -> None:
        """The next sampled token (the caller extends the hashes)."""
        self.token_ids.append(token_id)

    # ------------------------------------------------------------------ loads

    def start_sync_load(self, start: int, num_tokens: int) -> None:
        """Tokens ``[start, start + num_tokens)`` are loaded in this step's forward."""
        self.sync_load = (start, start + num_tokens)
        self.num_external_tokens += num_tokens

    def end_sync_load(self) -> None:
        self.sync_load = None

    def fail_sync_load(self, first_invalid: int) -> None:
        """This step's sync load is bad from token ``first_invalid``: those tokens, and
        the tokens computed this step after them, are recomputed."""
        assert self.sync_load is not None
        lost = self.sync_load[1] - first_invalid
        self.num_recomputed_tokens += lost
        self.num_external_tokens -= lost
        self.sync_load = None
        self.num_computed_tokens = first_invalid

    def end_remote_load(self, valid_end: int, *, keep: bool) -> None:
        """The async receive ended; its tokens before ``valid_end`` arrived intact, the
        rest are recomputed. ``keep``: the intact tokens count as computed (not when
        the request fails instead)."""
        start = self.num_computed_tokens
        end = start + self.pending_external_tokens
        self.pending_external_tokens = 0
        self.num_recomputed_tokens += end - valid_end
        if keep:
            self.num_external_tokens += valid_end - start
            # at least one token is computed to produce the next token
            self.num_computed_tokens = min(valid_end, self.num_tokens - 1)
        self.state = RequestState.WAITING

    def give_up_remote(self) -> None:
        """The engine stopped waiting for its receive: recompute what it would bring,
        without the connector."""
        self.num_recomputed_tokens += self.pending_external_tokens
        self.pending_external_tokens = 0
        self.state = RequestState.WAITING
        self.connector_done = True
        self.sync_load = None

    def give_up_lookup(self) -> None:
        """The engine stopped asking the connector: a miss."""
        self.connector_done = True
        self.state = RequestState.WAITING

    def add_verified(self, verified_bytes: int, mismatched_bytes: int) -> None:
        self.verified_bytes += verified_bytes
        self.mismatched_bytes += mismatched_bytes

    # ------------------------------------------------------------------ ending

    def fail(self, error: str) -> None:
        """Why it ends in FINISHED_ERROR (set before it ends)."""
        self.error = error

    def end(self, state: RequestState) -> None:
        self.state = state

    def set_transfer_params_out(self, params: TransferParams | None) -> None:
        """What ``request_finished`` returned for the other engine."""
        self.transfer_params_out = params

    # ------------------------------------------------------------------ blocks (BlockSpace)

    def extend_blocks(self, region: int, block_ids: Sequence[int]) -> None:
        self.block_ids[region].extend(block_ids)

    def set_blocks(self, region: int, block_ids: Sequence[int]) -> None:
        self.block_ids[region] = list(block_ids)

    def clear_blocks(self) -> None:
        self.block_ids = [[] for _ in range(self.num_regions)]

    def result(self) -> RequestResult:
        return RequestResult(
            request_id=self.request_id, state=self.state, output=tuple(self.output),
            num_prompt_tokens=self.num_prompt_tokens,
            num_local_hit_tokens=self.num_local_hit_tokens,
            num_external_tokens=self.num_external_tokens,
            num_recomputed_tokens=self.num_recomputed_tokens,
            verified_bytes=self.verified_bytes, mismatched_bytes=self.mismatched_bytes,
            transfer_params=self.transfer_params_out, error=self.error)


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


def common_hit_tokens(hits: Sequence[int], tokens_per_block: Sequence[int]) -> int:
    """Tokens covered by full-block hits in *every* region: ``min(hits[r] * T[r])``
    rounded down to a multiple of every region's ``T[r]`` (a partial block is no hit)."""
    if not hits:
        return 0
    limit = min(h * t for h, t in zip(hits, tokens_per_block, strict=True))
    step = 1
    for t in tokens_per_block:
        step = step * t // _gcd(step, t)
    return limit // step * step


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
