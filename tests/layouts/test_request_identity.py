"""What besides its token ids decides a request's KV is in its keys and its prompt chain.

vLLM's prefix cache hashes a block with its LoRA adapter, the multimodal inputs
it overlaps and the prompt's embeddings; a placeholder token is the same for
every image. kvbridge's block hashes (store and offload keys, KV events) and the
sealed params' prompt chain count the same things, through one function.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvbridge.connectors.sealing import prompt_chain
from kvbridge.connectors.step import ConnectorRequest
from kvbridge.integrations.vllm.request_view import _HashChain, identity_of
from kvbridge.layouts import block_extra_keys, hash_blocks

TOKENS = [5] * 64  # placeholder-like: every position the same token


def _vllm_like(**fields: object) -> SimpleNamespace:
    """The attributes of a vLLM ``Request`` that :func:`identity_of` reads."""
    base: dict[str, object] = {"cache_salt": None, "lora_request": None, "mm_features": [],
                               "prompt_embeds": None}
    return SimpleNamespace(**{**base, **fields})


def _image(offset: int, length: int, identifier: str) -> SimpleNamespace:
    return SimpleNamespace(identifier=identifier,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def _hashes(request: SimpleNamespace) -> tuple[bytes, ...]:
    chain = _HashChain(1, *identity_of(request))
    return chain.update(TOKENS, [16])[0]


def test_a_salt_alone_keeps_the_keys_they_always_were() -> None:
    assert block_extra_keys(0, 16, "s") == ("s",)
    assert _hashes(_vllm_like(cache_salt="s")) == tuple(hash_blocks(TOKENS, 16, ("s",)))
    assert _hashes(_vllm_like()) == tuple(hash_blocks(TOKENS, 16))


def test_another_image_adapter_or_embedding_is_another_key_from_its_block_on() -> None:
    plain = _hashes(_vllm_like())
    cat = _hashes(_vllm_like(mm_features=[_image(20, 8, "cat")]))
    dog = _hashes(_vllm_like(mm_features=[_image(20, 8, "dog")]))
    assert cat[0] == dog[0] == plain[0]  # the block before the image is shared
    assert len({cat[1], dog[1], plain[1]}) == 3 and cat[3] != dog[3]  # chained on
    lora = SimpleNamespace(lora_name="a", lora_path="/adapters/a")
    other_path = SimpleNamespace(lora_name="a", lora_path="/adapters/b")
    assert _hashes(_vllm_like(lora_request=lora))[0] != plain[0]
    assert _hashes(_vllm_like(lora_request=lora)) != _hashes(_vllm_like(
        lora_request=other_path))
    one, two = torch.zeros(64, 8), torch.ones(64, 8)
    assert _hashes(_vllm_like(prompt_embeds=one)) != _hashes(_vllm_like(prompt_embeds=two))


def test_the_prompt_chain_counts_the_same_things_as_the_block_hashes() -> None:
    image = _vllm_like(mm_features=[_image(20, 8, "cat")])
    salt, lora, features, embeds = identity_of(image)
    request = ConnectorRequest("r", tuple(TOKENS), 64, (), cache_salt=salt, lora=lora,
                               features=features, embeds=embeds)
    links = _hashes(image)
    computed = prompt_chain(TOKENS, 64, extra_keys=request.extra_keys)
    assert computed == links[-1] == prompt_chain(TOKENS, 64, links=links,
                                                 extra_keys=request.extra_keys)
    dog = ConnectorRequest("r", tuple(TOKENS), 64, (),
                           features=((20, 8, "dog"),))
    assert prompt_chain(TOKENS, 40, extra_keys=dog.extra_keys) != prompt_chain(
        TOKENS, 40, extra_keys=request.extra_keys)
    assert prompt_chain(TOKENS, 16, extra_keys=dog.extra_keys) == prompt_chain(TOKENS, 16)
