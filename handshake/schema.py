"""Wire schema of the handshake side channel: typed, versioned msgpack records.

This module owns no code of its own: it is the one import path of the schema
(``from kvbridge.handshake.schema import ...``, as the server, client, tools,
tests and docs use it) and re-exports the records from the modules that own
them, one concept each:

* :mod:`~kvbridge.handshake.codec` — limits, ``PROTOCOL_VERSION`` and the strict
  reading every record shares;
* :mod:`~kvbridge.handshake.header` — **CompatHeader** and ``TransferMode``;
* :mod:`~kvbridge.handshake.agent` — **AgentMetadata**, ``RankKey``,
  ``RegionMemory`` and :func:`check_agent`;
* :mod:`~kvbridge.handshake.document` — **EngineMetadata**, the engine document;
* :mod:`~kvbridge.handshake.messages` — **MetadataRequest** and the replies.

It may not grow code: a new record or check goes into the module of its concept
(or a new one), and only its name is added here.

Every record has one encode and one decode function. Decoding is strict: the
message size is bounded before anything is parsed, nesting right after
(``MAX_NESTING``), a peer's topology sizes before anything loops over its ranks
(``MAX_RANKS``), every map must have exactly
the known keys, every value is type- and range-checked, and any failure raises
:class:`HandshakeError` naming the field (``"ranks[3].regions[0].base_addrs[2]"``).
No pickle, no msgpack extension types: a peer can send us nothing but plain
maps, lists, strings, bytes, integers, floats, booleans and nil.

Records (``PROTOCOL_VERSION`` 1):

* **CompatHeader** — protocol version plus the compatibility fingerprint: model,
  layer count, transfer mode (pull or push) and, per region, its layout kind,
  dtype, head size, KV heads, key-only and token sharding. It deliberately
  leaves out TP/PP/DCP sizes, block size and memory order: those may differ
  between producer and consumer and are checked when a transfer plan is made.
* **AgentMetadata** — one rank of one engine: engine id, NIXL agent name and
  opaque agent blob, per-region memory (one base address per layer of the
  region on that rank, since each layer is its own tensor; bytes of one block
  of one layer; number of blocks; memory order; block size), the rank's
  topology, its registration generation and the full KVCacheSpec.
* **EngineMetadata** — an engine document: the header, then a body with the
  engine id, incarnation, generation, spec, topology sizes and the selected
  ranks. The body travels as opaque bytes inside the document, so a reader
  decodes and checks the header first and interprets the body only if the
  header matches what it expects (:func:`decode_engine`). The same bytes are
  what ``kvbridge probe --save`` writes to a file.
* **MetadataRequest** and the replies **MetadataReply**, **StatusReply**,
  **ErrorReply** — the request/response pair of the ZMQ side channel. Every
  reply carries the server's clock so a client can estimate a clock offset.

Invariants checked on decode (and on :func:`check_agent` before a server
publishes a rank): per-region memory agrees with what the spec says this rank
holds (block bytes, layer count, block size, memory order), address ranges
neither wrap past 2**64 nor overlap, and the header's fingerprint matches its
own fields and the spec in the body.
"""

from __future__ import annotations

from kvbridge.handshake.agent import (
    AgentMetadata,
    RankKey,
    RegionMemory,
    check_agent,
    decode_agent,
    encode_agent,
)
from kvbridge.handshake.codec import (
    MAX_BLOB_BYTES,
    MAX_BLOCK_BYTES,
    MAX_DEVICE_ID,
    MAX_DIGEST_ALGORITHMS,
    MAX_DOCUMENT_BYTES,
    MAX_LAYERS,
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_NESTING,
    MAX_NUM_BLOCKS,
    MAX_RANKS,
    MAX_REGIONS,
    MAX_REQUEST_BYTES,
    MEM_TYPES,
    PROTOCOL_VERSION,
    U64_MAX,
)
from kvbridge.handshake.document import (
    EngineMetadata,
    decode_engine,
    decode_header,
    encode_engine,
)
from kvbridge.handshake.header import (
    CompatHeader,
    RegionCompat,
    TransferMode,
    check_compatible,
)
from kvbridge.handshake.messages import (
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    Reply,
    RequestKind,
    ServerClock,
    StatusReply,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    peek_request_id,
)

__all__ = [
    "MAX_BLOB_BYTES",
    "MAX_BLOCK_BYTES",
    "MAX_DEVICE_ID",
    "MAX_DIGEST_ALGORITHMS",
    "MAX_DOCUMENT_BYTES",
    "MAX_LAYERS",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_NUM_BLOCKS",
    "MAX_RANKS",
    "MAX_REGIONS",
    "MAX_REQUEST_BYTES",
    "MEM_TYPES",
    "PROTOCOL_VERSION",
    "U64_MAX",
    "AgentMetadata",
    "CompatHeader",
    "EngineMetadata",
    "ErrorReply",
    "MetadataReply",
    "MetadataRequest",
    "RankKey",
    "RegionCompat",
    "RegionMemory",
    "Reply",
    "RequestKind",
    "ServerClock",
    "StatusReply",
    "TransferMode",
    "check_agent",
    "check_compatible",
    "decode_agent",
    "decode_engine",
    "decode_header",
    "decode_reply",
    "decode_request",
    "encode_agent",
    "encode_engine",
    "encode_reply",
    "encode_request",
    "peek_request_id",
]
