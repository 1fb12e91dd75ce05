"""The core a server imports never imports the tools a person runs, no module
imports another in a circle, core and toolbox stay within their line budgets,
and only ``settings.py`` reads the package's environment variables."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import ROOT

PACKAGE = ROOT / "python" / "sglang_mxfp8_hicache"
CORE = tuple(sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"))
"""The modules a server imports: every module of the package but ``tools/``."""
CORE_LINE_BUDGET = 3900
"""Lines of ``python/sglang_mxfp8_hicache/*.py``: the plugin and its hook
account, the page, the pool, the movers, the L3 guards, the settings, the
metrics and the release adapter."""
TOOLS_LINE_BUDGET = 2990
"""Lines of ``tools/*.py``: check (with its own round trip), size (with its
planner), and the L2 and L3 benches (timing beside GEMM, HBM, decode and
prefill loops included, and a raw copy's layer 0); the tests' builders and full round trip are in
``test/testkit/``."""
SETTINGS = "settings.py"
VARIABLE_PREFIX = "SGLANG_MXFP8_HICACHE_"


def test_core_imports_no_tools():
    modules = ", ".join(f"sglang_mxfp8_hicache.{name}" for name in CORE)
    code = (
        f"import sys, {modules}\n"
        "sglang_mxfp8_hicache.plugin.register()\n"
        "tools = sorted(m for m in sys.modules if m.startswith('sglang_mxfp8_hicache.tools'))\n"
        "print(tools)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports anywhere (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("sglang_mxfp8_hicache.")}
    return found


def test_no_module_imports_another_in_a_circle():
    """Every import of the package, lazy ones included, forms no cycle."""
    paths = {
        "sglang_mxfp8_hicache."
        + ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: _imports(path) & paths.keys() for name, path in paths.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name not in done:
            for imported in graph[name]:
                visit(imported, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())
    core = {n for n in graph if ".tools." not in n}
    assert not {i for n in core for i in graph[n] if ".tools." in i}


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_core_stays_small():
    """The core within its budget: what only tools or tests use lives with them."""
    lines = _lines(PACKAGE.glob("*.py"))
    assert lines <= CORE_LINE_BUDGET, lines


def test_tools_stay_small():
    """The toolbox within its budget: what only tests use lives in
    ``test/testkit/``."""
    lines = _lines((PACKAGE / "tools").glob("*.py"))
    assert lines <= TOOLS_LINE_BUDGET, lines


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are statements of their own
    (docstrings, and attribute docstrings after an assignment)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _environ_access(node: ast.AST) -> bool:
    """``os.environ``, ``os.getenv``, ``os.putenv`` or a bare ``environ`` /
    ``getenv`` (``from os import environ``)."""
    names = ("environ", "getenv", "putenv", "environb")
    if isinstance(node, ast.Attribute):
        return node.attr in names
    return isinstance(node, ast.Name) and node.id in names


def package_variable_reads(source: str, *, core: bool) -> list[str]:
    """Where ``source`` names or reads one of the package's environment
    variables itself, each as ``line N: what``:

    - a string that is a bare variable name (``"SGLANG_MXFP8_HICACHE_X"``,
      or the prefix alone, an f-string's literal part included): the name
      of a variable held as data, to be read; a message that names one among
      other words, and a docstring, are not;
    - in a core module, any use of ``os.environ`` or ``os.getenv``: the
      core's settings come from ``settings.Settings``.
    """
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    bare = re.compile(rf"\s*{VARIABLE_PREFIX}\w*\s*")
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and bare.fullmatch(node.value)
        ):
            found.append(f"line {node.lineno}: the name {node.value.strip()!r}")
        elif core and _environ_access(node):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_settings_reads_the_package_variables():
    """No core or tools module but ``settings.py`` names a variable of the
    package as data or, in the core, touches ``os.environ``: the settings
    are read once, checked, and handed to what uses them."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == SETTINGS:
            continue
        core = path.parent == PACKAGE
        reads = package_variable_reads(path.read_text(), core=core)
        if reads:
            found[path.relative_to(PACKAGE).as_posix()] = reads
    assert not found


@pytest.mark.parametrize(
    ("source", "core", "reads"),
    [
        ('import os\nos.environ.get("SGLANG_MXFP8_HICACHE_STAGING_MB")', True, 2),
        ('import os\nos.getenv("SGLANG_MXFP8_HICACHE_X", "1")', False, 1),
        ('NAME = "SGLANG_MXFP8_HICACHE_DISABLE"', False, 1),
        ('def f(n):\n    return f"SGLANG_MXFP8_HICACHE_{n}"', False, 1),
        ("from os import environ\nvalue = environ['HOME']", True, 1),
        ("import os\nos.environ.get('HOME')", False, 0),
        ('"""Reads ``SGLANG_MXFP8_HICACHE_DISABLE``."""', True, 0),
        ('X = 1\n"""set by SGLANG_MXFP8_HICACHE_X"""', True, 0),
        ('raise ValueError("SGLANG_MXFP8_HICACHE_X=2 is not accepted")', True, 0),
        ('def f(n):\n    return f"{n} set by SGLANG_MXFP8_HICACHE_X"', True, 0),
    ],
    ids=[
        "core_environ_get",
        "tools_getenv_by_name",
        "name_as_data",
        "name_built",
        "core_from_os_import",
        "tools_other_variable",
        "docstring",
        "attribute_docstring",
        "error_message",
        "log_message",
    ],
)
def test_variable_reads_are_found(source, core, reads):
    """The check above finds what it must and lets messages be."""
    assert len(package_variable_reads(source, core=core)) == reads
