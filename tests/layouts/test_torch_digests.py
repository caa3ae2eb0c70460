"""``torch-mix64-v1`` block digests (layouts.torch_digests): pinned by golden vectors,
the same in another process, the same as the numpy reference of the definition, the
same whatever the tiling of the sum, and every flipped bit and swapped word seen.

CPU tensors only here; the algorithm uses nothing but int64 tensor operations and
an integer sum, so a CUDA tensor gives the same digests by construction."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.layouts.digests import (
    ALGORITHM,
    ALGORITHMS,
    TORCH_ALGORITHM,
    digest_algorithms,
    mix64_combine,
    mix64_digest,
    pick_algorithm,
)
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

GOLDEN = Path(__file__).parents[1] / "golden" / "vectors" / "block_digests_torch_mix64.txt"
REGEN = os.environ.get("KVBRIDGE_REGEN_GOLDEN") == "1"
BLOCK_BYTES, STRIDE, NUM_BLOCKS = 256, 320, 4  # as test_digests: a padded page


def reference_layers() -> dict[int, torch.Tensor]:
    """The bytes of test_digests' reference layers, as uint8 tensors (padding 0xEE)."""
    out = {}
    for layer in (0, 1, 2):
        buf = np.full(NUM_BLOCKS * STRIDE, 0xEE, dtype=np.uint8)
        i = np.arange(BLOCK_BYTES)
        for b in range(NUM_BLOCKS):
            buf[b * STRIDE:b * STRIDE + BLOCK_BYTES] = (i * 31 + b * 7 + layer * 13) & 0xFF
        out[layer] = torch.from_numpy(buf)
    return out


def digester(layers: dict[int, torch.Tensor], block_bytes: int = BLOCK_BYTES,
             stride: int = STRIDE, chunk_words: int | None = None,
             engine: str = "auto") -> TorchBlockDigester:
    spans = {layer: TensorSpan(t, stride, block_bytes, NUM_BLOCKS) for layer, t in layers.items()}
    return TorchBlockDigester(spans, [(0, 1), (2,)], chunk_words=chunk_words, engine=engine)


def render(engine: str = "auto") -> str:
    """The golden file's text, the sums computed by ``engine`` (test_triton_digests
    renders it with the Triton kernel too)."""
    lines = [f"empty {mix64_digest(b''):016x}", f"kvbridge {mix64_digest(b'kvbridge'):016x}",
             f"zeros16 {mix64_digest(bytes(16)):016x}"]
    layers = reference_layers()
    # the padded page, a span with a 5-byte tail word, and spans at an odd offset
    # (not 8-byte aligned: the copied path)
    cases = (("page", layers, BLOCK_BYTES, STRIDE),
             ("tail", layers, BLOCK_BYTES - 3, STRIDE),
             ("unaligned", {k: t[3:] for k, t in layers.items()}, BLOCK_BYTES - 8, STRIDE - 1))
    for name, tensors, block_bytes, stride in cases:
        d = digester(tensors, block_bytes, stride, engine=engine)
        for region in range(2):
            for b in range(NUM_BLOCKS):
                layer_hex = " ".join(f"{x:016x}" for x in d.layer_digests(region, b))
                lines.append(f"{name} region {region} block {b} layers {layer_hex} "
                             f"block {d.block_digest(region, b):016x}")
    return "\n".join(lines) + "\n"


def test_torch_digests_match_the_golden_vectors() -> None:
    text = render()
    if REGEN:
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_torch_digests_are_the_same_in_another_process_with_other_threads() -> None:
    here = str(Path(__file__).parent)
    code = (f"import sys, torch; sys.path.insert(0, {here!r}); torch.set_num_threads(1); "
            "import test_torch_digests as t; sys.stdout.write(t.render())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "777"}, timeout=120, check=True)
    assert out.stdout == GOLDEN.read_text()


def test_the_digester_is_the_reference_definition_over_the_same_bytes() -> None:
    layers = reference_layers()
    d = digester(layers)
    for region, ids in ((0, (0, 1)), (1, (2,))):
        for b in range(NUM_BLOCKS):
            spans = [layers[layer].numpy()[b * STRIDE:b * STRIDE + BLOCK_BYTES].tobytes()
                     for layer in ids]
            assert d.layer_digests(region, b) == tuple(mix64_digest(s) for s in spans)
            assert d.block_digest(region, b) == mix64_combine([mix64_digest(s) for s in spans])
    # padding between blocks is not KV
    before = d.block_digests(0, range(NUM_BLOCKS))
    layers[0][BLOCK_BYTES + 3] ^= 0xFF
    assert d.block_digests(0, range(NUM_BLOCKS)) == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_bytes=st.integers(1, 200), pad=st.integers(0, 24), offset=st.integers(0, 9),
       num_blocks=st.integers(1, 6), chunk=st.sampled_from([None, 1, 2, 5, 64]),
       dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32]),
       data=st.data())
def test_any_geometry_and_tiling_gives_the_reference_digests(
        block_bytes: int, pad: int, offset: int, num_blocks: int, chunk: int | None,
        dtype: torch.dtype, data: st.DataObject) -> None:
    stride = block_bytes + pad
    size = dtype.itemsize
    offset -= offset % size
    stride += -stride % size
    total = offset + num_blocks * stride
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=total + size, dtype=np.uint8)
    tensor = torch.from_numpy(raw).view(dtype)[offset // size:]
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=8))
    spans = {0: TensorSpan(tensor, stride, block_bytes, num_blocks),
             7: TensorSpan(tensor, stride, block_bytes, num_blocks)}
    d = TorchBlockDigester(spans, [(0, 7)], chunk_words=chunk)
    want = [mix64_combine([mix64_digest(raw[offset + b * stride:offset + b * stride
                                            + block_bytes].tobytes())] * 2) for b in ids]
    assert d.block_digests(0, ids) == want


def test_every_flipped_bit_of_a_block_changes_its_digest() -> None:
    """Exhaustive over a block of 67 bytes (8 words and a 3-byte tail): each of its 536
    single-bit flips is a block of its own in one tensor, digested in one batch."""
    block_bytes = 67
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
    nbits = block_bytes * 8
    rows = np.tile(base, (nbits + 1, 1))
    for bit in range(nbits):
        rows[bit + 1, bit // 8] ^= np.uint8(1 << (bit % 8))
    tensor = torch.from_numpy(np.ascontiguousarray(rows).reshape(-1))
    d = TorchBlockDigester({0: TensorSpan(tensor, block_bytes, block_bytes, nbits + 1)}, [(0,)])
    digests = d.block_digests(0, range(nbits + 1))
    assert len(set(digests)) == nbits + 1  # every flip changed it, and no two flips agree


def test_swapped_and_moved_words_change_the_digest() -> None:
    """Position dependence: the sum of an unmixed or position-free function of the words
    would not see a swap. Words that differ only in the top bit are the case a plain
    ``sum(c_i * w_i)`` misses (their difference times an even ``c_i - c_j`` is 0 mod
    2^64); each swap is a block of its own, digested in one batch."""
    rng = np.random.default_rng(11)
    words = rng.integers(0, 2**63, size=16, dtype=np.uint64)
    words[9] = words[4] ^ np.uint64(1 << 63)  # differ only in bit 63
    words[12] = words[3] ^ np.uint64(1 << 62)
    pairs = [(i, j) for i in range(16) for j in range(i + 1, 16)]
    rows = np.tile(words, (len(pairs) + 2, 1))
    for n, (i, j) in enumerate(pairs):
        rows[n + 1, [i, j]] = rows[n + 1, [j, i]]
    rows[-1] = np.roll(words, 1)  # every word moved by one position
    tensor = torch.from_numpy(rows.reshape(-1).view(np.uint8).copy())
    d = TorchBlockDigester({0: TensorSpan(tensor, 128, 128, len(rows))}, [(0,)])
    digests = d.block_digests(0, range(len(rows)))
    assert len(set(digests)) == len(rows)


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=32, unique=True),
       data=st.data())
def test_any_swap_of_two_distinct_words_is_seen(words: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(words) - 1))
    j = data.draw(st.integers(0, len(words) - 1).filter(lambda k: k != i))
    swapped = list(words)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    a = np.asarray(words, dtype="<u8").tobytes()
    b = np.asarray(swapped, dtype="<u8").tobytes()
    assert mix64_digest(a) != mix64_digest(b)
    rows = torch.from_numpy(np.frombuffer(a + b, dtype=np.uint8).copy())
    d = TorchBlockDigester({0: TensorSpan(rows, len(a), len(a), 2)}, [(0,)])
    assert d.layer_digests(0, 0) != d.layer_digests(0, 1)


def test_zero_padding_of_the_tail_is_not_mistaken_for_data() -> None:
    assert mix64_digest(b"abc") != mix64_digest(b"abc\0")
    assert mix64_digest(b"") != mix64_digest(bytes(8))


def test_bounds_are_checked_before_any_read() -> None:
    tensor = torch.zeros(4 * 64, dtype=torch.uint8)
    d = TorchBlockDigester({0: TensorSpan(tensor, 64, 64, 4)}, [(0,)])
    with pytest.raises(LayoutError, match="block 4 outside"):
        d.block_digests(0, [0, 4])
    with pytest.raises(LayoutError, match="past the 256 bytes"):
        TorchBlockDigester({0: TensorSpan(tensor, 64, 64, 5)}, [(0,)])
    with pytest.raises(LayoutError, match="no span for layers"):
        TorchBlockDigester({0: TensorSpan(tensor, 64, 64, 4)}, [(0, 1)])
    assert d.block_digests(0, []) == [] and d.block_bytes(0) == 64


def test_a_host_rank_offers_both_a_gpu_rank_only_the_torch_algorithm() -> None:
    assert digest_algorithms(True) == (ALGORITHM, TORCH_ALGORITHM) == ALGORITHMS
    assert digest_algorithms(False) == (TORCH_ALGORITHM,)
    assert digest_algorithms(True, [TORCH_ALGORITHM]) == (TORCH_ALGORITHM,)
    assert digest_algorithms(False, [ALGORITHM]) == ()
    with pytest.raises(LayoutError, match="unknown digest algorithm 'md5'"):
        digest_algorithms(True, ["md5"])
    # the consumer's own preference decides; nothing in common: None
    host, gpu = digest_algorithms(True), digest_algorithms(False)
    assert pick_algorithm(host, host) == ALGORITHM
    assert pick_algorithm(host, gpu) == pick_algorithm(gpu, host) == TORCH_ALGORITHM
    assert pick_algorithm(gpu, (ALGORITHM,)) is None  # an older producer
    assert pick_algorithm((TORCH_ALGORITHM, ALGORITHM), host) == TORCH_ALGORITHM


def _scalar_mix64(data: bytes) -> int:
    """The module docstring's definition, word by word in Python integers (a third
    implementation, with neither numpy nor torch)."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def splitmix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i:8 * i + 8], "little")
        x = w ^ (w >> 32)
        x = (x * (splitmix(((i + 1) * golden) & mask) | 1)) & mask
        total = (total + (x ^ (x >> 29))) & mask
    return splitmix((total + (len(data) + 1) * golden) & mask)


def test_the_definition_word_by_word_gives_the_golden_values() -> None:
    golden = dict(line.split(" ", 1) for line in GOLDEN.read_text().splitlines()[:3])
    assert int(golden["empty"], 16) == _scalar_mix64(b"")
    assert int(golden["kvbridge"], 16) == _scalar_mix64(b"kvbridge")
    assert int(golden["zeros16"], 16) == _scalar_mix64(bytes(16))
    span = bytes(range(256)) * 3 + b"tail!"
    assert mix64_digest(span) == _scalar_mix64(span)
