"""docs/tests.md cannot rot: every file it names exists, every `tests/…::name` is a
test function there, and every section names at least one file or test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "tests.md"
REF = re.compile(r"`((?:tests|bench|fuzz|docs)/[\w./-]*?)(?:::([\w:]+))?`")


def _refs() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in REF.finditer(MAP.read_text())]


def _names(path: Path) -> set[str]:
    """``name`` for each top-level test function, ``Class::name`` for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def test_the_map_names_tests() -> None:
    named = [name for _path, name in _refs() if name is not None]
    assert len(named) > 100, named


@pytest.mark.parametrize(("path", "name"), _refs(), ids=lambda v: v or "")
def test_every_reference_exists(path: str, name: str | None) -> None:
    target = REPO / path
    assert target.exists(), f"docs/tests.md names {path}, which does not exist"
    if name is None:
        return
    assert name.split("::")[-1].startswith("test_"), f"{path}::{name} is not a test"
    assert name in _names(target), f"docs/tests.md names {path}::{name}, which is not there"


def test_every_section_names_a_test_or_a_file() -> None:
    sections = re.split(r"^#+ ", MAP.read_text(), flags=re.MULTILINE)[1:]
    # a heading with nothing under it but subsections is a group, not a section
    empty = [s.splitlines()[0] for s in sections if s.strip().count("\n") and not REF.search(s)]
    assert empty == [], f"sections of docs/tests.md that name nothing: {empty}"
