"""Region specs and the KV cache spec of one model, with per-rank shapes.

Memory model of one rank (what every connector and the reference engine use):
for each region and each of its layers on this pipeline stage, one tensor of
shape ``(num_blocks, num_kv, *block_shape)`` where ``num_kv`` is 2 (key and
value) or 1 (key-only, MLA) and ``block_shape`` is ``(heads, tokens,
head_dim)`` for HND order or ``(tokens, heads, head_dim)`` for NHD. So one
block of one layer is contiguous (``block_bytes_per_layer`` bytes), and under
HND one head's slice of K (or V) inside it is contiguous too.

Interior formats (``RegionSpec.interior``): where K and V sit inside a block.

* ``kv_outer`` (kvbridge's own): all K of the block, then all V, as above.
* ``token_kv`` (vLLM's GPU backends, e.g. FlashAttention: ``kv.transpose(1, 2)
  .split(head_size, -1)``): one tensor ``(num_blocks, *cells, 2 * head_dim)``
  where ``cells`` is ``(heads, tokens)`` (HND) or ``(tokens, heads)`` (NHD) and
  each cell holds that head's K of that token, then its V.
* ``head_kv`` (vLLM's CPU backend): ``(num_blocks, heads, tokens, 2 * head_dim)``
  read as each head's ``tokens`` K rows, then its ``tokens`` V rows (HND only).

The three have the same bytes per block and differ in meaning: two engines
with different interiors never exchange bytes (the handshake compares it).
Key-only regions (MLA) have one interior, ``kv_outer``.

A block's bytes need not sit ``block_bytes_per_layer`` apart: the planner's
:class:`~kvbridge.layouts.plan.LayerMemory` carries the real block stride
(padded pages, block-outermost engine layouts).

Head assignment (SPLIT regions) uses the head groups of the topology
(``tp_size // dcp_size`` groups): with ``H`` global KV heads and ``G`` groups,
either ``H % G == 0`` (group ``g`` holds heads ``[g*H/G, (g+1)*H/G)``) or
``G % H == 0`` (heads are replicated: group ``g`` holds head ``g*H//G``).
Anything else cannot be sharded and is refused. REPLICATE regions hold every
head on every rank.

Token sharding (DCP): a token-sharded region's rank block holds ``block_size``
tokens of a virtual block of ``block_size * dcp_size`` tokens: virtual token
``t`` lives on DCP rank ``t % dcp_size`` at slot ``t // dcp_size``. A region
that is not token-sharded (Mamba-like state, sliding window) holds the same
whole block on every DCP rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.limits import (
    MAX_BLOCK_SIZE,
    MAX_ENGINE_SLICES,
    MAX_HEAD_DIM,
    MAX_HEAD_TOKENS,
    MAX_KV_HEADS,
    MAX_LAYER_RANKS,
    MAX_LAYERS,
    MAX_SPEC_FILE_BYTES,
    check_at_most,
)
from kvbridge.layouts.topology import ParallelTopology

#: Bytes per element of every KV dtype kvbridge knows (names as in torch).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


_MAXIMA = {"block_size": MAX_BLOCK_SIZE, "num_kv_heads": MAX_KV_HEADS,
           "head_dim": MAX_HEAD_DIM}


def _short(values: object) -> str:
    text = repr(values)
    return text if len(text) <= 80 else text[:80] + "..."


class RegionLayout(str, Enum):
    """How a region's KV heads sit across TP ranks."""

    SPLIT = "split"  # heads divided across TP head groups (full attention)
    REPLICATE = "replicate"  # every rank holds the whole block (MLA latent, Mamba state)


class Interior(str, Enum):
    """Where K and V sit inside one block of one layer (see the module docstring)."""

    KV_OUTER = "kv_outer"  # (2, *block_shape): K of every head and token, then V
    TOKEN_KV = "token_kv"  # (*cells, 2 * head_dim): per (head, token) cell, K then V (GPU)
    HEAD_KV = "head_kv"  # (heads, 2 * tokens, head_dim): per head, K rows then V rows (CPU)


class MemoryOrder(str, Enum):
    """Order of the axes inside one block of K (or V)."""

    HND = "HND"  # heads, tokens, head_dim: a head slice is contiguous
    NHD = "NHD"  # tokens, heads, head_dim: a head slice is strided per token


@dataclass(frozen=True)
class RegionSpec:
    """A group of layers sharing one KV format."""

    name: str
    layout: RegionLayout
    layer_ids: tuple[int, ...]
    block_size: int  # tokens per rank block
    num_kv_heads: int  # global, across all TP ranks
    head_dim: int
    dtype: str
    key_only: bool = False
    memory_order: MemoryOrder = MemoryOrder.HND
    token_sharded: bool = True  # sharded across DCP ranks (full attention, MLA)
    interior: Interior = Interior.KV_OUTER

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise LayoutError("name", f"expected a non-empty string of <= 64 chars, "
                                      f"got {self.name!r}")
        if not isinstance(self.layout, RegionLayout):
            raise LayoutError("layout", f"expected one of {[m.value for m in RegionLayout]}, "
                                        f"got {self.layout!r}")
        if not isinstance(self.memory_order, MemoryOrder):
            raise LayoutError("memory_order", f"expected one of "
                                              f"{[m.value for m in MemoryOrder]}, "
                                              f"got {self.memory_order!r}")
        if (not isinstance(self.layer_ids, tuple) or not self.layer_ids
                or not all(isinstance(i, int) and not isinstance(i, bool)
                           and 0 <= i < MAX_LAYERS for i in self.layer_ids)):
            raise LayoutError("layer_ids", f"expected a non-empty list of layer indices in "
                                           f"[0, {MAX_LAYERS}), got "
                                           f"{_short(self.layer_ids)}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise LayoutError("layer_ids", f"duplicate layer id in {list(self.layer_ids)}")
        for name in ("block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(name, f"expected an integer >= 1, got {value!r}")
            check_at_most(name, value, _MAXIMA[name])
        check_at_most("block_size", self.num_kv_heads * self.block_size, MAX_HEAD_TOKENS,
                      "(num_kv_heads * block_size)")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise LayoutError("dtype", f"unknown KV dtype {self.dtype!r}; expected one of "
                                       f"{sorted(DTYPE_BYTES)}")
        if not isinstance(self.key_only, bool) or not isinstance(self.token_sharded, bool):
            raise LayoutError("key_only" if not isinstance(self.key_only, bool)
                              else "token_sharded", "expected true or false")
        if not isinstance(self.interior, Interior):
            raise LayoutError("interior", f"expected one of {[m.value for m in Interior]}, "
                                          f"got {self.interior!r}")
        if self.key_only and self.interior is not Interior.KV_OUTER:
            raise LayoutError("interior", f"a key-only region has no V to place; expected "
                                          f"'kv_outer', got {self.interior.value!r}")
        if self.interior is Interior.HEAD_KV and self.memory_order is not MemoryOrder.HND:
            raise LayoutError("interior", "'head_kv' (each head's K rows then V rows) is a "
                                          "head-major format: it needs memory_order 'HND'")

    @property
    def num_kv(self) -> int:
        return 1 if self.key_only else 2

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def tokens_per_key(self, dcp_size: int) -> int:
        """Tokens covered by one block key (one hash) under ``dcp_size``."""
        return self.block_size * dcp_size if self.token_sharded else self.block_size

    def heads_of(self, topology: ParallelTopology) -> tuple[int, int]:
        """``(first_head, num_heads)`` held by ``topology``'s rank."""
        if self.layout is RegionLayout.REPLICATE:
            return 0, self.num_kv_heads
        groups = topology.num_head_groups
        heads = self.num_kv_heads
        group = topology.head_group
        if heads % groups == 0:
            per_group = heads // groups
            return group * per_group, per_group
        if groups % heads == 0:
            return group * heads // groups, 1
        raise LayoutError(
            "tp_size",
            f"region {self.name!r}: {heads} KV heads cannot be divided across "
            f"{groups} head groups (tp_size {topology.tp_size} / dcp_size "
            f"{topology.dcp_size}); one must be a multiple of the other",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layout": self.layout.value,
            "layer_ids": list(self.layer_ids),
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "key_only": self.key_only,
            "memory_order": self.memory_order.value,
            "token_sharded": self.token_sharded,
            # only when not the default, so specs written before interiors keep their
            # fingerprints
            **({"interior": self.interior.value} if self.interior is not Interior.KV_OUTER
               else {}),
        }

    @classmethod
    def from_dict(cls, data: object, field: str = "region") -> RegionSpec:
        if not isinstance(data, dict):
            raise LayoutError(field, f"expected a mapping, got {type(data).__name__}")
        required = ("name", "layout", "layer_ids", "block_size", "num_kv_heads", "head_dim",
                    "dtype")
        optional = ("key_only", "memory_order", "token_sharded", "interior")
        for name in required:
            if name not in data:
                raise LayoutError(f"{field}.{name}", "missing")
        unknown = set(data) - set(required) - set(optional)
        if unknown:
            raise LayoutError(f"{field}.{sorted(unknown)[0]}",
                              f"unknown field; expected {list(required + optional)}")
        kwargs = dict(data)
        try:
            kwargs["layout"] = RegionLayout(str(data["layout"]).lower())
        except ValueError:
            raise LayoutError(f"{field}.layout", f"expected 'split' or 'replicate', "
                                                 f"got {data['layout']!r}") from None
        if "memory_order" in data:
            try:
                kwargs["memory_order"] = MemoryOrder(str(data["memory_order"]).upper())
            except ValueError:
                raise LayoutError(f"{field}.memory_order", f"expected 'HND' or 'NHD', "
                                  f"got {data['memory_order']!r}") from None
        if "interior" in data:
            try:
                kwargs["interior"] = Interior(str(data["interior"]).lower())
            except ValueError:
                raise LayoutError(f"{field}.interior", f"expected one of "
                                  f"{[m.value for m in Interior]}, "
                                  f"got {data['interior']!r}") from None
        if not isinstance(data["layer_ids"], list | tuple):
            raise LayoutError(f"{field}.layer_ids", "expected a list of integers")
        kwargs["layer_ids"] = tuple(data["layer_ids"])
        try:
            return cls(**kwargs)
        except LayoutError as exc:
            raise LayoutError(f"{field}.{exc.field}", exc.reason) from None


@dataclass(frozen=True)
class RankRegionShape:
    """What one rank holds of one region: its layers, heads and bytes per block."""

    region: RegionSpec
    layer_ids: tuple[int, ...]  # this pipeline stage's layers of the region
    head_start: int
    num_heads: int

    @property
    def block_shape(self) -> tuple[int, int, int]:
        r = self.region
        if r.memory_order is MemoryOrder.HND:
            return (self.num_heads, r.block_size, r.head_dim)
        return (r.block_size, self.num_heads, r.head_dim)

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the per-layer KV tensor of this region on this rank.

        ``kv_outer``: ``(num_blocks, num_kv, *block_shape)``; ``token_kv`` and
        ``head_kv``: vLLM's ``(num_blocks, *cells, 2 * head_dim)``.
        """
        if self.region.interior is Interior.KV_OUTER:
            return (num_blocks, self.region.num_kv, *self.block_shape)
        a, b, dim = self.block_shape
        return (num_blocks, a, b, 2 * dim)

    @property
    def block_bytes_per_layer(self) -> int:
        r = self.region
        return r.num_kv * self.num_heads * r.block_size * r.head_dim * r.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all of this rank's layers of the region."""
        return self.block_bytes_per_layer * len(self.layer_ids)


#: Bounds of ``KVCacheSpec.engine_format`` (it travels in handshakes).
MAX_FORMAT_KEYS = 8
MAX_FORMAT_CHARS = 64


@dataclass(frozen=True)
class KVCacheSpec:
    """The regions of one model. Layer ids of all regions form ``0..num_layers-1``.

    ``engine_format``: the serving engine's names for its KV format (e.g.
    ``{"engine": "vllm", "attn_backend": "CPU_ATTN", "kv_cache_layout": "LBHNC",
    "cache_dtype": "auto"}``), compared as they are by two engines before any
    byte moves; empty for engines that do not say.
    """

    model: str
    regions: tuple[RegionSpec, ...]
    engine_format: tuple[tuple[str, str], ...] = ()
    _layer_owner: dict[int, int] = field(default_factory=dict, init=False, repr=False,
                                         compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model or len(self.model) > 256:
            raise LayoutError("model", f"expected a non-empty name, got {self.model!r}")
        if not isinstance(self.regions, tuple) or not self.regions:
            raise LayoutError("regions", "expected at least one region")
        fmt = self.engine_format
        if (not isinstance(fmt, tuple) or len(fmt) > MAX_FORMAT_KEYS
                or not all(isinstance(kv, tuple) and len(kv) == 2
                           and all(isinstance(x, str) and 0 < len(x) <= MAX_FORMAT_CHARS
                                   for x in kv) for kv in fmt)
                or len({k for k, _ in fmt}) != len(fmt)):
            raise LayoutError("engine_format", f"expected at most {MAX_FORMAT_KEYS} distinct "
                                               f"names, each mapped to a string of 1.."
                                               f"{MAX_FORMAT_CHARS} chars, got {fmt!r}")
        object.__setattr__(self, "engine_format", tuple(sorted(fmt)))
        names: set[str] = set()
        for index, region in enumerate(self.regions):
            if not isinstance(region, RegionSpec):
                raise LayoutError(f"regions[{index}]", "expected a RegionSpec")
            if region.name in names:
                raise LayoutError(f"regions[{index}].name", f"duplicate region {region.name!r}")
            names.add(region.name)
            for layer in region.layer_ids:
                if layer in self._layer_owner:
                    raise LayoutError(f"regions[{index}].layer_ids",
                                      f"layer {layer} already belongs to region "
                                      f"{self.regions[self._layer_owner[layer]].name!r}")
                self._layer_owner[layer] = index
        expected = set(range(len(self._layer_owner)))
        if set(self._layer_owner) != expected:
            missing = sorted(expected - set(self._layer_owner))
            raise LayoutError("regions", f"layer ids must cover 0..{len(expected) - 1} "
                                         f"with no gap; missing {missing[:5]}")

    @property
    def num_layers(self) -> int:
        return len(self._layer_owner)

    def region(self, name: str) -> RegionSpec:
        for region in self.regions:
            if region.name == name:
                return region
        raise LayoutError("region", f"unknown region {name!r}; expected one of "
                                    f"{[r.name for r in self.regions]}")

    def region_of_layer(self, layer: int) -> RegionSpec:
        return self.regions[self._layer_owner[layer]]

    def stage_layers(self, pp_size: int, pp_rank: int) -> range:
        """Layers held by pipeline stage ``pp_rank``: a contiguous, balanced split."""
        if pp_size > self.num_layers:
            raise LayoutError("pp_size", f"{pp_size} pipeline stages for only "
                                         f"{self.num_layers} layers")
        start = pp_rank * self.num_layers // pp_size
        stop = (pp_rank + 1) * self.num_layers // pp_size
        return range(start, stop)

    def rank_shapes(self, topology: ParallelTopology) -> tuple[RankRegionShape, ...]:
        """Per-region shapes of ``topology``'s rank, in region order.

        Regions with no layer on this pipeline stage are included with an empty
        ``layer_ids`` so region indices line up across ranks.
        """
        stage = self.stage_layers(topology.pp_size, topology.pp_rank)
        shapes = []
        for region in self.regions:
            head_start, num_heads = region.heads_of(topology)
            layers = tuple(sorted(layer for layer in region.layer_ids if layer in stage))
            shapes.append(RankRegionShape(region, layers, head_start, num_heads))
        return tuple(shapes)

    def validate_topology(self, topology: ParallelTopology, field: str = "topology") -> None:
        """Raise a LayoutError naming the field if this model cannot run on ``topology``."""
        try:
            self.stage_layers(topology.pp_size, 0)
            for region in self.regions:
                region.heads_of(topology)
        except LayoutError as exc:
            raise LayoutError(f"{field}.{exc.field}", exc.reason) from None
        ranks_per_stage = topology.tp_size * topology.pcp_size
        layer_ranks = self.num_layers * ranks_per_stage
        if layer_ranks > MAX_LAYER_RANKS:
            raise LayoutError(field, f"{self.num_layers} layers x {ranks_per_stage} ranks per "
                                     f"stage (tp_size * pcp_size) = {layer_ranks} exceed "
                                     f"kvbridge's limit of {MAX_LAYER_RANKS}; use fewer ranks")
        rows = self.slice_count(topology)
        if rows > MAX_ENGINE_SLICES:
            raise LayoutError(field, f"{rows} contiguous KV slices per block index over all "
                                     f"ranks (layers x K/V x heads, x tokens under NHD) "
                                     f"exceed kvbridge's limit of {MAX_ENGINE_SLICES}; use "
                                     f"fewer ranks, or HND order")

    def slice_count(self, topology: ParallelTopology) -> int:
        """Contiguous slices of one block index over all of ``topology``'s ranks: what a
        transfer plan to it lists before coalescing (a head's K or V under HND, a token
        of it under NHD). Bounded by :data:`MAX_ENGINE_SLICES`, so planning stays cheap."""
        total = 0
        ranks_per_stage = topology.tp_size * topology.pcp_size
        for region in self.regions:
            heads = region.heads_of(topology)[1]  # the same on every rank of a region
            per_layer = region.num_kv * heads * (
                region.block_size if region.memory_order is MemoryOrder.NHD else 1)
            total += per_layer * len(region.layer_ids) * ranks_per_stage
        return total

    def fingerprint(self) -> str:
        """Layout fingerprint: changes whenever the bytes of a block could change meaning.

        Covers the model name and every region field (dtype, block size, heads,
        order, ...). It does not cover parallel sizes: those are part of a key
        namespace. Stable across processes and Python versions (sha256 of
        canonical JSON).
        """
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model,
                               "regions": [r.to_dict() for r in self.regions]}
        if self.engine_format:
            out["engine_format"] = dict(self.engine_format)
        return out

    @classmethod
    def from_dict(cls, data: object) -> KVCacheSpec:
        if not isinstance(data, dict):
            raise LayoutError("spec", f"expected a mapping, got {type(data).__name__}")
        unknown = set(data) - {"model", "regions", "engine_format"}
        if unknown:
            raise LayoutError(sorted(unknown)[0], "unknown field; expected 'model', 'regions' "
                                                  "and optionally 'engine_format'")
        if "model" not in data:
            raise LayoutError("model", "missing")
        regions = data.get("regions")
        if not isinstance(regions, list) or not regions:
            raise LayoutError("regions", "expected a non-empty list of regions")
        parsed = tuple(RegionSpec.from_dict(r, f"regions[{i}]") for i, r in enumerate(regions))
        fmt = data.get("engine_format") or {}
        if not isinstance(fmt, dict) or len(fmt) > MAX_FORMAT_KEYS:
            raise LayoutError("engine_format", f"expected a map of at most {MAX_FORMAT_KEYS} "
                                               f"names to strings")
        return cls(model=data["model"], regions=parsed,
                   engine_format=tuple((k, v) for k, v in fmt.items()))

    @classmethod
    def from_json_file(cls, path: str | Path) -> KVCacheSpec:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, /dev/zero fill
                raise LayoutError("model", f"{str(path)!r} is not a regular file")
            with open(path, "rb") as file:
                raw = file.read(MAX_SPEC_FILE_BYTES + 1)
        except OSError as exc:
            raise LayoutError("model", f"cannot read spec file {str(path)!r}: "
                                       f"{exc.strerror}") from None
        if len(raw) > MAX_SPEC_FILE_BYTES:
            raise LayoutError("model", f"{path}: larger than {MAX_SPEC_FILE_BYTES} bytes; "
                                       f"a spec file is a few KiB")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise LayoutError("model", f"{path}: not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise LayoutError("model", f"{path}: invalid JSON at line {exc.lineno}: "
                                       f"{exc.msg}") from None
        except RecursionError:
            raise LayoutError("model", f"{path}: JSON nested deeper than a spec is "
                                       f"(a map of regions)") from None
        except ValueError:  # an integer of more digits than Python converts
            raise LayoutError("model", f"{path}: a number of thousands of digits; a spec's "
                                       f"sizes are small integers") from None
        return cls.from_dict(data)
