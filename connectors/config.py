"""Connector configuration, parsed once at the edge (dict, JSON or CLI flags).

``ConnectorConfig`` is what an operator writes::

    {"kv_connector": "nixl", "kv_role": "kv_consumer",
     "kv_connector_extra_config": {"mode": "pull"}}

or on a command line::

    --kv-connector nixl --kv-role kv_consumer --kv-config '{"mode": "pull"}'

The short names ``connector``, ``role``, ``extra``, ``load_failure_policy``
are accepted too (giving both spellings of one setting is an error). The
connector-specific ``extra`` mapping is validated by the connector's plugin
(``ConnectorPlugin.parse_extra``) when the registry resolves the connector, so
a bad key fails before any engine or connector state exists.
"""

from __future__ import annotations

import argparse
import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.errors import ConfigError


class KVRole(str, enum.Enum):
    """What an engine does with KV through its connector.

    ``KV_BOTH`` is the natural role of the offloading/store connectors (save
    and load on the same engine). For the prefill/decode connectors it is
    deprecated: accepted with a warning that says to use ``kv_producer`` on
    prefill engines and ``kv_consumer`` on decode engines.
    """

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def is_producer(self) -> bool:
        return self in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self in (KVRole.CONSUMER, KVRole.BOTH)

    @classmethod
    def parse(cls, value: object, field_name: str = "kv_role") -> KVRole:
        if isinstance(value, KVRole):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            # Accept the short spellings an operator might type.
            text = {"producer": "kv_producer", "consumer": "kv_consumer",
                    "both": "kv_both"}.get(text, text)
            try:
                return cls(text)
            except ValueError:
                pass
        raise ConfigError(field_name, f"expected one of {[r.value for r in cls]}, got {value!r}")


class LoadFailurePolicy(str, enum.Enum):
    """What the engine does with blocks whose load failed.

    ``RECOMPUTE`` (default): the blocks are treated as not computed and the
    engine computes them (never trusts their bytes). ``FAIL``: the request
    finishes with an error instead.
    """

    RECOMPUTE = "recompute"
    FAIL = "fail"


# (canonical name, alias): both spellings are accepted, not both at once.
_ALIASES = (
    ("kv_connector", "connector"),
    ("kv_role", "role"),
    ("kv_connector_extra_config", "extra"),
    ("kv_load_failure_policy", "load_failure_policy"),
    ("engine_id", "kv_engine_id"),
)
_KNOWN = frozenset(name for pair in _ALIASES for name in pair)


def _new_engine_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings of one engine. Immutable.

    ``connector``: a registered name (entry point of group ``kvbridge.connectors``)
    or a ``module:Class`` path. ``engine_id``: this engine's id as peers see it
    (random when not given). ``extra``: connector-specific settings, validated
    by the connector's plugin, never interpreted here.
    """

    connector: str
    role: KVRole
    engine_id: str = field(default_factory=_new_engine_id)
    extra: Mapping[str, Any] = field(default_factory=dict)
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE

    def __post_init__(self) -> None:
        if not isinstance(self.connector, str) or not self.connector.strip():
            raise ConfigError("kv_connector", f"expected a connector name or 'module:Class', "
                                              f"got {self.connector!r}")
        if not isinstance(self.role, KVRole):
            raise ConfigError("kv_role", f"expected one of {[r.value for r in KVRole]}, "
                                         f"got {self.role!r}")
        if (not isinstance(self.engine_id, str) or not self.engine_id
                or len(self.engine_id) > 128):
            raise ConfigError("engine_id", f"expected a non-empty string of <= 128 chars, "
                                           f"got {self.engine_id!r}")
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise ConfigError("kv_connector_extra_config",
                              "expected a JSON object (mapping with string keys)")
        if not isinstance(self.load_failure_policy, LoadFailurePolicy):
            raise ConfigError("kv_load_failure_policy",
                              f"expected one of {[p.value for p in LoadFailurePolicy]}, "
                              f"got {self.load_failure_policy!r}")
        object.__setattr__(self, "extra", dict(self.extra))

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dict(cls, data: object) -> ConnectorConfig:
        """Parse a mapping (vLLM-style or short key names). Raises :class:`ConfigError`."""
        if not isinstance(data, Mapping):
            raise ConfigError("kv_transfer_config",
                              f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(str(k) for k in set(data) - _KNOWN)
        if unknown:
            raise ConfigError(unknown[0], f"unknown setting; expected one of "
                                          f"{[pair[0] for pair in _ALIASES]}")
        values: dict[str, Any] = {}
        for canonical, alias in _ALIASES:
            if canonical in data and alias in data:
                raise ConfigError(canonical, f"given twice (as {canonical!r} and {alias!r})")
            if canonical in data:
                values[canonical] = data[canonical]
            elif alias in data:
                values[canonical] = data[alias]
        if "kv_connector" not in values:
            raise ConfigError("kv_connector", "missing; expected a connector name")
        if "kv_role" not in values:
            raise ConfigError("kv_role", f"missing; expected one of {[r.value for r in KVRole]}")
        role = KVRole.parse(values["kv_role"])
        policy_value = values.get("kv_load_failure_policy", LoadFailurePolicy.RECOMPUTE.value)
        try:
            policy = LoadFailurePolicy(policy_value)
        except ValueError:
            raise ConfigError("kv_load_failure_policy",
                              f"expected one of {[p.value for p in LoadFailurePolicy]}, "
                              f"got {policy_value!r}") from None
        extra = values.get("kv_connector_extra_config")
        if extra is None:
            extra = {}
        kwargs: dict[str, Any] = {"connector": values["kv_connector"], "role": role,
                                  "extra": extra, "load_failure_policy": policy}
        if values.get("engine_id") is not None:
            kwargs["engine_id"] = values["engine_id"]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> ConnectorConfig:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("kv_transfer_config", f"invalid JSON: {exc}") from None
        return cls.from_dict(data)

    @staticmethod
    def add_cli_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
        """Add ``--kv-connector``, ``--kv-role``, ``--kv-config``, ``--engine-id``,
        ``--kv-load-failure-policy`` to ``parser``."""
        group = parser.add_argument_group("connector")
        group.add_argument("--kv-connector", metavar="NAME", required=required,
                           help="registered connector name or module:Class")
        group.add_argument("--kv-role", metavar="ROLE",
                           help="kv_producer, kv_consumer or kv_both")
        group.add_argument("--kv-config", metavar="JSON",
                           help="connector-specific settings as a JSON object")
        group.add_argument("--engine-id", metavar="ID", help="this engine's id (default: random)")
        group.add_argument("--kv-load-failure-policy", metavar="POLICY",
                           help="recompute (default) or fail")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConnectorConfig:
        """Build from a namespace filled by :meth:`add_cli_arguments`."""
        data: dict[str, Any] = {}
        if getattr(args, "kv_connector", None) is not None:
            data["kv_connector"] = args.kv_connector
        if getattr(args, "kv_role", None) is not None:
            data["kv_role"] = args.kv_role
        if getattr(args, "engine_id", None) is not None:
            data["engine_id"] = args.engine_id
        if getattr(args, "kv_load_failure_policy", None) is not None:
            data["kv_load_failure_policy"] = args.kv_load_failure_policy
        text = getattr(args, "kv_config", None)
        if text is not None:
            try:
                extra = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError("kv_config", f"invalid JSON: {exc}") from None
            if not isinstance(extra, dict):
                raise ConfigError("kv_config", f"expected a JSON object, "
                                               f"got {type(extra).__name__}")
            data["kv_connector_extra_config"] = extra
        return cls.from_dict(data)

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> ConnectorConfig:
        """Parse connector flags from an argument list (unrelated flags are an error)."""
        parser = _RaisingParser(prog="kvbridge", add_help=False)
        cls.add_cli_arguments(parser)
        args = parser.parse_args(list(argv))
        return cls.from_args(args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_connector": self.connector,
            "kv_role": self.role.value,
            "engine_id": self.engine_id,
            "kv_connector_extra_config": dict(self.extra),
            "kv_load_failure_policy": self.load_failure_policy.value,
        }

    def with_extra(self, **updates: Any) -> ConnectorConfig:
        """A copy with ``extra`` keys added or replaced (for tests and harnesses)."""
        merged = dict(self.extra)
        merged.update(updates)
        return ConnectorConfig(self.connector, self.role, self.engine_id, merged,
                               self.load_failure_policy)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit
        raise ConfigError("argv", message)
