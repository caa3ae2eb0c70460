"""What the adapter derives from vLLM's configuration, once, at start-up.

Owns: vLLM's ``KVCacheConfig`` groups -> :class:`GroupInfo` (and the refusals of
groups kvbridge cannot describe: packed pages, KV quantization with scales,
replica groups), the format vLLM resolved (platform, ``kv_cache_layout``, cache
dtype, attention backend), parallel sizes -> :class:`ParallelTopology` (refusing
PCP, DCP interleave > 1, a host KV buffer on a GPU), ``kv_transfer_config`` ->
:class:`ConnectorConfig`, all in one :class:`EngineDescription`; and finding the
named kvbridge connector (:func:`_resolve`, with fallbacks for installs whose
entry points are missing). May not touch: requests, tensors, or the connector
halves once built (:mod:`kvbridge.integrations.vllm.connector`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.connectors import ConnectorConfig
from kvbridge.connectors import registry as kvb_registry
from kvbridge.integrations.vllm.layout import (
    REQUIRED_LAYOUT,
    AdapterConfigError,
    AdapterSpec,
    GroupInfo,
    GroupKind,
    VllmFormat,
    build_spec,
    kvbridge_dtype,
    required_layout,
)
from kvbridge.layouts import ParallelTopology

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Adapter-only key of ``kv_connector_extra_config``.
CONNECTOR_KEY = "kvbridge_connector"

#: kvbridge connectors whose two halves share memory: one process, unless the
#: offloading connector's CPU slots are file-backed (``shm_dir``).
SAME_PROCESS_CONNECTORS = frozenset({"offloading"})
#: kvbridge connectors that take transfer params from requests and count the ones they
#: refuse (``refused_params*`` in their scheduler stats): only these are asked for
#: them every step (the others' ``get_stats`` walk tiers or pending lookups).
PARAMS_CONNECTORS = frozenset({"nixl"})


def _group_info(index: int, group: Any, total_kv_heads: int, cache_dtype: str) -> GroupInfo:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    type_name = type(spec).__name__
    if isinstance(spec, MLAAttentionSpec):
        kind = GroupKind.MLA
    elif isinstance(spec, SlidingWindowSpec):
        kind = GroupKind.SLIDING_WINDOW
    elif isinstance(spec, FullAttentionSpec):
        kind = GroupKind.FULL
    else:
        kind = GroupKind.UNSUPPORTED
    if kind is GroupKind.UNSUPPORTED:
        return GroupInfo(index, kind, type_name, tuple(group.layer_names), 1, 1, 1, "float32")
    if not getattr(group, "enable_kv_transfer", True):
        # vLLM 0.33: an ephemeral replica group vLLM rebuilds from its source after a load.
        raise AdapterConfigError(f"kv_cache_config.kv_cache_groups[{index}]",
                                 f"{type_name} group has enable_kv_transfer=False (a replica "
                                 f"vLLM rebuilds after loads); kvbridge's adapter transfers "
                                 f"every group and does not skip one yet")
    where = f"kv_cache_config.kv_cache_groups[{index}]"
    packed = [f"{name}={getattr(spec, name)!r}" for name, plain in (
        ("num_head_slots", None), ("state_content_bytes", None), ("tokens_per_state", 1))
        if getattr(spec, name, plain) != plain]
    if packed:
        raise AdapterConfigError(where, f"{type_name} has a packed page ({', '.join(packed)}): "
                                        f"not plain K/V cells kvbridge can describe")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in ("NONE", "FP8_PER_TENSOR"):
        raise AdapterConfigError("kv_cache_dtype", f"{type_name} uses KV quantization {quant} "
                                                   f"(scales or packed values in the cache), "
                                                   f"which kvbridge does not describe; use "
                                                   f"'auto' or a plain fp8 kv_cache_dtype")
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    if kind is GroupKind.MLA:
        # MLAAttentionSpec: one latent (kv_lora_rank + rope) per token, no V (head_size_v 0).
        head_size_v = spec.head_size if head_size_v in (0, None) else head_size_v
    if head_size_v not in (None, spec.head_size):
        raise AdapterConfigError(f"kv_cache_config.kv_cache_groups[{index}]",
                                 f"K head size {spec.head_size} != V head size {head_size_v}; "
                                 f"kvbridge regions have one head_dim")
    heads = 1 if kind is GroupKind.MLA else total_kv_heads
    return GroupInfo(index, kind, type_name, tuple(group.layer_names), int(spec.block_size),
                     int(heads), int(spec.head_size),
                     kvbridge_dtype(str(spec.dtype), cache_dtype),
                     int(getattr(spec, "page_size_bytes", 0) or 0))


def _vllm_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmFormat:
    """The format vLLM resolved: platform, ``kv_cache_layout`` (the engine core resolves it
    before the connector exists; it may have dropped kvbridge's request), cache dtype."""
    from vllm.platforms import current_platform

    layout = (getattr(kv_cache_config, "kv_cache_layout", None)
              or getattr(vllm_config.cache_config, "kv_cache_layout", None))
    if layout is None:
        # Not resolved yet (an older vLLM, or a profiling run): what vLLM will use for
        # kvbridge's request; register_kv_caches checks the tensors' strides against it.
        layout = required_layout(vllm_config.cache_config.block_size,
                                 bool(getattr(vllm_config.model_config, "use_mla", False))
                                 ) or REQUIRED_LAYOUT
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend_name = getattr(backend, "name", None) or (str(backend) if backend else "auto")
    return VllmFormat(device=str(current_platform.device_type), kv_cache_layout=str(layout),
                      cache_dtype=str(vllm_config.cache_config.cache_dtype or "auto"),
                      attn_backend=backend_name)


@dataclass(frozen=True)
class EngineDescription:
    """Everything the adapter derives from vLLM's configuration, once, at start-up."""

    adapter: AdapterSpec
    topology: ParallelTopology
    config: ConnectorConfig
    num_blocks: int

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  connector: str) -> EngineDescription:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        parallel = vllm_config.parallel_config
        dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
        if pcp > 1:
            raise AdapterConfigError("prefill_context_parallel_size",
                                     f"{pcp} > 1 is not supported by kvbridge's vLLM adapter; "
                                     f"use 1")
        interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
        if dcp > 1 and interleave != 1:
            raise AdapterConfigError(
                "cp_kv_cache_interleave_size",
                f"{interleave} places runs of {interleave} tokens on each DCP rank; kvbridge's "
                f"token sharding is token t on DCP rank t % dcp_size (interleave 1): use 1")
        from vllm.platforms import current_platform

        if (current_platform.device_type != "cpu"
                and str(getattr(transfer, "kv_buffer_device", "")) == "cpu"):
            raise AdapterConfigError(
                "kv_buffer_device",
                "'cpu' stages KV in a host buffer; kvbridge's connectors register the "
                "device KV cache itself: leave kv_buffer_device at the device (e.g. 'cuda')")
        try:
            topology = ParallelTopology(tp_size=int(parallel.tensor_parallel_size),
                                        pp_size=int(parallel.pipeline_parallel_size),
                                        dcp_size=dcp)
        except Exception as exc:
            raise AdapterConfigError("tensor_parallel_size", str(exc)) from None
        model_config = vllm_config.model_config
        total_kv_heads = int(model_config.get_total_num_kv_heads())
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        groups = [_group_info(i, g, total_kv_heads, cache_dtype)
                  for i, g in enumerate(kv_cache_config.kv_cache_groups)]
        fmt = _vllm_format(vllm_config, kv_cache_config)
        adapter = build_spec(str(model_config.model), groups, fmt,
                             int(parallel.tensor_parallel_size))
        try:
            adapter.spec.validate_topology(topology)
        except Exception as exc:
            raise AdapterConfigError("tensor_parallel_size", str(exc)) from None
        extra = dict(transfer.kv_connector_extra_config or {})
        extra.pop(CONNECTOR_KEY, None)
        config = ConnectorConfig.from_dict({
            "kv_connector": connector,
            "kv_role": transfer.kv_role,
            "engine_id": transfer.engine_id,
            "kv_connector_extra_config": extra,
        })
        return cls(adapter, topology, config, int(kv_cache_config.num_blocks))



def _resolve(config: ConnectorConfig) -> Any:
    """The connector's plugin: kvbridge's own are known to the registry in code, so an
    install without entry points (a source tree) finds them too."""
    return kvb_registry.resolve(config)
