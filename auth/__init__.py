"""Cluster authentication: who may talk to a kvbridge engine.

One cluster secret, configured once per host (a file named by
``KVBRIDGE_SECRET_FILE``, the value in ``KVBRIDGE_SECRET``, a connector's
``auth_secret_file``, ``kvbridge serve --secret-file``), authenticates every
request a peer sends to an engine's sockets that hand something out or act:
the side channel (NIXL agent metadata), the control port, the events replay
ROUTER, and a NIXL consumer's ``hello``. Each such message is *sealed*
(:mod:`kvbridge.auth.seal`): a 60-byte header with the sender's clock, a
random nonce and an HMAC-SHA256 tag over the label of the socket, the header
and the body; a reply is sealed bound to the request's nonce, so a client also
knows it talks to a member. A server admits a nonce once within the clock
window (:class:`~kvbridge.auth.seal.NonceWindow`), so a captured request
cannot be replayed.

Without a secret kvbridge serves loopback only: :func:`check_bind` refuses a
non-loopback address unless the operator passes the flag whose name says what
it does (``insecure_no_auth`` / ``--insecure-no-auth`` /
``KVBRIDGE_INSECURE_NO_AUTH=1``).

What it does not do: encrypt. Bodies travel in the clear (as the KV itself
does over NIXL); the seal gives membership and integrity, not
confidentiality. The KV events PUB stream (vLLM's protocol, one way) is not
authenticated.

The bottom of the package: imports nothing of kvbridge.
"""

from kvbridge.auth.policy import (
    INSECURE_ENV,
    SECRET_ENV,
    SECRET_FILE_ENV,
    BindRefused,
    check_bind,
    endpoint_host,
    insecure_from_env,
    is_loopback,
    resolve_auth,
    resolve_secret,
)
from kvbridge.auth.seal import (
    HEADER_BYTES,
    MAX_SKEW_S,
    AuthError,
    ClusterAuth,
    Label,
    Sealed,
    is_sealed,
)
from kvbridge.auth.secret import MIN_SECRET_BYTES, Secret, SecretError, new_secret

__all__ = [
    "HEADER_BYTES", "INSECURE_ENV", "MAX_SKEW_S", "MIN_SECRET_BYTES", "SECRET_ENV",
    "SECRET_FILE_ENV", "AuthError", "BindRefused", "ClusterAuth", "Label", "Secret",
    "SecretError", "Sealed", "check_bind", "endpoint_host", "insecure_from_env", "is_loopback", "is_sealed",
    "new_secret", "resolve_auth", "resolve_secret",
]
