"""Names imported on first use, so that building the CLI parser stays cheap.

``kvbridge --help`` imports every ``tools/commands/*.py`` (and the demo runners they
register flags for). Those that need the engine (which imports torch) bind its
names with :func:`lazy` at run time and import them for real under
``TYPE_CHECKING``::

    if TYPE_CHECKING:
        from kvbridge.engine.core import EngineConfig
    else:
        EngineConfig = lazy("kvbridge.engine.core", "EngineConfig")

The proxy imports its module the first time it is called or an attribute of it
is read, then forwards (``EngineConfig(...)``, ``RequestState.FINISHED_LENGTH``,
``RequestResult.from_dict(...)``, ``raise EngineProcessError(...)``,
``isinstance(x, Proxy)``). It is not the class itself: ``except Proxy:`` and
subclassing need the real one -- use :meth:`LazyName.resolve` there.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any


class LazyName:
    """``module.name``, imported on first use (thread-safe; the import runs once)."""

    __slots__ = ("_module", "_name", "_target", "_lock")

    def __init__(self, module: str, name: str) -> None:
        self._module = module
        self._name = name
        self._target: Any = None
        self._lock = threading.Lock()

    def resolve(self) -> Any:
        target = self._target
        if target is None:
            with self._lock:
                if self._target is None:
                    self._target = getattr(importlib.import_module(self._module), self._name)
                target = self._target
        return target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.resolve(), attr)

    def __instancecheck__(self, obj: Any) -> bool:  # isinstance(x, proxy) works too
        return isinstance(obj, self.resolve())

    def __subclasscheck__(self, cls: Any) -> bool:
        return issubclass(cls, self.resolve())

    def __repr__(self) -> str:
        state = "loaded" if self._target is not None else "not loaded"
        return f"<lazy {self._module}.{self._name} ({state})>"


def lazy(module: str, name: str) -> Any:
    """A :class:`LazyName` typed ``Any`` (the real type comes from ``TYPE_CHECKING``)."""
    return LazyName(module, name)
