"""vLLM KV cache groups and tensors described in kvbridge's memory model (pure; no vLLM import).

What vLLM (>= 0.32) hands a connector, per layer: one view ``(num_blocks, heads,
block_size, C)`` of a shared flat buffer (``allocate_kv_cache`` /
``create_kv_cache_views``), ``C = (head_size + head_size_v)`` elements, whose
memory order is the resolved ``kv_cache_layout``. What those bytes mean depends
on the attention backend (the *interior*, :class:`kvbridge.layouts.Interior`):

* GPU backends (FlashAttention, Triton, FlashInfer, ...) read each (head, token)
  cell as K then V (``kv.transpose(1, 2).split(head_size, -1)``): ``token_kv``;
* vLLM's CPU backend (``CPU_ATTN``) reads each head's block as its K rows then
  its V rows (``view(B, H, 2 * N, D).chunk(2, dim=2)``): ``head_kv``;
* MLA backends (``MLAAttentionSpec``: one latent of ``kv_lora_rank + rope`` per
  token, ``head_size_v == 0``, one KV head): a key-only REPLICATE region.

Memory orders (``kv_cache_layout``, ``VLLM_KV_CACHE_LAYOUT``):

=========  ===============================================================
LBHNC/HND  supported: kvbridge ``HND`` (what :func:`required_layout` asks for)
LBNHC/NHD  supported: kvbridge ``NHD`` (vLLM's view transposed, no copy; asked
           for at block sizes a backend may split into kernel blocks)
BLHNC      refused: block-outermost (every layer's page inside one block)
BLNHC      refused: block-outermost
BHLNC      refused: block-outermost, heads outside the layer
LHBNC      refused: heads outside the blocks
=========  ===============================================================

Block strides come from the tensors themselves, so padded pages (a block
stride larger than a block's bytes, as vLLM pads hybrid and MLA pages) are
described as they are. A view at kernel-block granularity (a backend kernel
block smaller than the manager block: R kernel blocks per manager block) is
regrouped into manager blocks where that is the same bytes (LBNHC, or one KV
head per rank), so block ids stay vLLM's manager ids; LBHNC with several heads
per rank, or padded kernel pages, are refused at start-up naming the settings
that avoid it (:func:`manager_block_view`). Hybrid models: one region per KV cache group;
groups alias the same bytes (layer i of each group), which the transports
register once.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.layouts import Interior, KVCacheSpec, MemoryOrder, RegionLayout, RegionSpec
from kvbridge.layouts.spec import DTYPE_BYTES


class AdapterConfigError(ValueError):
    """A vLLM setting kvbridge cannot serve; ``field`` names the setting."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


#: vLLM ``kv_cache_layout`` names kvbridge serves, and their kvbridge memory order.
SUPPORTED_LAYOUTS = {"LBHNC": MemoryOrder.HND, "LBNHC": MemoryOrder.NHD}
#: vLLM's legacy aliases.
LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}
#: Layouts kvbridge refuses, and why (the message names the setting to change).
REFUSED_LAYOUTS = {
    "BLHNC": "block-outermost: a block holds every layer's page, so one layer's blocks are "
             "not a contiguous tensor kvbridge can register per layer",
    "BLNHC": "block-outermost: a block holds every layer's page, so one layer's blocks are "
             "not a contiguous tensor kvbridge can register per layer",
    "BHLNC": "block-outermost with heads outside the layer: one layer's block is not "
             "contiguous",
    "LHBNC": "heads outside the blocks: one layer's block is not contiguous",
}
#: What kvbridge asks vLLM for (``get_required_kvcache_layout``) for head-split models:
#: a head's slice of a block is contiguous, as vLLM's NixlConnector asks.
REQUIRED_LAYOUT = "LBHNC"
#: Manager block sizes every vLLM GPU attention backend runs as they are (FlashInfer
#: and TRT-LLM kernels take 16, 32 or 64 tokens; FlashAttention and Triton any multiple
#: of 16); another size may be split into kernel blocks, whose head-major (LBHNC) pages
#: kvbridge cannot regroup into one manager page (:func:`manager_block_view`).
SPLIT_FREE_BLOCK_SIZES = (16, 32, 64)
#: What kvbridge asks for where a split may happen: the same bytes at any split.
SPLIT_SAFE_LAYOUT = "LBNHC"


def required_layout(block_size: object, use_mla: bool) -> str | None:
    """The ``kv_cache_layout`` kvbridge asks vLLM for (``get_required_kvcache_layout``).

    None for MLA (one head: every layout is the same bytes). LBHNC for head-split
    models, whose head slices are then one run for heterogeneous TP, unless the
    manager block size may be split into kernel blocks (a size not in
    ``SPLIT_FREE_BLOCK_SIZES`` above 16): then LBNHC, which kvbridge moves at any
    split (equal TP still coalesces to one descriptor per layer; heterogeneous TP
    costs a descriptor per token), instead of refusing at start-up.
    """
    if use_mla:
        return None
    if isinstance(block_size, int) and block_size > 16 and \
            block_size not in SPLIT_FREE_BLOCK_SIZES:
        return SPLIT_SAFE_LAYOUT
    return REQUIRED_LAYOUT


def memory_order_of(layout_name: str | None, num_kv_heads_local: int = 2) -> MemoryOrder:
    """kvbridge's memory order for a resolved vLLM ``kv_cache_layout``; refuses the rest.

    With one KV head per rank (MLA) LBHNC and LBNHC are the same bytes: HND.
    """
    name = LAYOUT_ALIASES.get(str(layout_name), str(layout_name))
    if name in SUPPORTED_LAYOUTS:
        return MemoryOrder.HND if num_kv_heads_local == 1 else SUPPORTED_LAYOUTS[name]
    why = REFUSED_LAYOUTS.get(name, "unknown to kvbridge")
    raise AdapterConfigError(
        "kv_cache_layout",
        f"vLLM resolved KV cache layout {name} ({why}); kvbridge serves "
        f"{'/'.join(SUPPORTED_LAYOUTS)}: set VLLM_KV_CACHE_LAYOUT={REQUIRED_LAYOUT} "
        f"(or --kv-cache-layout / cache_config.kv_cache_layout {REQUIRED_LAYOUT})")


class GroupKind(str, enum.Enum):
    FULL = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    UNSUPPORTED = "unsupported"


#: vLLM spec classes that hold no attention KV (state, not pages of tokens): refused by name.
STATE_KINDS = {
    "MambaSpec": "Mamba / linear-attention state",
}


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
    page_bytes: int = 0  # vLLM's (possibly padded) page size per layer; 0 = not known


#: vLLM cache dtype names -> kvbridge's (torch) dtype names. The bytes are fp8 stored as
#: uint8; the per-tensor scales live in the layers, outside the cache.
KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
#: vLLM cache dtypes whose bytes are not plain elements of the KV (scales or codebooks inside
#: the cache, packed nibbles, per-token-head scales): refused by name.
QUANTIZED_PREFIXES = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head",
                      "nvfp4", "turboquant_", "ultraquant_", "fp8_ds_mla")


def kvbridge_dtype(torch_dtype_name: str, cache_dtype: str | None) -> str:
    """The dtype name kvbridge uses for a vLLM cache; refuses what it does not know."""
    if cache_dtype not in ("auto", None, ""):
        name = KV_CACHE_DTYPES.get(str(cache_dtype))
        if name is None:
            if str(cache_dtype).startswith(QUANTIZED_PREFIXES):
                raise AdapterConfigError(
                    "kv_cache_dtype", f"{cache_dtype!r} is a scaled/quantized KV cache format "
                                      f"(scales or packed values in the cache) that kvbridge "
                                      f"does not describe; use 'auto' or one of "
                                      f"{sorted(KV_CACHE_DTYPES)}")
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
class VllmFormat:
    """Which of vLLM's KV formats an engine runs: what two engines compare by name."""

    device: str  # vLLM platform device type: "cpu", "cuda", ...
    kv_cache_layout: str  # resolved layout name (LBHNC, LBNHC, ...)
    cache_dtype: str  # vLLM's kv_cache_dtype ("auto", "fp8", ...)
    attn_backend: str = "auto"  # the configured attention backend, or "auto"

    @property
    def interior(self) -> Interior:
        """Where K and V sit in a non-MLA block: vLLM's CPU backend or a GPU backend."""
        return Interior.HEAD_KV if self.device == "cpu" else Interior.TOKEN_KV

    def engine_format(self) -> tuple[tuple[str, str], ...]:
        return (("engine", "vllm"), ("device", self.device),
                ("kv_cache_layout", LAYOUT_ALIASES.get(self.kv_cache_layout,
                                                       self.kv_cache_layout)),
                ("cache_dtype", self.cache_dtype or "auto"),
                ("attn_backend", self.attn_backend or "auto"))


@dataclass(frozen=True)
class AdapterSpec:
    """The kvbridge spec of a vLLM engine plus the name <-> layer id mapping."""

    spec: KVCacheSpec
    fmt: VllmFormat
    layer_ids: Mapping[str, int]  # vLLM layer name -> kvbridge layer id
    group_of_region: tuple[int, ...]  # region index -> vLLM group index

    def layer_id(self, name: str) -> int | None:
        return self.layer_ids.get(name)


def build_spec(model: str, groups: Sequence[GroupInfo], fmt: VllmFormat,
               tp_size: int = 1,
               number_of: Callable[[str], int] = layer_number) -> AdapterSpec:
    """One kvbridge region per vLLM group; layer ids ordered by vLLM's layer index."""
    if not groups:
        raise AdapterConfigError("kv_cache_config", "no KV cache groups")
    for group in groups:
        if group.kind is GroupKind.UNSUPPORTED:
            what = STATE_KINDS.get(group.type_name, f"{group.type_name} layers")
            raise AdapterConfigError(
                f"kv_cache_config.kv_cache_groups[{group.index}]",
                f"{what} ({group.type_name}, layers {list(group.layer_names[:2])}...) is not "
                f"supported by kvbridge's vLLM adapter: it serves full attention, sliding "
                f"window and MLA groups; run this model with vLLM's own connector")
    names = sorted({n for g in groups for n in g.layer_names}, key=lambda n: (number_of(n), n))
    layer_ids = {name: index for index, name in enumerate(names)}
    regions = []
    for group in groups:
        ids = tuple(sorted(layer_ids[n] for n in group.layer_names))
        mla = group.kind is GroupKind.MLA
        local_heads = 1 if mla else max(1, group.num_kv_heads // max(1, tp_size))
        regions.append(RegionSpec(
            name=f"g{group.index}-{group.kind.value}",
            layout=RegionLayout.REPLICATE if mla else RegionLayout.SPLIT,
            layer_ids=ids,
            block_size=group.block_size,
            num_kv_heads=group.num_kv_heads,
            head_dim=group.head_size,
            dtype=group.dtype,
            key_only=mla,
            memory_order=memory_order_of(fmt.kv_cache_layout, local_heads),
            token_sharded=group.kind is not GroupKind.SLIDING_WINDOW,
            interior=Interior.KV_OUTER if mla else fmt.interior,
        ))
    spec = KVCacheSpec(model=model, regions=tuple(regions), engine_format=fmt.engine_format())
    return AdapterSpec(spec, fmt, layer_ids, tuple(g.index for g in groups))


def manager_block_view(tensor: Any, ratio: int, region: RegionSpec, layer_name: str,
                       kv_cache_layout: str) -> Any:
    """vLLM's kernel-block view ``(B * R, H, k, C)`` as manager blocks ``(B, H, R * k, C)``.

    vLLM splits manager block ``b`` into kernel blocks ``b*R .. b*R+R-1`` (the
    block table the attention reads, and vLLM's NixlConnector, expand ids the
    same way). Where those R kernel pages are adjacent and each is token-major
    (NHD, or one KV head per rank: MLA, or HND with one local head), their bytes
    are exactly one manager page of ``R * k`` tokens in the same order, whatever
    R is: this returns that view (no copy), so block ids, transfer params and the
    handshake stay at manager granularity and two engines with different kernel
    splits of the same manager block exchange byte for byte. Under HND with
    several heads per rank a manager block is R head-major kernel pages (head
    h's tokens are not one run), and with padded kernel pages the R pages are
    not adjacent: refused naming the settings that avoid it.
    """
    blocks, heads, tokens, content = (int(x) for x in tensor.shape)
    stride = tuple(int(x) for x in tensor.stride())
    manager_tokens = tokens * ratio
    where = (f"layer {layer_name}: vLLM split each {manager_tokens}-token block into {ratio} "
             f"kernel blocks of {tokens} tokens (the attention backend's kernel block size)")
    token_major = heads == 1 or region.memory_order is MemoryOrder.NHD
    if not token_major:
        raise AdapterConfigError(
            "block_size", f"{where}; under {kv_cache_layout} with {heads} KV heads per rank a "
                          f"manager block is {ratio} head-major kernel pages, not one "
                          f"{kv_cache_layout} page kvbridge can describe: set "
                          f"VLLM_KV_CACHE_LAYOUT=LBNHC (the same bytes at any split) or run "
                          f"with --block-size {tokens}")
    token_stride = content if heads == 1 else heads * content
    page = tokens * token_stride
    dense = stride[3] == 1 and (tokens == 1 or stride[2] == token_stride) and stride[0] == page
    if not dense:
        raise AdapterConfigError(
            "block_size", f"{where}; its kernel pages are not adjacent (strides {stride} for "
                          f"shape {tuple(tensor.shape)}, padded pages), so a manager block is "
                          f"not one run of bytes: run with --block-size {tokens}")
    return tensor.as_strided((blocks // ratio, heads, manager_tokens, content),
                             (page * ratio, stride[1], token_stride, 1))


def kvbridge_view(tensor: Any, region: RegionSpec, expected_shape: Sequence[int],
                  layer_name: str, kv_cache_layout: str, manager_blocks: int | None = None,
                  ) -> Any:
    """A view of a vLLM layer tensor with kvbridge's per-layer shape; no copy.

    ``tensor`` is vLLM's ``(num_blocks, heads, block_size, C)`` view. Checks its
    strides are the ones ``kv_cache_layout`` promises (a head's cells, a token's
    row, the content contiguous; any block stride at least a block's bytes) and
    raises :class:`AdapterConfigError` naming ``kv_cache_layout`` (or
    ``block_size`` for kernel-block views kvbridge cannot regroup) otherwise.
    A view at kernel-block granularity (``manager_blocks * R`` blocks) is first
    regrouped into manager blocks (:func:`manager_block_view`). Checked at
    start-up, in ``register_kv_caches``.
    """
    shape = tuple(int(x) for x in tensor.shape)
    expected = tuple(int(x) for x in expected_shape)
    if len(shape) != 4:
        raise AdapterConfigError("kv_cache_layout", f"layer {layer_name}: expected vLLM's 4-D "
                                                    f"(blocks, heads, tokens, content) view, "
                                                    f"got shape {shape}")
    blocks, heads, tokens, content = shape
    if manager_blocks is not None and blocks != manager_blocks and blocks % manager_blocks == 0:
        tensor = manager_block_view(tensor, blocks // manager_blocks, region, layer_name,
                                    kv_cache_layout)
        shape = tuple(int(x) for x in tensor.shape)
        blocks, heads, tokens, content = shape
    stride = tuple(int(x) for x in tensor.stride())
    order = region.memory_order
    want_token = content
    want_head = tokens * content if order is MemoryOrder.HND else content
    if order is MemoryOrder.NHD:
        want_token = heads * content
    bad = (stride[3] != 1 or (tokens > 1 and stride[2] != want_token)
           or (heads > 1 and stride[1] != want_head)
           or stride[0] < heads * tokens * content)
    if bad:
        raise AdapterConfigError(
            "kv_cache_layout", f"layer {layer_name}: KV view strides {stride} for shape "
                               f"{shape} are not vLLM's {kv_cache_layout} with dense pages; "
                               f"set VLLM_KV_CACHE_LAYOUT={REQUIRED_LAYOUT}")
    if region.key_only:  # MLA: (blocks, 1, tokens, latent) -> (blocks, 1, 1, tokens, latent)
        view = tensor.unsqueeze(1)
    elif order is MemoryOrder.NHD:  # vLLM's logical (B, H, N, C) -> kvbridge's (B, N, H, C)
        view = tensor.transpose(1, 2)
    else:
        view = tensor
    got = tuple(int(x) for x in view.shape)
    if got[1:] != expected[1:]:
        raise AdapterConfigError("kv_cache_layout", f"layer {layer_name}: expected per-block "
                                                    f"shape {expected[1:]} for region "
                                                    f"{region.name!r}, vLLM's view gives "
                                                    f"{got[1:]}")
    return view
