"""The KV-event wire format, byte-compatible with vLLM's ZMQ event publisher.

Pure functions only (no sockets): encode/decode a batch, build/parse frames.

This module is the format's description and its one import path
(``from kvbridge.events.wire import ...``); it owns no code. The code lives in
one module per concept, and is re-exported here:

- :mod:`~kvbridge.events.encoding` -- events and batches to payload bytes;
- :mod:`~kvbridge.events.decoding` -- the reference Python checks (every error);
- :mod:`~kvbridge.events.fast_decoding` -- the msgspec fast path and
  :func:`decode_batch`;
- :mod:`~kvbridge.events.frames` -- sequence numbers, live frames, replay.

It may not grow code: a change to the format goes into the module of its
concept, and the description below is kept true.

Followed revision
-----------------
vLLM ``main`` as of 2026-09 (``vllm/distributed/kv_events.py``), i.e. after

- PR #42892 (merged 2026-06-09, released in v0.23+): event structs dropped
  ``array_like=True``; each event is a msgpack **map** tagged by a ``"type"`` key,
  encoded by msgspec with ``omit_defaults=True``; the outer ``EventBatch`` stays a
  positional array ``[ts, events, data_parallel_rank]``;
- PR #48281 (v0.26) ``locality`` and PR #52067 ``ownership`` as trailing optional
  fields of ``BlockStored``/``BlockRemoved``; PR #48123 ``medium="STORAGE"``;
- PR #45177 (merged 2026-06-10): replay replies carry the topic frame.

``EventWireFormat.ARRAY`` produces the older encoding (vLLM before #42892):
each event a positional array whose first element is the tag, every field
present, as msgspec encodes ``array_like`` structs. kvbridge's decoder reads both.

Encoding (MAP, the default)::

    multipart  [topic, seq (8-byte big-endian signed), payload]
    payload    [ts: float64, events: [event...], data_parallel_rank: int | nil]
    BlockStored   {"type": "BlockStored", "block_hashes", "parent_block_hash",
                   "token_ids", "block_size", "lora_id", "medium", "lora_name",
                   then only when not None: "extra_keys", "group_idx",
                   "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                   "locality", "ownership"}
    BlockRemoved  {"type": "BlockRemoved", "block_hashes", "medium",
                   then only when not None: "group_idx", "locality", "ownership"}
    AllBlocksCleared {"type": "AllBlocksCleared"}

Keys appear in declaration order, so the bytes equal msgspec's encoding of
vLLM's own structs (tests check this against msgspec).

Speed: MAP batches are encoded by msgspec, and decoded and type-checked by
msgspec into typed structs (C, no per-field Python); batches with ``extra_keys``
are too when every ``extra_keys`` value is an array of nil, scalars and arrays of
them, at most 3 levels deep, without maps or bin values (what vLLM and kvbridge's
engine send: a cache salt, LoRA name or multimodal hashes per block), which
msgspec hands over as the tuples the Python checks freeze them into. Anything
those typed decoders reject (maps, bin values or deeper nesting in ``extra_keys``
included) and the ARRAY encoding
go through the Python checks below, which stay the reference: they produce every
error message, and tests check that the paths accept the same batches with the
same values.
Block hashes are ints (uint64) or bytes (msgpack bin). ``extra_keys`` may nest
arrays/maps at most ``MAX_EXTRA_KEYS_DEPTH`` (32) levels deep; deeper is a decode
error naming the field (the whole batch is rejected). Reference bytes of every
form live in ``tests/golden/vectors/events_*``.

Replay (vLLM protocol): a client (REQ or DEALER) sends one frame, the 8-byte
start sequence; the publisher's ROUTER answers ``[topic, seq, payload]`` for
every buffered batch with ``seq >= start``, then ``[b"", END_SEQ, b""]``
(``END_SEQ`` = -1). ``replay_includes_topic=False`` gives the pre-#45177 replies
``[seq, payload]`` / ``[END_SEQ, b""]``.

kvbridge extension (incarnations): a request frame that starts with
``REPLAY_MAGIC`` followed by a msgpack map ``{"incarnation", "start_seq",
"end_seq"}``. A kvbridge publisher first answers ``[REPLAY_MAGIC, info]`` where
``info`` is ``{"incarnation", "oldest_seq", "next_seq", "matched"}``, then (only
when ``matched``) the batches in ``[start_seq, end_seq)`` and the end marker. A
vLLM publisher reads the frame as a huge start sequence and answers with the
end marker alone, which tells the client to fall back to the plain protocol.
"""

from __future__ import annotations

from .decoding import MAX_EXTRA_KEYS_DEPTH, decode_event
from .decoding import _decode_batch_checked as _decode_batch_checked
from .encoding import TAG_KEY, EventWireFormat, encode_batch, encode_events, event_to_wire
from .fast_decoding import _decode_typed as _decode_typed
from .fast_decoding import _decode_typed_keyed as _decode_typed_keyed
from .fast_decoding import decode_batch
from .frames import (
    END_SEQ,
    END_SEQ_BYTES,
    REPLAY_MAGIC,
    SEQ_BYTES,
    LiveFrame,
    ReplayInfo,
    ReplayReply,
    ReplayRequest,
    decode_replay_info,
    decode_seq,
    encode_replay_info,
    encode_replay_request,
    encode_seq,
    parse_pub_frames,
    parse_replay_reply,
    parse_replay_request,
    pub_frames,
    replay_batch_frames,
    replay_end_frames,
)

# Not in __all__ but re-exported on purpose (the redundant ``as`` aliases above): the
# private ``_decode_*`` paths that tests/events/test_wire_fast_path.py compares.
__all__ = [
    "END_SEQ",
    "END_SEQ_BYTES",
    "MAX_EXTRA_KEYS_DEPTH",
    "REPLAY_MAGIC",
    "SEQ_BYTES",
    "TAG_KEY",
    "EventWireFormat",
    "LiveFrame",
    "ReplayInfo",
    "ReplayReply",
    "ReplayRequest",
    "decode_batch",
    "decode_event",
    "decode_replay_info",
    "decode_seq",
    "encode_batch",
    "encode_events",
    "encode_replay_info",
    "encode_replay_request",
    "encode_seq",
    "event_to_wire",
    "parse_pub_frames",
    "parse_replay_reply",
    "parse_replay_request",
    "pub_frames",
    "replay_batch_frames",
    "replay_end_frames",
]
