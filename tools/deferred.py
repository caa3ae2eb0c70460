"""Arguments added to a subcommand's parser only when that subcommand is used.

``kvbridge --help`` builds every subcommand's parser. Some flags come from
modules that import the engine (and so torch) -- e.g. ``kvbridge demo``'s
connector-specific flags, declared by ``tools/demo_<name>.py``. With
:func:`defer_arguments` those modules are imported when the subcommand's own
arguments are parsed or its help/usage is printed, not when the top-level
parser is built.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

AddArguments = Callable[[argparse.ArgumentParser], None]


class DeferringParser(argparse.ArgumentParser):
    """An ArgumentParser that runs its deferred ``add(parser)`` callbacks once, first
    thing when it parses, formats help or formats usage."""

    _kvbridge_deferred: list[AddArguments]

    def _add_deferred(self) -> None:
        pending = self.__dict__.pop("_kvbridge_deferred", [])
        for add in pending:
            add(self)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        self._add_deferred()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_deferred()
        return super().format_help()

    def format_usage(self) -> str:
        self._add_deferred()
        return super().format_usage()


def defer_arguments(parser: argparse.ArgumentParser, add: AddArguments) -> None:
    """Run ``add(parser)`` when ``parser`` is first used instead of now."""
    if not isinstance(parser, DeferringParser):
        if type(parser) is not argparse.ArgumentParser:
            raise TypeError(f"cannot defer arguments of a {type(parser).__name__}")
        parser.__class__ = DeferringParser  # same state; only the three hooks differ
    deferred: Any = parser.__dict__.setdefault("_kvbridge_deferred", [])
    deferred.append(add)
