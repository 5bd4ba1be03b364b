"""The suite's own layout: every test module in a tier (unit/, e2e/, browser/, realvllm/),
unit/ laid out as the code it tests, the browser tier marked as such, and no module of the
suite importing a test module or a conftest: what tests share is in tests/support/ (or a
tier's own helper module), and fixtures reach tests through the conftests alone."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.support.common import ROOT

TESTS = ROOT / "tests"
TIERS = ("unit", "e2e", "browser", "realvllm")


def python_files() -> Iterator[Path]:
    for path in sorted(TESTS.rglob("*.py")):
        if "__pycache__" not in path.parts and "data" not in path.relative_to(TESTS).parts:
            yield path


def modules_of_tests() -> list[Path]:
    return [p for p in python_files() if p.name.startswith("test_")]


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """Every module `path` imports, by absolute name (relative imports resolved), with the
    names a `from` import takes, since each may be a module too."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def test_every_test_module_is_in_a_tier() -> None:
    misplaced = [
        str(p.relative_to(TESTS))
        for p in modules_of_tests()
        if p.relative_to(TESTS).parts[0] not in TIERS
    ]
    assert not misplaced, f"test modules outside tests/{{{','.join(TIERS)}}}/: {misplaced}"


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    """Test modules, conftests and helpers alike: a helper goes to tests/support/, a fixture
    to the conftest of the tier that needs it (tests/conftest.py when several do)."""
    found: dict[str, str] = {}
    for path in python_files():
        for line, name in imported(path):
            parts = name.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts):
                found.setdefault(f"{path.relative_to(ROOT)}:{line}", name)
    assert not found, "\n".join(f"{where} imports {name}" for where, name in found.items())


def test_every_folder_of_the_suite_is_a_package() -> None:
    """Module names stay unique (tests/unit/.../test_metrics.py beside tests/e2e/...)."""
    folders = {p.parent for p in python_files()}
    assert not [str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()]


def test_unit_folders_are_the_codes_own() -> None:
    unit = TESTS / "unit"
    folders = [p.parent.relative_to(unit) for p in unit.rglob("test_*.py")]
    assert not [str(f) for f in folders if f.parts and not (ROOT / f).is_dir()]


def marked_browser(path: Path) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "browser"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_the_browser_tier_and_only_it_is_marked_browser() -> None:
    """`-m "not browser"` leaves out exactly tests/browser/."""
    wrong = [
        str(path.relative_to(TESTS))
        for path in modules_of_tests()
        if marked_browser(path) != (path.relative_to(TESTS).parts[0] == "browser")
    ]
    assert not wrong, f"marked browser outside tests/browser/, or not marked in it: {wrong}"
