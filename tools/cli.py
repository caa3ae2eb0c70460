"""Entry point of the `kvbridge` command.

Each subcommand lives in its own module `kvbridge/tools/commands/<name>.py` that
defines::

    def register(subparsers: argparse._SubParsersAction) -> None

which adds its parser and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). Modules are discovered here, so adding
a subcommand never edits this file.

Exit codes: 0 ok, 1 a failure was found (refused plan, mismatched bytes,
incompatible peers, ...), 2 usage error. A kvbridge error that a command does
not handle itself is printed as one line and mapped by
:func:`library_error_code` (bad input 2, failure 1); anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import kvbridge.tools.commands as _commands_pkg

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
    for info in sorted(pkgutil.iter_modules(_commands_pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"kvbridge.tools.commands.{info.name}")
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
    except Exception as exc:
        code = library_error_code(exc)
        if code is None:
            raise  # not a kvbridge error: a bug, keep its traceback
        command = " ".join(filter(None, (args.command,
                                         *(getattr(args, f"{args.command}_command", None),))))
        print(f"kvbridge {command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return code


def library_error_code(exc: BaseException) -> int | None:
    """The exit code for a kvbridge error a command did not handle itself.

    Errors about what the user gave (a malformed topology, config, transfer
    params, role) are usage errors (2); errors found while doing the work (an
    unreachable or incompatible peer, a failed transfer, a store that refused)
    are failures (1). None: not one of kvbridge's errors (let it propagate).
    Imports happen here, after the fact, so start-up stays cheap.
    """
    from kvbridge.auth import BindRefused, SecretError
    from kvbridge.connectors.errors import (
        ConfigError,
        KVBridgeError,
        RoleError,
        TransferParamsError,
    )
    from kvbridge.events.errors import EventsError
    from kvbridge.handshake.errors import HandshakeError
    from kvbridge.layouts import LayoutError
    from kvbridge.offload.types import OffloadError

    if isinstance(exc, LayoutError | ConfigError | TransferParamsError | RoleError
                  | SecretError | BindRefused):
        return EXIT_USAGE
    if isinstance(exc, KVBridgeError | HandshakeError | EventsError | OffloadError):
        return EXIT_FAILURE
    names = {cls.__name__ for cls in type(exc).__mro__}
    # backends and the engine harness: checked by name, so that a failed command
    # does not import NIXL or Mooncake just to classify its error
    if names & {"TransportError", "MooncakeError", "MooncakeMasterError",
                "EngineProcessError"}:
        return EXIT_USAGE if "MooncakeConfigError" in names else EXIT_FAILURE
    return None


if __name__ == "__main__":
    sys.exit(main())
