"""tools/lazy: a name imported on first use behaves as the name for calls, attributes and
isinstance, and imports its module only then."""

from __future__ import annotations

import subprocess
import sys

from kvbridge.tools.lazy import LazyName, lazy


def test_first_use_imports_and_forwards() -> None:
    code = ("import sys\n"
            "from kvbridge.tools.lazy import lazy\n"
            "Fraction = lazy('fractions', 'Fraction')\n"
            "assert 'fractions' not in sys.modules, 'imported too early'\n"
            "half = Fraction(1, 2)\n"
            "assert 'fractions' in sys.modules\n"
            "assert isinstance(half, Fraction) and half.denominator == 2\n"
            "assert Fraction.from_float(0.25) == Fraction(1, 4)\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_resolve_and_errors() -> None:
    name = lazy("collections", "OrderedDict")
    assert isinstance(name, LazyName) and "not loaded" in repr(name)
    import collections

    assert name.resolve() is collections.OrderedDict and "(loaded)" in repr(name)
    assert issubclass(collections.OrderedDict, name)
    missing = lazy("collections", "NoSuchThing")
    try:
        missing()
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("a missing name must raise on first use")
