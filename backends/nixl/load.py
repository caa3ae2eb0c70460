"""Which NIXL build to load, loading it once, and saying which one loaded (for ``kvbridge doctor``).

Owns :func:`load_nixl_api` (the ``_api`` module of the NIXL build that matches
torch's CUDA, imported once per process and remembered), the order it tries
(:func:`nixl_candidates`, :func:`torch_cuda_major`) and :func:`loaded_nixl`.
It applies the backend environment defaults (:func:`kvbridge.backends.apply_env_defaults`)
before the first import, since UCX reads them when the first agent starts.

May not touch: an agent (no agent is created here: the transport does that),
registrations or transfers; torch only for its CUDA version. Imports only
:mod:`kvbridge.backends` (the environment defaults) and :mod:`.records`.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvbridge.backends import apply_env_defaults
from kvbridge.backends.nixl.records import NixlUnavailableError


def load_nixl_api() -> Any:
    """Return NIXL's ``_api`` module: the build that matches torch's CUDA.

    The order and the reason for it come from :func:`nixl_candidates` (the
    ``nixl`` meta package's ``nixl._api`` first: it picks the build for the
    installed CUDA; else ``nixl_cu13`` / ``nixl_cu12``, the one matching
    torch's CUDA major first). :func:`loaded_nixl` says which one loaded.
    """
    apply_env_defaults()  # UCX_MODULES and the CUDA transports must be set before an agent
    global _LOADED
    if _LOADED is not None:
        return importlib.import_module(_LOADED[0])
    errors = []
    names, reason = nixl_candidates()
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a shared library that fails to load
            errors.append(f"{name}: {exc!r}")
            continue
        _LOADED = (name, reason + (f" ({'; '.join(errors)})" if errors else ""))
        return module
    raise NixlUnavailableError("NIXL is not importable (" + "; ".join(errors) + ")")


_LOADED: tuple[str, str] | None = None


def torch_cuda_major() -> int | None:
    """The CUDA major version torch was built with (None for a CPU build or no torch)."""
    try:
        import torch
    except Exception:
        return None
    version = getattr(torch.version, "cuda", None)
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


def nixl_candidates(cuda_major: int | None = None, *, from_torch: bool = True
                    ) -> tuple[list[str], str]:
    """NIXL modules to try, in order, and why that order (for ``kvbridge doctor``).

    ``nixl._api`` (the meta package, which dispatches to the build for the
    installed CUDA) first; then the per-CUDA wheels, the one for torch's CUDA
    major first (a ``nixl_cu12`` next to a CUDA 13 torch links the wrong CUDA
    runtime). A CPU torch prefers ``nixl_cu12``, the build tested here.
    ``cuda_major`` overrides torch's (None with ``from_torch=False``: no CUDA).
    """
    major = torch_cuda_major() if cuda_major is None and from_torch else cuda_major
    if major is not None and major >= 13:
        builds, why = ["nixl_cu13._api", "nixl_cu12._api"], f"torch is built for CUDA {major}"
    elif major is not None:
        builds, why = ["nixl_cu12._api", "nixl_cu13._api"], f"torch is built for CUDA {major}"
    else:
        builds, why = ["nixl_cu12._api", "nixl_cu13._api"], "torch has no CUDA (CPU build)"
    return ["nixl._api", *builds], (f"nixl._api (meta package) first, then "
                                    f"{builds[0].split('.')[0]}: {why}")


def loaded_nixl() -> tuple[str, str] | None:
    """``(module, why)`` of the NIXL build :func:`load_nixl_api` loaded, or None yet."""
    return _LOADED
