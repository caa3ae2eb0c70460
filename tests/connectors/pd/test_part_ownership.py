"""No attribute of the PD worker is written from two parts: each part owns its state.

The worker is a facade over parts (:mod:`kvbridge.connectors.pd.worker`'s
docstring lists them); each part is an object that owns the attributes its
``__init__`` creates. This test reads the parts' modules with :mod:`ast`
(nothing is imported) and finds every write of an attribute: ``self.x = ``,
``self.x[...] = ``, ``self.x += ``, ``del self.x[...]``, and calls of a
container's mutating methods (``self.x.add(...)``, ``.pop``, ``.append``, ...),
also through a chain (``self.other.x.add(...)``). It then checks:

- a write through another object (``self.other.x ... = ``, ``self.other.x.add``):
  a part writing another part's state; never allowed, unless ``self.other`` is
  a record the class created itself in ``__init__`` (a dataclass, or a class
  defined elsewhere: the lease table's ``LeaseStats``), not a part. The facade filling the
  context it created, ``self.cx``, is the one named exception;
- outside ``__init__``, an object's attribute written from classes in two
  modules: classes that share one ``self`` (mixins of one base) are one object,
  so mixins whose methods write each other's attributes are found here;
- a part writes only attributes its own ``__init__`` creates (it cannot grow
  state another reader does not know of).

A write through a local name (``session.active += 1`` on a record a part holds)
is not an attribute of a part; records have their own owners, said in the
modules' docstrings.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PD = Path(__file__).resolve().parents[3] / "connectors" / "pd"

#: the modules that hold the worker's parts (a module building the worker's state
#: must be listed: see test_every_module_with_worker_state_is_scanned)
PART_MODULES = ("worker.py", "worker_state.py", "sessions.py", "loads.py", "load_checks.py",
                "push_consumer.py", "holds.py", "hold_digests.py", "push.py", "pump.py",
                "leases.py")

#: (class, attribute through which it writes) allowed: the facade fills the context it
#: creates (the transport, memory and digesters at registration, an observer)
FACADE_WRITES = {("PdWorker", "cx")}

#: methods that change the container they are called on
MUTATORS = frozenset({"add", "append", "clear", "discard", "extend", "insert", "pop",
                      "popitem", "remove", "setdefault", "sort", "update", "__setitem__",
                      "__delitem__"})


@dataclass(frozen=True)
class Write:
    module: str
    cls: str
    method: str
    chain: tuple[str, ...]  # attribute names after ``self``: ("x",) or ("other", "x")
    line: int
    made_by: str = ""  # ``__init__``'s ``self.x = Made(...)``: "Made"


def _chain(node: ast.expr) -> tuple[str, ...] | None:
    """``self.a.b[...]`` -> ("a", "b"); None when the base is not ``self``."""
    names: list[str] = []
    while isinstance(node, ast.Subscript | ast.Attribute):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and names:
        return tuple(reversed(names))
    return None


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        yield from node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        yield node.target
    elif isinstance(node, ast.Delete):
        yield from node.targets
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in MUTATORS):
        yield node.func.value


def _flatten(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for elt in target.elts:
            yield from _flatten(elt)
    else:
        yield target


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name) and target.id == "dataclass":
            return True
    return False


def scan(directory: Path, modules: tuple[str, ...]) -> tuple[list[Write], dict[str, list[str]]]:
    """Every attribute write of ``self`` in the classes of ``modules``, and each part
    class's bases (by name; dataclasses are records, not parts)."""
    writes: list[Write] = []
    bases: dict[str, list[str]] = {}
    for module in modules:
        tree = ast.parse((directory / module).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if _is_dataclass(cls):
                continue
            bases[cls.name] = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                for node in ast.walk(method):
                    for target in _targets(node):
                        for one in _flatten(target):
                            chain = _chain(one)
                            if chain is None:
                                continue
                            value = getattr(node, "value", None)
                            made_by = value.func.id if (
                                isinstance(value, ast.Call)
                                and isinstance(value.func, ast.Name)) else ""
                            writes.append(Write(module, cls.name, method.name, chain,
                                                getattr(node, "lineno", 0), made_by))
    return writes, bases


def _root(cls: str, bases: dict[str, list[str]]) -> str:
    """The object a class's ``self`` is: mixins of a scanned base share it."""
    for base in bases.get(cls, ()):
        if base in bases:
            return _root(base, bases)
    return cls


def problems(directory: Path, modules: tuple[str, ...] = PART_MODULES) -> list[str]:
    writes, bases = scan(directory, modules)
    found: list[str] = []
    declared: dict[str, set[str]] = {}
    records: dict[str, set[str]] = {}  # attributes holding records the class made itself
    for w in writes:
        if w.method == "__init__" and len(w.chain) == 1:
            declared.setdefault(_root(w.cls, bases), set()).add(w.chain[0])
            if w.made_by and w.made_by not in bases:
                records.setdefault(_root(w.cls, bases), set()).add(w.chain[0])
    writers: dict[tuple[str, str], set[str]] = {}
    for w in writes:
        where = f"{w.module}:{w.line} {w.cls}.{w.method}"
        if len(w.chain) > 1:
            if (w.cls, w.chain[0]) not in FACADE_WRITES \
                    and w.chain[0] not in records.get(_root(w.cls, bases), set()):
                found.append(f"{where} writes self.{'.'.join(w.chain)}: another object's "
                             f"attribute")
            continue
        obj = _root(w.cls, bases)
        if w.chain[0] not in declared.get(obj, set()):
            found.append(f"{where} writes self.{w.chain[0]}, which {obj}.__init__ does not "
                         f"create")
        if w.method != "__init__":
            writers.setdefault((obj, w.chain[0]), set()).add(w.module)
    for (obj, attr), mods in sorted(writers.items()):
        if len(mods) > 1:
            found.append(f"{obj}.{attr} is written from {len(mods)} modules: {sorted(mods)}")
    return found


def multi_writers(directory: Path, modules: tuple[str, ...]) -> tuple[int, int]:
    """(attributes written from two or more modules, attributes written): the measure
    the refactor is judged by (``__init__`` not counted as a writer)."""
    writes, bases = scan(directory, modules)
    by: dict[tuple[str, str], set[str]] = {}
    for w in writes:
        if w.method != "__init__":
            by.setdefault((_root(w.cls, bases), w.chain[0]), set()).add(w.module)
    return sum(1 for m in by.values() if len(m) > 1), len(by)


def test_no_attribute_of_the_worker_is_written_from_two_parts() -> None:
    assert problems(PD) == []
    assert multi_writers(PD, PART_MODULES)[0] == 0


def test_the_check_finds_a_part_writing_another_parts_state(tmp_path: Path) -> None:
    """The check can fail: mixins sharing one ``self`` and a part writing through a
    reference to another are both found."""
    (tmp_path / "base.py").write_text(
        "class Base:\n"
        "    def __init__(self, other):\n"
        "        self.jobs = {}\n"
        "        self.done = set()\n"
        "        self.other = other\n"
        "        self.part = Part()\n"
        "class Part:\n"
        "    def __init__(self):\n"
        "        self.done = set()\n")
    (tmp_path / "one.py").write_text(
        "class One(Base):\n"
        "    def drop(self, rid):\n"
        "        self.jobs.pop(rid, None)\n")
    (tmp_path / "two.py").write_text(
        "class Two(Base):\n"
        "    def prune(self, rid):\n"
        "        self.jobs[rid] = 1\n"
        "        self.other.done.add(rid)\n"
        "        self.part.done.add(rid)\n"
        "        self.extra = 1\n")
    found = problems(tmp_path, ("base.py", "one.py", "two.py"))
    assert any("Base.jobs is written from 2 modules" in f for f in found)
    assert any("self.other.done" in f for f in found)
    assert any("self.part.done" in f for f in found)  # a part it made is still a part
    assert any("self.extra" in f for f in found)
    assert multi_writers(tmp_path, ("base.py", "one.py", "two.py")) == (1, 4)


def test_every_module_with_worker_state_is_scanned() -> None:
    """A module that builds on the worker's context is a part: it must be scanned."""
    uses_context = {p.name for p in PD.glob("*.py")
                    if "WorkerContext" in p.read_text() and p.name != "observe.py"}
    assert uses_context <= set(PART_MODULES), uses_context - set(PART_MODULES)
