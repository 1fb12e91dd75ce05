"""The core a server imports never imports the tools a person runs, no module
imports another in a circle, and the toolbox stays small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from testkit import ROOT

CORE = (
    "plugin",
    "host_pool",
    "geometry",
    "page",
    "transfer",
    "sizing",
    "storage",
    "refusals",
    "errors",
    "seal",
    "releases",
)


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


PACKAGE = ROOT / "python" / "sglang_mxfp8_hicache"
TOOLS_LINE_BUDGET = 2500
"""Lines of ``tools/*.py``: check (with its own round trip), size, and the L2
and L3 benches (timing beside the forward pass included); the tests' builders
and full round trip are in ``test/testkit/``."""


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


def test_tools_stay_small():
    """The toolbox stays within its budget: what only tests use lives in
    ``test/testkit/``."""
    lines = sum(
        len(p.read_text().splitlines()) for p in (PACKAGE / "tools").glob("*.py")
    )
    assert lines <= TOOLS_LINE_BUDGET, lines


def test_readme_install_works_from_any_clone_and_as_root():
    """The install steps name no folder a clone may not have made, and say
    what to run where ``sudo`` is absent (a root shell)."""
    readme = (PACKAGE.parent.parent / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("## ", 1)[0]
    assert "cd sglang-mxfp8-hicache" not in install
    assert "sudo apt-get install" in install and "root shell" in install
    assert "## Commands" in readme and "about 45 minutes on 2" in readme


def test_benchmarks_doc_is_the_current_tables_only():
    """docs/benchmarks.md holds the method, the current tables and a paragraph
    per design choice, no history: 150 lines at most."""
    doc = (PACKAGE.parent.parent / "docs" / "benchmarks.md").read_text()
    assert len(doc.splitlines()) <= 150


def test_l3_tables_are_the_committed_runs():
    """Each row of the L3 tables in docs/benchmarks.md (the CI machine's, then
    the GPU host's) is its committed JSON: every ratio, bold where it meets
    its goal, and the cells met."""
    import re

    import msgspec

    from sglang_mxfp8_hicache.tools.results import L3_DIRECTIONS, Report

    root = PACKAGE.parent.parent
    doc = (root / "docs" / "benchmarks.md").read_text()
    section = doc.split("**L3, every served backend**")[1].split("\n## ")[0]
    cpu, gpu = [b for b in section.split("\n\n") if b.startswith("| backend")]

    for table, host, count in ((cpu, "cpu", 7), (gpu, "h100", 5)):
        rows = [line for line in table.splitlines() if line.startswith("| `")]
        assert len(rows) == count
        for row in rows:
            label, *cells, met = [c.strip() for c in row.strip("|").split("|")]
            backend = re.match(r"`(\w+)`", label).group(1)
            data = (
                root / "docs" / "data" / f"bench-l3-{backend}-{host}.json"
            ).read_bytes()
            report = msgspec.json.decode(data, type=Report)
            assert [c.pages for c in report.cells] == [1, 4, 16, 64, 256]
            expected = [
                " / ".join(
                    f"**{c.ratio(d):.2f}**"
                    if c.ratio(d) <= c.goal
                    else f"{c.ratio(d):.2f}"
                    for d in L3_DIRECTIONS
                )
                for c in report.cells
            ]
            assert cells == expected, label
            held = sum(len(L3_DIRECTIONS) - len(c.missed()) for c in report.cells)
            assert met == f"{held}/10", label
