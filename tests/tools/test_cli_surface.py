"""The `kvbridge` command as a whole: cheap start-up, --help of every command with an
example, --json everywhere, and every leaf command covered by a --json/exit-code test."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from tests.conftest import assert_figures

TESTS = Path(__file__).resolve().parents[1]

#: Modules `kvbridge --help` must not import: start-up stays well under a second and
#: a broken NIXL/Mooncake install cannot break `--help`.
HEAVY = ("torch", "nixl_cu12", "nixl", "mooncake", "mooncake.store", "kvbridge.engine",
         "kvbridge.connectors.nixl", "kvbridge.connectors.mooncake_store", "matplotlib")

#: Leaf command -> (test file under tests/, a string of the call that checks its --json
#: output and exit code). A new subcommand without such a test fails
#: test_every_leaf_command_has_a_json_test.
JSON_TESTS: dict[str, tuple[str, str]] = {
    "plan": ("tools/test_cmd_plan.py", '"plan"'),
    "keys": ("tools/test_cmd_keys.py", '"keys"'),
    "probe": ("handshake/test_cli.py", '"probe"'),
    "diff": ("handshake/test_cli.py", '"diff"'),
    "handshake serve-example": ("handshake/test_cli.py", '"serve-example"'),
    "doctor": ("tools/test_cmd_doctor.py", '"doctor", "--json"'),
    "events tail": ("events/test_cli_buffer.py", '"events", "tail"'),
    "events bench": ("tools/test_cli_surface.py", '"events", "bench"'),
    "offload fsck": ("offload/test_fsck.py", '"offload", "fsck"'),
    "offload bench": ("offload/test_fsck.py", '"offload", "bench"'),
    "mooncake master": ("backends/test_mooncake_cli.py", '"mooncake", "master"'),
    "mooncake bench": ("backends/test_mooncake_cli.py", '"mooncake", "bench"'),
    "demo": ("connectors/nixl/test_cli.py", '"demo"'),
    "serve": ("connectors/nixl/test_cli.py", '"serve"'),
    "bench": ("tools/test_bench_suite.py", '"bench"'),
    "trace": ("tools/test_cmd_trace.py", '"trace"'),
    "auth new-secret": ("tools/test_cmd_auth.py", '"auth", "new-secret"'),
    "auth show": ("tools/test_cmd_auth.py", '"auth", "show"'),
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def leaf_commands() -> dict[str, argparse.ArgumentParser]:
    """Every runnable command path ("events tail", "plan", ...) -> its parser."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        children = _subparsers(parser)
        if not children:
            out[prefix] = parser
        for name, child in children.items():
            walk(f"{prefix} {name}".strip(), child)

    walk("", build_parser())
    return out


def test_help_does_not_import_heavy_modules() -> None:
    code = ("import sys, json\n"
            "from kvbridge.tools.cli import build_parser\n"
            "build_parser()\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_every_command_has_json_an_example_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    leaves = leaf_commands()
    assert {"plan", "keys", "probe", "diff", "doctor", "trace", "bench", "demo", "serve",
            "events tail", "offload fsck"} <= set(leaves)
    for name, parser in leaves.items():
        options = {o for a in parser._actions for o in a.option_strings}
        assert "--json" in options, f"kvbridge {name} has no --json"
        assert parser.epilog and "example" in parser.epilog, f"kvbridge {name}: no example"
        assert f"kvbridge {name.split()[0]}" in parser.epilog, name
        with pytest.raises(SystemExit) as exit_info:
            main([*name.split(), "--help"])
        assert exit_info.value.code == 0
        assert "usage: kvbridge" in capsys.readouterr().out


def test_groups_without_a_command_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    for group in ("events", "offload", "mooncake", "handshake"):
        assert main([group]) == EXIT_USAGE, group
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == EXIT_USAGE
    capsys.readouterr()


def test_every_leaf_command_has_a_json_test() -> None:
    assert set(JSON_TESTS) == set(leaf_commands())
    for name, (path, needle) in JSON_TESTS.items():
        text = (TESTS / path).read_text()
        assert needle in text and "--json" in text, f"{path} does not test kvbridge {name}"


def test_events_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["events", "bench", "--events", "320", "--batch-sizes", "16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    row = data["results"]["16"]
    assert row["kvbridge"]["received_events"] == 320 and row["raw"]["received_events"] == 320
    assert_figures(row, ("ratio",))  # well-formed; how fast is `kvbridge bench`'s business
    assert main(["events", "bench", "--batch-sizes", "x"]) == EXIT_USAGE


def test_single_engine_topology_flags_agree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "--model", "tiny-gqa", "--topology", "tp=4,dcp=2", "--json"]) == 0
    by_topology = json.loads(capsys.readouterr().out)
    assert main(["keys", "--model", "tiny-gqa", "--tp", "4", "--dcp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_topology
    assert main(["keys", "--model", "tiny-gqa", "--topology", "tp=4", "--tp", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["handshake", "serve-example", "--topology", "tp=3"]) == EXIT_USAGE


def test_progress_only_on_a_terminal_or_when_forced() -> None:
    import io

    from kvbridge.tools.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    piped = io.StringIO()
    Progress("x", stream=piped).update("hidden")
    assert piped.getvalue() == ""
    forced = io.StringIO()
    progress = Progress("x", force=True, stream=forced, min_interval_s=0)
    progress.count(1, 4, "requests")
    progress.done()
    assert "[x] [#####...............] 1/4 requests" in forced.getvalue()
    assert forced.getvalue().endswith("\r\033[K")
    tty = Tty()
    with Progress("bench", stream=tty).ticking("working", interval_s=0.01):
        pass
    assert "[bench] working" in tty.getvalue()


def test_unhandled_library_errors_map_to_exit_codes() -> None:
    from kvbridge.backends.nixl import NixlTransportError
    from kvbridge.connectors import ConfigError, TransferParamsError
    from kvbridge.handshake import HandshakeError
    from kvbridge.layouts import LayoutError
    from kvbridge.tools.cli import EXIT_FAILURE, library_error_code

    assert library_error_code(LayoutError("tp_size", "expected >= 1")) == EXIT_USAGE
    assert library_error_code(ConfigError("kv_role", "unknown")) == EXIT_USAGE
    assert library_error_code(TransferParamsError("transfer_params", "v9")) == EXIT_USAGE
    assert library_error_code(HandshakeError("timeout", "no answer")) == EXIT_FAILURE
    assert library_error_code(NixlTransportError("peer gone")) == EXIT_FAILURE
    assert library_error_code(KeyError("a bug")) is None  # bugs keep their traceback


def test_an_unhandled_kvbridge_error_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.connectors import ConfigError
    from kvbridge.handshake import HandshakeError
    from kvbridge.tools.commands import events as cmd_events
    from kvbridge.tools.commands import plan as cmd_plan
    def bad_input(args: object) -> int:
        raise ConfigError("kv_config", "expected a JSON object")

    def peer_gone(args: object) -> int:
        raise HandshakeError("peer", "went away")

    def bug(args: object) -> int:
        raise LookupError("a bug")

    monkeypatch.setattr(cmd_plan, "run", bad_input)  # register() reads it per build_parser
    assert main(["plan", "--model", "m", "--producer", "tp=1", "--consumer", "tp=1"]) == 2
    assert capsys.readouterr().err == ("kvbridge plan: ConfigError: kv_config: expected a "
                                       "JSON object\n")
    monkeypatch.setattr(cmd_events, "_bench", peer_gone)
    assert main(["events", "bench"]) == 1
    assert "kvbridge events bench: HandshakeError: peer: went away" in capsys.readouterr().err
    monkeypatch.setattr(cmd_plan, "run", bug)
    with pytest.raises(LookupError):
        main(["plan", "--model", "m", "--producer", "tp=1", "--consumer", "tp=1"])
