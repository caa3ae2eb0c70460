"""Where a secret comes from, and which addresses may be served without one."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping

from kvbridge.auth.seal import ClusterAuth
from kvbridge.auth.secret import Secret, SecretError

logger = logging.getLogger(__name__)

#: A file holding the cluster secret (preferred: the value stays out of ``ps`` and env dumps).
SECRET_FILE_ENV = "KVBRIDGE_SECRET_FILE"
#: The cluster secret itself.
SECRET_ENV = "KVBRIDGE_SECRET"
#: "1": serve non-loopback addresses without a secret (anyone who reaches them may act).
INSECURE_ENV = "KVBRIDGE_INSECURE_NO_AUTH"
_TRUE = ("1", "true", "yes", "on")


class BindRefused(ValueError):
    """A non-loopback bind without a secret and without the insecure flag."""


def resolve_secret(value: str | bytes | None = None, file: str | None = None, *,
                   environ: Mapping[str, str] | None = None) -> Secret | None:
    """The configured secret: an explicit file or value first, then the environment.

    Both a file and a value given at the same level is an error (which wins
    would be a guess). None when nothing is configured anywhere.
    """
    env = os.environ if environ is None else environ
    if value is not None and file is not None:
        raise SecretError("auth_secret / auth_secret_file", "give one of them, not both")
    if file is not None:
        return Secret.from_file(file)
    if value is not None:
        return Secret.from_value(value, "auth_secret")
    env_file, env_value = env.get(SECRET_FILE_ENV) or None, env.get(SECRET_ENV) or None
    if env_file is not None and env_value is not None:
        raise SecretError(f"{SECRET_FILE_ENV} / {SECRET_ENV}", "both are set; set one")
    if env_file is not None:
        return Secret.from_file(env_file)
    if env_value is not None:
        return Secret.from_value(env_value, f"environment {SECRET_ENV}")
    return None


def resolve_auth(value: str | bytes | None = None, file: str | None = None, *,
                 environ: Mapping[str, str] | None = None) -> ClusterAuth | None:
    """:func:`resolve_secret`'s secret, ready to seal and open (None: no secret)."""
    secret = resolve_secret(value, file, environ=environ)
    return ClusterAuth(secret) if secret is not None else None


def insecure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(INSECURE_ENV, "").strip().lower() in _TRUE


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, ``localhost``)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: it may reach other machines


def endpoint_host(endpoint: str) -> str:
    """The host a ZMQ endpoint binds (``tcp://H:P`` -> ``H``); ``ipc``/``inproc``: local."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return "localhost"
    return rest.rpartition(":")[0] or rest


def check_bind(host: str, authenticated: bool, insecure: bool, what: str) -> None:
    """Refuse to serve ``what`` on a non-loopback ``host`` unless it is ``authenticated``.

    ``insecure`` (the operator's explicit flag) lets it through with a warning.
    """
    if authenticated or is_loopback(host):
        return
    if insecure:
        logger.warning("%s listens on %s without authentication (insecure_no_auth): "
                       "anyone who reaches it may use it", what, host)
        return
    raise BindRefused(
        f"{what}: refusing to listen on {host} without a cluster secret; configure one "
        f"({SECRET_FILE_ENV}, auth_secret_file, --secret-file; make one with `kvbridge "
        f"auth new-secret`), bind 127.0.0.1, or pass the insecure_no_auth flag "
        f"(--insecure-no-auth, {INSECURE_ENV}=1) to serve it unauthenticated")
