"""kvbridge's Mooncake HTTP metadata server: the protocol, its bounds, its bind, its shutdown.

Real sockets on this host throughout; the master-level tests run a real
``mooncake_master`` and real Mooncake clients against the metadata server
kvbridge runs in its place of the embedded one.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator

import pytest

from kvbridge.backends.mooncake.master import (
    MooncakeMaster,
    listening_addresses,
    port_accepts,
)
from kvbridge.backends.mooncake.metadata import (
    MetadataHTTPServer,
    MetadataLimits,
    MetadataStore,
    PutResult,
    bind_listener,
)
from tests.conftest import require

SMALL = MetadataLimits(max_key_bytes=64, max_value_bytes=1024, max_total_bytes=4096, max_keys=4,
                       max_connections=3, request_timeout_s=0.5)


@pytest.fixture
def server() -> Iterator[MetadataHTTPServer]:
    srv = MetadataHTTPServer(bind_listener("127.0.0.1", 0), SMALL).start()
    yield srv
    srv.close()


def _port(srv: MetadataHTTPServer) -> int:
    return int(srv.server_address[1])


def _call(port: int, method: str, target: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _raw(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes (bounded by a 30 s socket timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


# ---- the pure store ---------------------------------------------------------------------
def test_store_keeps_its_bounds_and_a_refused_put_changes_nothing() -> None:
    store = MetadataStore(MetadataLimits(max_value_bytes=1024, max_total_bytes=2048, max_keys=3))
    assert store.put("mooncake/rpc_meta/a", b"x" * 10) is PutResult.STORED
    assert store.put("mooncake/rpc_meta/a", b"y") is PutResult.DUPLICATE_RPC_META
    assert store.get("mooncake/rpc_meta/a") == b"x" * 10
    assert store.put("ram/a", b"1" * 1000) is PutResult.STORED
    assert store.put("ram/a", b"2" * 900) is PutResult.STORED  # overwrite: not rpc_meta
    assert store.put("ram/b", b"3" * 1025) is PutResult.TOO_LARGE
    assert store.put("ram/b", b"3" * 1024) is PutResult.STORED
    assert store.total_bytes == 10 + 900 + 1024
    assert store.put("ram/c", b"4") is PutResult.FULL  # a 4th key
    assert store.put("ram/a", b"5" * 1014) is PutResult.STORED  # 2048 bytes: exactly full
    assert store.put("ram/a", b"6" * 1015) is PutResult.FULL  # one byte over the total
    assert store.get("ram/a") == b"5" * 1014 and len(store) == 3 and store.total_bytes == 2048
    assert store.delete("ram/a") and not store.delete("ram/a")
    assert store.total_bytes == 10 + 1024


# ---- the HTTP protocol --------------------------------------------------------------------
def test_protocol_is_mooncakes(server: MetadataHTTPServer) -> None:
    port = _port(server)
    key = "/metadata?key=mooncake%2Fram%2F127.0.0.1%3A1234"
    assert _call(port, "GET", key)[0] == 404
    assert _call(port, "PUT", key, b'{"segment": 1}')[0] == 200
    assert _call(port, "GET", key) == (200, b'{"segment": 1}')
    assert server.store.get("mooncake/ram/127.0.0.1:1234") == b'{"segment": 1}'  # URL-decoded
    rpc = "/metadata?key=mooncake%2Frpc_meta%2Fhost%3A1"
    assert _call(port, "PUT", rpc, b"a")[0] == 200
    assert _call(port, "PUT", rpc, b"b")[0] == 400  # an RPC endpoint is not taken over
    assert _call(port, "GET", rpc) == (200, b"a")
    assert _call(port, "DELETE", key)[0] == 200
    assert _call(port, "DELETE", key)[0] == 404
    assert _call(port, "GET", "/metadata")[0] == 400
    assert _call(port, "GET", "/metadata?key=%20")[0] == 400
    assert _call(port, "GET", "/other?key=a")[0] == 404
    assert _call(port, "POST", key, b"x")[0] == 405


def test_keep_alive_serves_several_requests_on_one_connection(server: MetadataHTTPServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", _port(server), timeout=30)
    try:
        for i in range(3):
            conn.request("PUT", f"/metadata?key=k{i}", body=b"v" * i)
            assert conn.getresponse().read() == b"metadata updated"
        conn.request("GET", "/metadata?key=k2")
        assert conn.getresponse().read() == b"vv"
    finally:
        conn.close()


# ---- bounds -------------------------------------------------------------------------------
def test_oversized_body_is_refused_unread_and_the_server_keeps_serving(
        server: MetadataHTTPServer) -> None:
    port = _port(server)
    # Declared 1 TB, 1 KiB sent: the answer comes at once and the body is never read.
    reply = _raw(port, b"PUT /metadata?key=big HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Length: 1000000000000\r\n\r\n" + b"z" * 1024)
    assert reply.startswith(b"HTTP/1.1 413 ")
    # With Expect: 100-continue the refusal comes before the client sends anything.
    reply = _raw(port, b"PUT /metadata?key=big HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                       b"Content-Length: 1025\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in reply
    assert _raw(port, b"PUT /metadata?key=c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"5\r\nhello\r\n0\r\n\r\n").startswith(b"HTTP/1.1 411 ")
    assert _raw(port, b"PUT /metadata?key=n HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 411 ")
    assert _call(port, "GET", "/metadata?key=" + "k" * 65)[0] == 414
    assert server.counters["refused_too_large"] == 2
    assert server.store.get("big") is None and len(server.store) == 0
    assert _call(port, "PUT", "/metadata?key=ok", b"v" * 1024)[0] == 200  # exactly the limit
    assert _call(port, "GET", "/metadata?key=ok") == (200, b"v" * 1024)


def test_total_bytes_and_key_count_are_bounded(server: MetadataHTTPServer) -> None:
    port = _port(server)
    for i in range(4):
        assert _call(port, "PUT", f"/metadata?key=k{i}", b"x" * 1000)[0] == 200
    assert _call(port, "PUT", "/metadata?key=k4", b"x")[0] == 507  # a 5th key
    assert _call(port, "PUT", "/metadata?key=k0", b"x" * 1024)[0] == 200  # 4024 bytes
    assert _call(port, "PUT", "/metadata?key=k1", b"x" * 1100)[0] == 413  # over the value limit
    assert _call(port, "DELETE", "/metadata?key=k3")[0] == 200
    assert _call(port, "PUT", "/metadata?key=k4", b"y")[0] == 200
    assert server.store.total_bytes == 1024 + 1000 + 1000 + 1 and server.counters["refused_full"] == 1


def test_connections_beyond_the_limit_are_closed_and_the_server_recovers(
        server: MetadataHTTPServer) -> None:
    port = _port(server)
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
    try:
        for sock in held:  # each has a thread now: a request on it is answered
            sock.sendall(b"GET /metadata?key=none HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 404 ")
        assert _raw(port, b"GET /metadata?key=none HTTP/1.1\r\n\r\n") == b""  # closed at accept
        assert server.counters["refused_connections"] >= 1
    finally:
        for sock in held:
            sock.close()
    # The held connections' threads end when they see EOF; then a slot is free again.
    for _ in range(300):
        status = _raw(port, b"GET /metadata?key=none HTTP/1.1\r\nConnection: close\r\n\r\n")
        if status:
            break
        threading.Event().wait(0.05)
    assert status.startswith(b"HTTP/1.1 404 ")


def test_a_stalled_request_is_dropped_after_the_request_timeout(server: MetadataHTTPServer) -> None:
    port = _port(server)
    # Body promised, 3 of 10 bytes sent, then silence: the server closes (timeout 0.5 s).
    assert _raw(port, b"PUT /metadata?key=slow HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc") == b""
    # Headers never finished: same.
    assert _raw(port, b"GET /metadata?key=slow HTTP/1.1\r\nHost") == b""
    assert server.store.get("slow") is None
    assert _call(port, "GET", "/metadata?key=slow")[0] == 404


def test_close_ends_idle_connections_joins_threads_and_frees_the_port() -> None:
    before = {t.ident for t in threading.enumerate()}
    limits = MetadataLimits(request_timeout_s=3600.0)  # an idle client would hold its thread
    srv = MetadataHTTPServer(bind_listener("127.0.0.1", 0), limits).start()
    port = _port(srv)
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    idle.request("PUT", "/metadata?key=a", body=b"1")
    assert idle.getresponse().read() == b"metadata updated"  # keep-alive: stays open
    srv.close()
    assert {t.ident for t in threading.enumerate()} <= before
    assert srv.socket.fileno() == -1 and not port_accepts("127.0.0.1", port)
    assert idle.sock is not None and idle.sock.recv(1) == b""  # the server ended it
    idle.close()
    srv.close()  # idempotent


# ---- under a real master ------------------------------------------------------------------
@pytest.fixture(scope="module")
def bounded_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")
    log = tmp_path_factory.mktemp("mc") / "master.log"
    limits = MetadataLimits(max_value_bytes=64 << 10, request_timeout_s=5.0)
    with MooncakeMaster(log_path=log, metadata_limits=limits) as master:
        yield master


def test_every_port_listens_on_loopback_only(bounded_master: MooncakeMaster) -> None:
    # the kernel's own table of listening sockets (tests bind and connect on 127.0.0.1 only)
    for port in bounded_master.ports.rpc_port, bounded_master.ports.http_port, \
            bounded_master.ports.metrics_port:
        assert listening_addresses(port) == ["127.0.0.1"]
        assert port_accepts("127.0.0.1", port)


def test_host_must_be_an_address_of_this_machine() -> None:
    with pytest.raises(ValueError, match="IP address"):
        MooncakeMaster(host="localhost")
    with pytest.raises(ValueError, match="cannot be bound"):
        MooncakeMaster(host="203.0.113.77")


def test_mooncake_clients_put_and_get_through_it_and_oversized_puts_are_refused(
        bounded_master: MooncakeMaster) -> None:
    torch = require("torch")
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

    config = MooncakeConfig(bounded_master.rpc_address, bounded_master.metadata_url,
                            global_segment_size=32 << 20, local_buffer_size=8 << 20,
                            op_timeout_s=30.0)
    url = bounded_master.metadata_url.removeprefix(f"http://127.0.0.1:{bounded_master.http_port}")
    with MooncakeStoreClient(config) as client:
        value = torch.arange(1 << 16, dtype=torch.uint8)
        client.register_buffer(value.data_ptr(), value.nbytes)
        out = torch.zeros_like(value)
        client.register_buffer(out.data_ptr(), out.nbytes)
        try:
            key = "mcbind/metadata-test"
            assert client.batch_put_from([key], [value.data_ptr()], [value.nbytes])[0].ok
            # a value above the limit (64 KiB here): refused, nothing stored, server still serving
            status, _ = _call(bounded_master.http_port, "PUT", url + "?key=huge",
                              b"h" * ((64 << 10) + 1))
            assert status == 413
            assert _call(bounded_master.http_port, "GET", url + "?key=huge")[0] == 404
            assert client.batch_get_into([key], [out.data_ptr()], [out.nbytes])[0].ok
            assert torch.equal(out, value)
        finally:
            client.unregister_buffer(out.data_ptr())
            client.unregister_buffer(value.data_ptr())
    assert bounded_master.is_serving()


_OWNER = """
import json, sys
from kvbridge.backends.mooncake.master import MooncakeMaster
master = MooncakeMaster().start()
print(json.dumps({"pid": master.pid, "metadata_pid": master.metadata_pid,
                  "ports": [master.rpc_port, master.http_port, master.metrics_port]}), flush=True)
sys.stdin.read()  # until killed
"""


def test_both_processes_die_with_a_killed_owner_and_free_their_ports() -> None:
    import json
    import os
    import subprocess
    import sys
    import time

    require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        assert all(port_accepts("127.0.0.1", p) for p in info["ports"])
        owner.kill()  # no stop(), no __exit__: only PR_SET_PDEATHSIG is left to act
        owner.wait(timeout=30)
        for pid in info["pid"], info["metadata_pid"]:
            for _ in range(600):  # bounded wait (30 s) for SIGTERM to take effect
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, 9)
                pytest.fail(f"pid {pid} outlived its owner")
        assert not any(port_accepts("127.0.0.1", p) for p in info["ports"])
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
