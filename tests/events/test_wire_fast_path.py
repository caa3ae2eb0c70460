"""The typed (msgspec) codec paths agree with the Python reference paths.

``decode_batch`` decodes MAP batches with msgspec and hands everything msgspec
rejects (and every batch with ``extra_keys``) to the Python checks; ``encode_events``
encodes MAP batches with msgspec. These tests pin that the fast paths change
nothing observable: the same batches accepted with the same values (same types),
the same errors naming the same fields, the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventWireFormat,
    decode_batch,
    encode_events,
    wire,
)
from kvbridge.events.wire import event_to_wire

U64_MAX = (1 << 64) - 1


def _outcome(decode: Any, payload: bytes) -> tuple[str, str]:
    """What a decoder makes of ``payload``: the batch (its repr shows tuple vs list,
    1 vs 1.0 vs True) or the error's field and reason."""
    try:
        return ("ok", repr(decode(payload)))
    except EventDecodeError as exc:
        return ("error", f"{exc.field}: {exc.reason}")


# Values of every msgpack type, valid or not for any given field.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=U64_MAX),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=8),
    st.text(max_size=6),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner, max_size=3),
    max_leaves=8,
)
_hash = st.integers(min_value=0, max_value=U64_MAX) | st.binary(min_size=1, max_size=32)
_good_value = {
    "block_hashes": st.lists(_hash, max_size=4),
    "parent_block_hash": st.none() | _hash,
    "token_ids": st.lists(st.integers(min_value=-(1 << 63), max_value=U64_MAX), max_size=8),
    "block_size": st.integers(min_value=0, max_value=1 << 20),
    "lora_id": st.none() | st.integers(0, 100),
    "medium": st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
    "lora_name": st.none() | st.text(max_size=6),
    "extra_keys": st.none() | st.lists(_values, max_size=3),
    "group_idx": st.none() | st.integers(0, 8),
    "kv_cache_spec_kind": st.none() | st.text(max_size=6),
    "kv_cache_spec_sliding_window": st.none() | st.integers(0, 4096),
    "locality": st.sampled_from([None, "LOCAL", "REMOTE"]),
    "ownership": st.none() | st.text(max_size=6),
}
_FIELDS = {
    "BlockStored": list(_good_value),
    "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
    "AllBlocksCleared": [],
}


@st.composite
def _event_map(draw: Any) -> dict[Any, Any]:
    """A well-formed map-form event; optional fields present or absent."""
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    event: dict[Any, Any] = {"type": tag}
    for name in _FIELDS[tag]:
        if name in _REQUIRED or draw(st.booleans()):
            event[name] = draw(_good_value[name])
    return event


_REQUIRED = {"block_hashes", "parent_block_hash", "token_ids", "block_size"}


@st.composite
def _batch_payload(draw: Any) -> bytes:
    """A well-formed batch, or one with one thing wrong (or merely unusual)."""
    ts: Any = draw(st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 1 << 40))
    events: Any = draw(st.lists(_event_map(), max_size=4))
    dp: Any = draw(st.none() | st.integers(0, 7))
    body: list[Any] = [ts, events, dp]
    mutation = draw(st.integers(0, 11))
    if mutation == 1:
        body[0] = draw(st.sampled_from([math.nan, math.inf, -math.inf, True]) | _values)
    elif mutation == 2:
        body[2] = draw(_values)
    elif mutation == 3:
        body = body[:2]
    elif mutation == 4:
        body.append(draw(_values))  # a trailing element newer senders might add
    elif mutation == 5:
        body[1] = draw(_values)
    elif mutation >= 6 and events:
        event = events[draw(st.integers(0, len(events) - 1))]
        names = [name for name in event if name != "type"]
        if mutation == 6:
            event["type"] = draw(_values)
        elif mutation == 7 and names:
            event[draw(st.sampled_from(names))] = draw(_values)  # retyped
        elif mutation == 8 and names:
            del event[draw(st.sampled_from(names))]
        elif mutation == 9:
            event[draw(st.text(max_size=4) | st.integers(0, 9))] = draw(_values)  # unknown
        elif mutation == 10:
            event["extra_keys"] = draw(_values)
        elif mutation == 11 and names:  # the right type family, a wrong exact type
            event[draw(st.sampled_from(names))] = draw(
                st.sampled_from([True, False, 1.0, "1", b"1", [True], [1.5], ["a"], {}]))
    return msgpack.packb(body, use_bin_type=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batch_payload())
def test_typed_decoder_accepts_and_rejects_exactly_what_the_checks_do(payload: bytes) -> None:
    assert _outcome(decode_batch, payload) == _outcome(wire._decode_batch_checked, payload)


_BASE_EVENTS: dict[str, dict[str, Any]] = {
    "BlockStored": {"type": "BlockStored", "block_hashes": [1, b"\x01" * 8],
                    "parent_block_hash": 5, "token_ids": [1, 2], "block_size": 16,
                    "lora_id": 1, "medium": "GPU", "lora_name": "a", "group_idx": 0,
                    "kv_cache_spec_kind": "full", "kv_cache_spec_sliding_window": 8,
                    "locality": "LOCAL", "ownership": "fs"},
    "BlockRemoved": {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU",
                     "group_idx": 0, "locality": "REMOTE", "ownership": "fs"},
}
_WRONG_EXACT_TYPES: list[Any] = [
    True, False, 1.0, "1", b"1", None, [True], [1.5], ["a"], [None], [[1]], {}, {"a": 1},
    -1,
]


def test_every_field_with_a_wrong_exact_type_gets_the_checks_verdict() -> None:
    """Each field of each event (and of the batch) swapped for values of the wrong
    exact type (bool for int, float for int, str for bytes, ...): the typed decoder
    must accept exactly what the checks accept, and report the same field."""
    cases: list[bytes] = []
    for base in _BASE_EVENTS.values():
        for name in base:
            for value in _WRONG_EXACT_TYPES:
                event = dict(base)
                event[name] = value
                cases.append(msgpack.packb([1.0, [event], 0], use_bin_type=True))
            missing = {k: v for k, v in base.items() if k != name}
            cases.append(msgpack.packb([1.0, [missing], 0], use_bin_type=True))
    for value in [*_WRONG_EXACT_TYPES, math.nan, math.inf, -math.inf, 7]:
        cases.append(msgpack.packb([value, [], 0], use_bin_type=True))
        cases.append(msgpack.packb([1.0, [], value], use_bin_type=True))
        cases.append(msgpack.packb([1.0, value, 0], use_bin_type=True))
    accepted = 0
    for payload in cases:
        expected = _outcome(wire._decode_batch_checked, payload)
        assert _outcome(decode_batch, payload) == expected, msgpack.unpackb(payload)
        accepted += expected[0] == "ok"
    assert 0 < accepted < len(cases)  # both verdicts were exercised


def test_typed_decoder_is_taken_for_plain_map_batches_and_skipped_otherwise() -> None:
    events = [
        BlockStored(block_hashes=(1, U64_MAX), parent_block_hash=None,
                    token_ids=tuple(range(32)), block_size=16, group_idx=0),
        BlockStored(block_hashes=(b"\x01" * 32,), parent_block_hash=b"\x02" * 32,
                    token_ids=(), block_size=16, lora_id=3, lora_name="a", locality="LOCAL"),
        BlockRemoved(block_hashes=(7,), medium="CPU", ownership="fs"),
        AllBlocksCleared(),
    ]
    payload = encode_events(2.5, events, 1)
    fast = wire._decode_typed(payload)
    assert fast is not None
    assert repr(fast) == repr(wire._decode_batch_checked(payload))
    assert fast.events == tuple(events) and fast.ts == 2.5 and fast.data_parallel_rank == 1
    assert hash(fast.events[0]) == hash(events[0])  # records stay hashable
    # The Python checks decide: extra_keys (frozen, depth-bounded there), the
    # array encoding, a non-finite ts, a type msgspec rejects.
    with_keys = BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(),
                            block_size=16, extra_keys=(("salt",),))
    assert wire._decode_typed(encode_events(1.0, [with_keys], 0)) is None
    assert decode_batch(encode_events(1.0, [with_keys], 0)).events == (with_keys,)
    assert wire._decode_typed(encode_events(1.0, events, 0, EventWireFormat.ARRAY)) is None
    assert wire._decode_typed(msgpack.packb([math.inf, [], 0])) is None
    bad = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}], 0])
    assert wire._decode_typed(bad) is None
    assert _outcome(decode_batch, bad) == (
        "error", "events[0].block_hashes[0]: expected int or bytes block hash, got bool")


@st.composite
def _valid_event(draw: Any) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    fields = {name: draw(_good_value[name]) for name in _FIELDS[
        "BlockStored" if kind == "stored" else "BlockRemoved"]}
    if kind == "stored":
        return BlockStored(**fields)
    return BlockRemoved(**fields)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_valid_event(), max_size=6),
       st.floats(allow_nan=False, allow_infinity=False),
       st.none() | st.integers(0, 7))
def test_typed_encoder_writes_the_reference_bytes(
    events: list[Any], ts: float, dp: int | None
) -> None:
    reference = msgpack.packb([float(ts), [event_to_wire(e) for e in events], dp],
                              use_bin_type=True)
    assert encode_events(ts, events, dp) == reference
    decoded = decode_batch(reference).events
    # NaN inside extra_keys is valid and never equal to itself: compare the bytes the
    # decoded events encode to (the reference encoder's), which pins every value
    assert len(decoded) == len(events)
    assert msgpack.packb([float(ts), [event_to_wire(e) for e in decoded], dp],
                         use_bin_type=True) == reference


def test_keyed_decoder_takes_the_usual_extra_keys_and_leaves_the_rest() -> None:
    """Batches with extra_keys of the usual shapes (a cache salt, LoRA name or
    multimodal hashes per block, nil entries) are decoded by msgspec's keyed decoder
    into the values the Python checks produce; maps, bin values, ext types and
    deeper nesting are left to the Python checks, which decide as before."""
    salted = [
        BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=(5, 6),
                    block_size=1, extra_keys=(("salt",), ("salt",))),
        BlockStored(block_hashes=(3,), parent_block_hash=2, token_ids=(7,), block_size=1,
                    extra_keys=((("mm-hash", 0), "lora", 2.5, True, None, -1, U64_MAX),)),
        BlockStored(block_hashes=(4,), parent_block_hash=3, token_ids=(8,), block_size=1,
                    extra_keys=(None, ())),
        BlockRemoved(block_hashes=(1,)),
        AllBlocksCleared(),
    ]
    payload = encode_events(3.0, salted, 0)
    assert wire._decode_typed(payload) is None
    keyed = wire._decode_typed_keyed(payload)
    assert keyed is not None
    assert repr(keyed) == repr(wire._decode_batch_checked(payload))
    assert keyed.events == tuple(salted)
    assert {hash(e) for e in keyed.events} == {hash(e) for e in salted}

    def stored_with(extra: Any) -> bytes:
        event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1], "block_size": 1, "extra_keys": extra}
        return msgpack.packb([1.0, [event], 0], use_bin_type=True)

    left = [
        stored_with([{"a": 1}]),  # a map: frozen to sorted pairs by the Python path
        stored_with([[b"\x01"]]),  # bin
        stored_with([[[["four levels"]]]]),  # deeper than the keyed decoder's 3
        stored_with([msgpack.ExtType(1, b"x")]),
        stored_with("not an array"),
        stored_with([[1]] * 3 + [[True, {"a": [1]}]]),
    ]
    for payload in left:
        assert wire._decode_typed_keyed(payload) is None
        assert _outcome(decode_batch, payload) == _outcome(wire._decode_batch_checked, payload)
    # An error elsewhere in a batch with extra_keys is still named by the checks.
    bad = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                "parent_block_hash": None, "token_ids": [1, True],
                                "block_size": 1, "extra_keys": [["salt"]]}], 0])
    assert wire._decode_typed_keyed(bad) is None
    assert _outcome(decode_batch, bad) == ("error", "events[0].token_ids[1]: expected int, got bool")


_key_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=U64_MAX)
    | st.floats() | st.text(max_size=4) | st.binary(max_size=2),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                 max_size=2),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_key_values, max_size=3))
def test_extra_keys_of_any_shape_decode_as_the_checks_decode_them(extra: list[Any]) -> None:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [1], "block_size": 1, "extra_keys": extra}
    payload = msgpack.packb([1.0, [event], 0], use_bin_type=True)
    assert _outcome(decode_batch, payload) == _outcome(wire._decode_batch_checked, payload)


def test_records_whose_dict_lacks_a_field_encode_by_attribute() -> None:
    """The encoder reads fields from the instance dict; a record whose dict lacks
    one (the class default applies, as getattr sees it) is read attribute by
    attribute, and encodes to the reference bytes."""
    stored = object.__new__(BlockStored)
    vars(stored).update(block_hashes=(1,), parent_block_hash=None, token_ids=(5,),
                        block_size=1, ownership="me")
    removed = object.__new__(BlockRemoved)
    vars(removed).update(block_hashes=(b"h",), group_idx=2)
    assert stored.medium == "GPU" and removed.medium == "GPU"  # class defaults
    events = [stored, removed, AllBlocksCleared()]
    reference = msgpack.packb([1.0, [event_to_wire(e) for e in events], None],
                              use_bin_type=True)
    assert encode_events(1.0, events, None) == reference
