"""MooncakeStoreClient against a real mooncake_master: zero-copy round trips and per-key results.

One client per module (Mooncake's close() takes ~2 s); keys are namespaced per test.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import pytest

from kvbridge.backends.mooncake import (
    KeyStatus,
    McStatus,
    MooncakeClosedError,
    MooncakeConfig,
    MooncakeConfigError,
    MooncakeStoreClient,
)
from kvbridge.backends.mooncake.master import MooncakeMaster
from tests.conftest import require

torch = require("torch")
require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")

MiB = 1 << 20


@pytest.fixture(scope="module")
def client(mooncake_master: MooncakeMaster) -> Iterator[MooncakeStoreClient]:
    config = MooncakeConfig(
        mooncake_master.rpc_address,
        mooncake_master.metadata_url,
        global_segment_size=64 * MiB,
        local_buffer_size=16 * MiB,
        op_timeout_s=10.0,
    )
    with MooncakeStoreClient(config) as store_client:
        yield store_client
    assert not store_client.is_open


class Registered:
    """A CPU tensor registered with the client for the duration of a ``with`` block."""

    def __init__(self, client: MooncakeStoreClient, tensor: torch.Tensor) -> None:
        self.client, self.tensor = client, tensor

    def __enter__(self) -> torch.Tensor:
        self.client.register_buffer(self.tensor.data_ptr(), self.tensor.nbytes)
        return self.tensor

    def __exit__(self, *exc: object) -> None:
        self.client.unregister_buffer(self.tensor.data_ptr())


def _keys(prefix: str, n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"kvbridge-test/{prefix}/{tag}/{i}" for i in range(n)]


def _rows(t: torch.Tensor) -> tuple[list[int], list[int]]:
    row_bytes = t[0].nbytes
    return [t[i].data_ptr() for i in range(t.shape[0])], [row_bytes] * t.shape[0]


@pytest.mark.parametrize(
    ("dtype", "num_blocks", "block_elems"),
    [(torch.uint8, 8, 16 << 10), (torch.bfloat16, 4, 256 << 10), (torch.float16, 33, 1000)],
)
def test_put_get_round_trip_is_byte_exact(
    client: MooncakeStoreClient, dtype: torch.dtype, num_blocks: int, block_elems: int
) -> None:
    gen = torch.Generator().manual_seed(num_blocks)
    row_bytes = block_elems * dtype.itemsize
    src = torch.randint(0, 256, (num_blocks, row_bytes), generator=gen, dtype=torch.uint8).view(dtype)
    dst = torch.zeros_like(src)
    keys = _keys("roundtrip", num_blocks)
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        put = client.batch_put_from(keys, ptrs, sizes)
        assert [r.status for r in put] == [KeyStatus.OK] * num_blocks
        assert [r.nbytes for r in put] == sizes
        got = client.batch_get_into(keys, _rows(dst)[0], sizes)
        assert all(r.ok and r.nbytes == sizes[0] for r in got), [str(r) for r in got]
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    assert client.batch_exists(keys) == [True] * num_blocks


def test_started_calls_run_beside_the_caller_and_give_the_same_results(
    client: MooncakeStoreClient,
) -> None:
    """``start_batch_put_from``/``start_batch_get_into``: two calls in flight at once
    (a put and a get of other keys), results collected later, once per call."""
    src = torch.randint(0, 256, (6, 64 << 10), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = _keys("started", 6)
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        assert all(r.ok for r in client.batch_put_from(keys[:3], ptrs[:3], sizes[:3]))
        put = client.start_batch_put_from(keys[3:], ptrs[3:], sizes[3:])
        get = client.start_batch_get_into(keys[:3], _rows(dst)[0][:3], sizes[:3])
        got = get.results()
        assert all(r.ok and r.nbytes == sizes[0] for r in got), [str(r) for r in got]
        assert get.results() is got and get.done()  # collected once
        assert [r.status for r in put.results()] == [KeyStatus.OK] * 3
        later = client.start_batch_get_into(keys[3:], _rows(dst)[0][3:], sizes[3:])
        assert all(r.ok for r in later.results())
        empty = client.start_batch_get_into([], [], [])
        assert empty.done() and empty.results() == []
    assert torch.equal(src, dst)


def test_missing_keys_are_not_found_per_key(client: MooncakeStoreClient) -> None:
    src = torch.arange(4 * 4096, dtype=torch.int32).view(torch.uint8).reshape(4, -1).clone()
    dst = torch.zeros_like(src)
    stored = _keys("partial", 2)
    missing = _keys("partial-missing", 2)
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        assert all(r.ok for r in client.batch_put_from(stored, ptrs[:2], sizes[:2]))
        order = [stored[0], missing[0], stored[1], missing[1]]
        got = client.batch_get_into(order, _rows(dst)[0], sizes)
    assert [r.status for r in got] == [KeyStatus.OK, KeyStatus.NOT_FOUND, KeyStatus.OK, KeyStatus.NOT_FOUND]
    assert got[1].code == McStatus.OBJECT_NOT_FOUND and got[1].code_name == "OBJECT_NOT_FOUND"
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[1])
    assert not dst[1].any() and not dst[3].any()  # a miss leaves its destination untouched
    assert client.batch_exists(order) == [True, False, True, False]
    detailed = client.batch_exists_results(order)
    assert [r.status for r in detailed] == [KeyStatus.OK, KeyStatus.NOT_FOUND] * 2


def test_put_keeps_old_value_and_upsert_overwrites(client: MooncakeStoreClient) -> None:
    old = torch.full((1, 8192), 7, dtype=torch.uint8)
    new = torch.full((1, 8192), 9, dtype=torch.uint8)
    dst = torch.zeros_like(old)
    (key,) = _keys("overwrite", 1)
    with Registered(client, old), Registered(client, new), Registered(client, dst):
        assert client.batch_put_from([key], [old.data_ptr()], [old.nbytes])[0].ok
        # Documented Mooncake semantics: a put on an existing key reports OK and keeps the old bytes.
        assert client.batch_put_from([key], [new.data_ptr()], [new.nbytes])[0].ok
        assert client.batch_get_into([key], [dst.data_ptr()], [dst.nbytes])[0].ok
        assert torch.equal(dst, old)
        assert client.batch_upsert_from([key], [new.data_ptr()], [new.nbytes])[0].ok
        assert client.batch_get_into([key], [dst.data_ptr()], [dst.nbytes])[0].ok
        assert torch.equal(dst, new)


def test_get_size_mismatch_is_an_error_unless_allowed(client: MooncakeStoreClient) -> None:
    src = torch.randint(0, 255, (1, 4096), dtype=torch.uint8)
    big = torch.zeros((1, 8192), dtype=torch.uint8)
    small = torch.zeros((1, 1024), dtype=torch.uint8)
    (key,) = _keys("size", 1)
    with Registered(client, src), Registered(client, big), Registered(client, small):
        assert client.batch_put_from([key], [src.data_ptr()], [src.nbytes])[0].ok
        strict = client.batch_get_into([key], [big.data_ptr()], [big.nbytes])[0]
        assert strict.status is KeyStatus.ERROR and strict.code == McStatus.SIZE_MISMATCH
        assert strict.nbytes == 4096
        loose = client.batch_get_into([key], [big.data_ptr()], [big.nbytes], exact_size=False)[0]
        assert loose.ok and loose.nbytes == 4096 and torch.equal(big[0, :4096], src[0])
        too_small = client.batch_get_into([key], [small.data_ptr()], [small.nbytes])[0]
        assert too_small.status is KeyStatus.ERROR and too_small.code == McStatus.INVALID_PARAMS


def test_remove_respects_read_lease_unless_forced(client: MooncakeStoreClient) -> None:
    src = torch.randint(0, 255, (2, 2048), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = _keys("remove", 2)
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        assert all(r.ok for r in client.batch_put_from(keys, ptrs, sizes))
        assert all(r.ok for r in client.batch_get_into(keys, _rows(dst)[0], sizes))
    held = client.remove(keys)
    assert [r.code_name for r in held] == ["OBJECT_HAS_LEASE"] * 2
    assert all(r.ok for r in client.remove(keys, force=True))
    assert client.batch_exists(keys) == [False, False]
    assert [r.status for r in client.remove(keys)] == [KeyStatus.NOT_FOUND] * 2


def test_arguments_are_validated_before_any_call(client: MooncakeStoreClient) -> None:
    before = client.stats().calls
    with pytest.raises(MooncakeConfigError, match="one entry per key"):
        client.batch_put_from(["a", "b"], [1], [1, 1])
    with pytest.raises(MooncakeConfigError, match=r"sizes\[0\]"):
        client.batch_get_into(["a"], [4096], [0])
    with pytest.raises(MooncakeConfigError, match=r"keys\[1\]"):
        client.batch_exists(["a", ""])
    with pytest.raises(MooncakeConfigError, match="no buffer registered"):
        client.unregister_buffer(0xDEAD000)
    buf = torch.zeros(4096, dtype=torch.uint8)
    with Registered(client, buf):
        with pytest.raises(MooncakeConfigError, match="already registered"):
            client.register_buffer(buf.data_ptr(), buf.nbytes)
        assert client.registered_buffers == {buf.data_ptr(): buf.nbytes}
    assert client.registered_buffers == {}
    assert client.stats().calls == before
    assert client.batch_get_into([], [], []) == []


def test_many_small_blocks_in_one_batch(client: MooncakeStoreClient) -> None:
    num_blocks, block_bytes = 512, 4096
    src = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = _keys("many", num_blocks)
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        assert all(r.ok for r in client.batch_put_from(keys, ptrs, sizes))
        # Read back in a shuffled order into shuffled rows: each key must land where asked.
        order = list(itertools.chain(range(1, num_blocks, 2), range(0, num_blocks, 2)))
        got = client.batch_get_into([keys[i] for i in order], _rows(dst)[0], sizes)
        assert all(r.ok for r in got)
    assert torch.equal(dst, src[order])
    assert all(r.ok for r in client.remove(keys, force=True))


def test_a_batch_of_many_small_keys_is_cut_and_answers_in_key_order(
    client: MooncakeStoreClient,
) -> None:
    """``split_calls`` (2): 1024 keys of 4 KiB go as two calls at once; the per-key
    results still come in key order, misses in either part where they are."""
    num_blocks, block_bytes = 1024, 4096
    src = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = _keys("cut", num_blocks)
    missing = {3, 700, 1023}  # one in the first part, two in the second
    before = client.stats().cut_batches
    with Registered(client, src), Registered(client, dst):
        ptrs, sizes = _rows(src)
        stored = [i for i in range(num_blocks) if i not in missing]
        put = client.batch_put_from([keys[i] for i in stored], [ptrs[i] for i in stored],
                                    [sizes[i] for i in stored])
        assert [r.status for r in put] == [KeyStatus.OK] * len(stored)
        order = list(range(num_blocks))[::-1]
        got = client.start_batch_get_into([keys[i] for i in order], _rows(dst)[0], sizes)
        statuses = [r.status for r in got.results()]
        assert got.done() and got.results() is got.results()
    assert client.stats().cut_batches == before + 2
    for row, i in enumerate(order):
        want = KeyStatus.NOT_FOUND if i in missing else KeyStatus.OK
        assert statuses[row] is want, (row, i)
        assert torch.equal(dst[row], src[i]) if i not in missing else not dst[row].any()
    client.remove(keys, force=True)
    # keys over 64 KiB on average are not cut (the copy is the cost there)
    big = torch.zeros((2 * 256, 66 << 10), dtype=torch.uint8)
    with Registered(client, big):
        bkeys = _keys("uncut", big.shape[0])
        assert all(r.ok for r in client.batch_put_from(bkeys, *_rows(big)))
    assert client.stats().cut_batches == before + 2
    client.remove(bkeys, force=True)


def test_second_client_reads_blocks_stored_in_first_clients_segment(
    mooncake_master: MooncakeMaster, client: MooncakeStoreClient
) -> None:
    src = torch.randint(0, 255, (3, 64 << 10), dtype=torch.uint8)
    keys = _keys("cross", 3)
    with Registered(client, src):
        assert all(r.ok for r in client.batch_put_from(keys, *_rows(src)))
    # A client that lends no memory (segment 0) still reads and writes through others'.
    reader_config = MooncakeConfig(
        mooncake_master.rpc_address, mooncake_master.metadata_url,
        global_segment_size=0, local_buffer_size=16 * MiB,
    )
    dst = torch.zeros_like(src)
    with MooncakeStoreClient(reader_config) as reader, Registered(reader, dst):
        assert reader.hostname() != client.hostname()
        assert reader.batch_exists(keys) == [True] * 3
        got = reader.batch_get_into(keys, *_rows(dst))
        assert all(r.ok for r in got), [str(r) for r in got]
        (extra,) = _keys("cross-from-reader", 1)
        assert reader.batch_put_from([extra], [dst[0].data_ptr()], [dst[0].nbytes])[0].ok
    assert torch.equal(src, dst)
    assert client.batch_exists([extra]) == [True]
    assert all(r.ok for r in client.remove(keys + [extra], force=True))
    with pytest.raises(MooncakeClosedError):
        reader.batch_exists(keys)
    reader.close()  # idempotent


_WRITER = r"""
import ctypes, sys
from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient
rpc, meta, prefix, n, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
buf = (ctypes.c_ubyte * (n * size))()
for i in range(n):
    ctypes.memset(ctypes.addressof(buf) + i * size, 17 + i, size)
with MooncakeStoreClient(MooncakeConfig(rpc, meta, global_segment_size=16 << 20)) as client:
    base = ctypes.addressof(buf)
    client.register_buffer(base, n * size)
    keys = [f"{prefix}/{i}" for i in range(n)]
    results = client.batch_put_from(keys, [base + i * size for i in range(n)], [size] * n)
    print("stored" if all(r.ok for r in results) else f"failed {results}", flush=True)
    sys.stdin.readline()  # keep the segment mounted until the reader is done
    client.unregister_buffer(base)
"""


def test_blocks_stored_by_another_process_are_read_over_tcp(
    mooncake_master: MooncakeMaster, client: MooncakeStoreClient
) -> None:
    import os
    import select
    import subprocess
    import sys

    n, size = 4, 256 << 10
    (prefix,) = _keys("other-process", 1)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, mooncake_master.rpc_address, mooncake_master.metadata_url,
         prefix, str(n), str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        readable, _, _ = select.select([writer.stdout], [], [], 120)  # bounded: setup + put
        assert readable, f"writer printed nothing within 120 s (exit code {writer.poll()})"
        assert writer.stdout.readline().strip() == "stored"
        dst = torch.zeros((n, size), dtype=torch.uint8)
        keys = [f"{prefix}/{i}" for i in range(n)]
        with Registered(client, dst):
            got = client.batch_get_into(keys, *_rows(dst))
        assert all(r.ok for r in got), [str(r) for r in got]
        for i in range(n):
            assert bool((dst[i] == 17 + i).all())
        writer.stdin.write("done\n")
        writer.stdin.flush()
        assert writer.wait(timeout=30) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(timeout=10)
