"""The subscriber's fast path for in-order live frames changes nothing observable.

``KVEventSubscriber._on_live`` delivers a well-formed frame carrying the expected
seq in one test (``SequenceTracker.in_order_live``) instead of building a
``LiveFrame`` and a verdict; everything else takes the full path. These tests
feed the same frames, valid and not, in and out of order, to a subscriber with the
fast path and to one whose fast path always declines, and compare what comes out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    Medium,
    ReceivedBatch,
    encode_events,
)
from kvbridge.events.stream import _received_batch
from kvbridge.events.wire import encode_seq

_TOPIC = b"kv"
_PAYLOADS = [
    encode_events(1.5, [BlockStored((1, 2), None, tuple(range(32)), 16, group_idx=0)], None),
    encode_events(2.5, [BlockRemoved((7,), medium=Medium.CPU)], 3),
    b"\xc1 not msgpack",  # decodes to a MalformedFrame
]

_frame = st.one_of(
    # mostly well-formed [topic, seq, payload] with small seqs (in order, gaps, repeats)
    st.tuples(st.just(_TOPIC), st.integers(-3, 12).map(encode_seq),
              st.sampled_from(_PAYLOADS)).map(list),
    # wrong frame counts, short or long seq frames
    st.lists(st.binary(max_size=9), max_size=4),
    st.tuples(st.just(_TOPIC), st.binary(min_size=7, max_size=7),
              st.sampled_from(_PAYLOADS)).map(list),
)


def _drain(sub: KVEventSubscriber, frames: list[list[bytes]]) -> list[Any]:
    out: list[Any] = []
    for frame in frames:
        sub._on_live(frame)
        while sub._ready:
            out.append(sub._ready.popleft())
    return out


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.none() | st.integers(0, 3), st.lists(_frame, max_size=25))
def test_fast_and_full_live_paths_hand_out_the_same_items(
    make_subscriber: Callable[..., KVEventSubscriber], monkeypatch: pytest.MonkeyPatch,
    start: int | None, frames: list[list[bytes]],
) -> None:
    # No replay endpoint: a gap is declared lost at once, and nothing waits on a socket.
    fast = make_subscriber(endpoint="tcp://127.0.0.1:1", topic="kv", start_seq=start)
    full = make_subscriber(endpoint="tcp://127.0.0.1:1", topic="kv", start_seq=start)
    with monkeypatch.context() as patch:
        patch.setattr(full._tracker, "in_order_live", lambda seq: False)
        expected = _drain(full, frames)
    got = _drain(fast, frames)
    assert got == expected
    assert [type(item) for item in got] == [type(item) for item in expected]
    assert fast.stats == full.stats
    assert fast.next_seq == full.next_seq


def test_the_fast_path_is_taken_for_in_order_frames(
    make_subscriber: Callable[..., KVEventSubscriber], monkeypatch: pytest.MonkeyPatch,
) -> None:
    sub = make_subscriber(endpoint="tcp://127.0.0.1:1", topic="kv", start_seq=0)
    import kvbridge.events.subscriber_core as subscriber_module

    def no_full_path(frames: Any) -> Any:
        raise AssertionError("an in-order frame took the full path")

    monkeypatch.setattr(subscriber_module, "parse_pub_frames", no_full_path)
    items = _drain(sub, [[_TOPIC, encode_seq(seq), _PAYLOADS[0]] for seq in range(3)])
    assert [item.seq for item in items] == [0, 1, 2]


def test_received_batch_built_without_init_equals_the_constructed_one() -> None:
    batch = EventBatch(1.0, (BlockRemoved((1,)),), None)
    for replayed in (False, True):
        built = _received_batch(4, batch, b"t", replayed)
        constructed = ReceivedBatch(seq=4, batch=batch, topic=b"t", replayed=replayed)
        assert type(built) is ReceivedBatch
        assert built == constructed and hash(built) == hash(constructed)
        assert repr(built) == repr(constructed)
        assert vars(built) == vars(constructed)
