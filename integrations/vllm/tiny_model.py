"""Build a tiny Llama checkpoint locally, for tests that run a real vLLM engine.

No hub is reachable here (and none is needed): the weights are seeded random
numbers saved with ``transformers``' ``save_pretrained`` and the tokenizer is a
byte-level BPE trained on a small generated corpus with the ``tokenizers``
library. The same seed gives the same model, so token ids produced by two
engines serving it can be compared exactly.

Shape choices: 2 layers, 4 query heads, 2 KV heads (GQA, so KV-head slicing is
exercised), head_dim 64 (a size vLLM's CPU attention supports), float32
weights (no bf16 rounding between a colocated and a disaggregated run).

Two more kinds for vLLM's other KV cache formats (``--kind``):

- ``mla``: a DeepSeek-V2-style MLA model (2 dense layers, ``kv_lora_rank``
  512 + rope 64 = the 576-wide latent vLLM's CPU MLA kernel is built for),
  float16 weights (vLLM CPU's MLA backend wants 16-bit weights; bf16 kernels
  die with an illegal instruction on this project's machines);
- ``hybrid``: a Gemma-3-style model whose layers alternate sliding-window
  (window 64 tokens) and full attention, so vLLM's hybrid allocator makes two
  KV cache groups over shared bytes; float32 weights.

Run ``python -m kvbridge.integrations.vllm.tiny_model [--kind K] OUT_DIR`` (inside
the vLLM venv, where ``transformers`` and ``tokenizers`` are installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: Written next to the checkpoint; a rebuild is skipped when it matches.
RECIPE_FILE = "kvbridge_tiny_recipe.json"


@dataclass(frozen=True)
class TinyLlamaRecipe:
    """Everything that determines the checkpoint's bytes."""

    kind: str = "llama"  # "llama", "mla" (DeepSeek-V2 style) or "hybrid" (Gemma-3 style)
    seed: int = 1234
    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    init_std: float = 0.08  # large enough that greedy outputs depend on the whole prompt
    sliding_window: int = 64  # hybrid only: tokens seen by the sliding-window layers
    mla_nope_dim: int = 64  # mla only: qk_nope_head_dim and v_head_dim

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_WORDS = (
    'the', 'a', 'an', 'of', 'to', 'in', 'for', 'on', 'with', 'at', 'by', 'from', 'cache',
    'block', 'token', 'layer', 'head', 'prefill', 'decode', 'transfer', 'memory', 'store',
    'load', 'save', 'producer', 'consumer', 'request', 'engine', 'model', 'router', 'page',
    'key', 'value', 'attention', 'batch', 'queue', 'lease', 'notify', 'read', 'write',
    'remote', 'local', 'rank', 'shard', 'group', 'fast', 'slow', 'small', 'large', 'first',
    'last', 'next', 'open', 'close', 'start', 'stop', 'send', 'receive', 'copy', 'move',
)


def _corpus(seed: int, num_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ","]))
    return lines


def build_tokenizer(recipe: TinyLlamaRecipe, out_dir: Path) -> int:
    """Train a byte-level BPE and save it as a fast tokenizer; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(recipe.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=recipe.max_position_embeddings,
    )
    fast.save_pretrained(str(out_dir))
    return int(tok.get_vocab_size())


#: The recipes of the three kinds (``--kind``).
RECIPES = {
    "llama": TinyLlamaRecipe(),
    "mla": TinyLlamaRecipe(kind="mla", num_heads=4, num_kv_heads=4, init_std=0.05),
    "hybrid": TinyLlamaRecipe(kind="hybrid", num_layers=4, num_kv_heads=1),
}


def _config(recipe: TinyLlamaRecipe, vocab_size: int) -> tuple[object, str]:
    """The transformers config and weight dtype of one recipe."""
    from transformers import DeepseekV2Config, Gemma3TextConfig, LlamaConfig

    common = dict(vocab_size=vocab_size, hidden_size=recipe.hidden_size,
                  intermediate_size=recipe.intermediate_size,
                  num_hidden_layers=recipe.num_layers,
                  num_attention_heads=recipe.num_heads,
                  num_key_value_heads=recipe.num_kv_heads,
                  max_position_embeddings=recipe.max_position_embeddings,
                  initializer_range=recipe.init_std, bos_token_id=0, eos_token_id=1,
                  pad_token_id=2, tie_word_embeddings=False)
    if recipe.kind == "mla":
        # Dense MLPs (first_k_dense_replace = all layers); no q LoRA; latent 512 + rope 64.
        return DeepseekV2Config(**common, kv_lora_rank=512, q_lora_rank=None,
                                qk_rope_head_dim=64, qk_nope_head_dim=recipe.mla_nope_dim,
                                v_head_dim=recipe.mla_nope_dim,
                                first_k_dense_replace=recipe.num_layers, n_routed_experts=4,
                                n_shared_experts=1, num_experts_per_tok=2,
                                moe_intermediate_size=64, torch_dtype="float16"), "float16"
    if recipe.kind == "hybrid":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(recipe.num_layers)]
        return Gemma3TextConfig(**common, head_dim=recipe.head_dim,
                                query_pre_attn_scalar=recipe.head_dim,
                                sliding_window=recipe.sliding_window, layer_types=types,
                                torch_dtype="float32"), "float32"
    if recipe.kind != "llama":
        raise ValueError(f"kind: expected one of {sorted(RECIPES)}, got {recipe.kind!r}")
    return LlamaConfig(**common, head_dim=recipe.head_dim, torch_dtype="float32"), "float32"


def build_model(recipe: TinyLlamaRecipe, out_dir: Path, vocab_size: int) -> None:
    """Seeded random weights, saved as safetensors with a config.json."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if recipe.kind != "llama":
        config, dtype = _config(recipe, vocab_size)
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config)
        _randomize(model, recipe)
        model.to(getattr(torch, dtype)).save_pretrained(str(out_dir), safe_serialization=True)
        return
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        initializer_range=recipe.init_std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    _randomize(model, recipe)
    model.to(torch.float32).save_pretrained(str(out_dir), safe_serialization=True)


def _randomize(model: object, recipe: TinyLlamaRecipe) -> None:
    import torch

    with torch.no_grad():
        generator = torch.Generator().manual_seed(recipe.seed)
        for _name, param in sorted(model.named_parameters()):  # type: ignore[attr-defined]
            if param.dim() == 1:  # norms: keep them near one
                param.copy_(1.0 + 0.01 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(recipe.init_std * torch.randn(param.shape, generator=generator))


def ensure_tiny_llama(out_dir: Path, recipe: TinyLlamaRecipe | None = None) -> Path:
    """Build the checkpoint in ``out_dir`` unless the same recipe is already there."""
    recipe = recipe or TinyLlamaRecipe()
    out_dir = Path(out_dir)
    marker = out_dir / RECIPE_FILE
    wanted = json.dumps(recipe.to_dict(), sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted and (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(recipe, out_dir)
    build_model(recipe, out_dir, vocab)
    marker.write_text(wanted)
    logger.info("built tiny %s (%d layers, vocab %d) in %s", recipe.kind, recipe.num_layers,
                vocab, out_dir)
    return out_dir


def ensure_tiny_model(kind: str, out_dir: Path) -> Path:
    """The checkpoint of one kind (``llama``, ``mla``, ``hybrid``), built once."""
    if kind not in RECIPES:
        raise ValueError(f"kind: expected one of {sorted(RECIPES)}, got {kind!r}")
    return ensure_tiny_llama(out_dir, RECIPES[kind])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a tiny seeded checkpoint (Llama, MLA or hybrid) used by the vLLM tests.",
        epilog="example: python -m kvbridge.integrations.vllm.tiny_model /tmp/tiny-llama",
    )
    parser.add_argument("--kind", choices=sorted(RECIPES), default="llama",
                        help="llama (dense GQA), mla (DeepSeek-V2 style), hybrid (Gemma-3 "
                             "style sliding-window + full attention); default llama")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    path = ensure_tiny_model(args.kind, args.out_dir)
    print(path)  # noqa: T201 (a command-line entry point)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
