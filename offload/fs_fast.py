"""GIL-free reads and writes of a job part's block files: one call per part, not per block.

Why: under vLLM's tiering the fs tier's loads and stores were bound by per-block Python
work under the GIL on its I/O threads (an open, fstat, readv and close per block to
load; an lstat, open, writev, close and rename per block to store; each a Python call
that takes the GIL again), not by the disk. The optional C extension
``kvbridge.offload._fsio`` (``offload/_fsio.c``, built by ``pip install``) does a whole
part's files with the GIL released and answers per file:

* :func:`read_files`: open with ``O_NOFOLLOW | O_NONBLOCK`` and ``O_DIRECT`` where the
  tier uses it, ``fstat``, ``preadv`` into the destination slices, close. Headers and
  digests are checked in Python after the read, as before.
* :func:`write_files`: ``lstat`` the block's path (a regular file there: already
  stored, nothing written), make a temp file beside it (``O_CREAT | O_EXCL |
  O_NOFOLLOW``, ``O_DIRECT`` as for reads), ``pwritev`` the header the tier built and
  the block's bytes, ``fsync`` when the tier does, close, rename over the path; on any
  error the temp file is removed. Digests and headers are made in Python before.

Only the happy case is done there: a file that is not a regular file of exactly header
+ block bytes, anything but a regular file in a block's place, or any error, is read or
stored again the plain way (:func:`kvbridge.offload.fs_io.load_block`,
:func:`~kvbridge.offload.fs_io.store_block`), which names what is wrong and applies the
policy (deletions, a removed fan-out directory made again), so the outcome of a load or
a store never depends on the path.

Where the extension is missing (no C compiler at install time) the tier reads and
writes one by one in Python, logged once; :func:`active_path` says which path loads and
stores take (``kvbridge doctor`` prints it). ``KVBRIDGE_FS_FAST=0`` turns the extension
off (tests of the fallback, or to rule it out).

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
#: per-file status of a write: written (renamed into place)
WRITTEN = 0
#: per-file status of a write: a regular file was already there (a stored block:
#: success, nothing written)
EXISTED = -2

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
    """Whether loads and stores may go through the extension (it is built and not turned
    off)."""
    return _module is not None


def active_path() -> str:
    """Which path the fs tier's loads and stores take, in words (doctor, logs)."""
    if _module is not None:
        return "c-extension (GIL-free batch reads and writes)"
    return f"python (one call per block: {_why_not})"


def log_fallback_once() -> None:
    """Say once per process that loads and stores go one by one in Python, and why."""
    global _logged
    if _module is None and not _logged:
        _logged = True
        logger.info("fs tier loads and stores go through block files one by one in Python: "
                    "%s", _why_not)


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


#: one block file to store: its path, its temp path (made beside it, renamed over it;
#: removed on any error), whether O_DIRECT (used only where every buffer's address and
#: length are page aligned), whether to fsync, its buffers (header first), in file order
WriteItem = tuple[bytes, bytes, bool, bool, tuple[memoryview, ...]]


def write_files(items: Sequence[WriteItem]) -> list[int]:
    """Per item :data:`WRITTEN`, :data:`EXISTED` (a regular file is at the path: nothing
    written), a positive errno (nothing at the path is changed, the temp file is removed),
    or another negative status (something not a regular file is at the path: nothing
    written). Requires :func:`available`. Buffers must be contiguous."""
    assert _module is not None, "write_files without the extension"
    write: Callable[[Sequence[WriteItem]], list[int]] = _module.write_files
    return write(items)
