"""The producer's push machines (``send_state``), driven without a transport.

Every legal path of a consumer rank's :class:`SendTransfer` through the
machine, every illegal event in every state, and random event sequences
checked against an oracle written here independently of the module's
transition table; the same for the request's :class:`PushJob` phases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.backends.device.fence import DONE
from kvbridge.backends.transfer import PeerHandle
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.send_state import (
    TRANSITIONS,
    PushJob,
    PushPhase,
    SendEvent,
    SendState,
    SendStateError,
    SendTransfer,
)

S = SendState
E = SendEvent
NEEDED = frozenset({0, 1, 2})


def _transfer(needed: frozenset[int] = NEEDED) -> SendTransfer:
    reg = messages.Register("req-1", 3, 1, (0,), ((4, 5),))
    return SendTransfer(3, PeerHandle("consumer-agent", 1), reg, layers_needed=needed)


def _fire(t: SendTransfer, event: SendEvent, now: float = 1.0,
          layers: frozenset[int] = NEEDED) -> None:
    """The method of the transfer that stands for ``event``."""
    calls: dict[SendEvent, Callable[[], None]] = {
        E.POSTED: lambda: t.posted(layers, 2),
        E.NOTHING_NEEDED: lambda: t.nothing_needed(now),
        E.WRITTEN: lambda: t.written(now),
        E.CANCEL: t.cancel,
        E.SETTLED_CANCELLED: lambda: t.cancelled("cancelled by consumer", now),
        E.FAIL: lambda: t.fail("write refused: bad block", now),
    }
    calls[event]()


def _paths() -> list[tuple[SendEvent, ...]]:
    """Every event sequence from FENCED to a terminal state, each self-loop taken once."""
    out: list[tuple[SendEvent, ...]] = []

    def walk(state: SendState, path: tuple[SendEvent, ...],
             looped: frozenset[SendState]) -> None:
        if state.terminal:
            out.append(path)
            return
        for (src, event), dst in TRANSITIONS.items():
            if src is not state or (dst is state and state in looped):
                continue
            walk(dst, (*path, event), looped | {state} if dst is state else looped)

    walk(S.FENCED, (), frozenset())
    return out


PATHS = _paths()


def test_the_paths_cover_every_transition_and_end_in_each_outcome() -> None:
    used = {(s, e) for path in PATHS for s, e in _states_along(path)}
    assert used == set(TRANSITIONS)
    assert {_end(path) for path in PATHS} == {S.PUSHED, S.CANCELLED, S.FAILED}


def _states_along(path: tuple[SendEvent, ...]) -> list[tuple[SendState, SendEvent]]:
    state, out = S.FENCED, []
    for event in path:
        out.append((state, event))
        state = TRANSITIONS[(state, event)]
    return out


def _end(path: tuple[SendEvent, ...]) -> SendState:
    state = S.FENCED
    for event in path:
        state = TRANSITIONS[(state, event)]
    return state


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(e.value for e in p))
def test_every_legal_path(path: tuple[SendEvent, ...]) -> None:
    needed = frozenset() if E.NOTHING_NEEDED in path else NEEDED
    t = _transfer(needed)
    assert t.state is S.FENCED and t.writable and t.finished_at is None
    for i, (before, event) in enumerate(_states_along(path)):
        assert t.state is before
        _fire(t, event, now=float(i + 1))
        assert t.state is TRANSITIONS[(before, event)]
        assert t.writable is (t.state in (S.FENCED, S.WRITING))
    assert t.state.terminal and t.finished_at == float(len(path))
    assert (t.error is None) is (t.state is S.PUSHED)
    assert (t.layers_written == NEEDED) is (E.POSTED in path)
    assert t.runs == 2 * path.count(E.POSTED)


def _reach(state: SendState) -> SendTransfer:
    path = {S.FENCED: (), S.WRITING: (E.POSTED,), S.CANCELLING: (E.CANCEL,),
            S.PUSHED: (E.POSTED, E.WRITTEN), S.CANCELLED: (E.SETTLED_CANCELLED,),
            S.FAILED: (E.FAIL,)}[state]
    t = _transfer()
    for event in path:
        _fire(t, event)
    assert t.state is state
    return t


ILLEGAL = [(s, e) for s in SendState for e in SendEvent if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize("state,event", ILLEGAL, ids=lambda x: x.value)
def test_every_illegal_event_raises_and_changes_nothing(state: SendState,
                                                        event: SendEvent) -> None:
    t = _reach(state)
    before = replace(t, layers_written=set(t.layers_written), transfers=list(t.transfers))
    with pytest.raises(SendStateError, match=f"{event.value} in state {state.value}"):
        _fire(t, event, now=99.0)
    assert t == before


def test_every_terminal_state_refuses_every_event() -> None:
    terminal = [s for s in SendState if s.terminal]
    assert terminal == [S.PUSHED, S.CANCELLED, S.FAILED]
    assert not [k for k in TRANSITIONS if k[0].terminal]
    assert all((s, e) in ILLEGAL for s in terminal for e in SendEvent)


def test_written_before_every_needed_layer_was_posted_raises() -> None:
    t = _transfer()
    t.posted(frozenset({0, 1}), 1)
    with pytest.raises(SendStateError, match=r"layers \[2\] unposted"):
        t.written(2.0)
    assert t.state is S.WRITING and t.finished_at is None
    t.posted(frozenset({2}), 1)
    t.written(3.0)
    assert t.state is S.PUSHED and t.runs == 2


def test_nothing_needed_with_layers_to_write_raises() -> None:
    t = _transfer()
    with pytest.raises(SendStateError, match=r"layers \[0, 1, 2\] needed"):
        t.nothing_needed(1.0)
    assert t.state is S.FENCED


def _oracle(state: SendState, event: SendEvent, needed: frozenset[int],
            written: set[int]) -> SendState | None:
    """The machine as the module docstring draws it; None: the event is illegal."""
    live = state in (S.FENCED, S.WRITING)
    if event is E.POSTED:
        return S.WRITING if live else None
    if event is E.NOTHING_NEEDED:
        return S.PUSHED if state is S.FENCED and not needed else None
    if event is E.WRITTEN:
        return S.PUSHED if state is S.WRITING and written >= needed else None
    if event is E.CANCEL:
        return S.CANCELLING if live or state is S.CANCELLING else None
    if event is E.SETTLED_CANCELLED:
        return S.CANCELLED if live or state is S.CANCELLING else None
    return S.FAILED if live else None


@settings(max_examples=300, deadline=None)
@given(st.frozensets(st.integers(0, 3), max_size=3),
       st.lists(st.tuples(st.sampled_from(list(SendEvent)),
                          st.frozensets(st.integers(0, 3), max_size=3)), max_size=12))
def test_random_event_sequences_follow_the_oracle(
        needed: frozenset[int], events: list[tuple[SendEvent, frozenset[int]]]) -> None:
    t = _transfer(needed)
    written: set[int] = set()
    ended_at: float | None = None
    for i, (event, layers) in enumerate(events):
        now = float(i + 1)
        expected = _oracle(t.state, event, needed, written)
        before = replace(t, layers_written=set(t.layers_written))
        if expected is None:
            with pytest.raises(SendStateError):
                _fire(t, event, now=now, layers=layers)
            assert t == before  # an illegal event changes nothing
            continue
        _fire(t, event, now=now, layers=layers)
        assert t.state is expected
        if event is E.POSTED:
            written |= layers
        if expected.terminal and ended_at is None:
            ended_at = now
        # terminal states are reached once: finished_at is the first arrival's time
        assert t.finished_at == ended_at
    assert t.layers_written == written
    assert t.state.terminal is (t.finished_at is not None)
    assert (t.error is not None) is (t.state in (S.CANCELLED, S.FAILED))


# ---------------------------------------------------------------------- the request


class _Fence:
    def __init__(self) -> None:
        self.passed = False

    def done(self) -> bool:
        return self.passed


def test_job_phases() -> None:
    job = PushJob("r", started_at=1.0)
    assert job.phase is PushPhase.PREFILLING and not job.final and not job.dropped
    job.order(((1, 2),), final=False)
    assert job.phase is PushPhase.PREFILLING and job.block_ids == ((1, 2),)
    with pytest.raises(SendStateError, match="fence before its final push order"):
        job.fence(DONE, frozenset({0}))
    with pytest.raises(SendStateError, match="every layer ready in phase prefilling"):
        job.ready_all({0, 1})
    assert not job.fenced and not job.layers_ready
    job.order(((1, 2, 3),), final=True)
    assert job.final and job.block_ids == ((1, 2, 3),)
    job.order(((1, 2, 3),), final=False)  # a later order does not undo the last step
    assert job.final
    job.ready_all({0, 1})
    assert job.layers_ready == {0, 1}
    job.drop()
    assert job.dropped and not job.final
    job.order(((1, 2, 3),), final=True)  # a dropped request stays dropped
    job.drop()
    assert job.phase is PushPhase.DROPPED
    with pytest.raises(SendStateError):
        job.ready_all({2})
    job.fence(DONE, frozenset({2}))  # a layer saved as the abort came: still released
    assert job.release_fenced() and job.layers_ready == {0, 1, 2}


def test_fenced_layers_are_ready_only_once_their_fence_passed() -> None:
    job = PushJob("r")
    job.order((), final=True)
    a, b = _Fence(), _Fence()
    job.fence(a, frozenset({0}))
    job.fence(b, frozenset({1, 2}))
    with pytest.raises(SendStateError, match="2 fences pending"):
        job.ready_all({0, 1, 2})
    assert not job.release_fenced() and job.layers_ready == set()
    b.passed = True
    assert job.release_fenced() and job.layers_ready == {1, 2}
    a.passed = True
    assert job.release_fenced() and job.layers_ready == {0, 1, 2}
    assert job.fenced == [] and not job.release_fenced()


JOB_EVENTS = ["order", "order_final", "drop", "fence", "ready_all"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(JOB_EVENTS), max_size=12))
def test_random_job_sequences_follow_the_oracle(events: list[str]) -> None:
    job = PushJob("r")
    phase = PushPhase.PREFILLING
    fences = 0
    for event in events:
        legal = True
        if event in ("order", "order_final"):
            job.order(((1,),), final=event == "order_final")
            if event == "order_final" and phase is PushPhase.PREFILLING:
                phase = PushPhase.FINAL
        elif event == "drop":
            job.drop()
            phase = PushPhase.DROPPED
        else:
            legal = phase is not PushPhase.PREFILLING if event == "fence" \
                else phase is PushPhase.FINAL and not fences
            call: Callable[[], Any] = (lambda: job.fence(DONE, frozenset({0}))) \
                if event == "fence" else (lambda: job.ready_all({0, 1}))
            if legal:
                call()
                fences += event == "fence"
            else:
                with pytest.raises(SendStateError):
                    call()
        assert job.phase is phase and len(job.fenced) == fences
