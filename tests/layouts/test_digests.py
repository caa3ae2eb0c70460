"""Block digests (layouts.digests): definition pinned by golden vectors, stable across
processes, and every flipped byte of a block's span seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbridge.layouts.digests import (
    BlockDigester,
    DigestMode,
    LayerSpan,
    VerifyPolicy,
    combine,
    digest_bytes,
    mismatched,
    pack,
    unpack,
)
from kvbridge.layouts.errors import LayoutError

GOLDEN = Path(__file__).parents[1] / "golden" / "vectors" / "block_digests.txt"
REGEN = os.environ.get("KVBRIDGE_REGEN_GOLDEN") == "1"
BLOCK_BYTES, STRIDE, NUM_BLOCKS = 256, 320, 4  # a padded page: 64 bytes between blocks


def reference_layers() -> dict[int, np.ndarray]:
    """Three layers of four blocks with known bytes; the padding holds 0xEE (not hashed)."""
    out = {}
    for layer in (0, 1, 2):
        buf = np.full(NUM_BLOCKS * STRIDE, 0xEE, dtype=np.uint8)
        i = np.arange(BLOCK_BYTES)
        for b in range(NUM_BLOCKS):
            buf[b * STRIDE:b * STRIDE + BLOCK_BYTES] = (i * 31 + b * 7 + layer * 13) & 0xFF
        out[layer] = buf
    return out


def digester(layers: dict[int, np.ndarray]) -> BlockDigester:
    spans = {layer: LayerSpan(buf.ctypes.data, STRIDE, BLOCK_BYTES, NUM_BLOCKS)
             for layer, buf in layers.items()}
    return BlockDigester(spans, [(0, 1), (2,)], owner=layers)


def render(d: BlockDigester) -> str:
    lines = [f"empty {digest_bytes(b''):016x}", f"kvbridge {digest_bytes(b'kvbridge'):016x}"]
    for region in range(2):
        for b in range(NUM_BLOCKS):
            layer_hex = " ".join(f"{x:016x}" for x in d.layer_digests(region, b))
            lines.append(f"region {region} block {b} layers {layer_hex} "
                         f"block {d.block_digest(region, b):016x}")
    return "\n".join(lines) + "\n"


def test_digests_match_the_golden_vectors() -> None:
    text = render(digester(reference_layers()))
    if REGEN:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_digests_are_the_same_in_another_process_with_another_hash_seed() -> None:
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_digests as t; "
            "sys.stdout.write(t.render(t.digester(t.reference_layers())))")
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120, check=True)
        assert out.stdout == GOLDEN.read_text()


def test_every_flipped_byte_changes_its_block_digest_and_no_other() -> None:
    layers = reference_layers()
    d = digester(layers)
    before = [d.block_digests(r, range(NUM_BLOCKS)) for r in range(2)]
    for layer, region in ((0, 0), (1, 0), (2, 1)):
        for offset in (0, 1, 127, BLOCK_BYTES - 1):
            pos = 2 * STRIDE + offset
            layers[layer][pos] ^= 0x01
            after = [d.block_digests(r, range(NUM_BLOCKS)) for r in range(2)]
            assert mismatched(before[region], after[region]) == [2]
            assert after[1 - region] == before[1 - region]
            layers[layer][pos] ^= 0x01
    # padding between blocks is not KV: changing it changes nothing
    layers[0][BLOCK_BYTES + 3] ^= 0xFF
    assert [d.block_digests(r, range(NUM_BLOCKS)) for r in range(2)] == before


def test_another_blocks_bytes_under_this_block_are_seen() -> None:
    layers = reference_layers()
    d = digester(layers)
    want = d.block_digest(0, 1)
    for layer in (0, 1):
        layers[layer][STRIDE:STRIDE + BLOCK_BYTES] = layers[layer][:BLOCK_BYTES]
    assert d.block_digest(0, 1) == d.block_digest(0, 0) != want


def test_block_digest_is_the_digest_of_its_packed_layer_digests() -> None:
    d = digester(reference_layers())
    layer_digests = d.layer_digests(0, 3)
    assert d.block_digest(0, 3) == combine(layer_digests) == digest_bytes(pack(layer_digests))


def test_pack_and_unpack_round_trip_and_bound_the_size() -> None:
    values = [0, 1, (1 << 64) - 1, 0x0123456789ABCDEF]
    assert unpack(pack(values), 4) == tuple(values)
    with pytest.raises(LayoutError, match="expected 24 bytes"):
        unpack(pack(values), 3)
    with pytest.raises(LayoutError, match="digests"):
        unpack("not bytes", 1)  # type: ignore[arg-type]


def test_block_ids_outside_the_tensor_are_refused() -> None:
    d = digester(reference_layers())
    with pytest.raises(LayoutError, match="outside"):
        d.block_digest(0, NUM_BLOCKS)
    with pytest.raises(LayoutError, match="outside"):
        d.block_digest(1, -1)


def test_sample_mode_checks_a_deterministic_fraction() -> None:
    policy = VerifyPolicy(DigestMode.SAMPLE, sample_fraction=0.25)
    chosen = [b for b in range(4000) if policy.wants("req-7", 0, b)]
    assert 800 < len(chosen) < 1200
    assert chosen == [b for b in range(4000) if policy.wants("req-7", 0, b)]
    assert chosen != [b for b in range(4000) if policy.wants("req-8", 0, b)]
    assert policy.chosen("req-7", 0, 4000) == chosen  # the vectorised twin agrees
    assert policy.chosen("req-7", 1, 4000) != chosen  # regions are sampled apart
    assert all(VerifyPolicy(DigestMode.FULL).wants("r", 0, b) for b in range(10))
    assert not any(VerifyPolicy(DigestMode.OFF).wants("r", 0, b) for b in range(10))
    with pytest.raises(LayoutError, match="verify_sample"):
        VerifyPolicy(DigestMode.SAMPLE, sample_fraction=0.0)
