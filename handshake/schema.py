"""Wire schema of the handshake side channel: typed, versioned msgpack records.

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

import hashlib
import json
import math
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import msgpack

from kvbridge.handshake.errors import HandshakeError
from kvbridge.layouts import (
    Interior,
    KVCacheSpec,
    LayoutError,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
)
from kvbridge.layouts.limits import MAX_PARALLEL_SIZE, MAX_WORLD_SIZE
from kvbridge.layouts.plan import LayerMemory, rank_index
from kvbridge.layouts.spec import MAX_FORMAT_CHARS, MAX_FORMAT_KEYS

PROTOCOL_VERSION = 1

#: Largest message (request, reply or saved document) either side accepts, in bytes.
MAX_MESSAGE_BYTES = 1 << 20
#: Largest engine document: leaves room for the reply envelope around it.
MAX_DOCUMENT_BYTES = MAX_MESSAGE_BYTES - 4096
#: Largest request a server accepts, in bytes (requests are a few dozen bytes).
MAX_REQUEST_BYTES = 4096
MAX_NAME_CHARS = 256
MAX_BLOB_BYTES = 256 * 1024
#: Most ranks one engine may claim (tp_size * pp_size * pcp_size): the layouts bound
#: every ParallelTopology has (kvbridge.layouts.limits), checked here first so that the
#: error names the document's field and nothing loops over a peer's ranks before it.
MAX_RANKS = MAX_WORLD_SIZE
#: Deepest nesting of maps and lists a message may have (the deepest valid record,
#: an engine body's ``ranks[i].regions[j].base_addrs``, is 6 levels deep).
MAX_NESTING = 16
MAX_REGIONS = 64
MAX_LAYERS = 8192
MAX_NUM_BLOCKS = (1 << 31) - 1
# --- memory type per rank (gpu helper, issue 15): where a rank's KV lives -------------
#: NIXL memory types a rank's KV may be in (host memory, pinned or not; CUDA memory)
MEM_TYPES = ("DRAM", "VRAM")
MAX_DEVICE_ID = 1 << 16
MAX_DIGEST_ALGORITHMS = 8
MAX_BLOCK_BYTES = 1 << 40
U64_MAX = (1 << 64) - 1


class TransferMode(str, Enum):
    """Who moves the bytes: the consumer READs (pull) or the producer WRITEs (push)."""

    PULL = "pull"
    PUSH = "push"


class RankKey(NamedTuple):
    """Coordinates of one rank inside an engine; orders like ParallelTopology.ranks()."""

    pp_rank: int
    pcp_rank: int
    tp_rank: int

    @classmethod
    def of(cls, topology: ParallelTopology) -> RankKey:
        return cls(topology.pp_rank, topology.pcp_rank, topology.tp_rank)

    def describe(self) -> str:
        return f"pp{self.pp_rank}/pcp{self.pcp_rank}/tp{self.tp_rank}"


# --------------------------------------------------------------------------- helpers


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: object, what: str, max_bytes: int) -> object:
    """Parse one msgpack object from ``data`` after bounding its size."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise HandshakeError(what, f"expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise HandshakeError(what, f"message of {size} bytes exceeds the limit of "
                                   f"{max_bytes} bytes")
    if size == 0:
        raise HandshakeError(what, "empty message")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise HandshakeError(what, f"not a valid msgpack message ({type(exc).__name__}: "
                                   f"{exc})") from None
    _check_nesting(obj, "" if what == "message" else what)
    return obj


def _check_nesting(obj: object, root: str) -> None:
    """Refuse maps and lists nested deeper than MAX_NESTING (iteratively: no recursion).

    Everything after decoding (``repr`` in an error message, comparisons) recurses
    over nested values, so a hostile depth is refused here, once, naming the field
    that holds it (``"kind"``, ``"body.ranks"``), before any of it is interpreted.
    """
    stack: list[tuple[object, int, str]] = [(obj, 0, root)]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, dict):
            children: Iterable[tuple[object, str]] = (
                (v, _join(where, str(k)[:64]) if depth < 3 else where)
                for k, v in value.items())
        elif isinstance(value, list):
            children = ((v, where) for v in value)
        else:
            continue
        if depth >= MAX_NESTING:
            raise HandshakeError(where or "message",
                                 f"nested deeper than {MAX_NESTING} levels of maps and lists; "
                                 f"no valid handshake record is")
        stack.extend((child, depth + 1, path) for child, path in children
                     if isinstance(child, dict | list))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _prefixed(path: str, exc: HandshakeError | LayoutError) -> HandshakeError:
    return HandshakeError(_join(path, exc.field), exc.reason)


class _Reader:
    """Typed access to one decoded msgpack map with exactly the allowed keys."""

    def __init__(self, obj: object, path: str, required: Iterable[str],
                 optional: Iterable[str] = ()) -> None:
        label = path or "message"
        if not isinstance(obj, dict):
            raise HandshakeError(label, f"expected a map, got {_kind(obj)}")
        required = tuple(required)
        allowed = set(required) | set(optional)
        for key in obj:
            if key not in allowed:
                raise HandshakeError(_join(path, str(key)[:64]),
                                     f"unknown field; expected {sorted(allowed)}")
        for key in required:
            if key not in obj:
                raise HandshakeError(_join(path, key), "missing")
        self.obj: dict[str, object] = obj
        self.path = path

    def where(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> object:
        return self.obj.get(key)

    def get_int(self, key: str, lo: int = 0, hi: int = U64_MAX) -> int:
        return _check_int(self.obj.get(key), self.where(key), lo, hi)

    def opt_int(self, key: str, lo: int = 0, hi: int = U64_MAX) -> int | None:
        value = self.obj.get(key)
        return None if value is None else _check_int(value, self.where(key), lo, hi)

    def get_str(self, key: str, max_chars: int = MAX_NAME_CHARS, allow_empty: bool = False) -> str:
        return _check_str(self.obj.get(key), self.where(key), max_chars, allow_empty)

    def opt_str(self, key: str, max_chars: int = MAX_NAME_CHARS) -> str | None:
        value = self.obj.get(key)
        return None if value is None else _check_str(value, self.where(key), max_chars)

    def get_bytes(self, key: str, max_bytes: int, allow_empty: bool = False) -> bytes:
        value = self.obj.get(key)
        if not isinstance(value, bytes):
            raise HandshakeError(self.where(key), f"expected bytes, got {_kind(value)}")
        if len(value) > max_bytes:
            raise HandshakeError(self.where(key), f"{len(value)} bytes exceeds the limit of "
                                                  f"{max_bytes}")
        if not value and not allow_empty:
            raise HandshakeError(self.where(key), "expected non-empty bytes")
        return value

    def get_bool(self, key: str) -> bool:
        value = self.obj.get(key)
        if not isinstance(value, bool):
            raise HandshakeError(self.where(key), f"expected true or false, got {_kind(value)}")
        return value

    def get_float(self, key: str) -> float:
        value = self.obj.get(key)
        if isinstance(value, bool) or not isinstance(value, float | int):
            raise HandshakeError(self.where(key), f"expected a number, got {_kind(value)}")
        result = float(value)
        if not math.isfinite(result):
            raise HandshakeError(self.where(key), f"expected a finite number, got {result}")
        return result

    def get_list(self, key: str, max_items: int, min_items: int = 0) -> list[object]:
        value = self.obj.get(key)
        if not isinstance(value, list):
            raise HandshakeError(self.where(key), f"expected a list, got {_kind(value)}")
        if not min_items <= len(value) <= max_items:
            raise HandshakeError(self.where(key), f"expected {min_items}..{max_items} items, "
                                                  f"got {len(value)}")
        return value

    def get_enum(self, key: str, enum: type[Any]) -> Any:
        value = self.obj.get(key)
        choices = [m.value for m in enum]
        if not isinstance(value, str) or value not in choices:
            raise HandshakeError(self.where(key), f"expected one of {choices}, got "
                                                  f"{_short(value)}")
        return enum(value)


def _kind(value: object) -> str:
    return "nil" if value is None else type(value).__name__


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 60
_REPR.maxother = 60


def _short(value: object) -> str:
    """A bounded ``repr`` for error messages (never recurses deeper than 3 levels)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _printable(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` with anything non-printable escaped (for error replies)."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text[:max_chars]


def _check_int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandshakeError(where, f"expected an integer, got {_kind(value)}")
    if not lo <= value <= hi:
        raise HandshakeError(where, f"expected an integer in [{lo}, {hi}], got {value}")
    return value


def _check_str(value: object, where: str, max_chars: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise HandshakeError(where, f"expected a string, got {_kind(value)}")
    if not value and not allow_empty:
        raise HandshakeError(where, "expected a non-empty string")
    if len(value) > max_chars:
        raise HandshakeError(where, f"string of {len(value)} chars exceeds {max_chars}")
    if not value.isprintable():
        raise HandshakeError(where, "contains non-printable characters")
    return value


def _versioned(data: object, what: str, max_bytes: int) -> dict[str, object]:
    """Unpack a top-level record and check its protocol version before anything else."""
    obj = _unpack(data, what, max_bytes)
    if not isinstance(obj, dict):
        raise HandshakeError(what, f"expected a map, got {_kind(obj)}")
    if "v" not in obj:
        raise HandshakeError("protocol_version", "missing (field 'v')")
    version = obj["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise HandshakeError("protocol_version", f"expected an integer protocol version, "
                                                 f"got {_kind(version)}")
    if version != PROTOCOL_VERSION:
        raise HandshakeError("protocol_version",
                             f"peer speaks handshake protocol v{version}, this kvbridge speaks "
                             f"v{PROTOCOL_VERSION}; run the same kvbridge version on both sides")
    return obj


def _top(data: object, what: str, max_bytes: int, required: Sequence[str],
         optional: Sequence[str] = ()) -> _Reader:
    return _Reader(_versioned(data, what, max_bytes), "", ("v", *required), optional)


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class RegionCompat:
    """The fields of one region that producer and consumer must agree on exactly."""

    name: str
    layout: RegionLayout
    dtype: str
    head_dim: int
    num_kv_heads: int
    key_only: bool
    token_sharded: bool
    layer_ids: tuple[int, ...]
    #: where K and V sit in a block (layouts.Interior); a GPU-format and a CPU-format
    #: engine must never exchange bytes. Sent only when not the default "kv_outer".
    interior: Interior = Interior.KV_OUTER

    def to_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "layout": self.layout.value, "dtype": self.dtype,
            "head_dim": self.head_dim, "num_kv_heads": self.num_kv_heads,
            "key_only": self.key_only, "token_sharded": self.token_sharded,
            "layer_ids": list(self.layer_ids),
        }
        if self.interior is not Interior.KV_OUTER:
            out["interior"] = self.interior.value
        return out


@dataclass(frozen=True)
class CompatHeader:
    """What must match before anything else of a peer's metadata is read.

    ``fingerprint`` is a digest of every field except the protocol version (which
    is compared on its own, first). Two engines with equal fingerprints run the
    same model with the same KV formats and the same transfer mode; they may
    still differ in TP/PP/DCP sizes, block size or memory order, which a
    transfer plan handles or refuses.
    """

    model: str
    num_layers: int
    transfer_mode: TransferMode
    regions: tuple[RegionCompat, ...]
    protocol_version: int = PROTOCOL_VERSION
    #: the engine's names for its KV format (KVCacheSpec.engine_format: attention
    #: backend, layout, cache dtype), compared exactly; sent only when not empty
    engine_format: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, transfer_mode: TransferMode) -> CompatHeader:
        regions = tuple(
            RegionCompat(r.name, r.layout, r.dtype, r.head_dim, r.num_kv_heads, r.key_only,
                         r.token_sharded, tuple(r.layer_ids), r.interior)
            for r in spec.regions
        )
        return cls(spec.model, spec.num_layers, TransferMode(transfer_mode), regions,
                   engine_format=spec.engine_format)

    def compat_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "num_layers": self.num_layers,
            "transfer_mode": self.transfer_mode.value,
            "regions": [r.to_map() for r in self.regions],
        }
        if self.engine_format:
            out["engine_format"] = dict(self.engine_format)
        return out

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self.compat_map(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differences(self, other: CompatHeader) -> list[tuple[str, object, object]]:
        """Every field that differs, as ``(field, ours, theirs)``; regions matched by name."""
        diffs: list[tuple[str, object, object]] = []
        if self.protocol_version != other.protocol_version:
            diffs.append(("protocol_version", self.protocol_version, other.protocol_version))
        for name in ("model", "num_layers"):
            if getattr(self, name) != getattr(other, name):
                diffs.append((name, getattr(self, name), getattr(other, name)))
        if self.transfer_mode != other.transfer_mode:
            diffs.append(("transfer_mode", self.transfer_mode.value, other.transfer_mode.value))
        ours_fmt, theirs_fmt = dict(self.engine_format), dict(other.engine_format)
        for key in sorted(ours_fmt.keys() | theirs_fmt.keys()):
            if ours_fmt.get(key) != theirs_fmt.get(key):
                diffs.append((f"engine_format.{key}", ours_fmt.get(key), theirs_fmt.get(key)))
        ours = {r.name: r for r in self.regions}
        theirs = {r.name: r for r in other.regions}
        if list(ours) != list(theirs):
            diffs.append(("regions", list(ours), list(theirs)))
        for name in ours.keys() & theirs.keys():
            a, b = ours[name].to_map(), theirs[name].to_map()
            for key in sorted(a.keys() | b.keys()):
                if a.get(key) != b.get(key):
                    diffs.append((f"regions[{name}].{key}", a.get(key, "kv_outer"),
                                  b.get(key, "kv_outer")))
        return diffs


def _header_to_map(header: CompatHeader) -> dict[str, Any]:
    return {"protocol_version": header.protocol_version, "fingerprint": header.fingerprint,
            **header.compat_map()}


def _header_from_map(obj: object, path: str) -> CompatHeader:
    r = _Reader(obj, path, ("protocol_version", "fingerprint", "model", "num_layers",
                            "transfer_mode", "regions"), ("engine_format",))
    version = r.get_int("protocol_version", 0, 1 << 32)
    if version != PROTOCOL_VERSION:
        raise HandshakeError("protocol_version", f"peer header is v{version}, this kvbridge "
                                                 f"speaks v{PROTOCOL_VERSION}")
    regions = []
    for index, item in enumerate(r.get_list("regions", MAX_REGIONS, 1)):
        rr = _Reader(item, r.where(f"regions[{index}]"),
                     ("name", "layout", "dtype", "head_dim", "num_kv_heads", "key_only",
                      "token_sharded", "layer_ids"), ("interior",))
        layer_ids = tuple(_check_int(x, rr.where(f"layer_ids[{i}]"), 0, MAX_LAYERS)
                          for i, x in enumerate(rr.get_list("layer_ids", MAX_LAYERS, 1)))
        regions.append(RegionCompat(
            rr.get_str("name", 64), rr.get_enum("layout", RegionLayout), rr.get_str("dtype", 32),
            rr.get_int("head_dim", 1, 1 << 20), rr.get_int("num_kv_heads", 1, 1 << 20),
            rr.get_bool("key_only"), rr.get_bool("token_sharded"), layer_ids,
            rr.get_enum("interior", Interior) if rr.has("interior") else Interior.KV_OUTER))
    header = CompatHeader(r.get_str("model"), r.get_int("num_layers", 1, MAX_LAYERS),
                          r.get_enum("transfer_mode", TransferMode), tuple(regions), version,
                          _engine_format_from(r))
    carried = r.get_str("fingerprint", 64)
    if carried != header.fingerprint:
        raise HandshakeError(r.where("fingerprint"),
                             f"{carried!r} does not match the header's own fields "
                             f"({header.fingerprint!r}): corrupted or forged header")
    return header


def _engine_format_from(r: _Reader) -> tuple[tuple[str, str], ...]:
    raw = r.raw("engine_format")
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_FORMAT_KEYS:
        raise HandshakeError(r.where("engine_format"), f"expected a map of at most "
                                                       f"{MAX_FORMAT_KEYS} names to strings")
    return tuple(sorted(
        (_check_str(k, r.where("engine_format"), MAX_FORMAT_CHARS),
         _check_str(v, r.where(f"engine_format.{str(k)[:32]}"), MAX_FORMAT_CHARS))
        for k, v in raw.items()))


def check_compatible(local: CompatHeader, remote: CompatHeader) -> None:
    """Raise a HandshakeError naming the first differing field (and listing all)."""
    diffs = local.differences(remote)
    if not diffs:
        return
    listed = "; ".join(f"{f}: ours {a!r}, theirs {b!r}" for f, a, b in diffs)
    raise HandshakeError(f"fingerprint.{diffs[0][0]}",
                         f"peer is incompatible (fingerprint {remote.fingerprint} != ours "
                         f"{local.fingerprint}): {listed}")


# --------------------------------------------------------------------------- per rank


@dataclass(frozen=True)
class RegionMemory:
    """Where one region's KV blocks sit on one rank.

    ``base_addrs[i]`` is the address of the tensor of the i-th layer of the region
    held by this rank (``RankRegionShape.layer_ids`` order); block ``b`` of that
    layer spans ``[base + b * block_bytes_per_layer, base + (b+1) * block_bytes_per_layer)``.
    A region with no layer on this pipeline stage has no addresses.
    ``block_stride`` (0: equal to ``block_bytes_per_layer``) is the distance between
    two blocks when pages are padded or interleaved by the engine (vLLM's padded
    MLA pages); block ``b`` then starts at ``base + b * block_stride``.
    """

    name: str
    base_addrs: tuple[int, ...]
    block_bytes_per_layer: int  # bytes of one block of one layer on this rank
    num_blocks: int
    memory_order: MemoryOrder
    block_size: int  # tokens per block on this rank
    block_stride: int = 0

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes_per_layer

    def to_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "base_addrs": list(self.base_addrs),
                               "block_bytes_per_layer": self.block_bytes_per_layer,
                               "num_blocks": self.num_blocks,
                               "memory_order": self.memory_order.value,
                               "block_size": self.block_size}
        if self.stride != self.block_bytes_per_layer:
            out["block_stride"] = self.block_stride
        return out

    @classmethod
    def from_map(cls, obj: object, path: str) -> RegionMemory:
        r = _Reader(obj, path, ("name", "base_addrs", "block_bytes_per_layer", "num_blocks",
                                "memory_order", "block_size"), ("block_stride",))
        addrs = tuple(_check_int(x, r.where(f"base_addrs[{i}]"), 1, U64_MAX)
                      for i, x in enumerate(r.get_list("base_addrs", MAX_LAYERS)))
        return cls(r.get_str("name", 64), addrs, r.get_int("block_bytes_per_layer", 1, MAX_BLOCK_BYTES),
                   r.get_int("num_blocks", 0, MAX_NUM_BLOCKS), r.get_enum("memory_order", MemoryOrder),
                   r.get_int("block_size", 1, 1 << 20),
                   r.opt_int("block_stride", 1, MAX_BLOCK_BYTES) or 0)


@dataclass(frozen=True)
class AgentMetadata:
    """Everything a peer needs to move KV to or from one rank of an engine."""

    engine_id: str
    agent_name: str
    agent_blob: bytes  # opaque NIXL agent metadata (nixl_agent.get_agent_metadata())
    topology: ParallelTopology  # sizes of the engine plus this rank's coordinates
    regions: tuple[RegionMemory, ...]  # in spec region order
    spec: KVCacheSpec
    generation: int = 0  # registration generation; the server stamps it on publish
    # where the rank's KV lives: a peer prepares this rank's descriptors with it
    mem_type: str = "DRAM"  # one of MEM_TYPES
    device_id: int = 0  # CUDA device of VRAM (0 for DRAM)
    #: block digest algorithms this rank computes for a consumer that asks (issue 18;
    #: ``layouts.digests``), preferred first; empty: none (an older kvbridge, verify off)
    digests: tuple[str, ...] = ()

    @classmethod
    def build(cls, engine_id: str, agent_name: str, agent_blob: bytes, spec: KVCacheSpec,
              topology: ParallelTopology, layer_addrs: Mapping[int, int],
              num_blocks: int, block_strides: Sequence[int] = (), mem_type: str = "DRAM",
              device_id: int = 0, digests: Sequence[str] = ()) -> AgentMetadata:
        """Metadata of one rank from its layer tensors' addresses, checked.

        ``layer_addrs`` maps every layer id on this rank's stage to the data
        pointer of that layer's KV tensor (``tensor.data_ptr()``), each tensor
        shaped ``RankRegionShape.tensor_shape(num_blocks)`` and densely packed,
        unless ``block_strides[r]`` gives region ``r``'s real block stride (padded pages);
        ``mem_type``/``device_id`` say where they are (``VRAM`` on a CUDA device).
        """
        regions: list[RegionMemory] = []
        try:
            shapes = spec.rank_shapes(topology)
        except LayoutError as exc:
            raise HandshakeError(exc.field, exc.reason) from None
        for shape in shapes:
            missing = [layer for layer in shape.layer_ids if layer not in layer_addrs]
            if missing:
                raise HandshakeError("layer_addrs", f"no address for layer(s) {missing} of "
                                                    f"region {shape.region.name!r}")
            regions.append(RegionMemory(
                shape.region.name, tuple(int(layer_addrs[layer]) for layer in shape.layer_ids),
                shape.block_bytes_per_layer, num_blocks if shape.layer_ids else 0,
                shape.region.memory_order, shape.region.block_size,
                _stride_field(block_strides, len(regions), shape.block_bytes_per_layer)))
        meta = cls(engine_id, agent_name, agent_blob, topology, tuple(regions), spec,
                   mem_type=mem_type, device_id=device_id, digests=tuple(digests))
        check_agent(meta)
        return meta

    @property
    def rank(self) -> RankKey:
        return RankKey.of(self.topology)

    @property
    def rank_index(self) -> int:
        """Flat rank index as the transfer planner numbers ranks."""
        return rank_index(self.topology)

    def exposed_bytes(self) -> int:
        """Bytes of KV this rank advertises to its peers: every block of every layer it
        holds (what a peer with its agent metadata may READ or WRITE over NIXL)."""
        return sum(len(r.base_addrs) * r.num_blocks * r.stride for r in self.regions)

    def layer_memory(self) -> dict[int, LayerMemory]:
        """Layer id -> where that layer's tensor sits (the planner's LayerMemory)."""
        out: dict[int, LayerMemory] = {}
        shapes = self.spec.rank_shapes(self.topology)
        for memory, shape in zip(self.regions, shapes, strict=True):
            for layer, addr in zip(shape.layer_ids, memory.base_addrs, strict=True):
                out[layer] = LayerMemory(addr, memory.stride, memory.num_blocks)
        return out

    def region(self, name: str) -> RegionMemory:
        for region in self.regions:
            if region.name == name:
                return region
        raise HandshakeError("regions", f"no region {name!r} on rank {self.rank.describe()}")


def _stride_field(strides: Sequence[int], index: int, block_bytes: int) -> int:
    """``RegionMemory.block_stride`` for a given stride: 0 when dense (the default)."""
    stride = int(strides[index]) if index < len(strides) else 0
    return 0 if stride == block_bytes else stride


def _mem_type_or_dram(value: str | None) -> str:
    """Absent: DRAM (documents from before memory types existed); present, it is
    checked as given (an empty string is refused, never read as DRAM)."""
    return "DRAM" if value is None else value


def check_agent(meta: AgentMetadata) -> None:
    """Raise a HandshakeError (field relative to the rank) unless ``meta`` is consistent.

    Checks that the memory described agrees with what ``spec`` says this rank
    holds, and that no address range wraps or overlaps another: a peer will post
    RDMA descriptors into these ranges, so they must be exactly right.
    """
    _check_str(meta.engine_id, "engine_id", MAX_NAME_CHARS)
    _check_str(meta.agent_name, "agent_name", MAX_NAME_CHARS)
    if not isinstance(meta.agent_blob, bytes) or len(meta.agent_blob) > MAX_BLOB_BYTES:
        raise HandshakeError("agent_blob", f"expected at most {MAX_BLOB_BYTES} bytes")
    _check_int(meta.generation, "generation", 0, U64_MAX)
    if meta.mem_type not in MEM_TYPES:
        raise HandshakeError("mem_type", f"expected one of {list(MEM_TYPES)}, got "
                                         f"{_short(meta.mem_type)}")
    _check_int(meta.device_id, "device_id", 0, MAX_DEVICE_ID if meta.mem_type == "VRAM" else 0)
    if len(meta.digests) > MAX_DIGEST_ALGORITHMS:
        raise HandshakeError("digests", f"{len(meta.digests)} algorithms exceed the limit of "
                                        f"{MAX_DIGEST_ALGORITHMS}")
    for i, name in enumerate(meta.digests):
        _check_str(name, f"digests[{i}]", 32, False)
    try:
        meta.spec.validate_topology(meta.topology)
        shapes = meta.spec.rank_shapes(meta.topology)
    except LayoutError as exc:
        raise HandshakeError(exc.field, exc.reason) from None
    if len(meta.regions) != len(shapes):
        raise HandshakeError("regions", f"expected {len(shapes)} regions (one per spec "
                                        f"region), got {len(meta.regions)}")
    ranges: list[tuple[int, int, str, int, int]] = []  # start, end, field, region, stride
    for index, (memory, shape) in enumerate(zip(meta.regions, shapes, strict=True)):
        where = f"regions[{index}]"
        spec_region = shape.region
        if memory.name != spec_region.name:
            raise HandshakeError(f"{where}.name", f"expected {spec_region.name!r} (spec order), "
                                                  f"got {memory.name!r}")
        if memory.block_size != spec_region.block_size:
            raise HandshakeError(f"{where}.block_size", f"spec says {spec_region.block_size}, "
                                                        f"got {memory.block_size}")
        if memory.memory_order is not spec_region.memory_order:
            raise HandshakeError(f"{where}.memory_order",
                                 f"spec says {spec_region.memory_order.value}, "
                                 f"got {memory.memory_order.value}")
        if memory.block_bytes_per_layer != shape.block_bytes_per_layer:
            raise HandshakeError(f"{where}.block_bytes_per_layer",
                                 f"spec and topology give {shape.block_bytes_per_layer} bytes "
                                 f"per block per layer on this rank, got "
                                 f"{memory.block_bytes_per_layer}")
        if len(memory.base_addrs) != len(shape.layer_ids):
            raise HandshakeError(f"{where}.base_addrs",
                                 f"expected one address per layer of the region on this stage "
                                 f"({len(shape.layer_ids)}), got {len(memory.base_addrs)}")
        if shape.layer_ids and memory.num_blocks < 1:
            raise HandshakeError(f"{where}.num_blocks", "expected at least one block")
        if memory.stride < memory.block_bytes_per_layer:
            raise HandshakeError(f"{where}.block_stride",
                                 f"{memory.block_stride} is smaller than a block "
                                 f"({memory.block_bytes_per_layer} bytes): blocks would overlap")
        span = (max(memory.num_blocks - 1, 0) * memory.stride
                + memory.block_bytes_per_layer * (memory.num_blocks > 0))
        for layer_index, addr in enumerate(memory.base_addrs):
            if addr + span > U64_MAX + 1:
                raise HandshakeError(f"{where}.base_addrs[{layer_index}]",
                                     f"range of {span} bytes from {addr:#x} wraps past 2**64")
            ranges.append((addr, addr + span, f"{where}.base_addrs[{layer_index}]", index,
                           memory.stride))
    ranges.sort()
    # The one overlap allowed: a layer of one region aliasing a layer of another at the
    # same address with the same block stride (vLLM's hybrid allocator puts layer i of
    # every KV cache group on the same bytes; a block id belongs to one group at a time).
    widest: tuple[int, int, str, int, int] | None = None
    aliased: set[int] = set()  # regions already seen at widest's address
    for current in ranges:
        if widest is not None and current[0] < widest[1]:
            aliases = (current[0] == widest[0] and current[3] not in aliased
                       and current[4] == widest[4])
            if not aliases:
                raise HandshakeError(current[2], f"tensor overlaps {widest[2]}: each layer of "
                                                 f"each region must be its own tensor, or "
                                                 f"alias a layer of another region exactly")
            aliased.add(current[3])
        if widest is None or current[1] > widest[1]:
            widest = current
            aliased = {current[3]}


def _agent_to_map(meta: AgentMetadata, include_spec: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "engine_id": meta.engine_id, "agent_name": meta.agent_name,
        "agent_blob": meta.agent_blob, "topology": meta.topology.to_dict(),
        "regions": [r.to_map() for r in meta.regions], "generation": meta.generation,
    }
    if meta.mem_type != "DRAM":  # memory type (issue 15); absent = DRAM, as before it existed
        out["mem_type"], out["device_id"] = meta.mem_type, meta.device_id
    if meta.digests:  # absent = none, as before digests existed
        out["digests"] = list(meta.digests)
    if include_spec:
        out["spec"] = meta.spec.to_dict()
    return out


def _spec_from(obj: object, path: str) -> KVCacheSpec:
    try:
        return KVCacheSpec.from_dict(obj)
    except LayoutError as exc:
        raise _prefixed(path, exc) from None
    except (TypeError, ValueError) as exc:  # from_dict trusts value types in places
        raise HandshakeError(path, f"invalid spec: {exc}") from None


def _topology_from(obj: object, path: str) -> ParallelTopology:
    """A peer's topology, with every size bounded before anything loops over its ranks."""
    if isinstance(obj, dict):
        for name in ("tp_size", "pp_size", "dcp_size", "pcp_size"):
            value = obj.get(name, 1)
            if not isinstance(value, bool) and isinstance(value, int) \
                    and not 1 <= value <= MAX_PARALLEL_SIZE:
                shown = value if abs(value) < 10**12 else f"an integer of {len(str(value))} digits"
                raise HandshakeError(_join(path, name), f"expected an integer in "
                                                        f"[1, {MAX_PARALLEL_SIZE}], got {shown}")
        world = 1
        for name in ("tp_size", "pp_size", "pcp_size"):
            value = obj.get(name, 1)
            world *= value if isinstance(value, int) and not isinstance(value, bool) else 1
        if world > MAX_RANKS:
            raise HandshakeError(path, f"tp_size * pp_size * pcp_size = {world} ranks exceeds "
                                       f"the limit of {MAX_RANKS}")
    try:
        return ParallelTopology.from_dict(obj, path)
    except LayoutError as exc:
        raise HandshakeError(exc.field, exc.reason) from None
    except TypeError as exc:
        raise HandshakeError(path, f"invalid topology: {exc}") from None


def _agent_from_map(obj: object, path: str, spec: KVCacheSpec | None) -> AgentMetadata:
    keys = ("engine_id", "agent_name", "agent_blob", "topology", "regions", "generation")
    r = _Reader(obj, path, keys + (("spec",) if spec is None else ()),
                optional=("mem_type", "device_id", "digests"))
    if spec is None:
        spec = _spec_from(r.raw("spec"), r.where("spec"))
    regions = tuple(RegionMemory.from_map(item, r.where(f"regions[{i}]"))
                    for i, item in enumerate(r.get_list("regions", MAX_REGIONS, 1)))
    meta = AgentMetadata(
        engine_id=r.get_str("engine_id"), agent_name=r.get_str("agent_name"),
        agent_blob=r.get_bytes("agent_blob", MAX_BLOB_BYTES, allow_empty=True),
        topology=_topology_from(r.raw("topology"), r.where("topology")),
        regions=regions, spec=spec, generation=r.get_int("generation"),
        mem_type=_mem_type_or_dram(r.opt_str("mem_type", 8)),
        device_id=r.opt_int("device_id", 0, MAX_DEVICE_ID) or 0,
        digests=tuple(_check_str(name, r.where(f"digests[{i}]"), 32, False) for i, name in
                      enumerate(r.get_list("digests", MAX_DIGEST_ALGORITHMS, 0)
                                if r.has("digests") else ())))
    try:
        check_agent(meta)
    except HandshakeError as exc:
        raise _prefixed(path, exc) from None
    return meta


def encode_agent(meta: AgentMetadata) -> bytes:
    """One rank's metadata as a standalone record (e.g. worker -> scheduler process)."""
    check_agent(meta)
    return _pack({"v": PROTOCOL_VERSION, **_agent_to_map(meta, include_spec=True)})


def decode_agent(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> AgentMetadata:
    obj = _versioned(data, "message", max_bytes)
    return _agent_from_map({k: v for k, v in obj.items() if k != "v"}, "", None)


# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class EngineMetadata:
    """One engine's metadata as served: header, identity and the selected ranks.

    ``incarnation`` is random per server start, so a restarted engine at the same
    address is told apart; ``generation`` grows every time a rank re-registers.
    ``ranks`` holds the ranks that were asked for, ordered by ``RankKey``.
    """

    header: CompatHeader
    engine_id: str
    incarnation: str
    generation: int
    spec: KVCacheSpec
    topology: ParallelTopology  # sizes; rank coordinates are 0
    ranks: tuple[AgentMetadata, ...] = field(default=())

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint

    @property
    def transfer_mode(self) -> TransferMode:
        return self.header.transfer_mode

    def rank(self, pp_rank: int = 0, tp_rank: int = 0, pcp_rank: int = 0) -> AgentMetadata:
        key = RankKey(pp_rank, pcp_rank, tp_rank)
        for meta in self.ranks:
            if meta.rank == key:
                return meta
        raise HandshakeError("ranks", f"rank {key.describe()} not in this metadata "
                                      f"(have {[m.rank.describe() for m in self.ranks]})")

    def memory_by_rank(self) -> dict[int, dict[int, LayerMemory]]:
        """Planner rank index -> layer id -> LayerMemory, for ``absolute_descriptors``."""
        return {meta.rank_index: meta.layer_memory() for meta in self.ranks}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary (what ``kvbridge probe --json`` prints; blobs as size+digest)."""
        return {
            "engine_id": self.engine_id, "incarnation": self.incarnation,
            "generation": self.generation, "protocol_version": self.header.protocol_version,
            "fingerprint": self.fingerprint, "model": self.spec.model,
            "transfer_mode": self.transfer_mode.value, "topology": self.topology.describe(),
            "spec": self.spec.to_dict(),
            "missing_ranks": [k.describe() for k in self.missing_ranks()],
            "ranks": [{
                "rank": m.rank.describe(), "topology": m.topology.to_dict(),
                "agent_name": m.agent_name, "generation": m.generation,
                "agent_blob_bytes": len(m.agent_blob),
                "agent_blob_sha256": hashlib.sha256(m.agent_blob).hexdigest()[:16],
                "mem_type": m.mem_type, "device_id": m.device_id,
                "digests": list(m.digests),
                "exposed_bytes": m.exposed_bytes(),
                "regions": [{**r.to_map(), "base_addrs": [hex(a) for a in r.base_addrs]}
                            for r in m.regions],
            } for m in self.ranks],
        }

    def missing_ranks(self, limit: int | None = None) -> list[RankKey]:
        """Ranks of the topology that this document does not hold (the first ``limit``).

        Costs nothing for a complete document; otherwise at most one pass over the
        topology's ranks, which the decoder bounds by MAX_RANKS.
        """
        have = {m.rank for m in self.ranks}
        if len(have) >= self.topology.world_size:
            return []
        out: list[RankKey] = []
        for t in self.topology.ranks():
            key = RankKey.of(t)
            if key not in have:
                out.append(key)
                if limit is not None and len(out) >= limit:
                    break
        return out


def _body_to_map(meta: EngineMetadata) -> dict[str, Any]:
    return {"engine_id": meta.engine_id, "incarnation": meta.incarnation,
            "generation": meta.generation, "spec": meta.spec.to_dict(),
            "topology": meta.topology.to_dict(),
            "ranks": [_agent_to_map(m, include_spec=False) for m in meta.ranks]}


def encode_engine(meta: EngineMetadata) -> bytes:
    """The engine document: ``{"v", "header", "body": <msgpack bytes>}``."""
    if meta.header != CompatHeader.from_spec(meta.spec, meta.header.transfer_mode):
        raise HandshakeError("header", "does not describe the spec it is sent with")
    for index, rank in enumerate(meta.ranks):
        try:
            check_agent(rank)
        except HandshakeError as exc:
            raise _prefixed(f"ranks[{index}]", exc) from None
    body = _pack(_body_to_map(meta))
    data = _pack({"v": PROTOCOL_VERSION, "header": _header_to_map(meta.header), "body": body})
    if len(data) > MAX_DOCUMENT_BYTES:
        raise HandshakeError("ranks", f"engine document of {len(data)} bytes exceeds "
                                      f"{MAX_DOCUMENT_BYTES}; ask for fewer ranks at a time")
    return data


def decode_header(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> CompatHeader:
    """Decode only the header of an engine document (the body stays unread)."""
    r = _top(data, "message", max_bytes, ("header", "body"))
    return _header_from_map(r.raw("header"), "header")


def decode_engine(data: bytes, expected: CompatHeader | None = None,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> EngineMetadata:
    """Decode an engine document; with ``expected``, refuse a peer whose header differs.

    The header is decoded and compared first; the body is parsed only after it
    matched, so an incompatible peer is refused with a HandshakeError naming the
    first differing field (``"fingerprint.regions[attn].dtype"``) before any of its
    per-rank data is interpreted.
    """
    r = _top(data, "message", max_bytes, ("header", "body"))
    header = _header_from_map(r.raw("header"), "header")
    if expected is not None:
        check_compatible(expected, header)
    body_bytes = r.get_bytes("body", max_bytes)
    body = _Reader(_unpack(body_bytes, "body", max_bytes), "body",
                   ("engine_id", "incarnation", "generation", "spec", "topology", "ranks"))
    spec = _spec_from(body.raw("spec"), "body.spec")
    if CompatHeader.from_spec(spec, header.transfer_mode) != header:
        raise HandshakeError("body.spec", "does not match the header it came with")
    topology = _topology_from(body.raw("topology"), "body.topology")
    if topology != topology.sizes():
        raise HandshakeError("body.topology", "engine topology must have every rank set to 0")
    engine_id = body.get_str("engine_id")
    ranks = tuple(_agent_from_map(item, f"body.ranks[{i}]", spec)
                  for i, item in enumerate(body.get_list("ranks", MAX_RANKS)))
    seen: set[RankKey] = set()
    for index, rank in enumerate(ranks):
        where = f"body.ranks[{index}]"
        if rank.topology.sizes() != topology:
            raise HandshakeError(f"{where}.topology", f"sizes {rank.topology.describe()} differ "
                                                      f"from the engine's {topology.describe()}")
        if rank.engine_id != engine_id:
            raise HandshakeError(f"{where}.engine_id", f"{rank.engine_id!r} in an engine "
                                                       f"document of {engine_id!r}")
        if rank.rank in seen:
            raise HandshakeError(f"{where}.topology", f"rank {rank.rank.describe()} twice")
        seen.add(rank.rank)
    generation = body.get_int("generation")
    if any(rank.generation > generation for rank in ranks):
        raise HandshakeError("body.generation", "older than one of its ranks' generations")
    return EngineMetadata(header, engine_id, body.get_str("incarnation", 64), generation, spec,
                          topology, tuple(sorted(ranks, key=lambda m: m.rank)))


# --------------------------------------------------------------------------- requests


class RequestKind(str, Enum):
    GET = "get"  # metadata of the selected ranks (or "unchanged")
    PING = "ping"  # identity, generation and clock only


@dataclass(frozen=True)
class MetadataRequest:
    """Ask a server for metadata.

    Selection: each of ``pp_rank``, ``tp_rank``, ``pcp_rank`` is a number or None
    (= every value). ``tp_rank=1`` alone asks for TP rank 1 of every pipeline
    stage (the PP-aware aggregation a consumer rank needs); all None asks for
    the whole engine. With ``known_incarnation`` and ``known_generation`` set
    (both or neither), a server whose incarnation and generation are unchanged
    answers with a small StatusReply(unchanged=True) instead of the document.
    """

    request_id: int
    kind: RequestKind = RequestKind.GET
    pp_rank: int | None = None
    tp_rank: int | None = None
    pcp_rank: int | None = None
    known_incarnation: str | None = None
    known_generation: int | None = None

    def selects(self, key: RankKey) -> bool:
        return ((self.pp_rank is None or self.pp_rank == key.pp_rank)
                and (self.tp_rank is None or self.tp_rank == key.tp_rank)
                and (self.pcp_rank is None or self.pcp_rank == key.pcp_rank))


_RANK_LIMIT = 1 << 16


def encode_request(request: MetadataRequest) -> bytes:
    _check_int(request.request_id, "request_id", 0, U64_MAX)
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": RequestKind(request.kind).value,
                           "id": request.request_id}
    if request.kind is RequestKind.GET:
        out.update(pp=request.pp_rank, tp=request.tp_rank, pcp=request.pcp_rank,
                   known_incarnation=request.known_incarnation,
                   known_generation=request.known_generation)
    return _pack(out)


def decode_request(data: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> MetadataRequest:
    obj = _versioned(data, "message", max_bytes)
    kind_reader = _Reader(obj, "", ("v", "kind", "id"),
                          ("pp", "tp", "pcp", "known_incarnation", "known_generation"))
    kind = kind_reader.get_enum("kind", RequestKind)
    if kind is RequestKind.PING:
        r = _Reader(obj, "", ("v", "kind", "id"))
        return MetadataRequest(r.get_int("id"), kind)
    r = kind_reader
    known_incarnation = r.opt_str("known_incarnation", 64)
    known_generation = r.opt_int("known_generation")
    if (known_incarnation is None) != (known_generation is None):
        raise HandshakeError("known_generation" if known_generation is None
                             else "known_incarnation",
                             "known_incarnation and known_generation go together")
    return MetadataRequest(r.get_int("id"), kind, r.opt_int("pp", 0, _RANK_LIMIT),
                           r.opt_int("tp", 0, _RANK_LIMIT), r.opt_int("pcp", 0, _RANK_LIMIT),
                           known_incarnation, known_generation)


def peek_request_id(data: bytes) -> int:
    """Best-effort request id of a malformed request (0 when there is none)."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False) if \
            0 < len(data) <= MAX_REQUEST_BYTES else None
    except Exception:
        return 0
    if isinstance(obj, dict):
        value = obj.get("id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX:
            return value
    return 0


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class ServerClock:
    """The server's clocks when it built the reply (seconds)."""

    wall_s: float  # time.time()
    monotonic_s: float  # time.monotonic() of the server process (its own epoch)


@dataclass(frozen=True)
class MetadataReply:
    request_id: int
    clock: ServerClock
    engine_doc: bytes  # an engine document; decode with decode_engine()


@dataclass(frozen=True)
class StatusReply:
    request_id: int
    clock: ServerClock
    engine_id: str
    incarnation: str
    generation: int
    unchanged: bool  # answer to a conditional GET whose known state is current


@dataclass(frozen=True)
class ErrorReply:
    request_id: int
    clock: ServerClock
    field: str  # the request field the server rejected
    message: str
    retryable: bool = False  # e.g. a rank that has not registered yet


Reply = MetadataReply | StatusReply | ErrorReply


def encode_reply(reply: Reply) -> bytes:
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": reply.request_id,
                           "wall": reply.clock.wall_s, "mono": reply.clock.monotonic_s}
    if isinstance(reply, MetadataReply):
        out.update(kind="metadata", engine=reply.engine_doc)
    elif isinstance(reply, StatusReply):
        out.update(kind="status", engine_id=reply.engine_id, incarnation=reply.incarnation,
                   generation=reply.generation, unchanged=reply.unchanged)
    else:
        out.update(kind="error", field=_printable(reply.field, MAX_NAME_CHARS),
                   message=_printable(reply.message, 4096), retryable=reply.retryable)
    return _pack(out)


def decode_reply(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Reply:
    obj = _versioned(data, "message", max_bytes)
    common = ("v", "kind", "id", "wall", "mono")
    kind = _Reader(obj, "", common, ("engine", "engine_id", "incarnation", "generation",
                                     "unchanged", "field", "message", "retryable")).raw("kind")
    if kind == "metadata":
        r = _Reader(obj, "", common + ("engine",))
        return MetadataReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                             r.get_bytes("engine", max_bytes))
    if kind == "status":
        r = _Reader(obj, "", common + ("engine_id", "incarnation", "generation", "unchanged"))
        return StatusReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                           r.get_str("engine_id"), r.get_str("incarnation", 64), r.get_int("generation"),
                           r.get_bool("unchanged"))
    if kind == "error":
        r = _Reader(obj, "", common + ("field", "message", "retryable"))
        return ErrorReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                          r.get_str("field", MAX_NAME_CHARS, allow_empty=True),
                          r.get_str("message", 4096, allow_empty=True), r.get_bool("retryable"))
    raise HandshakeError("kind", f"expected 'metadata', 'status' or 'error', got {_short(kind)}")
