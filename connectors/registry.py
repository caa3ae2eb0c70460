"""Find connectors by name: entry points of group ``kvbridge.connectors``, or ``module:Class``.

kvbridge's own connectors register the same way as third-party ones, in
``pyproject.toml``::

    [project.entry-points."kvbridge.connectors"]
    nixl = "kvbridge.connectors.nixl:NixlPlugin"

A value resolves to a :class:`ConnectorPlugin` subclass. ``register()`` adds
one in-process (tests, notebooks) without packaging; in-process entries win
over entry points of the same name.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from kvbridge.connectors.api import ConnectorPlugin
from kvbridge.connectors.config import ConnectorConfig
from kvbridge.connectors.errors import ConfigError, UnknownConnectorError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvbridge.connectors"

_registered: dict[str, type[ConnectorPlugin]] = {}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    """Entry points of the group from *every* distribution on the path.

    Not ``metadata.entry_points(group=...)``: it keeps only the first
    distribution of a name, and a stale ``kvbridge.egg-info`` next to the
    sources (left by an older editable install) would hide entries that the
    installed metadata has. The first definition of a name wins.
    """
    found: dict[str, metadata.EntryPoint] = {}
    for dist in metadata.distributions():
        for entry in dist.entry_points:
            if entry.group == ENTRY_POINT_GROUP and entry.name not in found:
                found[entry.name] = entry
    return found


def available() -> dict[str, str]:
    """Registered names -> where they come from (``module:Class``), sorted by name."""
    found = {name: ep.value for name, ep in _entry_points().items()}
    for name, plugin in _registered.items():
        found[name] = f"{plugin.__module__}:{plugin.__qualname__}"
    return dict(sorted(found.items()))


def register(plugin: type[ConnectorPlugin], name: str | None = None) -> None:
    """Register ``plugin`` in this process under ``name`` (default ``plugin.name``)."""
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
    """The plugin class for a registered name or a ``module:Class`` path."""
    if name in _registered:
        return _registered[name]
    if ":" in name:
        return _check_plugin(_import_path(name), name)
    entry = _entry_points().get(name)
    if entry is None:
        raise UnknownConnectorError(name, list(available()))
    try:
        plugin = entry.load()
    except Exception as exc:  # a broken install must name the connector, not crash later
        raise UnknownConnectorError(name, list(available()),
                                    f"its entry point {entry.value!r} failed to load: "
                                    f"{type(exc).__name__}: {exc}") from exc
    return _check_plugin(plugin, f"entry point {name} = {entry.value}")


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
