"""Pure parts of the Mooncake client: status names, per-key interpretation, config validation.

No master and no wheel needed: these run everywhere.
"""

from __future__ import annotations

import pytest

from kvbridge.backends.mooncake import (
    KeyResult,
    KeyStatus,
    McStatus,
    MooncakeConfig,
    MooncakeConfigError,
    MooncakeStoreClient,
    Protocol,
    interpret_exists,
    interpret_get,
    interpret_put,
    interpret_remove,
    uniform,
)


def test_status_names_cover_mooncake_codes_and_unknowns() -> None:
    assert McStatus.name_of(-704) == "OBJECT_NOT_FOUND"
    assert McStatus.name_of(-706) == "OBJECT_HAS_LEASE"
    assert McStatus.name_of(-200) == "NO_AVAILABLE_HANDLE"
    assert McStatus.name_of(-900) == "RPC_FAIL"
    assert McStatus.name_of(-12345) == "UNKNOWN(-12345)"
    # kvbridge's own codes never collide with Mooncake's ranges (-1 .. -1999).
    own = [McStatus.TIMEOUT, McStatus.MASTER_UNREACHABLE, McStatus.CLIENT_CLOSED, McStatus.SIZE_MISMATCH]
    assert all(code <= -10000 for code in own)


def test_get_results_map_bytes_not_found_and_errors() -> None:
    assert interpret_get(4096, 4096) == KeyResult(KeyStatus.OK, 0, 4096)
    missing = interpret_get(-704, 4096)
    assert missing.not_found and not missing.ok and missing.code_name == "OBJECT_NOT_FOUND"
    failed = interpret_get(-900, 4096)
    assert failed.status is KeyStatus.ERROR and failed.code_name == "RPC_FAIL"
    short = interpret_get(2048, 4096)
    assert short.status is KeyStatus.ERROR and short.code == McStatus.SIZE_MISMATCH
    assert short.nbytes == 2048
    assert interpret_get(2048, 4096, exact_size=False) == KeyResult(KeyStatus.OK, 0, 2048)


def test_put_exists_remove_results() -> None:
    assert interpret_put(0, 100).ok and interpret_put(0, 100).nbytes == 100
    assert interpret_put(-200, 100).code_name == "NO_AVAILABLE_HANDLE"
    assert interpret_exists(1).ok
    assert interpret_exists(0).not_found
    assert interpret_exists(-1).status is KeyStatus.ERROR
    assert interpret_remove(0).ok
    assert interpret_remove(-704).not_found
    lease = interpret_remove(-706)
    assert lease.status is KeyStatus.ERROR and lease.code_name == "OBJECT_HAS_LEASE"
    assert str(lease) == "error(OBJECT_HAS_LEASE)"
    batch = uniform(3, McStatus.TIMEOUT)
    assert len(batch) == 3 and all(r.code_name == "TIMEOUT" for r in batch)


def test_config_validates_fields_by_name() -> None:
    cfg = MooncakeConfig("127.0.0.1:50051", "http://127.0.0.1:8080/metadata", protocol="TCP")  # type: ignore[arg-type]
    assert cfg.protocol is Protocol.TCP
    assert cfg.master_host_port == ("127.0.0.1", 50051)
    assert cfg.metadata_host_port == ("127.0.0.1", 8080)
    assert MooncakeConfig("h:1", "P2PHANDSHAKE").metadata_host_port is None
    cases = {
        "master_address": dict(master_address="no-port"),
        "op_timeout_s": dict(op_timeout_s=0),
        "global_segment_size": dict(global_segment_size=-1),
        "protocol": dict(protocol="carrier-pigeon"),
        "device_name": dict(protocol="rdma"),
        "num_op_threads": dict(num_op_threads=0),
        "split_calls": dict(split_calls=0),
    }
    for field_name, override in cases.items():
        kwargs: dict[str, object] = dict(master_address="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata")
        kwargs.update(override)
        with pytest.raises(MooncakeConfigError, match=field_name):
            MooncakeConfig(**kwargs)  # type: ignore[arg-type]


def test_client_construction_does_no_io_and_refuses_use_before_setup() -> None:
    client = MooncakeStoreClient(MooncakeConfig("127.0.0.1:1", "http://127.0.0.1:2/metadata"))
    assert not client.is_open
    with pytest.raises(Exception, match="setup"):
        client.batch_exists(["k"])
    client.close()
    client.close()  # idempotent, even without setup


def test_batch_interpretation_fast_paths_match_per_key_results() -> None:
    from kvbridge.backends.mooncake import interpret_get_batch, interpret_put_batch

    sizes = [64, 64, 128, 64]
    assert interpret_put_batch([0, 0, 0, 0], sizes) == [interpret_put(0, n) for n in sizes]
    assert interpret_put_batch([0] * 3, [32] * 3) == [KeyResult(KeyStatus.OK, 0, 32)] * 3
    mixed = interpret_put_batch([0, -200, 0, 0], sizes)
    assert [r.ok for r in mixed] == [True, False, True, True]
    assert mixed[1].code == McStatus.NO_AVAILABLE_HANDLE and mixed[2].nbytes == 128
    assert interpret_get_batch(list(sizes), sizes) == [interpret_get(n, n) for n in sizes]
    short = interpret_get_batch([64, 64, 100, -704], sizes)
    assert [r.code for r in short] == [0, 0, McStatus.SIZE_MISMATCH, McStatus.OBJECT_NOT_FOUND]
    assert interpret_put_batch([], []) == [] and interpret_get_batch([], []) == []


def test_batch_validation_names_the_bad_field() -> None:
    from kvbridge.backends.mooncake import _check_batch

    assert _check_batch(("k1", "k2"), (1, 2), (3, 4)) == (["k1", "k2"], [1, 2], [3, 4])
    with pytest.raises(MooncakeConfigError, match=r"keys\[1\]"):
        _check_batch(["k1", ""], [1, 2], [3, 4])
    with pytest.raises(MooncakeConfigError, match=r"keys\[0\]"):
        _check_batch([b"k1"], [1], [3])  # type: ignore[list-item]
    # an exact-int check: bool is refused as an address by the non-null test after int()
    with pytest.raises(MooncakeConfigError, match=r"ptrs\[0\]"):
        _check_batch(["k1"], [False], [3])
    with pytest.raises(MooncakeConfigError, match="ptrs must be ints"):
        _check_batch(["k1"], ["0x10"], [3])  # type: ignore[list-item]
    with pytest.raises(MooncakeConfigError, match=r"sizes\[1\]"):
        _check_batch(["k1", "k2"], [1, 2], [3, 0])
