"""The way a test or the demo hands the fs tiers a wrapped I/O object: never a setting.

Owns: the process's one :data:`FsIOFactory`, set only inside :func:`fs_io_factory`
(a ``with`` block around the engine's start) and read once per fs tier by
:func:`kvbridge.connectors.offloading.scheduler.build_managers`.

Why a scoped hook and not a setting or an environment variable: fault injection
(``kvbridge.offload.faults``) is a test switch, so nothing a user or an operator
writes (``kv_connector_extra_config``, the environment of a server) can turn it
on; the test or demo that wants it says so where it starts the engine, and it is
off again when the block ends. The reference engine builds its connector in the
caller's process, so the hook reaches it; a server in another process would need
the same call made in that process (a pytest plugin it loads), which no test needs
today.

May not touch: the settings (``settings.py``), the tiers themselves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from kvbridge.connectors.errors import ConfigError
from kvbridge.offload.fs_io import FsIO

#: ``(store directory, fingerprint) -> the I/O an fs tier makes its system calls through``
FsIOFactory = Callable[[str, str], FsIO]

_LOCK = threading.Lock()
_FACTORY: FsIOFactory | None = None


@contextlib.contextmanager
def fs_io_factory(factory: FsIOFactory) -> Iterator[None]:
    """Every fs tier an offloading connector builds inside the block gets
    ``factory(fs_dir, fingerprint)`` as its I/O. Not nested: one factory at a time."""
    global _FACTORY
    with _LOCK:
        if _FACTORY is not None:
            raise ConfigError("fs_io_factory", "a factory is already installed (one at a time)")
        _FACTORY = factory
    try:
        yield
    finally:
        with _LOCK:
            _FACTORY = None


def installed_fs_io_factory() -> FsIOFactory | None:
    """The factory of the enclosing :func:`fs_io_factory` block, or None (the real I/O)."""
    with _LOCK:
        return _FACTORY
