"""kvbridge's front door as vLLM loads it: a logits processor that changes no logits
and whose ``validate_params`` refuses bad ``kv_transfer_params`` with HTTP 400.

vLLM (0.32) has one supported per-request hook that runs in the API-server
process before a request reaches the engine: a custom logits processor's
``validate_params(sampling_params)`` classmethod, called at admission by
``InputProcessor._validate_params`` (``vllm/v1/engine/input_processor.py``); a
``ValueError`` from it becomes ``VLLMValidationError``, answered with HTTP 400.
The request's ``kv_transfer_params`` are in ``sampling_params.extra_args``.
The check itself is :func:`kvbridge.integrations.vllm.front_door.check_sampling_params`.

Enable it on every engine that takes ``kv_transfer_params`` from clients::

    --logits-processors kvbridge.integrations.vllm.params_gate:KVBridgeParamsGate

(``KVBridgeParamsGateV2`` under vLLM's V2 model runner, ``VLLM_USE_V2_MODEL_RUNNER=1``,
which refuses V1-interface processors at start-up.) It is not installed as a
``vllm.logits_processors`` entry point: vLLM loads those into every engine of
the environment, and the V2 runner refuses to start with a V1-interface one.

The processor's own part in sampling is nothing: ``apply`` returns the logits
unchanged and it declares itself argmax-invariant (V1: greedy requests skip
it) or declines every request (V2).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kvbridge.integrations.vllm.front_door import check_sampling_params

__all__ = ["KVBridgeParamsGate", "KVBridgeParamsGateV2"]


class KVBridgeParamsGate(LogitsProcessor):
    """vLLM's V1 model runner: ``--logits-processors kvbridge.integrations.vllm.params_gate:KVBridgeParamsGate``."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_sampling_params(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Nothing to keep: the gate acts at admission only."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """No per-request state."""


try:  # vLLM's V2 model runner interface (import-light by vLLM's design)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as _V2LogitsProcessor,
    )
except ImportError:  # a vLLM without the V2 runner: the V1 gate is all there is
    _V2LogitsProcessor = None

if _V2LogitsProcessor is not None:

    class KVBridgeParamsGateV2(_V2LogitsProcessor):
        """vLLM's V2 model runner: the same admission check, declining every request."""

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            check_sampling_params(sampling_params)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            return False

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            return logits
