"""vLLM KV cache groups and tensors described in kvbridge's memory model (pure; no vLLM import).

kvbridge's model (:mod:`kvbridge.layouts.spec`): per layer one tensor of shape
``(num_blocks, num_kv, *block_shape)``, ``block_shape`` = ``(heads, tokens,
head_dim)`` (HND) or ``(tokens, heads, head_dim)`` (NHD).

vLLM's CPU attention backend (0.32) stores a layer as ``(num_blocks,
num_kv_heads, block_size, 2 * head_size)``: inside a block, for each head, the
head's K rows (``block_size x head_size``) then its V rows. K and V sit
*inside* the head axis, which kvbridge's model (K/V outside the heads) cannot
say directly. Byte for byte it is exactly an HND **key-only** region whose
``head_dim`` is ``2 * head_size``: one block of one head is one contiguous run
of ``block_size * 2 * head_size`` elements in both descriptions, so head
slicing for heterogeneous TP, block addressing and every byte range a plan
computes are the same. What that description cannot express is a token
slice of a head (DCP token sharding would need K rows and V rows of the same
token, which are not adjacent here): the adapter refuses DCP > 1 with this
layout at start-up. The honest fix belongs in the layouts layer (a memory
order with K/V inside the head axis, ``HKND``); see the integration README.

Tensors that already follow kvbridge's model, ``(num_blocks, 2, heads,
tokens, head_dim)``, are described as they are (``NATIVE_HND``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.layouts import KVCacheSpec, MemoryOrder, RegionLayout, RegionSpec
from kvbridge.layouts.spec import DTYPE_BYTES


class AdapterConfigError(ValueError):
    """A vLLM setting kvbridge cannot serve; ``field`` names the setting."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class TensorLayout(str, enum.Enum):
    """How one vLLM layer tensor sits in memory."""

    CPU_PACKED = "cpu_packed"  # (num_blocks, heads, block_size, 2 * head_size)
    NATIVE_HND = "native_hnd"  # (num_blocks, 2, heads, block_size, head_size)


class GroupKind(str, enum.Enum):
    FULL = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV cache group, in plain values (built by the adapter from vLLM's config)."""

    index: int
    kind: GroupKind
    type_name: str  # vLLM's spec class name, for messages
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int  # global (all TP ranks)
    head_size: int
    dtype: str  # torch name without "torch."


#: vLLM cache dtype names -> kvbridge's (torch) dtype names.
KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def kvbridge_dtype(torch_dtype_name: str, cache_dtype: str) -> str:
    """The dtype name kvbridge uses for a vLLM cache; refuses what it does not know."""
    if cache_dtype not in ("auto", None, ""):
        name = KV_CACHE_DTYPES.get(cache_dtype)
        if name is None:
            raise AdapterConfigError("kv_cache_dtype", f"kvbridge does not know KV cache dtype "
                                                       f"{cache_dtype!r}; expected 'auto' or one "
                                                       f"of {sorted(KV_CACHE_DTYPES)}")
        return name
    name = torch_dtype_name.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise AdapterConfigError("kv_cache_dtype", f"kvbridge does not know KV dtype {name!r}; "
                                                   f"expected one of {sorted(DTYPE_BYTES)}")
    return name


_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_number(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    match = _LAYER_NUMBER.search(name)
    if match is None:
        raise AdapterConfigError("kv_cache_config", f"cannot find a layer index in layer "
                                                    f"name {name!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class AdapterSpec:
    """The kvbridge spec of a vLLM engine plus the name <-> layer id mapping."""

    spec: KVCacheSpec
    layout: TensorLayout
    layer_ids: Mapping[str, int]  # vLLM layer name -> kvbridge layer id
    group_of_region: tuple[int, ...]  # region index -> vLLM group index

    def layer_id(self, name: str) -> int | None:
        return self.layer_ids.get(name)


def build_spec(model: str, groups: Sequence[GroupInfo], layout: TensorLayout,
               dcp_size: int = 1,
               number_of: Callable[[str], int] = layer_number) -> AdapterSpec:
    """One kvbridge region per vLLM group; layer ids ordered by vLLM's layer index."""
    if not groups:
        raise AdapterConfigError("kv_cache_config", "no KV cache groups")
    for group in groups:
        if group.kind is GroupKind.UNSUPPORTED:
            raise AdapterConfigError(
                f"kv_cache_config.kv_cache_groups[{group.index}]",
                f"{group.type_name} layers are not supported by kvbridge's vLLM adapter "
                f"(full attention, MLA and sliding window are)")
    if layout is TensorLayout.CPU_PACKED and dcp_size > 1:
        raise AdapterConfigError(
            "decode_context_parallel_size",
            f"{dcp_size} > 1 shards tokens across ranks, which the CPU backend's packed KV "
            f"layout (K and V inside each head) does not allow kvbridge to address; use 1")
    names = sorted({n for g in groups for n in g.layer_names}, key=lambda n: (number_of(n), n))
    layer_ids = {name: index for index, name in enumerate(names)}
    regions = []
    for group in groups:
        ids = tuple(sorted(layer_ids[n] for n in group.layer_names))
        key_only = group.kind is GroupKind.MLA
        head_dim = group.head_size
        if layout is TensorLayout.CPU_PACKED and not key_only:
            key_only, head_dim = True, 2 * group.head_size  # see the module docstring
        regions.append(RegionSpec(
            name=f"g{group.index}-{group.kind.value}",
            layout=RegionLayout.REPLICATE if group.kind is GroupKind.MLA else RegionLayout.SPLIT,
            layer_ids=ids,
            block_size=group.block_size,
            num_kv_heads=group.num_kv_heads,
            head_dim=head_dim,
            dtype=group.dtype,
            key_only=key_only,
            memory_order=MemoryOrder.HND,
            token_sharded=group.kind is not GroupKind.SLIDING_WINDOW,
        ))
    spec = KVCacheSpec(model=model, regions=tuple(regions))
    return AdapterSpec(spec, layout, layer_ids, tuple(g.index for g in groups))


def kvbridge_view(tensor: Any, layout: TensorLayout, expected_shape: Sequence[int],
                  layer_name: str) -> Any:
    """A view of a vLLM layer tensor with kvbridge's per-layer shape; no copy.

    Raises :class:`AdapterConfigError` naming ``kv_cache_layout`` when the
    tensor is not what the layout promises (checked at start-up, in
    ``register_kv_caches``).
    """
    shape = tuple(tensor.shape)
    expected = tuple(expected_shape)
    if not tensor.is_contiguous():
        raise AdapterConfigError("kv_cache_layout", f"layer {layer_name}: KV tensor is not "
                                                    f"contiguous (strides {tensor.stride()})")
    if layout is TensorLayout.CPU_PACKED:
        num_blocks, heads, tokens, packed = (expected[0], expected[2], expected[3], expected[4])
        want = (num_blocks, heads, tokens, packed)
        if shape != want:
            raise AdapterConfigError("kv_cache_layout", f"layer {layer_name}: expected the CPU "
                                                        f"backend's {want}, got {shape}")
        return tensor.view(num_blocks, 1, heads, tokens, packed)
    if shape != expected:
        raise AdapterConfigError("kv_cache_layout", f"layer {layer_name}: expected {expected} "
                                                    f"(num_blocks, kv, heads, tokens, head_dim), "
                                                    f"got {shape}")
    return tensor
