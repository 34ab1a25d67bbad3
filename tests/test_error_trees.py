"""The drawings of the error hierarchies (the docstrings of bcd.errors and
control.errors) are the class trees: every class drawn exists under the parent
drawn, and every error class of the module is drawn."""

from __future__ import annotations

import inspect
import re
import types

import pytest

import bcd.errors
import control.errors
import control.renewal

_NAME = re.compile(r"^(?P<pre>[ │├└─]*)(?P<name>[A-Z][A-Za-z]+)\b")


def drawn(doc: str) -> dict[str, str | None]:
    """``{class: parent}`` from a docstring's ``::`` drawing (None for the root)."""
    block = doc.split("::", 1)[1].splitlines()[1:]
    lines: list[str] = []
    for line in block:
        if not line.strip():
            if lines:
                break
            continue
        lines.append(line)
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    base = None
    for line in lines:
        m = _NAME.match(line)
        if m is None:
            continue  # a description's second line
        column = len(m.group("pre"))
        base = column if base is None else base
        depth = (column - base) // 4
        del stack[depth:]
        parents[m.group("name")] = stack[-1] if stack else None
        stack.append(m.group("name"))
    return parents


def _classes(*modules: types.ModuleType) -> dict[str, type]:
    return {
        name: obj
        for module in modules
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == module.__name__
    }


@pytest.mark.parametrize(
    ("face", "modules"),
    [
        (bcd.errors, (bcd.errors,)),
        (control.errors, (control.errors, control.renewal)),
    ],
    ids=["bcd", "control"],
)
def test_the_drawing_is_the_tree(
    face: types.ModuleType, modules: tuple[types.ModuleType, ...]
) -> None:
    assert face.__doc__ is not None
    tree = drawn(face.__doc__)
    classes = _classes(*modules)
    (root,) = [name for name, parent in tree.items() if parent is None]
    for name, parent in tree.items():
        assert name in classes, f"{name} is drawn but not defined"
        if parent is not None:
            assert classes[name].__bases__ == (classes[parent],), f"{name} is not a {parent}"
    errors = {name for name, cls in classes.items() if issubclass(cls, classes[root])}
    assert errors == set(tree), "every error class is drawn"
