"""The packages depend one way: ``jobs -> elastic -> storage``, and production code never
imports the test package.

Read from the source (``ast``), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYER = {"storage": 0, "elastic": 1, "jobs": 2}


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(LAYER))
def test_no_module_imports_upward(package):
    upward = []
    for path in _modules(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in LAYER and LAYER[top] > LAYER[package]:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def test_production_code_does_not_import_the_test_package():
    """``elastic.testing`` (fault injection, measurement helpers) reaches the workers only
    through the ``StepHook`` seam; the ``jobs`` layer may use it (``--fault``, the demo)."""
    bad = []
    for package in ("storage", "elastic"):
        for path in _modules(package):
            if "testing" in path.relative_to(ROOT).parts:
                continue
            for name in _imports(path):
                if name == "tests" or name.startswith(("tests.", "elastic.testing")):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: a planted upward import is found."""
    planted = tmp_path / "m.py"
    planted.write_text("def f():\n    from jobs.spec import JobSpec\n")
    assert "jobs.spec" in _imports(planted)
