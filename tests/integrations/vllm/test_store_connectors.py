"""kvbridge store-type connectors in a single real vLLM engine (CPU platform).

Store, reset the prefix cache, load back: the output is the same and vLLM
counts the prompt tokens as externally loaded. Corrupting the stored bytes
changes the output of ``shared_storage`` (the loaded KV is really used); the
``offloading`` fs tier checks its block digests, so there the corruption is a
failed load and the output is right. Truncating them makes the load fail, vLLM recomputes (``kv_load_failure_policy: recompute``) and the
output is right again. vLLM's own offloading connector refuses the CPU
platform; kvbridge's connectors run on it.

Parametrized over ``shared_storage`` (the reference connector, one file per
block) and ``offloading`` (kvbridge's tiered store: a small CPU tier in front
of an fs tier; fillers evict a prompt from CPU so it comes back through fs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
PROMPT_LENGTHS = (100, 150)  # 3 and 4 full blocks of 32, plus a partial block


#: connector -> (extra config given the store directory, block file suffix)
STORES = {
    "shared_storage": (lambda root: {"path": str(root)}, ".kv"),
    # A CPU tier of 4 blocks per pool in front of an fs tier: fillers evict a
    # prompt's blocks from CPU, so loading it back goes through the fs tier.
    "offloading": (lambda root: {"cpu_blocks": 4, "fs_dir": str(root),
                                 "fs_o_direct": False}, ".kvb"),
}


@pytest.fixture(scope="module", params=sorted(STORES))
def store_engine(request: pytest.FixtureRequest, tiny_model: Path, server_logs: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    name = request.param
    root = tmp_path_factory.mktemp(f"kv-store-{name}")
    extra_of, suffix = STORES[name]
    config = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"kvbridge_connector": name, **extra_of(root)}}
    with h.server_group(server_logs / f"store-{name}") as group:
        (server,) = group.start(h.ServerSpec(f"store-{name}", str(tiny_model), h.free_port(),
                                             core=1, kv_transfer_config=config), timeout_s=400)
        yield {"server": server, "root": root, "suffix": suffix, "name": name}


def _evict_from_cpu(server: h.VllmServer, name: str, seed: int) -> None:
    """Offloading: push earlier blocks out of the 4-block CPU tier (LRU) with fillers."""
    if name != "offloading":
        return
    for i in range(3):
        server.complete(h.make_prompts(1, 130, seed=seed + i)[0], 1)


def _block_files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())


def _rewrite(files: list[Path], how: str) -> None:
    for path in files:
        size = path.stat().st_size
        if how == "corrupt":
            path.write_bytes(os.urandom(size))
        else:  # truncate: a provable short read -> load error
            with open(path, "r+b") as handle:
                handle.truncate(size // 2)


def test_store_reset_load_back_same_output_corrupt_changes_it(store_engine) -> None:
    server, root, name = store_engine["server"], store_engine["root"], store_engine["name"]
    prompts = [h.make_prompts(1, n, seed=900 + n)[0] for n in PROMPT_LENGTHS]
    first = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]

    server.reset_prefix_cache()
    before = server.metrics()
    again = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]
    after = server.metrics()
    assert again == first
    loaded = after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0)
    assert loaded == sum((n // 32) * 32 for n in PROMPT_LENGTHS)

    _evict_from_cpu(server, name, seed=5000)
    files = _block_files(root, store_engine["suffix"])
    assert files, "nothing reached the store directory"
    _rewrite(files, "corrupt")
    server.reset_prefix_cache()
    before = server.metrics()
    corrupted = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]
    after = server.metrics()
    if name == "offloading":
        # verified KV: the fs tier checks every block file against its digests, so the
        # random bytes are a failed load: vLLM recomputes and the output is right
        assert corrupted == first
        assert after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0) < loaded
    else:  # no digests: the loaded KV is really used, so random bytes change the output
        assert corrupted != first, "random KV bytes did not change the output"


def test_failed_load_is_recomputed_by_vllm(store_engine) -> None:
    server, root, name = store_engine["server"], store_engine["root"], store_engine["name"]
    prompt = h.make_prompts(1, 130, seed=31337)[0]
    want = server.complete(prompt, MAX_TOKENS).token_ids
    _evict_from_cpu(server, name, seed=6000)
    _rewrite(_block_files(root, store_engine["suffix"]), "truncate")
    server.reset_prefix_cache()
    got = server.complete(prompt, MAX_TOKENS).token_ids
    assert got == want
