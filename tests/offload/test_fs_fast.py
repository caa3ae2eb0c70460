"""fs tier loads and stores through the C extension (GIL-free batch reads and writes) and
through the Python fallback: the same bytes, the same outcome for every odd file or entry,
and the extension's bounds.

The fallback is forced by taking the extension away from ``fs_fast`` (what an install
without a C compiler has); the extension path needs it built (``pip install -e .``).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator

import pytest

from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload import fs_fast
from kvbridge.offload.blockdigest import layer_digests
from kvbridge.offload.fs import FsTier
from kvbridge.offload.fs_io import decode_block_header, describe_mode
from kvbridge.offload.fs_layout import FileMapper
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
    with pytest.raises(TypeError):
        fs_fast.read_files(iter([]))   # type: ignore[arg-type]
    # a bad item after a good one: the good one's buffer is released (else a resize fails)
    held = bytearray(8)
    with pytest.raises(TypeError):
        fs_fast.read_files([(b"a", False, (held,)), (b"b",)])  # type: ignore[list-item]
    held.extend(b"resized")
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


def test_write_extension_bounds_and_statuses(tmp_path: object) -> None:
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    buf = memoryview(b"12345678")

    def item(path: bytes, temp: bytes, *buffers: memoryview,
             direct: bool = False) -> fs_fast.WriteItem:
        return (path, temp, direct, False, buffers or (buf,))

    with pytest.raises(ValueError):
        fs_fast.write_files([item(b"a", b"a.t")] * (fs_fast.max_items() + 1))
    with pytest.raises(ValueError):
        fs_fast.write_files([item(b"a", b"a\0b")])
    with pytest.raises(ValueError):
        fs_fast.write_files([item(b"x" * 5000, b"a.t")])
    with pytest.raises(ValueError):
        fs_fast.write_files([item(b"a", b"a")])       # a failed write would unlink the block
    with pytest.raises(ValueError):
        fs_fast.write_files([item(b"a", b"a.t", *((buf,) * (fs_fast.max_buffers() + 1)))])
    with pytest.raises(TypeError):
        fs_fast.write_files([(b"a", b"a.t", False, (buf,))])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        fs_fast.write_files([item(b"a", b"a.t", "not a buffer")])  # type: ignore[arg-type]
    held = bytearray(8)
    with pytest.raises(TypeError):
        fs_fast.write_files([item(b"a", b"a.t", held),  # type: ignore[arg-type]
                             (b"b", b"b.t", False, (buf,))])  # type: ignore[list-item]
    held.extend(b"resized")
    root = str(tmp_path)
    path, temp = os.path.join(root, "f"), os.path.join(root, "f.tmp")
    raw, raw_temp = os.fsencode(path), os.fsencode(temp)
    # read-only buffers are written; an unaligned one with O_DIRECT asked is written buffered
    unaligned = memoryview(bytearray(b"_abcdef"))[1:]
    assert fs_fast.write_files([item(raw, raw_temp, buf, unaligned, direct=True)]) \
        == [fs_fast.WRITTEN]
    with open(path, "rb") as fh:
        assert fh.read() == b"12345678abcdef"
    assert not os.path.exists(temp)
    # a regular file there: nothing written; something else there: left to the caller
    os.mkdir(os.path.join(root, "d"))
    missing = os.path.join(root, "none", "f")
    statuses = fs_fast.write_files([
        item(raw, raw_temp, memoryview(b"other")),
        item(os.fsencode(os.path.join(root, "d")), raw_temp),
        item(os.fsencode(missing), os.fsencode(missing + ".tmp")),
    ])
    assert statuses == [fs_fast.EXISTED, -1, errno.ENOENT]
    with open(path, "rb") as fh:
        assert fh.read() == b"12345678abcdef"
    assert sorted(os.listdir(root)) == ["d", "f"]
    # a temp path someone else made (O_EXCL): an error, and that file is left alone
    with open(temp, "wb") as fh:
        fh.write(b"theirs")
    assert fs_fast.write_files([item(os.fsencode(os.path.join(root, "g")), raw_temp)]) \
        == [errno.EEXIST]
    with open(temp, "rb") as fh:
        assert fh.read() == b"theirs"


#: a write the file size limit cuts short (EFBIG after a partial write), as a disk error
#: mid-file would: the temp file goes, nothing is at the path
_EFBIG_WRITE = """
import errno, os, resource, signal, sys
from kvbridge.offload import fs_fast
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
path, temp = sys.argv[1], sys.argv[1] + ".tmp"
status = fs_fast.write_files([(os.fsencode(path), os.fsencode(temp), False, True,
                               (memoryview(bytes(4096)), memoryview(bytes(4096))))])
print(status == [errno.EFBIG], os.path.lexists(path), os.path.lexists(temp))
"""


def test_write_error_mid_file_removes_the_temp_file(tmp_path: object) -> None:
    import sys

    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    out = subprocess.run([sys.executable, "-c", _EFBIG_WRITE, os.path.join(str(tmp_path), "f")],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr
    assert os.listdir(str(tmp_path)) == []


def test_the_environment_switch_turns_the_extension_off() -> None:
    import subprocess
    import sys

    code = "from kvbridge.offload import fs_fast; print(fs_fast.available(), fs_fast.active_path())"
    env = dict(os.environ, **{fs_fast.ENV_SWITCH: "0"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.startswith("False python (one call per block: turned off (KVBRIDGE_FS_FAST=0))")


# --- stores -------------------------------------------------------------------------

LAYERS = 4
FP = "cd" * 8
#: blocks per store; each in a fan-out directory of its own (a scenario that breaks one
#: directory breaks one block)
NSTORE = 6
#: the position of the block a failing scenario breaks: the last, so the plain path stops
#: where the extension's call ended too (blocks after a failed one in the same call are
#: stored on that path: complete files, but not reported)
LAST = NSTORE - 1


def _store_keys() -> list[bytes]:
    keys: list[bytes] = []
    fanouts: set[str] = set()
    i = 0
    while len(keys) < NSTORE:
        key = b"st|" + str(i).encode()
        i += 1
        fanout = FileMapper.key_hash(key)[:2]
        if fanout not in fanouts:
            fanouts.add(fanout)
            keys.append(key)
    return keys


KEYS = _store_keys()


def _fanout(tier: FsTier, i: int) -> str:
    return os.path.dirname(tier.block_path(KEYS[i]))


def _existing(tier: FsTier) -> Callable[[], None]:
    _store_with(tier, [block_content(key, BLOCK) for key in KEYS])
    return lambda: None


def _odd_entries(tier: FsTier) -> Callable[[], None]:
    os.mkdir(tier.block_path(KEYS[0]))                      # an empty directory
    os.mkfifo(tier.block_path(KEYS[2]))                     # a FIFO
    target = os.path.join(tier.root, "outside-target")
    with open(target, "wb") as fh:
        fh.write(b"not a block")
    os.symlink(target, tier.block_path(KEYS[4]))            # a symlink: unlinked, not its target

    def check() -> None:
        with open(target, "rb") as fh:
            assert fh.read() == b"not a block"
    return check


def _non_empty_directory(tier: FsTier) -> Callable[[], None]:
    os.mkdir(tier.block_path(KEYS[LAST]))                   # cannot be removed: the store fails
    with open(os.path.join(tier.block_path(KEYS[LAST]), "inside"), "wb") as fh:
        fh.write(b"x")
    return lambda: None


def _missing_fanout(tier: FsTier) -> Callable[[], None]:
    shutil.rmtree(_fanout(tier, 1))                         # an operator cleaning up: made again
    return lambda: None


def _fanout_is_a_file(tier: FsTier) -> Callable[[], None]:
    os.rmdir(_fanout(tier, LAST))                           # ENOTDIR, whoever runs the test
    with open(_fanout(tier, LAST), "wb") as fh:
        fh.write(b"x")
    return lambda: None


def _read_only_fanout(tier: FsTier) -> Callable[[], None]:
    """EACCES where permissions bind; as root, EPERM from an immutable directory."""
    directory = _fanout(tier, LAST)
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return lambda: os.chmod(directory, 0o755)
    made = subprocess.run(["chattr", "+i", directory], capture_output=True, text=True,
                          timeout=60, check=False) if shutil.which("chattr") else None
    if made is None or made.returncode != 0:
        # not a backend: a file system (tmpfs, overlayfs) without the immutable flag
        # leaves root no directory it cannot write in; ``fanout-is-a-file`` still runs
        # a refused write through both paths
        pytest.skip("no directory root cannot write in (chattr +i: "
                    f"{made.stderr.strip() if made else 'not installed'})")
    return lambda: subprocess.run(["chattr", "-i", directory], timeout=60, check=True)


#: scenario -> (prepare the store directory, returning a clean-up; files the extension
#: leaves to the plain store)
SCENARIOS: dict[str, tuple[Callable[[FsTier], Callable[[], None]], int]] = {
    "new": (lambda tier: (lambda: None), 0),
    "existing": (_existing, 0),
    "odd-entries": (_odd_entries, 3),
    "non-empty-directory": (_non_empty_directory, 1),
    "missing-fanout": (_missing_fanout, 1),
    "fanout-is-a-file": (_fanout_is_a_file, 1),
    "read-only-fanout": (_read_only_fanout, 1),
}


def _store_with(tier: FsTier, contents: list[bytes]) -> None:
    src = Slots(len(contents))
    for i, content in enumerate(contents):
        src.view[i * BLOCK:(i + 1) * BLOCK] = content
    tier.store(KEYS[:len(contents)], src.lists(len(contents)), [None] * len(contents))


def _entry(tier: FsTier, i: int) -> str:
    """What is at block ``i``'s path: "block" (its header names its key and the digests
    of its bytes, then its bytes), or what else is there."""
    path = tier.block_path(KEYS[i])
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "absent"
    if not stat.S_ISREG(mode):
        return describe_mode(mode)
    with open(path, "rb") as fh:
        data = fh.read()
    header = decode_block_header(path, data[:tier.header_bytes])
    content = block_content(KEYS[i], BLOCK)
    if header.key_hash != FileMapper.key_hash_bytes(KEYS[i]) or data[tier.header_bytes:] \
            != content or header.layer_digests != layer_digests([memoryview(content)], LAYERS):
        return "another block"
    return "block"


def _store_outcome(root: str, scenario: str, direct: bool, fsync: bool) -> dict[str, object]:
    tier = FsTier(root, BLOCK, FP, use_o_direct=direct, fsync=fsync, num_layers=LAYERS,
                  verify=VerifyPolicy(DigestMode.FULL))
    if direct and not tier.o_direct:
        # not a backend: the buffered case of the same scenario still runs
        pytest.skip(f"O_DIRECT in {root}: this file system refuses it")
    prepare, _fallbacks = SCENARIOS[scenario]
    clean_up = prepare(tier)
    try:
        before = dict(tier.counters.extra)
        # the bytes written now: the blocks' own, except over blocks already stored, where
        # other bytes prove nothing was written again
        contents = [block_content(key, BLOCK) if scenario != "existing" else bytes(BLOCK)
                    for key in KEYS]
        error: object = None
        try:
            _store_with(tier, contents)
        except BatchIOError as exc:
            cause = exc.cause
            error = (exc.num_succeeded, type(cause).__name__, getattr(cause, "errno", None),
                     sorted(exc.skipped))
        entries = [_entry(tier, i) for i in range(NSTORE)]
        temps = [name for _d, _s, names in os.walk(root) for name in names
                 if name.endswith(".tmp")]
    finally:
        clean_up()
    # every block stored loads, its bytes checked against the digests in its header
    stored = [i for i, entry in enumerate(entries) if entry == "block"]
    dst = Slots(NSTORE)
    loaded: list[object] = []
    tier.load([KEYS[i] for i in stored], [dst.lists(NSTORE)[i] for i in stored],
              loaded)  # type: ignore[arg-type]
    for i in stored:
        assert bytes(dst.view[i * BLOCK:(i + 1) * BLOCK]) == block_content(KEYS[i], BLOCK)
    counts = {name: tier.counters.extra.get(name, 0) - before.get(name, 0)
              for name in ("store_existing", "fanout_refused", "fast_write_calls",
                           "fast_write_fallbacks")}
    return {"error": error, "entries": entries, "temps": temps,
            "loads_verified": tier.counters.snapshot()["loads_verified"], "counts": counts}


@pytest.mark.parametrize("direct,fsync", [(True, False), (True, True), (False, False),
                                          (False, True)],
                         ids=["o_direct", "o_direct-fsync", "buffered", "buffered-fsync"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_stores_same_outcome_on_both_paths(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                           scenario: str, direct: bool, fsync: bool) -> None:
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    results: dict[str, dict[str, object]] = {}
    for path in ("c-extension", "python"):
        with monkeypatch.context() as patch:
            if path == "python":
                patch.setattr(fs_fast, "_module", None)
            results[path] = _store_outcome(os.path.join(str(tmp_path), path), scenario,
                                           direct, fsync)
    fast, plain = results["c-extension"], results["python"]
    fast_counts, plain_counts = fast.pop("counts"), plain.pop("counts")
    assert fast == plain
    assert isinstance(fast_counts, dict) and isinstance(plain_counts, dict)
    # the extension's call was made (the plain path never makes one), and each block it
    # did not store was stored again the plain way
    assert fast_counts.pop("fast_write_calls") == 1 and plain_counts.pop("fast_write_calls") == 0
    assert fast_counts.pop("fast_write_fallbacks") == SCENARIOS[scenario][1]
    assert plain_counts.pop("fast_write_fallbacks") == 0
    assert fast_counts == plain_counts
    assert fast["temps"] == []
    failing = scenario in ("non-empty-directory", "fanout-is-a-file", "read-only-fanout")
    expected_entries = ["block"] * NSTORE
    if failing:
        expected_entries[LAST] = "a directory" if scenario == "non-empty-directory" \
            else "absent"
        assert isinstance(fast["error"], tuple) and fast["error"][0] == LAST
    else:
        assert fast["error"] is None
    assert fast["entries"] == expected_entries
    assert fast["loads_verified"] == expected_entries.count("block")
    assert fast_counts["store_existing"] == (NSTORE if scenario == "existing" else 0)


def test_digests_that_do_not_fit_the_layout_stop_the_store_there_on_both_paths(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing after the refused block is written on either path: the extension's call
    holds only the blocks before it."""
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    results = []
    for path in ("c-extension", "python"):
        with monkeypatch.context() as patch:
            if path == "python":
                patch.setattr(fs_fast, "_module", None)
            tier = FsTier(os.path.join(str(tmp_path), path), BLOCK, FP, num_layers=LAYERS,
                          verify=VerifyPolicy(DigestMode.FULL))
            src = Slots(NSTORE)
            for i, key in enumerate(KEYS):
                src.view[i * BLOCK:(i + 1) * BLOCK] = block_content(key, BLOCK)
            digests: list[object] = [None] * NSTORE
            digests[2] = (1, 2)                              # 2 layer digests for 4 layers
            with pytest.raises(BatchIOError) as info:
                tier.store(KEYS, src.lists(NSTORE), digests)  # type: ignore[arg-type]
            results.append((info.value.num_succeeded, info.value.cause.errno,
                            [_entry(tier, i) for i in range(NSTORE)],
                            tier.counters.extra.get("fast_write_calls", 0)))
    assert results[0][:3] == results[1][:3] == (2, errno.EINVAL, ["block"] * 2 + ["absent"] * 4)
    assert results[0][3] == 1 and results[1][3] == 0


def test_store_errors_are_named_as_on_the_plain_path(tmp_path: object) -> None:
    """The errno a failed store reports is the plain store's (it did the block again)."""
    if not fs_fast.available():
        missing_backend(f"fs tier C extension: {fs_fast.active_path()}")
    outcome = _store_outcome(str(tmp_path), "fanout-is-a-file", True, False)
    assert outcome["error"] == (LAST, "NotADirectoryError", errno.ENOTDIR, [])
