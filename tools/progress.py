"""Progress lines on stderr for commands that take more than a second.

Shown only when stderr is a terminal, or when the command got ``--progress``
(so a script that captures stderr sees no carriage returns). stdout is never
touched: ``--json`` output stays parseable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(text)`` rewrites one status line; ``done()`` ends it. Cheap when hidden."""

    def __init__(self, command: str, *, force: bool = False, stream: TextIO | None = None,
                 min_interval_s: float = 0.1) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = force or bool(isatty and isatty())
        self.min_interval_s = min_interval_s
        self._started = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._shown and now - self._last < self.min_interval_s:
            return
        self._last = now
        self._shown = True
        self.stream.write(f"\r[{self.command}] {text} ({now - self._started:.1f} s)\033[K")
        self.stream.flush()

    def count(self, done: int, total: int, what: str = "") -> None:
        width = 20
        filled = width * done // total if total else width
        self.update(f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what}".rstrip())

    def done(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self._shown = False
