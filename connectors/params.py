"""Transfer params: the typed, versioned record a router carries from producer to consumer.

In a prefill/decode deployment the producer's ``request_finished`` returns a
``TransferParams``; the router (PD proxy) forwards ``to_dict()`` to the
consumer with the decode request; the consumer engine parses it once with
``from_dict()`` at the edge and hands the typed record to its connector.

Wire form (``to_dict()``): plain JSON/msgpack types only, field names below,
``"version"`` first. Decoding is strict: an unknown version, a missing field,
an unknown field or a wrong type raises :class:`TransferParamsError` naming
the field. Connector-specific data goes in ``extra`` (a flat mapping of
str -> scalar), never in new top-level fields: a new field means a new version.

Version 2 adds the producer's seal (:mod:`kvbridge.connectors.sealing`):
``hold_id``, ``incarnation``, ``prompt_chain``, ``seal_key`` and ``seal``.
They are absent (null) in push params, which the router writes; a consumer
loads pull params only with them, checked against its own prompt.

Modes:

* ``PULL``: the producer holds ``block_ids`` (its local ids, per region in
  the spec's region order) until the consumer has read them (or a lease runs
  out); the consumer reads and notifies.
* ``PUSH``: the consumer allocates first and gives the producer its own block
  ids (through the connector's side channel); the producer writes. The
  ``consumer_*`` fields say where the consumer is; ``block_ids`` may be empty
  because the producer's blocks are not what the consumer needs to know.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.errors import TransferParamsError
from kvbridge.layouts import LayoutError, ParallelTopology
from kvbridge.layouts.limits import MAX_BLOCK_ID, MAX_PARAMS_BLOCK_IDS, MAX_REGIONS

#: Version this kvbridge writes and the only one it reads.
TRANSFER_PARAMS_VERSION = 2

#: One tuple of block ids per region, in the spec's region order.
BlockIds = tuple[tuple[int, ...], ...]

_Scalar = (str, int, float, bool, type(None))


class TransferMode(str, enum.Enum):
    """Who moves the bytes: the consumer reads (pull) or the producer writes (push)."""

    PULL = "pull"
    PUSH = "push"


def _fail(name: str, reason: str) -> TransferParamsError:
    return TransferParamsError(f"transfer_params.{name}", reason)


def _check_str(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise _fail(name, f"expected a non-empty string, got {value!r}")


def _check_hex(name: str, value: object, length: int) -> None:
    if value is None:
        return
    if (not isinstance(value, str) or len(value) != length
            or any(c not in "0123456789abcdef" for c in value)):
        raise _fail(name, f"expected {length} lowercase hex digits, got {_shown(value)}")


def _check_port(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise _fail(name, f"expected a TCP port in 1..65535, got {value!r}")


def normalize_block_ids(value: object, name: str = "block_ids") -> BlockIds:
    """``[[1, 2], [7]]`` -> ``((1, 2), (7,))`` after checking every id is an int >= 0.

    The lists' lengths are bounded first (:data:`MAX_PARAMS_BLOCK_IDS` ids in all):
    an oversized record is refused before a single id is read.
    """
    if not isinstance(value, list | tuple):
        raise _fail(name, f"expected a list of block-id lists (one per region), "
                          f"got {type(value).__name__}")
    if len(value) > MAX_REGIONS:
        raise _fail(name, f"{len(value)} block-id lists; at most {MAX_REGIONS} (one per region)")
    total = 0
    for index, group in enumerate(value):
        if not isinstance(group, list | tuple):
            raise _fail(f"{name}[{index}]", f"expected a list of block ids, "
                                            f"got {type(group).__name__}")
        total += len(group)
        if total > MAX_PARAMS_BLOCK_IDS:
            raise _fail(f"{name}[{index}]", f"{len(group)} block ids; a transfer params "
                                            f"record carries at most {MAX_PARAMS_BLOCK_IDS} "
                                            f"in all")
    groups: list[tuple[int, ...]] = []
    for index, group in enumerate(value):
        for position, block_id in enumerate(group):
            if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
                raise _fail(f"{name}[{index}][{position}]",
                            f"expected a block id (integer >= 0), got {_shown(block_id)}")
        groups.append(tuple(group))
    return tuple(groups)


def _shown(value: object) -> str:
    """``repr`` of a peer's value, short (a huge integer or string is not echoed whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**12:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class TransferParams:
    """Where a request's KV is and how to get it. Immutable; validated on construction.

    ``num_tokens`` is the number of prompt tokens whose KV the producer holds
    (or will write) in ``block_ids``: the consumer may load up to that many.
    ``producer_topology`` gives the producer's parallel sizes (ranks are 0).
    """

    mode: TransferMode
    producer_engine_id: str
    producer_host: str
    producer_port: int
    producer_request_id: str
    block_ids: BlockIds
    producer_topology: ParallelTopology
    num_tokens: int
    consumer_engine_id: str | None = None
    consumer_host: str | None = None
    consumer_port: int | None = None
    consumer_request_id: str | None = None
    spec_fingerprint: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: the producer's seal (:mod:`kvbridge.connectors.sealing`); None in push params
    hold_id: str | None = None
    incarnation: str | None = None
    prompt_chain: str | None = None
    seal_key: str | None = None
    seal: str | None = None
    version: int = TRANSFER_PARAMS_VERSION

    def __post_init__(self) -> None:
        if self.version != TRANSFER_PARAMS_VERSION:
            raise _fail("version", f"unsupported version {self.version!r}; this kvbridge "
                                   f"reads version {TRANSFER_PARAMS_VERSION}")
        if not isinstance(self.mode, TransferMode):
            raise _fail("mode", f"expected one of {[m.value for m in TransferMode]}, "
                                f"got {self.mode!r}")
        _check_str("producer_engine_id", self.producer_engine_id)
        _check_str("producer_host", self.producer_host)
        _check_port("producer_port", self.producer_port)
        _check_str("producer_request_id", self.producer_request_id)
        object.__setattr__(self, "block_ids", normalize_block_ids(self.block_ids))
        if not isinstance(self.producer_topology, ParallelTopology):
            raise _fail("producer_topology", "expected a ParallelTopology")
        if (not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool)
                or self.num_tokens < 0):
            raise _fail("num_tokens", f"expected an integer >= 0, got {self.num_tokens!r}")
        _check_str("consumer_engine_id", self.consumer_engine_id, optional=True)
        _check_str("consumer_host", self.consumer_host, optional=True)
        _check_port("consumer_port", self.consumer_port, optional=True)
        _check_str("consumer_request_id", self.consumer_request_id, optional=True)
        _check_str("spec_fingerprint", self.spec_fingerprint, optional=True)
        _check_hex("hold_id", self.hold_id, 32)
        _check_hex("incarnation", self.incarnation, 16)
        _check_hex("prompt_chain", self.prompt_chain, 64)
        _check_hex("seal", self.seal, 64)
        if self.seal_key is not None and self.seal_key not in ("cluster", "engine"):
            raise _fail("seal_key", f"expected 'cluster' or 'engine', got {_shown(self.seal_key)}")
        if self.mode is TransferMode.PUSH:
            for name in ("consumer_engine_id", "consumer_host", "consumer_port"):
                if getattr(self, name) is None:
                    raise _fail(name, "required in push mode (where the producer writes to)")
        elif not any(self.block_ids) and self.num_tokens > 0:
            raise _fail("block_ids", f"pull mode with num_tokens={self.num_tokens} "
                                     f"needs the producer's block ids")
        if not isinstance(self.extra, Mapping):
            raise _fail("extra", f"expected a mapping of str to scalars, "
                                 f"got {type(self.extra).__name__}")
        for key, value in self.extra.items():
            if not isinstance(key, str):
                raise _fail("extra", f"expected string keys, got {key!r}")
            if not isinstance(value, _Scalar):
                raise _fail(f"extra.{key}", f"expected a str, int, float, bool or null, "
                                            f"got {type(value).__name__}")
        object.__setattr__(self, "extra", dict(self.extra))

    def num_blocks(self, region_index: int) -> int:
        return len(self.block_ids[region_index]) if region_index < len(self.block_ids) else 0

    def check_request(self, num_prompt_tokens: int, block_tokens: Sequence[int]) -> None:
        """Raise :class:`TransferParamsError` naming the field unless these params fit the
        request they came with: ``num_prompt_tokens`` long, ``block_tokens[r]`` tokens per
        producer block of region ``r``.

        The consumer calls this before it allocates, looks up or iterates anything
        on the params' say: ``num_tokens`` is at most the prompt, each region's
        block-id list at most the blocks of ``num_tokens`` tokens plus one (the
        producer's list may hold the block of its first sampled token), and each id
        in ``[0, MAX_BLOCK_ID]``. Lengths are checked before any id is read. Where
        the ids sit in the producer's cache is checked by the worker against the
        producer's announced ``num_blocks`` before any READ is posted.
        """
        if self.num_tokens > num_prompt_tokens:
            raise _fail("num_tokens", f"{self.num_tokens} tokens for a prompt of "
                                      f"{num_prompt_tokens}")
        if len(self.block_ids) > len(block_tokens):
            raise _fail("block_ids", f"{len(self.block_ids)} block-id lists for "
                                     f"{len(block_tokens)} regions")
        for r, ids in enumerate(self.block_ids):
            most = -(-self.num_tokens // block_tokens[r]) + 1
            if len(ids) > most:
                raise _fail(f"block_ids[{r}]",
                            f"{len(ids)} block ids; {self.num_tokens} tokens in blocks of "
                            f"{block_tokens[r]} need at most {most}")
        for r, ids in enumerate(self.block_ids):
            if ids and max(ids) > MAX_BLOCK_ID:
                position = next(k for k, b in enumerate(ids) if b > MAX_BLOCK_ID)
                raise _fail(f"block_ids[{r}][{position}]",
                            f"block id {_shown(ids[position])} past the largest any cache "
                            f"holds ({MAX_BLOCK_ID})")

    def check_regions(self, num_regions: int) -> None:
        """Raise unless ``block_ids`` has one entry per region (pull mode only)."""
        if self.mode is TransferMode.PULL and len(self.block_ids) != num_regions:
            raise _fail("block_ids", f"expected {num_regions} block-id lists (one per "
                                     f"region), got {len(self.block_ids)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for routers (JSON and msgpack friendly); inverse of :meth:`from_dict`."""
        topo = self.producer_topology
        return {
            "version": self.version,
            "mode": self.mode.value,
            "producer_engine_id": self.producer_engine_id,
            "producer_host": self.producer_host,
            "producer_port": self.producer_port,
            "producer_request_id": self.producer_request_id,
            "block_ids": [list(group) for group in self.block_ids],
            "producer_topology": {"tp_size": topo.tp_size, "pp_size": topo.pp_size,
                                  "dcp_size": topo.dcp_size, "pcp_size": topo.pcp_size},
            "num_tokens": self.num_tokens,
            "consumer_engine_id": self.consumer_engine_id,
            "consumer_host": self.consumer_host,
            "consumer_port": self.consumer_port,
            "consumer_request_id": self.consumer_request_id,
            "spec_fingerprint": self.spec_fingerprint,
            "extra": dict(self.extra),
            "hold_id": self.hold_id,
            "incarnation": self.incarnation,
            "prompt_chain": self.prompt_chain,
            "seal_key": self.seal_key,
            "seal": self.seal,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: object) -> TransferParams:
        """Parse the wire form. Raises :class:`TransferParamsError` naming the field."""
        if not isinstance(data, Mapping):
            raise TransferParamsError("transfer_params",
                                      f"expected a mapping, got {type(data).__name__}")
        if "version" not in data:
            raise _fail("version", f"missing; expected {TRANSFER_PARAMS_VERSION}")
        version = data["version"]
        if version != TRANSFER_PARAMS_VERSION or isinstance(version, bool):
            raise _fail("version", f"unsupported version {version!r}; this kvbridge reads "
                                   f"version {TRANSFER_PARAMS_VERSION}")
        unknown = sorted(str(k) for k in set(data) - _FIELDS)
        if unknown:
            raise _fail(unknown[0], f"unknown field for version {TRANSFER_PARAMS_VERSION}; "
                                    f"connector-specific data belongs in 'extra'")
        for name in _REQUIRED:
            if name not in data:
                raise _fail(name, "missing")
        try:
            mode = TransferMode(data["mode"])
        except (ValueError, TypeError):
            raise _fail("mode", f"expected 'pull' or 'push', got {data['mode']!r}") from None
        topo_data = data["producer_topology"]
        if isinstance(topo_data, Mapping):
            topo_data = dict(topo_data)
        try:
            topology = ParallelTopology.from_dict(topo_data, "producer_topology")
        except LayoutError as exc:
            raise _fail(exc.field, exc.reason) from None
        return cls(
            version=version,
            mode=mode,
            producer_engine_id=data["producer_engine_id"],
            producer_host=data["producer_host"],
            producer_port=data["producer_port"],
            producer_request_id=data["producer_request_id"],
            block_ids=normalize_block_ids(data["block_ids"]),
            producer_topology=topology.sizes(),
            num_tokens=data["num_tokens"],
            consumer_engine_id=data.get("consumer_engine_id"),
            consumer_host=data.get("consumer_host"),
            consumer_port=data.get("consumer_port"),
            consumer_request_id=data.get("consumer_request_id"),
            spec_fingerprint=data.get("spec_fingerprint"),
            extra=_extra_of(data),
            hold_id=data.get("hold_id"),
            incarnation=data.get("incarnation"),
            prompt_chain=data.get("prompt_chain"),
            seal_key=data.get("seal_key"),
            seal=data.get("seal"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TransferParams:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TransferParamsError("transfer_params", f"invalid JSON: {exc}") from None
        return cls.from_dict(data)


def _extra_of(data: Mapping[str, Any]) -> Mapping[str, Any]:
    extra = data.get("extra")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise _fail("extra", f"expected a mapping of str to scalars, got {type(extra).__name__}")
    return extra


_REQUIRED = ("mode", "producer_engine_id", "producer_host", "producer_port",
             "producer_request_id", "block_ids", "producer_topology", "num_tokens")
_OPTIONAL = ("consumer_engine_id", "consumer_host", "consumer_port", "consumer_request_id",
             "spec_fingerprint", "extra", "hold_id", "incarnation", "prompt_chain",
             "seal_key", "seal")
_FIELDS = frozenset(("version", *_REQUIRED, *_OPTIONAL))


def block_ids_from_lists(groups: Sequence[Sequence[int]]) -> BlockIds:
    """Validated, immutable ``BlockIds`` from any nested sequence of ints."""
    return normalize_block_ids(list(groups))
