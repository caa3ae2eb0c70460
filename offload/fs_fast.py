"""GIL-free reads of a load's block files: one call per job part, not per block.

Why: under vLLM's tiering the fs tier's loads were bound by per-block Python work
under the GIL on its I/O threads (an open, fstat, readv and close per block, each a
Python call that takes the GIL again), not by the disk. The optional C extension
``kvbridge.offload._fsio`` (``offload/_fsio.c``, built by ``pip install``) reads a whole
part's files (open with ``O_NOFOLLOW | O_NONBLOCK`` and ``O_DIRECT`` where the tier uses
it, ``fstat``, ``preadv`` into the destination slices, close) with the GIL released and
answers per file. Only the happy case is read there: a file that is not a regular file
of exactly header + block bytes, or any error, is read again the plain way
(:func:`kvbridge.offload.fs_io.load_block`), which names what is wrong and applies the
deletion policy, so a load's outcome never depends on the path. Headers and digests are
checked in Python after the read, as before.

Where the extension is missing (no C compiler at install time) the tier reads one by
one in Python, logged once; :func:`active_path` says which path loads take
(``kvbridge doctor`` and the tier's stats print it). ``KVBRIDGE_FS_FAST=0`` turns the
extension off (tests of the fallback, or to rule it out).

Owns: the extension's import and the shape of one batch call.
May not touch: the tier's policy (deletions, quarantine, digests: :mod:`kvbridge.offload.fs`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

#: the environment variable that turns the extension off ("0")
ENV_SWITCH = "KVBRIDGE_FS_FAST"
#: per-file status: read in full
READ_OK = 0

_module: ModuleType | None = None
_why_not: str | None = None
_logged = False


def _load() -> None:
    global _module, _why_not
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _why_not = f"turned off ({ENV_SWITCH}=0)"
        return
    try:
        from kvbridge.offload import _fsio  # type: ignore[attr-defined]
    except ImportError as exc:
        import importlib.util

        if importlib.util.find_spec("kvbridge.offload._fsio") is None:
            _why_not = ("the C extension kvbridge.offload._fsio is not built (no C compiler "
                        "or Python headers when kvbridge was installed)")
        else:
            _why_not = f"the C extension kvbridge.offload._fsio does not load ({exc})"
        return
    _module = _fsio


_load()


def available() -> bool:
    """Whether loads may read through the extension (it is built and not turned off)."""
    return _module is not None


def active_path() -> str:
    """Which path the fs tier's loads take, in words (doctor, stats, logs)."""
    if _module is not None:
        return "c-extension (GIL-free batch reads)"
    return f"python (one call per block: {_why_not})"


def log_fallback_once() -> None:
    """Say once per process that loads read one by one in Python, and why."""
    global _logged
    if _module is None and not _logged:
        _logged = True
        logger.info("fs tier loads read block files one by one in Python: %s", _why_not)


def max_items() -> int:
    """Files per call at most (the extension's bound)."""
    return int(_module.MAX_ITEMS) if _module is not None else 0


def max_buffers() -> int:
    """Buffers per file at most (header included)."""
    return int(_module.MAX_BUFFERS) if _module is not None else 0


#: one file to read: its path, whether O_DIRECT (used only where every buffer's address and
#: length are page aligned), its buffers (header first), in file order
Item = tuple[bytes, bool, tuple[memoryview, ...]]


def read_files(items: Sequence[Item]) -> list[int]:
    """Per item 0 (its file read in full into its buffers), a positive errno, or a
    negative status (not a regular file of exactly the buffers' size). Requires
    :func:`available`. Buffers must be writable and contiguous."""
    assert _module is not None, "read_files without the extension"
    read: Callable[[Sequence[Item]], list[int]] = _module.read_files
    return read(items)
