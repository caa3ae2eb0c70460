"""fs tier loads through the C extension (GIL-free batch reads) and through the Python
fallback: the same bytes, the same outcome for every odd file, and the extension's bounds.

The fallback is forced by taking the extension away from ``fs_fast`` (what an install
without a C compiler has); the extension path needs it built (``pip install -e .``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest

from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload import fs_fast
from kvbridge.offload.fs import FsTier
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import BatchIOError
from tests.conftest import missing_backend

BLOCK = 16384
N = 12


def k(i: int) -> bytes:
    return b"ns|" + str(i).encode()


@pytest.fixture(params=["c-extension", "python"])
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(fs_fast, "_module", None)
        monkeypatch.setattr(fs_fast, "_why_not", "taken away by the test")
        assert not fs_fast.available()
    elif not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    yield request.param


class Slots:
    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK)
        self.view = memoryview(self.map)

    def lists(self, n: int) -> list[list[memoryview]]:
        return [[self.view[i * BLOCK:(i + 1) * BLOCK]] for i in range(n)]


def stored_tier(root: str, n: int = N) -> tuple[FsTier, Slots]:
    tier = FsTier(root, BLOCK, "ab" * 8, verify=VerifyPolicy(DigestMode.FULL))
    src = Slots(n)
    for i in range(n):
        src.view[i * BLOCK:(i + 1) * BLOCK] = block_content(k(i), BLOCK)
    tier.store([k(i) for i in range(n)], src.lists(n), [None] * n)
    return tier, src


def test_loads_every_byte(tmp_path: object, read_path: str) -> None:
    tier, _src = stored_tier(str(tmp_path))
    dst = Slots(N)
    digests: list[object] = []
    tier.load([k(i) for i in range(N)], dst.lists(N), digests)  # type: ignore[arg-type]
    for i in range(N):
        assert bytes(dst.view[i * BLOCK:(i + 1) * BLOCK]) == block_content(k(i), BLOCK)
    assert len(digests) == N and all(d is not None for d in digests)
    calls = tier.counters.extra.get("fast_read_calls", 0)
    assert (calls > 0) if read_path == "c-extension" else calls == 0
    assert tier.counters.snapshot()["loads_verified"] == N


def _damage(tier: FsTier) -> dict[int, str]:
    """One odd file per kind, at known positions."""
    def path(i: int) -> str:
        return tier.block_path(k(i))

    with open(path(1), "r+b") as fh:          # a flipped byte in the block: digest mismatch
        fh.seek(tier.header_bytes + 100)
        byte = fh.read(1)
        fh.seek(tier.header_bytes + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(path(3), "r+b") as fh:          # short: provably corrupt, removed
        fh.truncate(tier.header_bytes + BLOCK // 2)
    with open(path(5), "ab") as fh:           # longer than a block file: EFBIG, kept
        fh.write(b"x")
    with open(path(7), "r+b") as fh:          # torn header: removed
        fh.write(b"\0" * 8)
    os.remove(path(9))
    os.mkdir(path(9))                         # not a regular file: removed
    os.remove(path(11))                       # missing
    return {1: "digest", 3: "short", 5: "long", 7: "torn", 9: "dir", 11: "missing"}


def _outcome(tier: FsTier, n: int) -> tuple[list[str], dict[str, object]]:
    """Each block's outcome, loaded alone (a failure raises for its batch)."""
    dst = Slots(n)
    outcome: list[str] = []
    for i in range(n):
        digests: list[object] = []
        try:
            tier.load([k(i)], dst.lists(n)[i:i + 1], digests)  # type: ignore[arg-type]
        except BatchIOError as exc:
            cause = exc.cause
            outcome.append(f"{type(cause).__name__}:{getattr(cause, 'errno', None)}")
            continue
        assert bytes(dst.view[i * BLOCK:(i + 1) * BLOCK]) == block_content(k(i), BLOCK)
        outcome.append("loaded")
    counts = tier.counters.snapshot()
    kept: dict[str, object] = {"loads_verified": counts["loads_verified"]}
    kept["present"] = tier.probe([k(i) for i in range(n)])
    return outcome, kept


def test_odd_files_same_outcome_on_both_paths(tmp_path: object,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    results = []
    for path in ("c-extension", "python"):
        root = os.path.join(str(tmp_path), path)
        tier, _src = stored_tier(root)
        _damage(tier)
        with monkeypatch.context() as patch:
            if path == "python":
                patch.setattr(fs_fast, "_module", None)
            results.append(_outcome(tier, N))
        if path == "c-extension":
            # short, long, a directory, missing: read again the plain way; a flipped byte
            # and a torn header are read in full and refused by the checks after the read
            assert tier.counters.extra["fast_read_fallbacks"] == 4
    assert results[0] == results[1]
    outcome, kept = results[0]
    assert outcome[0] == "loaded" and outcome[1] != "loaded" and outcome[5] != "loaded"
    present = kept["present"]
    assert isinstance(present, list) and present[3] is False and present[5] is True


def test_batch_part_with_odd_files_loads_the_rest(tmp_path: object, read_path: str) -> None:
    tier, _src = stored_tier(str(tmp_path))
    with open(tier.block_path(k(4)), "r+b") as fh:   # digest mismatch: fails alone
        fh.seek(tier.header_bytes)
        fh.write(b"\xff" * 16)
    dst = Slots(N)
    digests: list[object] = []
    with pytest.raises(BatchIOError) as info:
        tier.load([k(i) for i in range(N)], dst.lists(N), digests)  # type: ignore[arg-type]
    assert set(info.value.skipped) == {4}
    for i in range(N):
        if i != 4:
            assert bytes(dst.view[i * BLOCK:(i + 1) * BLOCK]) == block_content(k(i), BLOCK)


def test_extension_bounds(tmp_path: object) -> None:
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    buf = memoryview(bytearray(8))
    with pytest.raises(ValueError):
        fs_fast.read_files([(b"a", False, (buf,))] * (fs_fast.max_items() + 1))
    with pytest.raises(ValueError):
        fs_fast.read_files([(b"a\0b", False, (buf,))])
    with pytest.raises(ValueError):
        fs_fast.read_files([(b"x" * 5000, False, (buf,))])
    with pytest.raises(ValueError):
        fs_fast.read_files([(b"a", False, (buf,) * (fs_fast.max_buffers() + 1))])
    with pytest.raises(BufferError):
        fs_fast.read_files([(b"a", False, (memoryview(b"read-only"),))])
    path = os.path.join(str(tmp_path), "f")
    with open(path, "wb") as fh:
        fh.write(b"0123456789abcdef")
    a, b = bytearray(6), bytearray(10)
    assert fs_fast.read_files([(os.fsencode(path), False, (memoryview(a), memoryview(b)))]) \
        == [fs_fast.READ_OK]
    assert bytes(a + b) == b"0123456789abcdef"
    small = bytearray(15)   # not exactly the file's size: left to the plain read
    missing = os.fsencode(os.path.join(str(tmp_path), "none"))
    assert fs_fast.read_files([(os.fsencode(path), False, (memoryview(small),)),
                               (missing, False, (memoryview(small),))]) == [-1, 2]


def test_the_environment_switch_turns_the_extension_off() -> None:
    import subprocess
    import sys

    code = "from kvbridge.offload import fs_fast; print(fs_fast.available(), fs_fast.active_path())"
    env = dict(os.environ, **{fs_fast.ENV_SWITCH: "0"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.startswith("False python (one call per block: turned off (KVBRIDGE_FS_FAST=0))")
