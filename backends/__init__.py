"""Thin adapters around the real transport libraries (NIXL, Mooncake).

These modules import nothing else of kvbridge, so `offload` (whose `obj` tier
needs Mooncake) and `connectors` can both use them without an upward import.

Environment defaults (:func:`env_defaults`, applied on import unless the user
set the variable): they must be in place before the first UCX agent exists,
and they never switch a fast path off on a real fleet:

* ``UCX_MODULES=^ib`` **only on a host without InfiniBand/RoCE devices**
  (``/sys/class/infiniband`` empty): there the ib module is useless, and
  without it every process that made a UCX agent segfaults at exit (see
  docs/backends.md, "Environment variables"); on an RDMA host it would force TCP,
  so it is not set there.
* on a host with NVIDIA GPUs: ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` (a READ over
  CUDA IPC without NVLink otherwise may fall back to TCP), and ``cuda_copy``
  added to a ``UCX_TLS`` the user restricted without it (UCX cannot move VRAM
  without it). ``UCX_RCACHE_MAX_UNRELEASED=1024`` as vLLM's NixlConnector sets.
* everywhere: ``UCX_DEBUG_SIGNO=0`` (UCX would take SIGHUP for its debug
  handler), ``NIXL_LOG_LEVEL=WARN``, ``MC_LOG_LEVEL=WARNING``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

_ENV_DEFAULTS = {
    "NIXL_LOG_LEVEL": "WARN",
    "MC_LOG_LEVEL": "WARNING",
    # UCX installs a debug handler on SIGHUP when an agent starts, replacing the
    # process's own: a hang-up would be swallowed (an engine under a closed terminal
    # would keep running, one that handles SIGHUP would never see it)
    "UCX_DEBUG_SIGNO": "0",
}

#: UCX transport names that move CUDA memory (any one of them in UCX_TLS is enough)
_CUDA_TLS = ("cuda_copy", "cuda", "all")
#: UCX transport names that use InfiniBand / RoCE verbs
RDMA_TLS = ("rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs",
            "ud_mlx5", "dc", "dc_x", "dc_mlx5", "ib", "all")


def infiniband_devices(root: str | os.PathLike[str] = "/") -> list[str]:
    """InfiniBand / RoCE devices of this host (``<root>/sys/class/infiniband/*``)."""
    path = Path(root) / "sys" / "class" / "infiniband"
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError:
        return []


def nvidia_gpus(root: str | os.PathLike[str] = "/") -> list[str]:
    """NVIDIA GPUs the driver exposes (``<root>/proc/driver/nvidia/gpus/*``, else
    ``<root>/dev/nvidia<N>``): checked without importing CUDA."""
    base = Path(root)
    try:
        found = sorted(p.name for p in (base / "proc" / "driver" / "nvidia" / "gpus").iterdir())
    except OSError:
        found = []
    if found:
        return found
    try:
        return sorted(p.name for p in (base / "dev").glob("nvidia[0-9]*"))
    except OSError:
        return []


def _tls_items(value: str) -> tuple[bool, list[str]]:
    negated = value.startswith("^")
    return negated, [t.strip() for t in value.lstrip("^").split(",") if t.strip()]


def env_defaults(environ: MutableMapping[str, str] | None = None,
                 root: str | os.PathLike[str] = "/") -> dict[str, str]:
    """The variables to set for this host, given ``environ`` (what the user set wins,
    except that ``cuda_copy`` is added to a restricted ``UCX_TLS`` on a GPU host).

    ``root`` is where ``sys``, ``proc`` and ``dev`` are looked up (a test passes a
    temporary tree)."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in _ENV_DEFAULTS.items() if k not in env}
    if "UCX_MODULES" not in env and not infiniband_devices(root):
        out["UCX_MODULES"] = "^ib"
    if nvidia_gpus(root):
        for key, value in (("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y"),
                           ("UCX_RCACHE_MAX_UNRELEASED", "1024")):
            if key not in env:
                out[key] = value
        tls = env.get("UCX_TLS")
        if tls:
            negated, items = _tls_items(tls)
            if negated and "cuda_copy" in items:
                rest = [t for t in items if t != "cuda_copy"]
                out["UCX_TLS"] = "^" + ",".join(rest) if rest else "all"
            elif not negated and not any(t in _CUDA_TLS for t in items):
                out["UCX_TLS"] = ",".join([*items, "cuda_copy"])
    return out


def tcp_only(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Why UCX cannot use InfiniBand/RoCE under ``environ`` (None if it can)."""
    env = os.environ if environ is None else environ
    modules = env.get("UCX_MODULES")
    if modules:
        negated, items = _tls_items(modules)
        if negated == ("ib" in items):  # "^ib,...", or a module list without ib
            return f"UCX_MODULES={modules} disables the ib module"
    tls = env.get("UCX_TLS")
    if tls:
        negated, items = _tls_items(tls)
        if not negated and not any(t in RDMA_TLS for t in items):
            return f"UCX_TLS={tls} has no RDMA transport"
    return None


def apply_env_defaults(root: str | os.PathLike[str] = "/") -> None:
    """Set the backend environment defaults for this host (see the module docstring)."""
    for key, value in env_defaults(os.environ, root).items():
        if key in os.environ:
            logger.warning("kvbridge: %s=%s -> %s (needed for CUDA memory transfers)", key,
                           os.environ[key], value)
        os.environ[key] = value


apply_env_defaults()
