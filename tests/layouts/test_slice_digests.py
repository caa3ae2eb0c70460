"""Slice digests (``BlockDigester.slice_digests``, ``xxh3-64-slices``, and
``TorchBlockDigester.slice_digests``, ``torch-mix64-v1-slices``): the definition
pinned by golden vectors (``tests/golden/vectors/slice_digests.txt`` and
``slice_digests_torch_mix64.txt``), both the bare definition over given ranges and
the ranges a NIXL consumer rank reads from one producer rank at another TP
(``connectors.pd.verify.slice_layers``); the torch digests equal the numpy
reference of the definition over the concatenated bytes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.connectors.pd.verify import slice_layers
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.layouts.digests import (
    SLICE_ALGORITHM,
    SLICE_DIGEST_VERSION,
    TORCH_SLICE_ALGORITHM,
    BlockDigester,
    Digester,
    LayerSpan,
    SliceLayer,
    combine,
    digest_bytes,
    merge_ranges,
    mix64_combine,
    mix64_digest,
)
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.plan import plan_consumer_rank, rank_at
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

VECTORS = Path(__file__).parents[1] / "golden" / "vectors"
GOLDEN = {SLICE_ALGORITHM: VECTORS / "slice_digests.txt",
          TORCH_SLICE_ALGORITHM: VECTORS / "slice_digests_torch_mix64.txt"}
REGEN = os.environ.get("KVBRIDGE_REGEN_GOLDEN") == "1"
NUM_BLOCKS = 3


def _as_torch(digester: BlockDigester, buffers: dict, engine: str = "auto"
              ) -> TorchBlockDigester:
    """The ``torch-mix64-v1`` digester of the same layer buffers (CPU tensors, no copy;
    ``engine``: which computes the sums, test_triton_digests renders with both)."""
    spans = {layer: TensorSpan(torch.from_numpy(buf), view[1], view[2], view[3])
             for layer, buf in buffers.items()
             for view in (digester._views[layer],)}
    return TorchBlockDigester(spans, digester.regions, engine=engine)


def _rank_buffers(model: str, topology: ParallelTopology) -> tuple[BlockDigester, dict]:
    """One rank's layer tensors with known bytes (block b, layer l, byte i)."""
    spec = load_spec(model)
    buffers = {}
    spans = {}
    shapes = spec.rank_shapes(topology)
    for shape in shapes:
        nbytes = shape.block_bytes_per_layer
        for layer in shape.layer_ids:
            # an aperiodic pattern (a wrong offset or order shows), different per layer
            # and rank: byte i of the layer tensor
            i = np.arange(NUM_BLOCKS * nbytes, dtype=np.int64) + layer * 7919 \
                + topology.tp_rank * 104729
            buf = (((i * 2654435761) % 4294967291) >> 11 & 0xFF).astype(np.uint8)
            buffers[layer] = buf
            spans[layer] = LayerSpan(buf.ctypes.data, nbytes, nbytes, NUM_BLOCKS)
    return BlockDigester(spans, [s.layer_ids for s in shapes], owner=buffers), buffers


def _ranges_text(layers: tuple[SliceLayer, ...]) -> str:
    return " ".join(f"L{layer}:" + ",".join(f"{o}+{n}" for o, n in ranges)
                    for layer, ranges in layers)


def render(algorithm: str, engine: str = "auto") -> str:
    torch_alg = algorithm == TORCH_SLICE_ALGORITHM
    lines = [f"algorithm {algorithm} version {SLICE_DIGEST_VERSION}"]
    # the bare definition: two ranges of layer 0, one of layer 1, of a 256-byte block
    buf = (((np.arange(2 * 256, dtype=np.int64) * 2654435761) % 4294967291) >> 11
           & 0xFF).astype(np.uint8)
    spans = {0: LayerSpan(buf.ctypes.data, 256, 256, 1),
             1: LayerSpan(buf.ctypes.data + 256, 256, 256, 1)}
    d: Digester = BlockDigester(spans, [(0, 1)], owner=buf)
    if torch_alg:
        d = _as_torch(d, {0: buf[:256], 1: buf[256:]}, engine)
    # and for the torch one, ranges inside words (the gathered bytes, not words)
    bare = ((0, ((16, 32), (128, 8))), (1, ((200, 56),)))
    lines.append(f"bare {_ranges_text(bare)} block 0 slice {d.slice_digests(bare, [0])[0]:016x}")
    odd = ((0, ((3, 29), (100, 1))), (1, ((250, 6),)))
    if torch_alg:
        lines.append(f"bare {_ranges_text(odd)} block 0 slice "
                     f"{d.slice_digests(odd, [0])[0]:016x}")
    # what one consumer rank reads from one producer rank (producer side: source offsets)
    for model, producer, consumer in (("tiny-gqa", 1, 2), ("tiny-gqa", 2, 1),
                                      ("tiny-gqa-nhd", 1, 2)):
        spec = load_spec(model)
        p_sizes, c_sizes = ParallelTopology(tp_size=producer), ParallelTopology(tp_size=consumer)
        for c in range(consumer):
            rank_plan = plan_consumer_rank(spec, p_sizes, rank_at(c_sizes, c))
            for p in rank_plan.sources:
                digester, buffers = _rank_buffers(model, rank_at(p_sizes, p))
                if torch_alg:
                    digester = _as_torch(digester, buffers, engine)
                layers = slice_layers(rank_plan, p, 0, "producer")
                head = f"{model} tp{producer}->tp{consumer} consumer {c} producer {p} region 0"
                if model.endswith("nhd"):
                    lines.append(f"{head} ranges {len(layers[0][1])} per layer")
                else:
                    lines.append(f"{head} ranges {_ranges_text(layers)}")
                for b, x in enumerate(digester.slice_digests(layers, range(NUM_BLOCKS))):
                    lines.append(f"{head} block {b} slice {x:016x}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("algorithm", [SLICE_ALGORITHM, TORCH_SLICE_ALGORITHM])
def test_slice_digests_match_the_golden_vectors(algorithm: str) -> None:
    text = render(algorithm)
    if REGEN:
        GOLDEN[algorithm].write_text(text)
    assert text == GOLDEN[algorithm].read_text()


@pytest.mark.parametrize("view_ranges", [16, 0])
@pytest.mark.parametrize("chunk_words", [None, 1, 5])
def test_torch_slice_digests_are_the_reference_of_the_concatenated_ranges(
        chunk_words: int | None, view_ranges: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch-mix64-v1-slices``: per layer (ascending), ``mix64_digest`` of the
    concatenated range bytes, combined with ``mix64_combine``; word-aligned ranges
    (summed as views of the words, or gathered as words when ``_VIEW_RANGES`` is 0)
    and ranges inside words (gathered as bytes) alike, whatever the tiling; whole
    ranges of every layer give the block digest."""
    from kvbridge.layouts import torch_digests

    monkeypatch.setattr(torch_digests, "_VIEW_RANGES", view_ranges)
    host, buffers = _rank_buffers("tiny-gqa", ParallelTopology())
    spans = {layer: TensorSpan(torch.from_numpy(buf), view[1], view[2], view[3])
             for layer, buf in buffers.items() for view in (host._views[layer],)}
    d = TorchBlockDigester(spans, host.regions, chunk_words=chunk_words)
    nbytes = load_spec("tiny-gqa").rank_shapes(ParallelTopology())[0].block_bytes_per_layer
    cases = (((2, ((96, 48), (8, 16))), (0, ((0, 8), (8, 8), (304, 8)))),  # whole words
             ((2, ((100, 50), (10, 20))), (0, ((0, 7), (7, 9), (300, 1)))),  # inside words
             ((1, ((0, nbytes),)),))
    for layers in cases:
        ids = [2, 0, 2] if chunk_words != 5 else [0, 1, 2]  # gathered rows, or one view
        want = [mix64_combine([mix64_digest(b"".join(bytes(buffers[layer][b * nbytes + o:][:n])
                                                     for o, n in ranges))
                               for layer, ranges in sorted(layers)]) for b in ids]
        assert d.slice_digests(layers, ids) == want, layers
    whole = tuple((layer, ((0, nbytes),)) for layer in (0, 1, 2, 3))
    assert d.slice_digests(whole, [1, 2]) == d.block_digests(0, [1, 2])
    before = d.slice_digests(cases[1], [1])
    buffers[0][nbytes + 20] ^= 1  # outside the ranges: no change
    assert d.slice_digests(cases[1], [1]) == before
    buffers[0][nbytes + 300] ^= 1  # inside
    assert d.slice_digests(cases[1], [1]) != before


def test_the_definition_is_the_combined_digests_of_the_concatenated_ranges() -> None:
    digester, buffers = _rank_buffers("tiny-gqa", ParallelTopology())
    nbytes = load_spec("tiny-gqa").rank_shapes(ParallelTopology())[0].block_bytes_per_layer
    layers = ((2, ((100, 50), (10, 20))), (0, ((0, 7), (7, 9), (300, 1))))
    b = 1
    want = combine([digest_bytes(bytes(buffers[0][b * nbytes:][0:16])
                                 + bytes(buffers[0][b * nbytes + 300:][:1])),
                    digest_bytes(bytes(buffers[2][b * nbytes + 100:][:50])
                                 + bytes(buffers[2][b * nbytes + 10:][:20]))])
    assert digester.slice_digests(layers, [b]) == [want]  # layers in ascending id
    # the cut does not matter, only the bytes: merged ranges give the same digest
    assert merge_ranges(((0, 7), (7, 9), (300, 1), (301, 0))) == ((0, 16), (300, 1))
    # a slice of every whole layer block is the block digest
    whole = tuple((layer, ((0, nbytes),)) for layer in (0, 1, 2, 3))
    assert digester.slice_digests(whole, [0, 2]) == digester.block_digests(0, [0, 2])
    # a byte outside the ranges does not matter, one inside does
    before = digester.slice_digests(layers, [b])
    buffers[0][b * nbytes + 20] ^= 1
    assert digester.slice_digests(layers, [b]) == before
    buffers[0][b * nbytes + 300] ^= 1
    assert digester.slice_digests(layers, [b]) != before


@pytest.mark.parametrize("algorithm", [SLICE_ALGORITHM, TORCH_SLICE_ALGORITHM])
def test_ranges_and_block_ids_outside_the_tensors_are_refused(algorithm: str) -> None:
    host, buffers = _rank_buffers("tiny-gqa", ParallelTopology())
    digester: Digester = host if algorithm == SLICE_ALGORITHM else _as_torch(host, buffers)
    nbytes = load_spec("tiny-gqa").rank_shapes(ParallelTopology())[0].block_bytes_per_layer
    with pytest.raises(LayoutError, match="outside"):
        digester.slice_digests(((0, ((nbytes - 4, 8),)),), [0])
    with pytest.raises(LayoutError, match="block 3 outside"):
        digester.slice_digests(((0, ((0, 8),)),), [3])
    with pytest.raises(LayoutError, match="no span for layer 9"):
        digester.slice_digests(((9, ((0, 8),)),), [0])


def test_evenly_spaced_ranges_gathered_at_once_hash_the_same_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Many ranges of one length at one step (NHD rows) are gathered with one strided
    copy: the digest is still that of the concatenated bytes, as streamed."""
    from kvbridge.layouts import digests

    digester, buffers = _rank_buffers("tiny-gqa", ParallelTopology())
    nbytes = load_spec("tiny-gqa").rank_shapes(ParallelTopology())[0].block_bytes_per_layer
    rows = tuple((64 + i * 512, 128) for i in range(16))
    assert digests._progression(rows) == (64, 128, 512, 16)  # the gathered path
    b = 2
    want = combine([digest_bytes(b"".join(bytes(buffers[1][b * nbytes + o:][:n])
                                          for o, n in rows))])
    gathered = digester.slice_digests(((1, rows),), [b, 0])
    assert gathered[0] == want
    monkeypatch.setattr(digests, "_GATHER_RANGES", 1 << 30)  # every range streamed
    assert digests._progression(rows) is None
    assert digester.slice_digests(((1, rows),), [b, 0]) == gathered
