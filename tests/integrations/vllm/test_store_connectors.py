"""kvbridge store-type connectors in a single real vLLM engine (CPU platform).

Store, reset the prefix cache, load back: the output is the same and vLLM
counts the prompt tokens as externally loaded. Corrupting the stored bytes
changes the output (the loaded KV is really used); truncating them makes the
load fail, vLLM recomputes (``kv_load_failure_policy: recompute``) and the
output is right again. vLLM's own offloading connector refuses the CPU
platform; kvbridge's connectors run on it.

Parametrized over the store connectors present: ``shared_storage`` (the
reference connector, one file per block) always; kvbridge's ``offloading``
connector when it is registered.
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


@pytest.fixture(scope="module")
def store_engine(tiny_model: Path, server_logs: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("kv-store")
    config = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"kvbridge_connector": "shared_storage",
                                            "path": str(root)}}
    with h.server_group(server_logs / "store") as group:
        (server,) = group.start(h.ServerSpec("store", str(tiny_model), h.free_port(), core=1,
                                             kv_transfer_config=config), timeout_s=400)
        yield {"server": server, "root": root}


def _block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if p.is_file())


def _rewrite(files: list[Path], how: str) -> None:
    for path in files:
        size = path.stat().st_size
        if how == "corrupt":
            path.write_bytes(os.urandom(size))
        else:  # truncate: a provable short read -> load error
            with open(path, "r+b") as handle:
                handle.truncate(size // 2)


def test_store_reset_load_back_same_output_corrupt_changes_it(store_engine) -> None:
    server, root = store_engine["server"], store_engine["root"]
    prompts = [h.make_prompts(1, n, seed=900 + n)[0] for n in PROMPT_LENGTHS]
    first = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]
    files = _block_files(root)
    assert files, "nothing was stored"

    server.reset_prefix_cache()
    before = server.metrics()
    again = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]
    after = server.metrics()
    assert again == first
    loaded = after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0)
    assert loaded == sum((n // 32) * 32 for n in PROMPT_LENGTHS)

    _rewrite(files, "corrupt")
    server.reset_prefix_cache()
    corrupted = [server.complete(p, MAX_TOKENS).token_ids for p in prompts]
    assert corrupted != first, "random KV bytes did not change the output"


def test_failed_load_is_recomputed_by_vllm(store_engine) -> None:
    server, root = store_engine["server"], store_engine["root"]
    prompt = h.make_prompts(1, 130, seed=31337)[0]
    want = server.complete(prompt, MAX_TOKENS).token_ids
    new_files = [p for p in _block_files(root)]
    _rewrite(new_files, "truncate")
    server.reset_prefix_cache()
    got = server.complete(prompt, MAX_TOKENS).token_ids
    assert got == want
