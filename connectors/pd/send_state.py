"""Per-request send state on one producer rank (push), with explicit states.

The mirror of :mod:`.state` (the consumer's ``RecvTransfer``): every state change
of a push on the producer side is a method here, so the worker acts on states
and a test drives both machines without a transport. A push is two machines.

The request, :class:`PushJob` (one per request this rank pushes; created by its
hold or its first push order)::

    PREFILLING --(push order marked final: the prompt's last step)--> FINAL
    PREFILLING, FINAL --(the producer request aborted, or a consumer's
                         cancelling register came before the request)--> DROPPED

DROPPED absorbs: a second drop, or a push order of a dropped request, changes
nothing. A layer's blocks become ready to write (``layers_ready``) only when the
fence recorded after the kernels that wrote it has passed (:meth:`PushJob.fence`,
:meth:`PushJob.release_fenced`), so fences belong to FINAL (or already dropped)
requests only: a fence of a PREFILLING request raises.

Each consumer rank that registered, :class:`SendTransfer` (one per request and
consumer rank). Before its ``register`` there is none: the request waits for it
(and a register that comes before the request is kept aside by the worker until
the request's hold or push order)::

    FENCED  --(WRITEs posted for layers whose fence passed)-------------> WRITING
    WRITING --(more layers posted)------------------------------------> WRITING
    FENCED  --(this producer rank holds nothing the consumer rank reads)--> PUSHED
    WRITING --(every layer it needs posted, every WRITE done)-----------> PUSHED
    FENCED, WRITING, CANCELLING --(cancelling register, request dropped)--> CANCELLING
    FENCED, WRITING, CANCELLING --(no WRITE of it in flight)------------> CANCELLED
    FENCED, WRITING --(a WRITE refused, failed or timed out)------------> FAILED

CANCELLING exists because a WRITE in flight still reads this rank's blocks and
lands in the consumer's: the answer waits until the transport settled every one of them.
PUSHED, CANCELLED and FAILED are terminal, reached once, and every event there
raises (the worker answers the consumer rank once, as the transfer gets there;
a PUSHED transfer of a rank it holds nothing for is not answered, only counted
by the lease). Any other event in a state without an arrow raises
:class:`SendStateError`. Nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.backends.device.fence import Fence
from kvbridge.connectors.pd import messages

if TYPE_CHECKING:
    from kvbridge.backends.transfer import DescList, PeerHandle, Transfer
    from kvbridge.connectors.pd.routing import DescTable


class SendStateError(RuntimeError):
    """An event in a state that has no transition for it: a bug in the caller."""


class PushPhase(str, enum.Enum):
    PREFILLING = "prefilling"  # the prompt's blocks are still being computed
    FINAL = "final"  # its last step was scheduled: layers ready as their fences pass
    DROPPED = "dropped"  # aborted: nothing more is written, targets end CANCELLED


class SendState(str, enum.Enum):
    FENCED = "fenced"  # registered, nothing posted: its layers wait for their fences
    WRITING = "writing"  # WRITEs posted, not all of them done or not every layer yet
    CANCELLING = "cancelling"  # cancelled while WRITEs may be in flight
    PUSHED = "pushed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (SendState.PUSHED, SendState.CANCELLED, SendState.FAILED)


class SendEvent(str, enum.Enum):
    POSTED = "posted"  # WRITEs of some layers posted (or those layers had nothing to post)
    NOTHING_NEEDED = "nothing_needed"  # the consumer rank reads nothing of this rank
    WRITTEN = "written"  # every needed layer posted and every WRITE done
    CANCEL = "cancel"  # cancelling register, or the request dropped
    SETTLED_CANCELLED = "settled_cancelled"  # cancelled with no WRITE in flight
    FAIL = "fail"  # a WRITE refused, failed or timed out


#: The whole machine of :class:`SendTransfer`: (state, event) -> next state.
TRANSITIONS: dict[tuple[SendState, SendEvent], SendState] = {
    (SendState.FENCED, SendEvent.POSTED): SendState.WRITING,
    (SendState.WRITING, SendEvent.POSTED): SendState.WRITING,
    (SendState.FENCED, SendEvent.NOTHING_NEEDED): SendState.PUSHED,
    (SendState.WRITING, SendEvent.WRITTEN): SendState.PUSHED,
    (SendState.FENCED, SendEvent.CANCEL): SendState.CANCELLING,
    (SendState.WRITING, SendEvent.CANCEL): SendState.CANCELLING,
    (SendState.CANCELLING, SendEvent.CANCEL): SendState.CANCELLING,  # a repeated cancel
    (SendState.FENCED, SendEvent.SETTLED_CANCELLED): SendState.CANCELLED,
    (SendState.WRITING, SendEvent.SETTLED_CANCELLED): SendState.CANCELLED,
    (SendState.CANCELLING, SendEvent.SETTLED_CANCELLED): SendState.CANCELLED,
    (SendState.FENCED, SendEvent.FAIL): SendState.FAILED,
    (SendState.WRITING, SendEvent.FAIL): SendState.FAILED,
}


@dataclass
class SendTransfer:
    """One request's push to one consumer rank, from its ``register`` on.

    ``layers_needed`` are the layers this producer rank writes to that consumer
    rank (its prepared lists, empty when it reads nothing of this rank);
    ``layers_written`` those whose WRITEs were posted; ``transfers`` the transport
    WRITEs posted, in order.
    """

    consumer_rank: int
    peer: PeerHandle
    register: messages.Register
    local: DescTable | None = None
    remote: DescTable | None = None
    local_list: DescList | None = None
    remote_list: DescList | None = None
    layers_needed: frozenset[int] = frozenset()
    layers_written: set[int] = field(default_factory=set)
    transfers: list[Transfer] = field(default_factory=list)
    runs: int = 0  # contiguous runs posted (what the transport moves after merging)
    #: slice digests per region of the blocks registered (``xxh3-64-slices`` asked)
    slice_digests: tuple[dict[int, int], ...] | None = None
    state: SendState = SendState.FENCED
    error: str | None = None  # why it ended CANCELLED or FAILED
    finished_at: float | None = None

    @property
    def writable(self) -> bool:
        """Layers may still be posted to it (not cancelled, not ended)."""
        return self.state in (SendState.FENCED, SendState.WRITING)

    def _move(self, event: SendEvent) -> None:
        """The one place :attr:`state` changes."""
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise SendStateError(f"push of request {self.register.request_id!r} to consumer "
                                 f"rank {self.consumer_rank}: {event.value} in state "
                                 f"{self.state.value}")
        self.state = nxt

    def posted(self, layers: set[int] | frozenset[int], runs: int) -> None:
        """The WRITEs of ``layers`` (``runs`` contiguous runs) are handed to the transport now; the
        caller appends the transfer to ``transfers`` (none when the layers had no rows).
        Counted before the post, so a refused post fails a WRITING transfer."""
        self._move(SendEvent.POSTED)
        self.runs += runs
        self.layers_written |= layers

    def nothing_needed(self, now: float) -> None:
        """The consumer rank reads nothing of this producer rank: done, unanswered."""
        if self.layers_needed and self.state is SendState.FENCED:
            raise SendStateError(f"push of request {self.register.request_id!r} to consumer "
                                 f"rank {self.consumer_rank}: nothing_needed with layers "
                                 f"{sorted(self.layers_needed)} needed")
        self._move(SendEvent.NOTHING_NEEDED)
        self.finished_at = now

    def written(self, now: float) -> None:
        """Every needed layer posted and every WRITE done."""
        if self.state is SendState.WRITING and not self.layers_written >= self.layers_needed:
            raise SendStateError(f"push of request {self.register.request_id!r} to consumer "
                                 f"rank {self.consumer_rank}: written with layers "
                                 f"{sorted(self.layers_needed - self.layers_written)} unposted")
        self._move(SendEvent.WRITTEN)
        self.finished_at = now

    def cancel(self) -> None:
        """Stop posting; the answer waits for the WRITEs in flight (:meth:`cancelled`)."""
        self._move(SendEvent.CANCEL)

    def cancelled(self, reason: str, now: float) -> None:
        """Cancelled, and none of its WRITEs is in flight any more."""
        self._move(SendEvent.SETTLED_CANCELLED)
        self.error = reason
        self.finished_at = now

    def fail(self, reason: str, now: float) -> None:
        self._move(SendEvent.FAIL)
        self.error = reason
        self.finished_at = now


@dataclass
class PushJob:
    """One request this producer rank pushes, and the consumer ranks that registered.

    ``block_ids`` are the request's blocks per region (the latest push order's);
    ``fenced`` the layers saved whose fence may not have passed, ``layers_ready``
    those whose fence passed (only these are ever posted).
    """

    request_id: str
    block_ids: tuple[tuple[int, ...], ...] = ()
    phase: PushPhase = PushPhase.PREFILLING
    layers_ready: set[int] = field(default_factory=set)
    fenced: list[tuple[Fence, frozenset[int]]] = field(default_factory=list)
    targets: dict[int, SendTransfer] = field(default_factory=dict)
    started_at: float = 0.0
    #: block id -> digest per region, taken once every layer is final
    digests: tuple[dict[int, int], ...] | None = None
    #: the same in the producer's other algorithms consumers ask for (not the first)
    alg_digests: dict[str, tuple[dict[int, int], ...]] = field(default_factory=dict)
    #: the producer's prompt chain (``sealing.prompt_chain``) a register must name
    chain: bytes = b""
    #: (region, block index) the engine released when the request finished (a sliding
    #: window's prefix): never written from then on
    released: frozenset[tuple[int, int]] = frozenset()
    engine: str | None = None  # the consumer engine whose register came first

    @property
    def final(self) -> bool:
        return self.phase is PushPhase.FINAL

    @property
    def dropped(self) -> bool:
        return self.phase is PushPhase.DROPPED

    def order(self, block_ids: tuple[tuple[int, ...], ...], final: bool) -> None:
        """A push order: the prompt's blocks so far; ``final`` in its last step."""
        self.block_ids = block_ids
        if final and self.phase is PushPhase.PREFILLING:
            self.phase = PushPhase.FINAL

    def release(self, held: tuple[tuple[int, ...], ...], null_block_id: int | None) -> None:
        """The request finished and the engine holds ``held`` (per region): the positions
        it names ``null_block_id`` at are gone, whatever the push orders named there."""
        if null_block_id is not None:
            self.released = frozenset((r, i) for r, ids in enumerate(held)
                                      for i, block in enumerate(ids) if block == null_block_id)

    def drop(self) -> None:
        """Aborted (by the engine, or cancelled by a consumer before it was known)."""
        self.phase = PushPhase.DROPPED

    def fence(self, fence: Fence, layers: frozenset[int]) -> None:
        """``layers`` were saved; ready to write once ``fence`` passed."""
        if self.phase is PushPhase.PREFILLING:
            raise SendStateError(f"push of request {self.request_id!r}: a fence before "
                                 "its final push order")
        self.fenced.append((fence, layers))

    def release_fenced(self) -> bool:
        """Move the layers of passed fences into ``layers_ready``; True if any moved."""
        if not self.fenced:
            return False
        waiting = []
        moved = False
        for fence, layers in self.fenced:
            if fence.done():
                self.layers_ready |= layers
                moved = True
            else:
                waiting.append((fence, layers))
        self.fenced = waiting
        return moved

    def ready_all(self, layers: set[int] | frozenset[int]) -> None:
        """Every layer is ready: the prefill finished in an earlier step, its fences
        passed, and a consumer rank registered only now."""
        if self.phase is not PushPhase.FINAL or self.fenced:
            raise SendStateError(f"push of request {self.request_id!r}: every layer ready "
                                 f"in phase {self.phase.value} with {len(self.fenced)} "
                                 "fences pending")
        self.layers_ready |= layers
