"""Per-request receive state on one consumer rank, with an explicit ``poll()`` state.

SGLang-style: each request's transfer is an object whose :meth:`RecvTransfer.poll`
says where it stands, so the worker loop is "poll everything, act on the
states", and a test can drive the machine without a transport::

    BOOTSTRAPPING --(peer session ready; pull: READs posted)--> TRANSFERRING
    BOOTSTRAPPING --(push: block ids registered)-------------> WAITING
    TRANSFERRING  --(every READ done)------------------------> WAITING
    WAITING       --(every expected ack / "pushed" is ok)----> DONE
    WAITING       --(pull: each READ without an ack yet ended
                     within its producer's ``held`` promise)--> DONE
    (pull, verifying: DONE also waits for the ``held`` answer carrying the
    digests asked of each producer rank; the worker then checks the blocks
    and may turn DONE into FAILED: :meth:`RecvTransfer.corrupt`)
    any non-terminal --(error, ack not ok, deadline)---------> FAILED

Invariants: DONE and FAILED are terminal and reached once; a FAILED request
reports exactly its local block ids (``local_blocks``) as load errors; every
state but the terminal ones is bounded by ``deadline`` (``poll(now)`` past it
fails the request, naming the state it was stuck in). Nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd.verify import DigestAsk


class RecvState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # waiting for the handshake / transport peer
    TRANSFERRING = "transferring"  # READs posted, not all done
    WAITING = "waiting"  # waiting for the producer's acks (pull) or writes (push)
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RecvState.DONE, RecvState.FAILED)


@dataclass
class RecvTransfer:
    """One request's load on one consumer rank.

    ``local_blocks`` are ``(region_index, block_id)`` of every local block this
    load writes; ``expected_from`` the producer ranks whose ack (pull) or
    "pushed" (push) must arrive ok before the request is DONE.
    """

    request_id: str
    params: TransferParams
    consumer_block_ids: tuple[tuple[int, ...], ...]
    producer_block_ids: tuple[tuple[int, ...], ...]
    start: tuple[int, ...]  # first block index per region (push registration)
    deadline: float
    started_at: float
    state: RecvState = RecvState.BOOTSTRAPPING
    error: str | None = None
    expected_from: frozenset[int] = frozenset()
    answered: set[int] = field(default_factory=set)
    transfers: list[object] = field(default_factory=list)  # backend Transfer objects
    #: pull: transfer id -> (producer rank, peer, encoded ReadDone) still to send once
    #: that READ is DONE
    read_notifs: dict[int, tuple[int, object, bytes]] = field(default_factory=dict)
    #: pull: producer rank -> local time the ``begin`` was sent (before sending)
    begun_at: dict[int, float] = field(default_factory=dict)
    #: producer rank -> local time until which its ``held`` answer promised the blocks
    promised_until: dict[int, float] = field(default_factory=dict)
    #: producer rank -> local time its READ was seen done
    read_done_at: dict[int, float] = field(default_factory=dict)
    done_on_promise: bool = False  # DONE before every ack came, on promises
    finished_at: float | None = None
    nbytes: int = 0
    num_descs: int = 0
    num_runs: int = 0  # contiguous runs the transport posts after merging (<= num_descs)
    counted_active: bool = False  # counted in its session's ``active`` (set by the worker)
    #: pull, verifying: producer rank -> the digests asked of it in the ``begin``
    digest_asks: dict[int, DigestAsk] = field(default_factory=dict)
    #: producer rank -> its ``held`` answer's packed digests (None: it sent none)
    digests: dict[int, tuple[bytes, ...] | None] = field(default_factory=dict)
    #: producer rank -> the digest algorithm of its ask (``layouts.digests``)
    digest_algorithms: dict[int, str] = field(default_factory=dict)
    unverified: int = 0  # blocks of this load that are not checked (counted, see verify)
    #: regions some producer rank's digests cover, and why the others are not checked
    checked_regions: set[int] = field(default_factory=set)
    unchecked_why: str = ""
    #: the digest of the sealed params (``sealing.record_digest``; empty: push, unsealed)
    record: bytes = b""
    #: push: the consumer's prompt chain over the tokens it takes (``sealing.prompt_chain``)
    chain: bytes = b""

    @property
    def local_blocks(self) -> frozenset[tuple[int, int]]:
        return frozenset((r, b) for r, ids in enumerate(self.consumer_block_ids) for b in ids)

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.consumer_block_ids)

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def fail(self, reason: str, now: float) -> bool:
        """Move to FAILED unless terminal; True if this call failed it."""
        if self.state.terminal:
            return False
        self.state = RecvState.FAILED
        self.error = reason
        self.finished_at = now
        return True

    def corrupt(self, reason: str) -> None:
        """DONE -> FAILED: the bytes landed but some failed their digest check."""
        if self.state is not RecvState.DONE:
            raise RuntimeError(f"request {self.request_id}: corrupt() in state {self.state.value}")
        self.state = RecvState.FAILED
        self.error = reason

    def posted(self, expected_from: frozenset[int], transfers: list[object], pull: bool) -> None:
        """Pull: READs posted (TRANSFERRING). Push: block ids registered (WAITING)."""
        if self.state is not RecvState.BOOTSTRAPPING:
            raise RuntimeError(f"request {self.request_id}: posted() in state {self.state.value}")
        self.expected_from = expected_from
        self.transfers = transfers
        self.state = RecvState.TRANSFERRING if pull and transfers else RecvState.WAITING

    def transfers_done(self) -> None:
        if self.state is RecvState.TRANSFERRING:
            self.state = RecvState.WAITING

    def read_done(self, producer_rank: int, seen_at: float) -> None:
        """The READ from ``producer_rank`` was seen DONE at ``seen_at`` (local clock)."""
        self.read_done_at.setdefault(producer_rank, seen_at)

    def promised(self, producer_rank: int, hold_s: float) -> None:
        """``producer_rank`` promised to hold the blocks for ``hold_s`` after our ``begin``."""
        begun = self.begun_at.get(producer_rank)
        if begun is not None and hold_s > 0:
            self.promised_until[producer_rank] = begun + hold_s

    def _covered(self, producer_rank: int) -> bool:
        """Its READ ended while the producer's promise held (so the bytes are good)."""
        until = self.promised_until.get(producer_rank)
        done = self.read_done_at.get(producer_rank)
        return until is not None and done is not None and done <= until

    def answer(self, producer_rank: int, ok: bool, reason: str, now: float) -> None:
        """An ack (pull) or a "pushed" (push) from ``producer_rank``."""
        if self.state.terminal:
            return
        if not ok:
            self.fail(f"producer rank {producer_rank}: {reason or 'refused'}", now)
            return
        self.answered.add(producer_rank)

    def poll(self, now: float) -> RecvState:
        """Advance on time alone: complete when every answer is in, fail past the deadline."""
        if self.state.terminal:
            return self.state
        if self.state is RecvState.WAITING and self.digest_asks.keys() <= self.digests.keys():
            missing = self.expected_from - self.answered
            if not missing or all(self._covered(p) for p in missing):
                self.state = RecvState.DONE
                self.finished_at = now
                self.done_on_promise = bool(missing)
                return self.state
        if now >= self.deadline:
            self.fail(f"deadline passed in state {self.state.value} "
                      f"({now - self.started_at:.3f} s after start)", now)
        return self.state
