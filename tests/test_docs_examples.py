"""Every `kvbridge ...` line in a fenced block of README.md and docs/*.md still works.

The rule, per line (after joining `\\` continuations and dropping the `# comment`):

* RUN: the command runs for real here (a subprocess with a deadline) and must exit 0,
  when it needs no second host, no running server and finishes in seconds: its
  command is in ``RUNNABLE`` and the line has no placeholder (``PLACEHOLDER``: an
  upper-case word such as HOST or M, ``[optional]`` syntax, ``...``, ``a|b``, a
  non-loopback address, a file the docs assume exists).
* CHECK: every other line (servers, two hosts, placeholders, minutes-long runs) is
  parsed by the real parser of :mod:`kvbridge.tools.cli`: the command and
  subcommand must exist and every ``--flag`` in the line (also inside ``[...]``)
  must be one of that subcommand's options. A renamed command or flag fails.

The counts at the end keep a regression to "skip everything" from passing.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: (command, subcommand or None): fast and local; run them when the line is concrete
RUNNABLE = {("plan", None), ("keys", None), ("doctor", None), ("bench", None)}
#: a line that names one of these is documentation of a form, not a runnable example
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b|\[|\.\.\.|\||\b(?!127\.)\d+\.\d+\.\d+\.\d+|"
                         r"\.png\b|/mnt/")
#: an optional bare flag such as ``[--json]`` is dropped before the rule applies
OPTIONAL_FLAG = re.compile(r"\s*\[--[\w-]+\]")
#: bench runs only when it renders a saved report (a measured run takes minutes)
BENCH_RUNS_ONLY = "--report"


def examples() -> list[tuple[str, int, str]]:
    """(file, line number, command line) of every `kvbridge ` line in a fenced block."""
    found = []
    for path in FILES:
        fenced = False
        lines = path.read_text().splitlines()
        index = 0
        while index < len(lines):
            line = lines[index]
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and line.lstrip().startswith("kvbridge "):
                number, text = index + 1, line.strip()
                while text.endswith("\\") and index + 1 < len(lines):
                    index += 1
                    text = text[:-1] + " " + lines[index].strip()
                found.append((str(path.relative_to(ROOT)), number, text))
            index += 1
    return found


def command_of(text: str) -> str:
    """The line without its trailing `# comment` and its optional bare flags."""
    return OPTIONAL_FLAG.sub("", " ".join(shlex.split(text, comments=True)))


def subparser_for(words: list[str]) -> tuple[argparse.ArgumentParser, tuple[str, str | None]]:
    """Walk the real parser down `kvbridge COMMAND [SUBCOMMAND]`; KeyError if one is unknown."""
    parser = build_parser()
    key: list[str] = []
    for word in words[1:3]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            break
        if word not in actions[0].choices:
            raise KeyError(f"unknown command {' '.join([*key, word])!r}")
        parser = actions[0].choices[word]
        key.append(word)
    return parser, (key[0], key[1] if len(key) > 1 else None)


def is_concrete(text: str) -> bool:
    return not PLACEHOLDER.search(command_of(text))


def is_runnable(text: str, key: tuple[str, str | None]) -> bool:
    if key not in RUNNABLE or not is_concrete(text):
        return False
    return key[0] != "bench" or BENCH_RUNS_ONLY in text


@functools.cache
def run_once(command: str) -> tuple[int, str]:
    """Exit code and stderr tail of ``kvbridge COMMAND`` (each distinct line runs once)."""
    env = dict(os.environ, COLUMNS="100")
    done = subprocess.run([sys.executable, "-m", "kvbridge.tools.cli",
                           *shlex.split(command)[1:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, done.stderr[-2000:]


EXAMPLES = examples()


@pytest.mark.parametrize(("where", "number", "text"), EXAMPLES,
                         ids=[f"{w}:{n}" for w, n, _ in EXAMPLES])
def test_docs_example(where: str, number: int, text: str) -> None:
    words = text.split()
    try:
        parser, key = subparser_for(words)
    except KeyError as exc:
        pytest.fail(f"{where}:{number}: {exc}: {text}")
    if is_runnable(text, key):
        code, stderr = run_once(command_of(text))
        assert code == 0, f"{where}:{number}: exit {code}: {text}\n{stderr}"
        return
    parser.format_help()  # adds a DeferringParser's deferred flags (kvbridge.tools.deferred)
    options = {s for a in parser._actions for s in a.option_strings}
    flags = re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", command_of(text.replace("|", " ")))
    unknown = [flag for flag in flags if flag not in options]
    assert not unknown, f"{where}:{number}: unknown flag(s) {unknown} of {key}: {text}"
    if is_concrete(text):  # no placeholder: the whole line must parse (values, choices)
        try:
            build_parser().parse_args(shlex.split(command_of(text))[1:])
        except SystemExit as exc:
            pytest.fail(f"{where}:{number}: usage error (exit {exc.code}): {text}")


def test_the_rule_runs_and_checks_enough() -> None:
    """The docs hold runnable examples and server examples; neither count may fall to 0."""
    run = check = 0
    for _where, _number, text in EXAMPLES:
        try:
            _parser, key = subparser_for(text.split())
        except KeyError:
            continue
        if is_runnable(text, key):
            run += 1
        else:
            check += 1
    assert run >= 4, f"only {run} docs examples would run"
    assert check >= 15, f"only {check} docs examples would be flag-checked"
    assert len({where for where, _, _ in EXAMPLES}) >= 5, "examples found in too few files"


def test_the_readme_table_is_rendered_from_the_saved_report() -> None:
    """README.md's performance table is `kvbridge bench all --report docs/bench.json
    --markdown`, byte for byte: the committed numbers and the committed report agree."""
    import json

    from kvbridge.tools.bench.suite import format_markdown

    table = format_markdown(json.loads((ROOT / "docs" / "bench.json").read_text()))
    assert table in (ROOT / "README.md").read_text()


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages and all(f"]({page})" in index for page in pages), pages
    readme = (ROOT / "README.md").read_text()
    assert "](docs/README.md)" in readme
    for page in pages:
        assert f"](docs/{page}" in readme, f"README.md does not link docs/{page}"
