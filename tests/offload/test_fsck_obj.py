"""fsck --obj against a real mooncake_master: the obj tier's pairs checked, broken ones removed.

Corruptions are made with the real client on the real objects: a block object
replaced by another key's bytes, a block evicted apart from its digests (an
orphan digest object), a torn digest object, a stray name under the tier's prefix.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fsck import FindingKind
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import OffloadError
from tests.conftest import require

require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")

from kvbridge.backends.mooncake import MooncakeStoreClient  # noqa: E402
from kvbridge.offload.fsck_obj import fsck_obj, list_keys  # noqa: E402
from kvbridge.offload.obj import ObjTier, run_obj_tier  # noqa: E402
from kvbridge.tools.cli import main as cli_main  # noqa: E402

BLOCK = 32 * 1024
LAYERS = 4
MiB = 1 << 20


@pytest.fixture(scope="module")
def client(mooncake_client) -> MooncakeStoreClient:
    return mooncake_client


def master_http(master) -> str:
    return master.metrics_url.rsplit("/", 1)[0]


def put_raw(client: MooncakeStoreClient, name: str, data: bytes) -> None:
    """Replace object ``name`` by ``data`` (Mooncake puts never overwrite: remove first)."""
    client.remove([name], force=True)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    client.register_buffer(ptr, len(data))
    try:
        (result,) = client.batch_put_from([name], [ptr], [len(data)])
        assert result.ok, result
    finally:
        client.unregister_buffer(ptr)


@pytest.fixture
def stored(client) -> Iterator[tuple[ObjTier, list[bytes]]]:
    """Four blocks stored by the real obj tier (digests on), in a namespace of their own."""
    tier = ObjTier(client, BLOCK, uuid.uuid4().hex[:16], num_layers=LAYERS)
    runner = run_obj_tier(tier)
    manager = OffloadManager(CpuTier(8, BLOCK, num_layers=LAYERS), [runner])
    keys = [b"fsck-obj|%d" % i for i in range(4)]
    spec = manager.prepare_store("w", keys)
    for key, slot in zip(spec.keys, spec.slots, strict=True):
        manager.primary.view(slot)[:] = block_content(key, BLOCK)
    manager.complete_store(spec.keys)
    manager.request_finished("w")
    assert manager.wait_idle(30) and runner.stats.stores_ok == 4
    yield tier, keys
    manager.shutdown()
    names = [tier.object_name(k) for k in keys] + [tier.digest_name(k) for k in keys]
    client.remove(names, force=True)      # the shared master: leave no layout behind


def ours(report, tier: ObjTier) -> list[tuple[str, str]]:
    return sorted((f.kind.value, f.path) for f in report.findings
                  if f.path.startswith(tier.prefix))


def test_a_clean_tier_is_verified_pair_by_pair(client, mooncake_master, stored) -> None:
    tier, keys = stored
    listed = list_keys(master_http(mooncake_master))
    assert {tier.object_name(k) for k in keys} | {tier.digest_name(k) for k in keys} \
        <= set(listed)
    fp = tier.prefix.split("/")[2]
    report = fsck_obj(client, master_http(mooncake_master), fingerprint=fp)
    assert ours(report, tier) == [] and report.layouts[fp] == BLOCK
    assert report.blocks_verified >= 4


def test_every_corruption_is_found_and_repair_removes_exactly_the_broken(
        client, mooncake_master, stored) -> None:
    tier, keys = stored
    fp = tier.prefix.split("/")[2]
    put_raw(client, tier.object_name(keys[1]), block_content(keys[0], BLOCK))  # another key's
    client.remove([tier.object_name(keys[2])], force=True)                     # evicted alone
    put_raw(client, tier.digest_name(keys[3]), b"\x00" * 64)                   # torn digests
    stray = tier.prefix + "not-a-block-name"
    put_raw(client, stray, b"x" * 16)
    url = master_http(mooncake_master)

    report = fsck_obj(client, url, fingerprint=fp)
    assert ours(report, tier) == sorted([
        (FindingKind.DIGEST_MISMATCH.value, tier.object_name(keys[1])),
        (FindingKind.ORPHAN_DIGEST.value, tier.digest_name(keys[2])),
        (FindingKind.CORRUPT_HEADER.value, tier.object_name(keys[3])),
        (FindingKind.UNKNOWN_FILE.value, stray)])
    mismatch = next(f for f in report.findings if f.kind is FindingKind.DIGEST_MISMATCH
                    and f.path == tier.object_name(keys[1]))
    assert mismatch.detail.startswith("layer 0 of 4")
    assert not any(f.repaired for f in report.findings)        # a dry run removes nothing
    assert client.batch_exists([tier.object_name(keys[1])]) == [True]

    report = fsck_obj(client, url, fingerprint=fp, repair=True)
    repaired = sorted((f.kind.value, f.path) for f in report.findings
                      if f.path.startswith(tier.prefix) and f.repaired)
    assert repaired == sorted([(FindingKind.DIGEST_MISMATCH.value, tier.object_name(keys[1])),
                               (FindingKind.ORPHAN_DIGEST.value, tier.digest_name(keys[2])),
                               (FindingKind.CORRUPT_HEADER.value, tier.object_name(keys[3]))])
    gone = [tier.object_name(keys[1]), tier.digest_name(keys[1]), tier.digest_name(keys[2]),
            tier.object_name(keys[3]), tier.digest_name(keys[3])]
    assert client.batch_exists(gone) == [False] * len(gone)
    assert client.batch_exists([tier.object_name(keys[0]), tier.digest_name(keys[0]),
                                stray]) == [True, True, True]   # the good pair, the unknown
    after = fsck_obj(client, url, fingerprint=fp)
    assert ours(after, tier) == [(FindingKind.UNKNOWN_FILE.value, stray)]
    client.remove([stray], force=True)


def test_cli_obj_reports_json_and_checks_its_flags(client, mooncake_master, stored,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    tier, keys = stored
    fp = tier.prefix.split("/")[2]
    put_raw(client, tier.object_name(keys[0]), block_content(keys[1], BLOCK))
    base = ["offload", "fsck", "--obj", "--master", mooncake_master.rpc_address,
            "--metadata", mooncake_master.metadata_url,
            "--master-http", master_http(mooncake_master), "--fingerprint", fp]
    assert cli_main([*base, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["counts"]["digest_mismatch"] >= 1
    assert any(f["path"] == tier.object_name(keys[0]) and f["broken"]
               for f in out["findings"])
    # other tests' layouts on the shared master are reported (foreign_layout), so the exit
    # status says "problems"; ours is repaired
    cli_main([*base, "--repair"])
    assert "digest_mismatch   repaired" in capsys.readouterr().out
    cli_main([*base, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert not [f for f in out["findings"] if f["path"].startswith(tier.prefix)]
    assert cli_main(["offload", "fsck", "--obj", "--master", "127.0.0.1:1"]) == 2
    assert "--obj needs --metadata, --master-http" in capsys.readouterr().err
    assert cli_main(["offload", "fsck"]) == 2
    assert "give the store directory PATH" in capsys.readouterr().err


# ------------------------------------------------------------ a hostile key-listing port

class HostileHttp:
    """A port on 127.0.0.1 that answers ``GET /get_all_keys`` badly, on a thread of its
    own: ``trickle`` (one byte every 50 ms, in the headers or in the body) or ``endless``
    (keys as fast as the client reads them). It gives up after ``give_up_s`` so that a
    client without bounds ends too (with a wrong answer the test then refuses)."""

    def __init__(self, mode: str, give_up_s: float = 20.0) -> None:
        self.mode = mode
        self.give_up_s = give_up_s
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self.listener.settimeout(self.give_up_s)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        give_up = time.monotonic() + self.give_up_s
        with conn:
            conn.settimeout(self.give_up_s)
            try:
                conn.recv(4096)                      # the request
                if self.mode == "trickle-headers":
                    conn.sendall(b"HTTP/1.0 200 OK\r\nX-Slow: ")
                    chunk = b"x"
                elif self.mode == "trickle-body":
                    conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
                    chunk = b"k"
                else:
                    conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
                    chunk = b"".join(b"someone-else/%032x\n" % i for i in range(1000))
                while time.monotonic() < give_up:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
                    if self.mode != "endless":
                        time.sleep(0.05)
            except OSError:
                return                               # the client went away: done

    def close(self) -> None:
        self.listener.close()
        self.thread.join(self.give_up_s + 5)


@pytest.mark.parametrize("mode", ["trickle-headers", "trickle-body"])
def test_a_trickling_key_list_ends_at_the_overall_deadline(mode: str) -> None:
    """Before: each read had a 10 s timeout and no deadline over them; a byte every 2 s
    held fsck for as long as the port liked."""
    server = HostileHttp(mode)
    try:
        with pytest.raises(OffloadError) as info:
            list_keys(server.url, timeout_s=1.0)
        assert info.value.field == "list_deadline", info.value
        assert "did not list its keys within 1 s (--list-deadline" in info.value.reason
        assert server.sent > 0                       # it was trickling, not silent
    finally:
        server.close()


def test_an_endless_key_list_is_refused_at_max_keys() -> None:
    """Before: read up to 256 MiB (millions of keys) before it was refused."""
    server = HostileHttp("endless")
    try:
        with pytest.raises(OffloadError) as info:
            list_keys(server.url, timeout_s=60.0, max_keys=5000)
        assert info.value.field == "max_keys", info.value
        assert "lists more than 5000 keys (--max-keys)" in info.value.reason
    finally:
        server.close()
    # what it made the server send: the bound plus socket buffers, far from 256 MiB
    assert server.sent < 64 << 20


def test_cli_obj_names_the_bound_it_hit_and_exits_1(mooncake_master,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base = ["offload", "fsck", "--obj", "--master", mooncake_master.rpc_address,
            "--metadata", mooncake_master.metadata_url]
    server = HostileHttp("trickle-body")
    try:
        assert cli_main([*base, "--master-http", server.url, "--list-deadline", "1"]) == 1
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.startswith("kvbridge offload fsck: list_deadline: the master at "
                          f"http://{server.url} did not list its keys within 1 s"), err
    server = HostileHttp("endless")
    try:
        assert cli_main([*base, "--master-http", server.url, "--max-keys", "100"]) == 1
    finally:
        server.close()
    assert "max_keys: the master at" in capsys.readouterr().err
    assert cli_main([*base, "--master-http", "127.0.0.1:1", "--max-keys", "0"]) == 2
    assert "--list-deadline and --max-keys must be > 0" in capsys.readouterr().err
