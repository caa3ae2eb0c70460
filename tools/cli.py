"""Entry point of the `kvbridge` command.

Each subcommand lives in its own module `kvbridge/tools/cmd_<name>.py` that
defines::

    def register(subparsers: argparse._SubParsersAction) -> None

which adds its parser and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Modules are discovered here, so adding
a subcommand never edits this file.

Exit codes: 0 ok, 1 a failure was found (refused plan, mismatched bytes,
incompatible peers, ...), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import kvbridge.tools as _tools_pkg

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description=(
            "Move paged KV cache between LLM serving engines, and debug it. "
            "Run `kvbridge COMMAND --help` for each command."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(_tools_pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("cmd_"):
            continue
        module = importlib.import_module(f"kvbridge.tools.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print("kvbridge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
