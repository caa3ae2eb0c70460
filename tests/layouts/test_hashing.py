"""Block hashes: chained, seeded, stable across processes whatever PYTHONHASHSEED is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbridge.layouts import LayoutError, hash_block, hash_blocks, root_hash

_SCRIPT = r"""
import json
from kvbridge.layouts import hash_blocks, load_spec, ParallelTopology
from kvbridge.layouts.namespaces import lookup_namespaces, block_keys
hashes = hash_blocks(list(range(100)), 16, extra_keys=["salt", 7, b"\x01"], seed=b"s")
spec = load_spec("tiny-hybrid")
keys = block_keys(lookup_namespaces(spec, ParallelTopology.parse("tp=4,dcp=2")), hashes[0])
print(json.dumps({"hashes": [h.hex() for h in hashes], "keys": [k.to_str() for k in keys]}))
"""


def _run(seed: str) -> dict[str, list[str]]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    result: dict[str, list[str]] = json.loads(out.stdout)
    return result


def test_hashes_and_keys_identical_across_processes_with_different_hash_seeds() -> None:
    a, b = _run("0"), _run("4242")
    assert len(a["hashes"]) == 6  # 100 tokens: 6 full blocks of 16, the tail is not hashed
    assert a["hashes"] == b["hashes"]
    assert a["keys"] == b["keys"]
    # Same in this process too (a third PYTHONHASHSEED, usually random).
    local = hash_blocks(list(range(100)), 16, extra_keys=["salt", 7, b"\x01"], seed=b"s")
    assert [h.hex() for h in local] == a["hashes"]


def test_chaining_seed_and_extra_keys_change_the_hash() -> None:
    tokens = list(range(32))
    base = hash_blocks(tokens, 16)
    assert base[1] == hash_block(base[0], tokens[16:])
    assert base[0] == hash_block(root_hash(), tokens[:16])
    assert hash_blocks(tokens, 16, seed=b"other")[0] != base[0]
    assert hash_blocks(tokens, 16, extra_keys=["salt"])[0] != base[0]
    changed_first = hash_blocks([1] + tokens[1:], 16)
    assert changed_first[1] != base[1]  # a change propagates down the chain
    assert hash_blocks(tokens, 32)[0] != base[0]  # DCP keys cover more tokens


def test_hash_errors_name_the_field() -> None:
    with pytest.raises(LayoutError) as info:
        hash_block(b"short", [1])
    assert info.value.field == "parent_hash"
    with pytest.raises(LayoutError) as info:
        hash_block(root_hash(), [2**70])
    assert info.value.field == "token_ids"
    with pytest.raises(LayoutError) as info:
        hash_block(root_hash(), [1], extra_keys=[1.5])  # type: ignore[list-item]
    assert info.value.field == "extra_keys"
    with pytest.raises(LayoutError) as info:
        hash_blocks([1], 0)
    assert info.value.field == "block_tokens"
