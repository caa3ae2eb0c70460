"""The compatibility header: what two engines must agree on before anything else is read.

Owns :class:`TransferMode`, :class:`RegionCompat` and :class:`CompatHeader` (the
fingerprint over model, layer count, transfer mode, engine format and per-region
KV format), their map form on the wire, and :func:`check_compatible`, which
refuses a peer naming the first differing field. TP/PP/DCP sizes, block size
and memory order are deliberately not part of it (a transfer plan handles or
refuses those).

May not touch: per-rank memory (:mod:`~kvbridge.handshake.agent`), the engine
document around the header (:mod:`~kvbridge.handshake.document`), sockets. The
fingerprint is computed from ``compat_map``; changing either changes every
peer's fingerprint (pinned by ``tests/golden``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvbridge.handshake.codec import (
    MAX_LAYERS,
    MAX_REGIONS,
    PROTOCOL_VERSION,
    _check_int,
    _check_str,
    _Reader,
)
from kvbridge.handshake.errors import HandshakeError
from kvbridge.layouts import Interior, KVCacheSpec, RegionLayout
from kvbridge.layouts.spec import MAX_FORMAT_CHARS, MAX_FORMAT_KEYS

# --------------------------------------------------------------------------- header


class TransferMode(str, Enum):
    """Who moves the bytes: the consumer READs (pull) or the producer WRITEs (push)."""

    PULL = "pull"
    PUSH = "push"


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
