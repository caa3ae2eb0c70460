"""Find connectors by name: kvbridge's own (in code), entry points, in-process, or ``module:Class``.

Where a name comes from, highest precedence first:

1. **in-process**: :func:`register` (tests, notebooks); it may replace any other.
2. **built-in**: :data:`BUILTIN_CONNECTORS`, kvbridge's own connectors as lazy
   ``module:Class`` paths. They are known in code, not through packaging
   metadata, so a source tree on ``PYTHONPATH`` (no ``pip install``) finds
   them, and loading a name imports only that connector's module (never NIXL
   or Mooncake at import time of this module).
3. **entry point**: group ``kvbridge.connectors`` of any installed
   distribution, how third-party connectors plug in::

       [project.entry-points."kvbridge.connectors"]
       my_store = "my_package.kv:MyStorePlugin"

kvbridge's own ``pyproject.toml`` declares the built-ins under the same group
(for tools that list entry points), but the registry never reads kvbridge's
own entry points: the code that runs is the truth, whichever kvbridge is
installed beside it, so an installed kvbridge's metadata can neither duplicate
a built-in nor point it at other code. A third-party entry point under a
built-in's name is ignored with a warning naming both (the built-in wins, as a
package must not silently replace ``nixl`` in every engine of the host);
replace a built-in deliberately with :func:`register`, or pick another name.
Two third-party distributions declaring one name: the first on ``sys.path``
wins, with the same warning. :func:`shadowed` lists every ignored entry point.

A value resolves to a :class:`ConnectorPlugin` subclass; :func:`sources` says
where each name came from (``kvbridge doctor`` lists it).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from types import MappingProxyType
from typing import Any

from kvbridge.connectors.api import ConnectorPlugin
from kvbridge.connectors.config import ConnectorConfig
from kvbridge.connectors.errors import ConfigError, UnknownConnectorError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvbridge.connectors"

#: kvbridge's own distribution name (normalized): its entry points are never read.
DISTRIBUTION = "kvbridge"

#: kvbridge's connectors, name -> ``module:Class``; imported only when loaded.
#: ``pyproject.toml``'s entry points of group ``kvbridge.connectors`` repeat
#: this table (a test keeps the two equal).
BUILTIN_CONNECTORS: Mapping[str, str] = MappingProxyType({
    "shared_storage": "kvbridge.connectors.shared_storage:SharedStoragePlugin",
    "nixl": "kvbridge.connectors.nixl:NixlPlugin",
    "mooncake_store": "kvbridge.connectors.mooncake_store:MooncakeStorePlugin",
    "mooncake_te": "kvbridge.connectors.mooncake_te:MooncakeTePlugin",
    "offloading": "kvbridge.connectors.offloading:OffloadingPlugin",
    "multi": "kvbridge.connectors.multi:MultiPlugin",
})

_registered: dict[str, type[ConnectorPlugin]] = {}
#: (name, distribution, value) of ignored entry points already warned about: once per process
_warned: set[tuple[str, str, str]] = set()


class Origin(str, Enum):
    """Where a connector name comes from (the values appear in ``kvbridge doctor --json``)."""

    BUILTIN = "built-in"
    ENTRY_POINT = "entry point"
    IN_PROCESS = "in-process"


@dataclass(frozen=True)
class ConnectorSource:
    """One registered name: its ``module:Class`` target and where it came from.

    ``distribution`` is ``"name version"`` of the package declaring an entry
    point (None for the other origins).
    """

    name: str
    target: str
    origin: Origin
    distribution: str | None = None

    def describe(self) -> str:
        if self.origin is Origin.ENTRY_POINT:
            return f"entry point of {self.distribution}"
        if self.origin is Origin.IN_PROCESS:
            return "registered in-process"
        return "built-in"


@dataclass(frozen=True)
class ShadowedEntryPoint:
    """An entry point the registry ignores because ``winner`` holds its name."""

    name: str
    value: str
    distribution: str
    winner: ConnectorSource

    def describe(self) -> str:
        return (f"entry point {self.name} = {self.value!r} of {self.distribution} is ignored: "
                f"the {self.winner.describe()} connector {self.name!r} "
                f"({self.winner.target}) holds the name")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _label(dist: metadata.Distribution) -> tuple[str, str]:
    """(normalized name, ``"Name version"``) of a distribution, tolerating broken metadata."""
    name = dist.metadata["Name"] or "unknown distribution"
    return _normalized(name), f"{name} {dist.version}"


def _scan() -> tuple[dict[str, tuple[ConnectorSource, metadata.EntryPoint]],
                   list[ShadowedEntryPoint]]:
    """Third-party entry points of the group by name, and those ignored.

    Reads *every* distribution on the path, not ``metadata.entry_points(group=...)``,
    which keeps only the first distribution of a name and so could not report a
    conflict. The same distribution found twice (an egg-info and a dist-info of
    one project) repeats its entries: the first is kept, silently.
    """
    found: dict[str, tuple[ConnectorSource, metadata.EntryPoint]] = {}
    ignored: list[ShadowedEntryPoint] = []
    for dist in metadata.distributions():
        normalized, label = _label(dist)
        if normalized == DISTRIBUTION:
            continue  # kvbridge's own connectors are the built-ins, in code
        for entry in dist.entry_points:
            if entry.group != ENTRY_POINT_GROUP:
                continue
            builtin = BUILTIN_CONNECTORS.get(entry.name)
            winner = (ConnectorSource(entry.name, builtin, Origin.BUILTIN) if builtin is not None
                      else found[entry.name][0] if entry.name in found else None)
            if winner is None:
                found[entry.name] = (ConnectorSource(entry.name, entry.value, Origin.ENTRY_POINT,
                                                     label), entry)
                continue
            item = ShadowedEntryPoint(entry.name, entry.value, label, winner)
            if winner.distribution != label and item not in ignored:
                ignored.append(item)
    for item in ignored:
        key = (item.name, item.distribution, item.value)
        if key not in _warned:
            _warned.add(key)
            logger.warning("kvbridge connectors: %s (use another name, or "
                           "registry.register() to replace it on purpose)", item.describe())
    return found, ignored


def sources() -> dict[str, ConnectorSource]:
    """Every registered name -> where it comes from, sorted by name (precedence applied)."""
    found = {name: source for name, (source, _) in _scan()[0].items()}
    for name, target in BUILTIN_CONNECTORS.items():
        found[name] = ConnectorSource(name, target, Origin.BUILTIN)
    for name, plugin in _registered.items():
        found[name] = ConnectorSource(name, f"{plugin.__module__}:{plugin.__qualname__}",
                                      Origin.IN_PROCESS)
    return dict(sorted(found.items()))


def shadowed() -> list[ShadowedEntryPoint]:
    """Entry points ignored because a built-in or an earlier distribution holds their name.

    (An in-process :func:`register` is not listed: it replaces any name on purpose.)
    """
    return _scan()[1]


def available() -> dict[str, str]:
    """Registered names -> their ``module:Class`` target, sorted by name (see :func:`sources`)."""
    return {name: source.target for name, source in sources().items()}


def register(plugin: type[ConnectorPlugin], name: str | None = None) -> None:
    """Register ``plugin`` in this process under ``name`` (default ``plugin.name``).

    It takes precedence over a built-in or an entry point of the same name until
    :func:`unregister`.
    """
    _check_plugin(plugin, name or plugin.name)
    _registered[name or plugin.name] = plugin


def unregister(name: str) -> None:
    _registered.pop(name, None)


def _check_plugin(obj: Any, origin: str) -> type[ConnectorPlugin]:
    if not (isinstance(obj, type) and issubclass(obj, ConnectorPlugin)):
        raise ConfigError("kv_connector", f"{origin} is not a ConnectorPlugin subclass "
                                          f"(got {obj!r})")
    if not obj.name:
        raise ConfigError("kv_connector", f"{origin}: plugin class sets no 'name'")
    return obj


def _import_path(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("kv_connector", f"cannot import module {module_name!r} "
                                          f"for {path!r}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError("kv_connector", f"module {module_name!r} has no "
                                              f"attribute {attr!r}") from None
    return target


def load(name: str) -> type[ConnectorPlugin]:
    """The plugin class for a registered name or a ``module:Class`` path.

    A built-in name imports its module directly: no packaging metadata is read.
    """
    if name in _registered:
        return _registered[name]
    builtin = BUILTIN_CONNECTORS.get(name)
    if builtin is not None:
        return _load_named(name, f"built-in connector {name} = {builtin}",
                           lambda: _import_path(builtin))
    if ":" in name:
        return _check_plugin(_import_path(name), name)
    scanned = _scan()[0].get(name)
    if scanned is None:
        raise UnknownConnectorError(name, list(available()))
    source, entry = scanned
    return _load_named(name, f"entry point {name} = {source.target} of {source.distribution}",
                       entry.load)


def _load_named(name: str, what: str, import_target: Callable[[], Any]
                ) -> type[ConnectorPlugin]:
    try:
        plugin = import_target()
    except Exception as exc:  # a broken install must name the connector, not crash later
        raise UnknownConnectorError(name, list(available()),
                                    f"its {what} failed to load: "
                                    f"{type(exc).__name__}: {exc}") from exc
    return _check_plugin(plugin, what)


@dataclass(frozen=True)
class ResolvedConnector:
    """A connector config checked against its plugin: role allowed, extra parsed."""

    plugin: type[ConnectorPlugin]
    config: ConnectorConfig
    extra: Any


def resolve(config: ConnectorConfig) -> ResolvedConnector:
    """Load the plugin, check the role, parse the extra config. Nothing is created yet."""
    plugin = load(config.connector)
    plugin.check_role(config.role)
    extra = plugin.parse_extra(config.extra)
    return ResolvedConnector(plugin, config, extra)
