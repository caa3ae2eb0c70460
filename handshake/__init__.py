"""Handshake side channel: versioned agent metadata, compatibility diff, ZMQ server/client.

Uses :mod:`kvbridge.layouts` only. See :mod:`kvbridge.handshake.schema` for the
wire records, :mod:`~kvbridge.handshake.server` for the store and its STREAM socket,
:mod:`~kvbridge.handshake.client` for the retried, cached client and
:mod:`~kvbridge.handshake.diff` for the compatibility diff.
"""

from kvbridge.handshake.address import format_address, parse_address
from kvbridge.handshake.client import (
    ClientStats,
    ClockEstimate,
    FetchResult,
    HandshakeClient,
    PingResult,
)
from kvbridge.handshake.diff import (
    CompatibilityReport,
    Mismatch,
    Role,
    Severity,
    diff_engines,
    plan_between,
)
from kvbridge.handshake.errors import HandshakeError, HandshakeTimeout
from kvbridge.handshake.schema import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AgentMetadata,
    CompatHeader,
    EngineMetadata,
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    RankKey,
    RegionMemory,
    RequestKind,
    ServerClock,
    StatusReply,
    TransferMode,
    check_agent,
    check_compatible,
    decode_agent,
    decode_engine,
    decode_header,
    decode_reply,
    decode_request,
    encode_agent,
    encode_engine,
    encode_reply,
    encode_request,
)
from kvbridge.handshake.server import HandshakeServer, MetadataStore

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "AgentMetadata",
    "ClientStats",
    "ClockEstimate",
    "CompatHeader",
    "CompatibilityReport",
    "EngineMetadata",
    "ErrorReply",
    "FetchResult",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeServer",
    "HandshakeTimeout",
    "MetadataReply",
    "MetadataRequest",
    "MetadataStore",
    "Mismatch",
    "PingResult",
    "RankKey",
    "RegionMemory",
    "RequestKind",
    "Role",
    "ServerClock",
    "Severity",
    "StatusReply",
    "TransferMode",
    "check_agent",
    "check_compatible",
    "decode_agent",
    "decode_engine",
    "decode_header",
    "decode_reply",
    "decode_request",
    "diff_engines",
    "encode_agent",
    "encode_engine",
    "encode_reply",
    "encode_request",
    "format_address",
    "parse_address",
    "plan_between",
]
