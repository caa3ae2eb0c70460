"""The fused Triton kernel of ``torch-mix64-v1`` (layouts.triton_digests), run by
Triton's interpreter on CPU tensors: bit-identical to the torch engine, the numpy
reference and the golden vectors, for whole blocks, padded pages, tail words,
unaligned spans and slices of every kind the planner makes; and the dispatch of
``TorchBlockDigester(engine=...)``.

The interpreter is a mode of the whole process, fixed when triton is first imported
(its own library functions are decorated then), so this module sets
``TRITON_INTERPRET=1`` before anything imports triton: pytest imports every test
module before it runs any test, and nothing else in kvbridge imports triton unless
the Triton engine is asked for. What needs a process without it runs in a
subprocess: the dispatch on CPU tensors, and the compiler (the kernel compiled for
sm_90 without a GPU). On a GPU, tests/gpu's digests check runs the compiled kernel
(``engine="auto"`` takes it there) against a CPU copy and the reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvbridge.layouts import torch_digests, triton_digests  # noqa: E402
from kvbridge.layouts.digests import (  # noqa: E402
    TORCH_SLICE_ALGORITHM,
    merge_ranges,
    mix64_combine,
    mix64_digest,
)
from kvbridge.layouts.errors import LayoutError  # noqa: E402
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester  # noqa: E402
from kvbridge.layouts.triton_digests import (  # noqa: E402
    MAX_CHUNK_WORDS,
    TILE_WORDS,
    chunk_words,
    plan_ranges,
)
from tests.conftest import missing_backend, require  # noqa: E402
from tests.layouts import test_slice_digests, test_torch_digests  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreter() -> None:
    """Triton importable and under its interpreter (else a skip, or a failure under
    KVBRIDGE_REQUIRE_BACKENDS=1)."""
    require("triton")
    if not triton_digests.interpreter_active():
        missing_backend("triton was imported without its interpreter before this module "
                        f"could ask for it: {triton_digests.INTERPRET_HINT}")


def _both(tensor: torch.Tensor, stride: int, block_bytes: int, num_blocks: int,
          layers: int = 1) -> tuple[TorchBlockDigester, TorchBlockDigester]:
    """The torch and the Triton digester of ``layers`` layers over the same tensor."""
    spans = {layer: TensorSpan(tensor, stride, block_bytes, num_blocks) for layer in range(layers)}
    regions = [tuple(range(layers))]
    return (TorchBlockDigester(spans, regions, engine="torch"),
            TorchBlockDigester(spans, regions, engine="triton"))


def test_the_triton_kernel_renders_the_golden_block_digests() -> None:
    """The padded page, a 5-byte tail word, spans at an odd offset (read as bytes)."""
    assert test_torch_digests.render("triton") == test_torch_digests.GOLDEN.read_text()


def test_the_triton_kernel_renders_the_golden_slice_digests() -> None:
    """Word-aligned HND ranges, ranges inside words, NHD rows (a table per position)."""
    assert test_slice_digests.render(TORCH_SLICE_ALGORITHM, "triton") == \
        test_slice_digests.GOLDEN[TORCH_SLICE_ALGORITHM].read_text()


@pytest.mark.parametrize("offset, block_bytes, stride, dtype", [
    (0, 20480 + 24, 20480 + 64, torch.int64),   # 3 items of one block: whole tiles + a rest
    (0, 4096 - 5, 4096, torch.float16),          # a tail word, 16-byte aligned words
    (8, 1000, 1008, torch.float32),              # 8-byte but not 16-byte aligned
    (3, 515, 517, torch.uint8),                  # unaligned: bytes, a tail
    (0, 0, 16, torch.uint8),                     # empty blocks
])
def test_block_digests_equal_the_torch_engine_and_the_reference(
        offset: int, block_bytes: int, stride: int, dtype: torch.dtype) -> None:
    num_blocks = 5
    raw = np.random.default_rng(block_bytes).integers(
        0, 256, size=offset + num_blocks * stride + 8, dtype=np.uint8)
    size = dtype.itemsize  # the offsets above are multiples of it
    tensor = torch.from_numpy(raw[:len(raw) // size * size]).view(dtype)[offset // size:]
    by_torch, by_triton = _both(tensor, stride, block_bytes, num_blocks, layers=2)
    ids = [4, 0, 2, 3]
    want = [mix64_combine([mix64_digest(raw[offset + b * stride:offset + b * stride
                                            + block_bytes].tobytes())] * 2) for b in ids]
    assert by_triton.block_digests(0, ids) == by_torch.block_digests(0, ids) == want
    assert by_triton.engine == "triton" and by_torch.engine == "torch"
    # the kernel ran (nothing to launch for empty blocks)
    assert (by_triton.kernel_launches > 0) == (block_bytes > 0)
    assert by_torch.kernel_launches == 0
    layer = [mix64_digest(raw[offset + b * stride:offset + b * stride + block_bytes].tobytes())
             for b in ids]
    assert by_triton.layer_digests_of(0, ids)[:, 1].tolist() == layer


SLICES = {
    # HND: a few word-aligned ranges, summed in place as words
    "hnd": ((0, ((64, 128), (512, 128))), (1, ((0, 1024),))),
    # a last range with a partial word (words, then its tail as bytes)
    "tail": ((0, ((8, 64), (128, 19))),),
    # NHD rows: many word-aligned ranges, through a table of word offsets
    "nhd": ((0, tuple((r * 64 + 16, 32) for r in range(16)) + ((1000, 16),)),),
    # ranges inside words, through a table of byte offsets
    "bytes": ((0, ((3, 29), (200, 1))), (1, ((1018, 6),))),
    # many ranges inside words
    "nhd-bytes": ((0, tuple((r * 50 + 1, 21) for r in range(20))),),
}


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("name", sorted(SLICES))
def test_slice_digests_equal_the_torch_engine_and_the_reference(name: str, offset: int) -> None:
    """Each kind of launch (offset 3: the layer's blocks are not 8-byte aligned, so
    every range is read as bytes)."""
    block_bytes, stride, num_blocks = 1024, 1024 + 8 + offset, 4
    raw = np.random.default_rng(len(name) + offset).integers(
        0, 256, size=offset + num_blocks * stride, dtype=np.uint8)
    tensor = torch.from_numpy(raw)[offset:]
    by_torch, by_triton = _both(tensor, stride, block_bytes, num_blocks, layers=2)
    layers = SLICES[name]
    ids = [3, 1, 0]
    want = [mix64_combine([mix64_digest(b"".join(
        raw[offset + b * stride + o:offset + b * stride + o + n].tobytes() for o, n in ranges))
        for _layer, ranges in layers]) for b in ids]
    assert by_triton.slice_digests(layers, ids) == by_torch.slice_digests(layers, ids) == want


def test_the_planner_makes_each_kind_of_launch() -> None:
    """The slices above reach every kind (so the test above covers each one)."""
    def kinds(ranges: tuple[tuple[int, int], ...], words_ok: bool = True) -> list[str]:
        return [("bytes" if launch.byte_mode else "words")
                + ("-indexed" if launch.indexed else "")
                for launch in plan_ranges(merge_ranges(ranges), words_ok, 1024)]

    assert kinds(SLICES["hnd"][0][1]) == ["words"]
    assert kinds(SLICES["tail"][0][1]) == ["words", "bytes"]
    assert kinds(SLICES["nhd"][0][1]) == ["words-indexed"]
    assert kinds(SLICES["bytes"][0][1]) == ["bytes-indexed"]
    assert kinds(SLICES["hnd"][0][1], words_ok=False) == ["bytes"]
    assert kinds(((0, 20480),)) == ["words"] and kinds(()) == []
    # a long range is cut into items of at most a chunk, positions continuing
    items = plan_ranges(((16, 20000 * 8),), True, 8192)[0].items
    assert items.tolist() == [[2, 8194, 16386], [8192, 8192, 3616], [0, 8192, 16384]]
    # few blocks are cut into more, smaller items (enough programs), never under a tile
    assert chunk_words(4096, 2048) == MAX_CHUNK_WORDS  # 4096 x 16 KiB: a block an item
    assert chunk_words(64, 2 << 17) < MAX_CHUNK_WORDS  # 64 x 2 MiB: more programs
    assert chunk_words(1, 10) == TILE_WORDS


def test_a_flipped_bit_changes_exactly_its_blocks_digest() -> None:
    """In a padded page with a tail word: the first bit, a bit in the middle, the last
    byte of the tail, and a byte of the padding (no block changes)."""
    block_bytes, stride, num_blocks = 2053, 2064, 6
    raw = np.random.default_rng(7).integers(0, 256, size=num_blocks * stride, dtype=np.uint8)
    tensor = torch.from_numpy(raw)
    _by_torch, by_triton = _both(tensor, stride, block_bytes, num_blocks)
    ids = list(range(num_blocks))
    before = by_triton.block_digests(0, ids)
    for block, byte, changed in ((0, 0, [0]), (3, 1000, [3]), (5, block_bytes - 1, [5]),
                                 (2, block_bytes + 4, [])):
        tensor[block * stride + byte] ^= 0x10
        after = by_triton.block_digests(0, ids)
        assert [b for b in ids if after[b] != before[b]] == changed
        tensor[block * stride + byte] ^= 0x10
    assert by_triton.block_digests(0, ids) == before


def test_auto_falls_back_to_the_torch_ops_when_the_kernel_fails_first(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Auto chose the kernel (as on a CUDA device) and it fails on first use (a triton
    it does not compile with): the digests are still right, by the torch ops, and the
    digester says so. A forced "triton" raises instead."""
    chosen = torch_digests._engine
    monkeypatch.setattr(torch_digests, "_engine", lambda engine, device: (
        triton_digests.TritonSums(device), "auto: the Triton kernel (as on a GPU)")
        if engine == "auto" else chosen(engine, device))

    def broken(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(triton_digests.TritonSums, "sums", broken)
    layers = test_torch_digests.reference_layers()
    auto = test_torch_digests.digester(layers)
    assert auto.engine == "triton"
    with caplog.at_level(logging.WARNING, logger="kvbridge.layouts.torch_digests"):
        got = auto.block_digests(0, range(4))
    assert got == test_torch_digests.digester(layers, engine="torch").block_digests(0, range(4))
    assert auto.engine == "torch" and "no such instruction" in auto.engine_note
    assert "the torch ops compute them from now on" in caplog.text
    forced = test_torch_digests.digester(layers, engine="triton")
    with pytest.raises(RuntimeError, match="no such instruction"):
        forced.block_digests(0, range(4))


def test_engine_names_are_checked() -> None:
    with pytest.raises(LayoutError, match="engine.*'cuda'"):
        test_torch_digests.digester(test_torch_digests.reference_layers(), engine="cuda")


def test_without_the_interpreter_cpu_tensors_take_the_torch_ops_and_never_import_triton(
        ) -> None:
    """In a process without TRITON_INTERPRET: auto on CPU tensors is the torch engine,
    and does not even import triton; a forced "triton" is a LayoutError that says what
    would make it run."""
    code = """
import json, sys, torch
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester
spans = {0: TensorSpan(torch.arange(64, dtype=torch.uint8), 16, 16, 4)}
auto = TorchBlockDigester(spans, [(0,)])
out = {"engine": auto.engine, "note": auto.engine_note, "digests": auto.block_digests(0, [1, 2]),
       "triton_imported": "triton" in sys.modules}
try:
    TorchBlockDigester(spans, [(0,)], engine="triton")
except LayoutError as exc:
    out["forced"] = str(exc)
sys.stdout.write(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    out = json.loads(done.stdout)
    raw = np.arange(64, dtype=np.uint8)
    assert out["digests"] == [mix64_combine([mix64_digest(raw[b * 16:b * 16 + 16].tobytes())])
                              for b in (1, 2)]
    assert out["engine"] == "torch" and "cpu" in out["note"] and not out["triton_imported"]
    assert "TRITON_INTERPRET=1" in out["forced"] and "engine" in out["forced"]


COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvbridge.layouts import triton_digests as td
assert td._import() is None and not td.interpreter_active()
kernel = triton.jit(td._mix_sums_kernel)
names = ["src", "ids", "items", "index", "out", "num_items", "stride", "total_bytes",
         "BYTES", "INDEXED", "ALIGN", "TILE"]
out = {}
for byte_mode, indexed, align in ((False, False, 2), (False, False, 1), (True, False, 1),
                                  (False, True, 1), (True, True, 1)):
    types = ["*u8" if byte_mode else "*i64", "*i64", "*i64", "*i64", "*i64", "i32", "i64",
             "i64"] + ["constexpr"] * 4
    values = {"BYTES": byte_mode, "INDEXED": indexed, "ALIGN": align, "TILE": td.TILE_WORDS}
    source = ASTSource(kernel, dict(zip(names, types)),
                       constexprs={(names.index(k),): v for k, v in values.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    out[f"{byte_mode}-{indexed}-{align}"] = {
        "vector_loads": len(re.findall(r"ld\\.global\\.v[248]\\.b64", ptx)),
        "cubin": len(compiled.asm.get("cubin", b""))}
sys.stdout.write(json.dumps(out))
"""


def test_the_kernel_compiles_for_an_h200_without_one() -> None:
    """The interpreter runs the kernel's Python with numpy; the compiler checks what it
    does not (types, the constexpr branches, lowering to PTX). Triton compiles for a
    target without a device (sm_90, an H100/H200): every kind of launch, down to a
    cubin by the ptxas the wheel ships; and the 16-byte-aligned whole-word path, the
    hot one, loads 16-byte vectors. In a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert len(out) == 5 and all(v["cubin"] > 0 for v in out.values())
    assert out["False-False-2"]["vector_loads"] > 0
