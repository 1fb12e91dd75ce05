"""The package declares every package its core imports, and nothing else:
the seals' ``xxhash`` and the rest must not arrive only because SGLang
happens to depend on them."""

from __future__ import annotations

import ast
import sys

import pytest
from packaging.requirements import Requirement

from testkit import ROOT

PACKAGE = ROOT / "python" / "sglang_mxfp8_hicache"


def _runtime_imports(tree: ast.AST) -> set[str]:
    """Top-level names of what ``tree`` imports, lazy imports included, those
    under ``if TYPE_CHECKING:`` left out."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_core_imports_are_the_declared_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    imported: set[str] = set()
    for path in PACKAGE.glob("*.py"):
        imported |= _runtime_imports(ast.parse(path.read_text()))
    third_party = imported - set(sys.stdlib_module_names) - {"sglang_mxfp8_hicache"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name for r in project["dependencies"]}
    assert third_party == declared
    bounded = [r for r in project["dependencies"] if Requirement(r).specifier]
    assert bounded == ["sglang>=0.5.16"], "a bound could move SGLang's own pins"
