"""The package's imports point downward only, and no two modules import each other.

docs/architecture.md ("The import rule") states the rule; this test keeps it true.
It reads every module of the package with :mod:`ast` (nothing is imported, so
it needs no backend and sees modules that would fail to import) and checks each
``kvbridge`` import against :data:`MAY_IMPORT`, then looks for cycles in the
module graph (Tarjan's strongly connected components).

What counts as an import of a module:

- ``import kvbridge.x.y`` and ``from kvbridge.x import y`` (``y`` a module:
  an edge to ``kvbridge.x.y``; a name: an edge to ``kvbridge.x``), and the
  relative forms, resolved against the importing module's package;
- imports inside functions ("deferred": they run when the function is called);
- ``importlib.import_module("kvbridge.x")``, ``__import__("kvbridge.x")`` and
  ``tools.lazy.lazy("kvbridge.x", name)`` with a literal module name (an
  f-string's literal ``kvbridge.x.`` prefix counts for the layer rule only);
- imports under ``if TYPE_CHECKING:`` ("type-only").

Every kind counts for the layer rule: a type-only import upward is still a
dependency upward (the signature names a type of a higher layer). For cycles,
type-only edges are left out: they never run, and a pair of modules whose
signatures name each other's types is allowed. A deferred import does run, so a
cycle through one counts (a function-level import is not a way around the rule).

Importing a submodule also runs its parent packages' ``__init__``; that is not
an edge here (a package whose ``__init__`` re-exports its submodules would
otherwise form a cycle with each of them).
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvbridge"

# auth/ (the cluster secret and sealed messages) is the floor: it imports nothing
# of kvbridge, and every package may use it (events/ seals its replay socket).
# Above it, the packages at the bottom import nothing else of kvbridge (not each
# other). backends/ holds the thin NIXL/Mooncake adapters and environment
# defaults that connectors, offload, engine and tools share.
FLOOR = frozenset({"auth"})
BOTTOM = frozenset({"layouts", "events", "backends"}) | FLOOR
_MIDDLE = BOTTOM | {"handshake", "offload"}
_ALL = _MIDDLE | {"connectors", "engine", "integrations", "tools"}

# Top-level package -> the other top-level packages its modules may import.
# "" is the root module (kvbridge/__init__.py): every import of any submodule
# runs it first, so whatever it imported would be a dependency of every layer;
# it imports nothing of kvbridge. Importing the root itself is allowed anywhere.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "": frozenset(),
    **{name: FLOOR - {name} for name in BOTTOM},
    "handshake": BOTTOM,
    "offload": BOTTOM,
    "connectors": _MIDDLE,
    # engine and integrations sit side by side above connectors: neither imports the other.
    "engine": _MIDDLE | {"connectors"},
    "integrations": _MIDDLE | {"connectors"},
    # tools uses everything; only tools (and tests, not scanned) import tools or engine.
    "tools": _ALL,
}

# (importing module, imported module) -> why this upward import is a design need.
# Empty today. An entry that no longer matches an import fails the test, so the
# list cannot outlive its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}

_RULE = "docs/architecture.md 'The import rule': dependencies point downward only"


class Kind(enum.Enum):
    TOP = "module level"  # runs when the module is imported
    DEFERRED = "deferred"  # inside a function, or a lazy()/import_module() by name
    TYPE_ONLY = "TYPE_CHECKING"  # never runs
    PREFIX = "dynamic prefix"  # f"kvbridge.x.{name}": only the package is known


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    path: Path
    line: int
    kind: Kind

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file for every module of the package rooted at ``root``.

    The same folders as the wheel's package list (tests/test_packaging.py): every
    folder with an ``__init__.py`` under ``root`` except hidden ones and tests/.
    A C extension's source (``offload/_fsio.c``) is the module it builds: a leaf that
    imports nothing of kvbridge. ``setup.py`` at the root is the build script, which
    the wheel leaves out (setup.py's build_py), not a module.
    """
    modules: dict[str, Path] = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        relative = path.relative_to(root)
        folders = relative.parts[:-1]
        if folders[:1] == ("tests",) or any(p.startswith(".") for p in relative.parts):
            continue
        if relative == Path("setup.py"):
            continue
        if not all((root.joinpath(*folders[:i]) / "__init__.py").is_file()
                   for i in range(len(folders) + 1)):
            continue  # a script folder, not part of the package
        parts = [*folders] if path.name == "__init__.py" else [*folders, path.stem]
        modules[".".join((package, *parts))] = path
    return modules


def _deeper(outer: Kind, inner: Kind) -> Kind:
    """The kind of an import nested in both: TYPE_CHECKING wins over deferred, deferred
    over module level (a function under TYPE_CHECKING never runs)."""
    order = [Kind.TOP, Kind.DEFERRED, Kind.TYPE_ONLY]
    return max(outer, inner, key=order.index)


_BY_NAME_CALLS = {"import_module": Kind.TOP, "__import__": Kind.TOP,
                  "lazy": Kind.DEFERRED, "LazyName": Kind.DEFERRED}


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: Path, modules: Mapping[str, Path],
                 package: str, shown: str) -> None:
        self.module, self.path, self.modules, self.package = module, path, modules, package
        self.shown = shown  # the path in messages, relative to the package root
        self.is_package = path.name == "__init__.py"
        self.kind = Kind.TOP
        self.imports: list[Import] = []
        self.errors: list[str] = []

    def _add(self, target: str, node: ast.AST, kind: Kind | None = None) -> None:
        self.imports.append(Import(self.module, target, self.path,
                                   getattr(node, "lineno", 0), kind or self.kind))

    def _ours(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _with_kind(self, kind: Kind, nodes: Iterable[ast.AST]) -> None:
        outer = self.kind
        self.kind = _deeper(outer, kind)
        for node in nodes:
            self.visit(node)
        self.kind = outer

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._ours(alias.name):
                self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            if node.level - 1 >= len(base):
                self.errors.append(f"{self.shown}:{node.lineno}: {self.module}: relative "
                                   f"import beyond the top-level package")
                return
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if not self._ours(source):
            return
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            self._add(submodule if submodule in self.modules else source, node)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else \
            test.attr if isinstance(test, ast.Attribute) else None
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._with_kind(Kind.TYPE_ONLY, node.body)
        for child in node.orelse:
            self.visit(child)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # decorators and defaults run at definition time; the body when called
        if not isinstance(node, ast.Lambda):
            for decorator in node.decorator_list:
                self.visit(decorator)
            if node.returns is not None:
                self.visit(node.returns)
        self.visit(node.args)
        body = node.body if isinstance(node.body, list) else [node.body]
        self._with_kind(Kind.DEFERRED, body)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else None
        if name in _BY_NAME_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) \
                    and self._ours(first.value):
                self._add(first.value, node, _deeper(self.kind, _BY_NAME_CALLS[name]))
            elif isinstance(first, ast.JoinedStr) and first.values \
                    and isinstance(first.values[0], ast.Constant) \
                    and isinstance(first.values[0].value, str):
                prefix = first.values[0].value.rsplit(".", 1)[0]
                if self._ours(prefix) and prefix != first.values[0].value:
                    self._add(prefix, node, Kind.PREFIX)
        self.generic_visit(node)


@dataclass
class Scan:
    root: Path
    modules: dict[str, Path]
    imports: list[Import]
    errors: list[str]  # unparsable relative imports, unknown targets


def scan(root: Path, package: str = PACKAGE) -> Scan:
    modules = module_files(root, package)
    imports: list[Import] = []
    errors: list[str] = []
    for module, path in modules.items():
        if path.suffix == ".c":
            continue   # an extension module: no Python imports
        collector = _Collector(module, path, modules, package, str(path.relative_to(root)))
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        imports += collector.imports
        errors += collector.errors
    for imp in imports:
        if imp.target not in modules:
            errors.append(f"{imp.where(root)}: {imp.importer} imports {imp.target} "
                          f"({imp.kind.value}), which is no module of the package")
    return Scan(root, modules, imports, errors)


def layer_of(module: str, package: str = PACKAGE) -> str:
    """The top-level package of ``module`` ("" for the root module)."""
    return module.split(".")[1] if module != package else ""


def layer_violations(result: Scan, may_import: Mapping[str, frozenset[str]] = MAY_IMPORT,
                     exceptions: Mapping[tuple[str, str], str] = EXCEPTIONS,
                     package: str = PACKAGE) -> list[str]:
    """One line per import that breaks the rule: file:line, who imports whom, the rule."""
    problems: list[str] = []
    unknown: set[str] = set()
    for module in result.modules:  # one line per unknown top-level package
        layer = layer_of(module, package)
        if layer not in may_import and layer not in unknown:
            unknown.add(layer)
            problems.append(f"{result.modules[module].relative_to(result.root)}: {module} is in "
                            f"no layer: add {layer!r} to MAY_IMPORT in tests/test_import_rules.py "
                            f"and to docs/architecture.md 'The packages' and 'The import rule'")
    used: set[tuple[str, str]] = set()
    for imp in result.imports:
        source, target = layer_of(imp.importer, package), layer_of(imp.target, package)
        if target in ("", source) or source not in may_import:
            continue
        if target in may_import[source]:
            continue
        if (imp.importer, imp.target) in exceptions:
            used.add((imp.importer, imp.target))
            continue
        allowed = ", ".join(sorted(may_import[source])) or "nothing of " + package
        problems.append(f"{imp.where(result.root)}: {imp.importer} imports {imp.target} "
                        f"({imp.kind.value}): {source or 'the root module'} may import only "
                        f"{allowed}, not {target} ({_RULE})")
    for stale in sorted(set(exceptions) - used):
        problems.append(f"EXCEPTIONS{stale!r} matches no upward import any more: remove it")
    return problems


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit); components in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.get(start, ())))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(result: Scan, *, type_only: bool = False) -> list[str]:
    """One line per import cycle, with one path around it. Type-only edges are left out
    unless ``type_only``."""
    edges: dict[tuple[str, str], Import] = {}
    graph: dict[str, set[str]] = {module: set() for module in result.modules}
    left_out = (Kind.PREFIX,) if type_only else (Kind.TYPE_ONLY, Kind.PREFIX)
    for imp in result.imports:
        if imp.kind in left_out or imp.target not in result.modules:
            continue
        graph[imp.importer].add(imp.target)
        edges.setdefault((imp.importer, imp.target), imp)
    problems = []
    for component in strongly_connected(graph):
        first = component[0]
        if len(component) == 1 and first not in graph[first]:
            continue
        # shortest way from `first` back to itself inside the component
        members = set(component)
        previous: dict[str, str] = {}
        frontier = [first]
        while frontier and first not in previous:
            following = []
            for node in frontier:
                for child in sorted(graph[node] & members):
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        path = [first]
        while True:
            path.append(previous[path[-1]])
            if path[-1] == first:
                break
        path.reverse()
        steps = "; ".join(
            f"{a} imports {b} at {edges[a, b].where(result.root)} ({edges[a, b].kind.value})"
            for a, b in zip(path, path[1:], strict=False))
        problems.append(f"import cycle among {', '.join(component)}: {steps} -- move the shared "
                        f"code into the module that owns it, or invert the dependency")
    return problems


# --- the real package --------------------------------------------------------------------


def test_package_imports_point_downward_only() -> None:
    result = scan(ROOT)
    assert len(result.modules) > 50, "the scan found too few modules: is ROOT the package?"
    assert any(imp.kind is Kind.TYPE_ONLY for imp in result.imports)
    assert any(imp.kind is Kind.DEFERRED for imp in result.imports)
    problems = result.errors + layer_violations(result)
    assert not problems, "\n".join(problems)


#: Inside ``connectors``: the PD core imports no adapter of it and no transport library's
#: adapter; it reaches a transport through ``connectors/pd/transport.py`` and speaks the
#: records of ``backends/transfer.py`` (docs/architecture.md, the ``connectors/`` room).
PD_CORE = "kvbridge.connectors.pd"
PD_MAY_NOT_IMPORT = ("kvbridge.connectors.nixl", "kvbridge.connectors.mooncake_te",
                     "kvbridge.connectors.mooncake_store", "kvbridge.backends.nixl",
                     "kvbridge.backends.mooncake")


def test_the_pd_core_imports_no_transport_adapter() -> None:
    result = scan(ROOT)
    core = [imp for imp in result.imports if imp.importer.startswith(PD_CORE + ".")
            or imp.importer == PD_CORE]
    assert any(imp.target == "kvbridge.backends.transfer" for imp in core)
    problems = [f"{imp.where(ROOT)}: {imp.importer} imports {imp.target} ({imp.kind.value})"
                for imp in core
                if any(imp.target == bad or imp.target.startswith(bad + ".")
                       for bad in PD_MAY_NOT_IMPORT)]
    assert not problems, "\n".join(problems)


def test_package_has_no_import_cycles() -> None:
    problems = cycles(scan(ROOT))
    assert not problems, "\n".join(problems)


def test_package_has_no_import_cycles_even_through_type_only_imports() -> None:
    """Two modules whose signatures name each other's types are one concept cut in two:
    pass the narrow part one needs of the other instead (the fs tier's batched reads
    take ``ChunkFiles``, not the tier)."""
    problems = cycles(scan(ROOT), type_only=True)
    assert not problems, "\n".join(problems)


# --- the checker, on a tiny package --------------------------------------------------------


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
    return root


def test_checker_names_an_upward_import_with_module_line_and_rule(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "layouts/spec.py": "import os\n\nfrom kvbridge.connectors.api import Connector\n",
        "connectors/api.py": "from ..layouts import spec\n\nConnector = object\n",
    })
    problems = layer_violations(scan(root))
    assert problems == [
        "layouts/spec.py:3: kvbridge.layouts.spec imports kvbridge.connectors.api "
        f"(module level): layouts may import only auth, not connectors ({_RULE})"]


def test_checker_counts_deferred_lazy_and_type_only_imports_for_layers(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "events/a.py": ("from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from kvbridge.engine import core\n"
                        "else:\n    import kvbridge.layouts.b\n"
                        "def f():\n    from ..tools import cli\n"
                        "X = lazy('kvbridge.offload.c', 'X')\n"),
        "engine/core.py": "", "layouts/b.py": "", "tools/cli.py": "", "offload/c.py": "",
    })
    result = scan(root)
    assert not result.errors
    kinds = {(imp.target, imp.kind) for imp in result.imports}
    assert kinds == {("kvbridge.engine.core", Kind.TYPE_ONLY), ("kvbridge.layouts.b", Kind.TOP),
                     ("kvbridge.tools.cli", Kind.DEFERRED),
                     ("kvbridge.offload.c", Kind.DEFERRED)}
    lines = sorted(p.split(":")[1] for p in layer_violations(result))
    assert lines == ["3", "5", "7", "8"]  # layouts is bottom too: events may not import it


def test_checker_finds_a_cycle_but_allows_one_through_type_checking(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "tools/demo.py": "from kvbridge.tools.report import route\n",
        "tools/report.py": "def route():\n    from kvbridge.tools import demo\n",
        "tools/typed.py": "from kvbridge.tools import hinted\n",
        "tools/hinted.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import typed\n",
        "tools/self.py": "import kvbridge.tools.self\n",
    })
    result = scan(root)
    assert not layer_violations(result)
    assert cycles(result) == [
        "import cycle among kvbridge.tools.demo, kvbridge.tools.report: "
        "kvbridge.tools.demo imports kvbridge.tools.report at tools/demo.py:1 (module level); "
        "kvbridge.tools.report imports kvbridge.tools.demo at tools/report.py:2 (deferred) "
        "-- move the shared code into the module that owns it, or invert the dependency",
        "import cycle among kvbridge.tools.self: kvbridge.tools.self imports kvbridge.tools.self "
        "at tools/self.py:1 (module level) "
        "-- move the shared code into the module that owns it, or invert the dependency"]


def test_checker_rejects_unknown_layers_targets_and_stale_exceptions(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "newpkg/x.py": "from kvbridge.layouts import missing_module_or_name\n",
        "layouts/__init__.py": "",
        "tools/t.py": "import importlib\nimportlib.import_module('kvbridge.tools.gone')\n",
        "tools/up.py": "from ... import x\n",
    })
    result = scan(root)
    assert result.errors == ["tools/up.py:1: kvbridge.tools.up: relative import beyond the "
                             "top-level package","tools/t.py:2: kvbridge.tools.t imports kvbridge.tools.gone "
                             "(module level), which is no module of the package"]
    problems = layer_violations(result, exceptions={("kvbridge.a", "kvbridge.b"): "why"})
    assert problems[0].startswith("newpkg/__init__.py: kvbridge.newpkg is in no layer: "
                                  "add 'newpkg' to MAY_IMPORT")
    assert problems[1:] == ["EXCEPTIONS('kvbridge.a', 'kvbridge.b') matches no upward import "
                            "any more: remove it"]


def test_checker_honours_a_documented_exception(tmp_path: Path) -> None:
    root = _package(tmp_path, {"handshake/h.py": "from kvbridge.offload import o\n",
                               "offload/o.py": ""})
    result = scan(root)
    assert len(layer_violations(result)) == 1
    assert layer_violations(result, exceptions={
        ("kvbridge.handshake.h", "kvbridge.offload.o"): "reason"}) == []
