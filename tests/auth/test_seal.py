"""The cluster secret and sealed messages: what authenticates, what does not, and why."""

from __future__ import annotations

import os
import stat

import pytest

from kvbridge.auth import (
    HEADER_BYTES,
    AuthError,
    BindRefused,
    ClusterAuth,
    Label,
    Secret,
    SecretError,
    check_bind,
    insecure_from_env,
    is_loopback,
    is_sealed,
    new_secret,
    resolve_secret,
)
from kvbridge.auth.seal import NonceWindow, open_sealed, seal

SECRET = Secret.from_value("s" * 32, "test")


def test_a_request_opens_once_and_its_reply_only_for_its_nonce() -> None:
    auth = ClusterAuth(SECRET)
    wire, nonce = auth.seal_request(Label.CONTROL, b"body")
    assert len(wire) == HEADER_BYTES + 4 and is_sealed(wire)
    opened = auth.open_request(Label.CONTROL, wire)
    assert opened.body == b"body" and opened.nonce == nonce
    reply = auth.seal_reply(Label.CONTROL, nonce, b"answer")
    assert auth.open_reply(Label.CONTROL, nonce, reply) == b"answer"
    other_wire, other_nonce = auth.seal_request(Label.CONTROL, b"body")
    with pytest.raises(AuthError, match="tag does not match"):
        auth.open_reply(Label.CONTROL, other_nonce, reply)  # a reply to another request
    with pytest.raises(AuthError, match="replayed"):
        auth.open_request(Label.CONTROL, wire)


def test_a_message_for_one_socket_does_not_open_on_another() -> None:
    auth = ClusterAuth(SECRET)
    wire, nonce = auth.seal_request(Label.CONTROL, b"shutdown")
    with pytest.raises(AuthError, match="tag does not match"):
        auth.open_request(Label.SIDE_CHANNEL, wire)
    reply = auth.seal_reply(Label.CONTROL, nonce, b"x")
    with pytest.raises(AuthError, match="tag does not match"):
        auth.open_request(Label.CONTROL, reply)  # a reply is not a request


@pytest.mark.parametrize("where", [0, 5, 12, 20, 30, HEADER_BYTES, HEADER_BYTES + 3])
def test_any_changed_byte_fails(where: int) -> None:
    auth = ClusterAuth(SECRET)
    wire = bytearray(auth.seal_request(Label.SIDE_CHANNEL, b"metadata please")[0])
    wire[where] ^= 0x01
    with pytest.raises(AuthError):
        auth.open_request(Label.SIDE_CHANNEL, bytes(wire))


def test_another_secret_and_no_seal_are_refused() -> None:
    ours, theirs = ClusterAuth(SECRET), ClusterAuth(Secret.from_value("t" * 32))
    with pytest.raises(AuthError, match="tag does not match"):
        ours.open_request(Label.CONTROL, theirs.seal_request(Label.CONTROL, b"x")[0])
    with pytest.raises(AuthError, match="not sealed"):
        ours.open_request(Label.CONTROL, b"\x81\xa2op\xa4info")
    with pytest.raises(AuthError, match="without authentication"):
        ours.open_reply(Label.CONTROL, bytes(16), b"\x81\xa2ok\xc3")


def test_the_clock_window_bounds_a_request_and_nonces_expire() -> None:
    window = NonceWindow(max_skew_s=60.0, capacity=4)
    now = 1_800_000_000.0
    with pytest.raises(AuthError, match="clock skew \\+61 s"):
        window.admit(b"a" * 16, int((now + 61) * 1000), now)
    with pytest.raises(AuthError, match="clock skew -61 s"):
        window.admit(b"a" * 16, int((now - 61) * 1000), now)
    for i in range(4):
        window.admit(bytes([i]) * 16, int(now * 1000), now)
    with pytest.raises(AuthError, match="busy") as busy:
        window.admit(b"z" * 16, int(now * 1000), now)
    assert busy.value.retryable
    later = now + 121  # two windows on: the old nonces cannot be inside the window again
    window.admit(b"z" * 16, int(later * 1000), later)
    assert len(window) == 1


def test_only_authenticated_nonces_take_room_in_the_window() -> None:
    auth = ClusterAuth(SECRET, capacity=2)
    stranger = ClusterAuth(Secret.from_value("t" * 32))
    for _ in range(100):
        with pytest.raises(AuthError):
            auth.open_request(Label.CONTROL, stranger.seal_request(Label.CONTROL, b"x")[0])
    assert len(auth.window) == 0
    auth.open_request(Label.CONTROL, auth.seal_request(Label.CONTROL, b"x")[0])


def test_the_seal_is_deterministic_given_its_clock_and_nonce() -> None:
    a = seal(SECRET, b"control", b"x", sent_ms=1, nonce=bytes(16))[0]
    assert a == seal(SECRET, b"control", b"x", sent_ms=1, nonce=bytes(16))[0]
    assert open_sealed(SECRET, b"control", a).sent_ms == 1


def test_a_secret_is_never_shown() -> None:
    secret = Secret.from_value("correct horse battery staple", "test")
    text = repr(secret) + str(secret) + repr(ClusterAuth(secret))
    assert "horse" not in text and secret.fingerprint in text
    with pytest.raises(TypeError):
        import pickle
        pickle.dumps(secret)
    assert Secret.from_value(" correct horse battery staple\n").same_as(secret)
    assert not Secret.from_value("x" * 16).same_as(secret)


def test_secret_sources_and_their_errors(tmp_path) -> None:
    with pytest.raises(SecretError, match="at least 16"):
        Secret.from_value("short")
    path = tmp_path / "secret"
    value = new_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(value) == 64
    with pytest.raises(FileExistsError):
        new_secret(path)
    assert Secret.from_file(path).same_as(Secret.from_value(value))
    with pytest.raises(SecretError, match="cannot read"):
        Secret.from_file(tmp_path / "missing")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    with pytest.raises(SecretError, match="one line"):
        Secret.from_file(big)
    with pytest.raises(SecretError, match="not a regular file"):
        Secret.from_file(tmp_path)
    env = {"KVBRIDGE_SECRET_FILE": str(path)}
    found = resolve_secret(environ=env)
    assert found is not None and found.same_as(Secret.from_value(value))
    assert "secret file" in found.source
    from_value = resolve_secret(environ={"KVBRIDGE_SECRET": "v" * 20})
    assert from_value is not None and from_value.source == "environment KVBRIDGE_SECRET"
    assert resolve_secret(environ={}) is None
    explicit = resolve_secret("e" * 20, environ=env)  # an explicit value wins over env
    assert explicit is not None and explicit.same_as(Secret.from_value("e" * 20))
    with pytest.raises(SecretError, match="both are set"):
        resolve_secret(environ={**env, "KVBRIDGE_SECRET": "v" * 20})
    with pytest.raises(SecretError, match="not both"):
        resolve_secret("e" * 20, str(path), environ={})


def test_loopback_binds_need_nothing_and_others_a_secret_or_the_insecure_flag() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, False, False, "x")
    for host in ("0.0.0.0", "*", "10.0.0.5", "::", "prefill-0.cluster"):
        assert not is_loopback(host)
        with pytest.raises(BindRefused, match="insecure_no_auth"):
            check_bind(host, False, False, "the control port")
        check_bind(host, True, False, "x")
        check_bind(host, False, True, "x")
    assert insecure_from_env({"KVBRIDGE_INSECURE_NO_AUTH": "1"})
    assert not insecure_from_env({"KVBRIDGE_INSECURE_NO_AUTH": "0"})
    assert not insecure_from_env({})


def test_the_tag_is_the_documented_hmac() -> None:
    """An independent reading of the layout in kvbridge.auth.seal's docstring."""
    import hashlib
    import hmac
    import struct

    raw = b"golden-cluster-secret-0123456789"
    key = hmac.new(raw, b"kvbridge cluster key v1", hashlib.sha256).digest()
    nonce, sent, body = bytes(range(16)), 1_767_225_600_000, b"payload"
    head = b"KVA1" + struct.pack(">Q", sent) + nonce
    bound = bytes(range(100, 116))
    tag = hmac.new(key, b"kvbridge-auth-v1\0" + b"control/reply" + b"\0" + bytes([16]) + bound
                   + head + body, hashlib.sha256).digest()
    wire, _ = seal(Secret.from_value(raw), b"control/reply", body, bound=bound, sent_ms=sent,
                   nonce=nonce)
    assert wire == head + tag + body
