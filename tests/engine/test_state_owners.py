"""Every piece of the reference engine's state has one owner.

The engine is built from parts (block space, request book, scheduling, loads,
content checks, hook log, event outlet) that each keep their own state and a
facade that routes between them. This test reads the source (no import, no
engine) and fails when

* an attribute of one object is written from two classes (a mixin writing the
  state another base declares: one ``self`` shared by several "owners"), or
* a class writes into another object's attribute through one of its own
  (``self.part.attr = ...``, ``self.part.attr.append(...)``,
  ``self.part.attr[k] = ...``), or through one of its read-only views (a property
  returning a part's container, then ``self.view.append(...)``): that part would
  not own ``attr`` any more.

and when a module other than ``engine/request.py`` writes a field of an
``EngineRequest`` (``req.state = ...``): a request changes only through its own
methods, one per thing that happens to it, which the parts call.

A write is an assignment (plain, annotated, augmented, to an item, ``del`` of
an item) or a call of a mutating container method on the attribute. Run as a
script (``python tests/engine/test_state_owners.py DIR``) it prints the
measurement for any copy of ``engine/``: classes, methods, attributes, and the
attributes written from more than one class.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"

#: methods that change the container they are called on
MUTATORS = frozenset({
    "append", "appendleft", "extend", "extendleft", "insert", "add", "discard", "remove",
    "pop", "popleft", "popitem", "clear", "update", "setdefault", "sort", "reverse",
    "difference_update", "intersection_update", "symmetric_difference_update", "rotate",
})


@dataclass
class ClassFacts:
    name: str
    module: str
    bases: tuple[str, ...]
    lines: int
    methods: int
    #: attribute -> methods (qualified ``module.Class.method``) that write it on ``self``
    writes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: ``self.<part>.<attr>`` writes: ``(part, attr, line)``; a write through a
    #: property is ``("<view>", name, line)``
    foreign: list[tuple[str, str, int]] = field(default_factory=list)


def _self_path(node: ast.expr) -> list[str] | None:
    """``self.a.b`` -> ``["a", "b"]`` (items looked through); None if not rooted at self."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
            names.append("[]")
        elif isinstance(node, ast.Name):
            return list(reversed(names)) if node.id == "self" else None
        else:
            return None


def _written_paths(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[list[str], int]]:
    """The ``self``-rooted paths a method writes, cut at the first item access:
    ``self.a[k] = v`` and ``self.a.append(v)`` write ``["a"]``; ``self.a.b = v`` writes
    ``["a", "b"]``."""
    targets: list[ast.expr] = []
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            targets.extend(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
        elif isinstance(node, ast.Delete):
            targets.extend(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS:
            targets.append(node.func.value)
    flat: list[ast.expr] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        else:
            flat.append(target)
    out = []
    for target in flat:
        path = _self_path(target)
        if not path or path[0] == "[]":
            continue
        cut = path.index("[]") if "[]" in path else len(path)
        out.append((path[:cut], target.lineno))
    return out


def _write_targets(tree: ast.AST) -> list[ast.expr]:
    """Every written expression in ``tree``, items looked through (``x.a[k] = v`` and
    ``x.a[k].append(v)`` write ``x.a``)."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS:
            targets = [node.func.value]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            else:
                while isinstance(target, ast.Subscript):
                    target = target.value
                out.append(target)
    return out


def request_field_writes(engine_dir: Path) -> list[tuple[str, int, str]]:
    """``(module, line, field)`` where a module other than ``request`` writes a field
    of ``EngineRequest`` on anything but its own ``self``."""
    request_tree = ast.parse((engine_dir / "request.py").read_text())
    request_class = next(n for n in request_tree.body
                         if isinstance(n, ast.ClassDef) and n.name == "EngineRequest")
    fields = {n.target.id for n in request_class.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    out = []
    for path in sorted(engine_dir.glob("*.py")):
        if path.stem == "request":
            continue
        for target in _write_targets(ast.parse(path.read_text())):
            if isinstance(target, ast.Attribute) and target.attr in fields and not (
                    isinstance(target.value, ast.Name) and target.value.id == "self"):
                out.append((path.stem, target.lineno, target.attr))
    return sorted(out)


def scan(engine_dir: Path) -> dict[str, ClassFacts]:
    """Every class defined in ``engine_dir/*.py``, by name."""
    classes: dict[str, ClassFacts] = {}
    for path in sorted(engine_dir.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = tuple(b.id for b in node.bases if isinstance(b, ast.Name))
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))]
            facts = ClassFacts(node.name, path.stem, bases,
                               (node.end_lineno or node.lineno) - node.lineno + 1, len(methods))
            views = {m.name for m in methods
                     if any(isinstance(d, ast.Name) and d.id == "property"
                            for d in m.decorator_list)}
            for method in methods:
                where = f"{path.stem}.{node.name}.{method.name}"
                for written, line in _written_paths(method):
                    if written[0] in views:
                        facts.foreign.append(("<view>", written[0], line))
                    elif len(written) == 1:
                        facts.writes[written[0]].add(where)
                    else:
                        facts.foreign.append((written[0], written[1], line))
            classes[node.name] = facts
    return classes


def chain(classes: dict[str, ClassFacts], name: str) -> list[ClassFacts]:
    """``name`` and its bases defined in the scanned modules (one ``self``)."""
    out: list[ClassFacts] = []
    todo = [name]
    while todo:
        facts = classes.get(todo.pop())
        if facts is not None and facts not in out:
            out.append(facts)
            todo.extend(facts.bases)
    return out


def multi_writers(classes: dict[str, ClassFacts]) -> dict[str, dict[str, set[str]]]:
    """object (most derived class) -> attribute -> the classes that write it, where
    more than one class writes it."""
    derived_from = {b for facts in classes.values() for b in facts.bases}
    out: dict[str, dict[str, set[str]]] = {}
    for name in classes:
        if name in derived_from:
            continue
        writers: dict[str, set[str]] = defaultdict(set)
        for facts in chain(classes, name):
            for attr in facts.writes:
                writers[attr].add(f"{facts.module}.{facts.name}")
        shared = {attr: who for attr, who in writers.items() if len(who) > 1}
        if shared:
            out[name] = shared
    return out


def test_no_attribute_is_written_from_two_classes() -> None:
    problems = multi_writers(scan(ENGINE_DIR))
    assert problems == {}, "\n".join(
        f"{obj}.{attr} written by {sorted(who)}" for obj, attrs in problems.items()
        for attr, who in sorted(attrs.items()))


def test_no_class_writes_another_objects_attribute() -> None:
    foreign = [(facts.module, facts.name, part, attr, line)
               for facts in scan(ENGINE_DIR).values() for part, attr, line in facts.foreign]
    assert foreign == [], "\n".join(
        f"engine/{m}.py:{line}: {cls} writes self.{part}.{attr}" if part != "<view>" else
        f"engine/{m}.py:{line}: {cls} writes through its view self.{attr}"
        for m, cls, part, attr, line in foreign)


def test_only_a_request_writes_its_fields() -> None:
    writes = request_field_writes(ENGINE_DIR)
    assert writes == [], "\n".join(
        f"engine/{m}.py:{line}: writes a request's {name} (call an EngineRequest method)"
        for m, line, name in writes)


def test_the_scan_sees_the_writes_it_forbids(tmp_path: Path) -> None:
    """The scanner itself: a mixin writing its base's state, and a write through a
    part, are both found (so the two tests above cannot pass by seeing nothing)."""
    (tmp_path / "a.py").write_text(
        "class Base:\n"
        "    def __init__(self):\n"
        "        self.queue = []\n"
        "        self.part = Part()\n")
    (tmp_path / "b.py").write_text(
        "from a import Base\n"
        "class Mixin(Base):\n"
        "    def run(self):\n"
        "        self.queue.append(1)\n"
        "        self.part.items[3] = 4\n"
        "        self.part.count += 1\n"
        "class Part:\n"
        "    def __init__(self):\n"
        "        self.items, self.count = {}, 0\n"
        "class Facade:\n"
        "    def __init__(self):\n"
        "        self._part = Part()\n"
        "    @property\n"
        "    def items(self):\n"
        "        return self._part.items\n"
        "    def poke(self):\n"
        "        self.items.clear()\n")
    classes = scan(tmp_path)
    assert multi_writers(classes) == {"Mixin": {"queue": {"a.Base", "b.Mixin"}}}
    assert sorted((p, a) for p, a, _ in classes["Mixin"].foreign) == [
        ("part", "count"), ("part", "items")]
    assert [(p, a) for p, a, _ in classes["Facade"].foreign] == [("<view>", "items")]
    assert set(classes["Part"].writes) == {"items", "count"}
    (tmp_path / "request.py").write_text(
        "class EngineRequest:\n"
        "    state: str\n"
        "    block_ids: list\n"
        "    def end(self):\n"
        "        self.state = 'done'\n")
    (tmp_path / "c.py").write_text(
        "def go(req, other):\n"
        "    req.state = 'x'\n"
        "    req.block_ids[0].append(1)\n"
        "    other.name = 1\n")
    assert [(m, f) for m, _, f in request_field_writes(tmp_path)] == [
        ("c", "state"), ("c", "block_ids")]


def _report(engine_dir: Path) -> None:
    classes = scan(engine_dir)
    shared = multi_writers(classes)
    derived_from = {b for facts in classes.values() for b in facts.bases}
    for name, facts in sorted(classes.items(), key=lambda kv: (kv[1].module, kv[0])):
        if name in derived_from or not (facts.writes or facts.bases):
            continue
        members = chain(classes, name)
        attrs = {a for f in members for a in f.writes}
        foreign = sum(len(f.foreign) for f in members)
        print(f"{facts.module}.{name}: {len(members)} class(es), "
              f"{sum(f.lines for f in members)} class lines, "
              f"{sum(f.methods for f in members)} methods, {len(attrs)} attributes written, "
              f"{len(shared.get(name, {}))} written from 2+ classes, "
              f"{foreign} writes through another object")
        for attr, who in sorted(shared.get(name, {}).items()):
            print(f"    {attr}: {', '.join(sorted(who))}")
    writers: dict[str, set[str]] = defaultdict(set)
    for module, _, name in request_field_writes(engine_dir):
        writers[name].add(module)
    print(f"EngineRequest fields written outside request.py: {len(writers)}, "
          f"from 2+ modules: {sum(1 for w in writers.values() if len(w) > 1)}")
    for name, modules in sorted(writers.items()):
        print(f"    {name}: {', '.join(sorted(modules))}")


if __name__ == "__main__":
    _report(Path(sys.argv[1]) if len(sys.argv) > 1 else ENGINE_DIR)
