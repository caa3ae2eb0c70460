"""Progress lines on stderr for commands that take more than a second.

Shown only when stderr is a terminal, or when the command got ``--progress``
(so a script that captures stderr sees no carriage returns). stdout is never
touched: ``--json`` output stays parseable.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
        self._lock = threading.Lock()

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
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
        with self._lock:
            if self.enabled and self._shown:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self._shown = False

    @contextmanager
    def ticking(self, text: str, interval_s: float = 0.5) -> Iterator[None]:
        """Show ``text`` with the elapsed time, refreshed every ``interval_s``, while a
        library call that reports no progress of its own runs; cleared at the end."""
        if not self.enabled:
            yield
            return
        stop = threading.Event()

        def tick() -> None:
            while True:
                self.update(text)
                if stop.wait(interval_s):
                    return

        thread = threading.Thread(target=tick, daemon=True, name="kvbridge-progress")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=2)
            self.done()
