"""The README and ``docs/`` say what the code does: their links resolve, the
paths, commands and flags they give exist, and their numbers are the code's
and the committed runs'."""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from testkit import ROOT

PACKAGE = ROOT / "python" / "sglang_mxfp8_hicache"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LINE_BUDGET = 180
BENCHMARKS_LINE_BUDGET = 150
PROG = "sglang-mxfp8-hicache"

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


per_page = pytest.mark.parametrize("page", PAGES, ids=_page_id)


def _prose(text: str) -> str:
    """``text`` without its fenced blocks."""
    return FENCE.sub("", text)


def _blocks(text: str) -> list[str]:
    """The lines of the fenced blocks, continuation lines joined."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def _spans(text: str) -> list[str]:
    """The inline code of ``text``, each span's whitespace made single spaces."""
    return [" ".join(span.split()) for span in SPAN.findall(_prose(text))]


def _section(text: str, heading: str) -> str:
    """The body under ``heading`` (a whole heading line), up to the next
    heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    following = re.compile(rf"^#{{1,{len(level)}}} ", re.M)
    end = following.search(_blank_fences(text), start)
    return text[start : end.start() if end else len(text)]


def _blank_fences(text: str) -> str:
    """``text`` with its fenced blocks' lines blanked (offsets kept), so that
    a ``#`` comment in a block is no heading."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _table(text: str) -> list[list[str]]:
    """The body rows of the first table in ``text``, cells stripped."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) > 2, text[:200]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:]]


def _code(cell: str) -> list[str]:
    return [" ".join(span.split()) for span in SPAN.findall(cell)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _blank_fences(page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


# The README


def test_readme_fits_a_screen():
    lines = len(README.read_text().splitlines())
    assert lines <= README_LINE_BUDGET, lines


def test_readme_keeps_the_two_commands_of_the_contract():
    """The main job and the tests, each a command of its own in a block, as CI
    and a fresh clone run them; the console script is the CLI's."""
    text = README.read_text()
    commands = [line.strip() for line in _blocks(text)]
    assert f"{PROG} check" in commands
    tests = "python -m pytest test/ -n 2 --dist worksteal"
    assert tests in commands
    assert tests in (ROOT / ".ci" / "run").read_text()  # CI runs what it says
    assert "about 25 minutes on 2" in text
    assert "`python -m pytest -m gpu test/`" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]\n", 1)[1].split("\n\n", 1)[0]
    assert f'{PROG} = "sglang_mxfp8_hicache.tools.cli:main"' in scripts.splitlines()


def test_readme_install_works_from_any_clone_and_as_root():
    """The install steps name no folder a clone may not have made, say what to
    run where ``sudo`` is absent (a root shell), and fetch the package lists
    before they install from them."""
    install = _section(README.read_text(), "## Install")
    assert "cd sglang-mxfp8-hicache" not in install
    assert "root shell" in install
    lines = [line.split(" #", 1)[0].strip() for line in _blocks(install)]
    update = lines.index("sudo apt-get update")
    assert lines.index("sudo apt-get install -y python3-venv") > update
    assert lines.index("sudo apt-get install -y libibverbs1") > update
    clone = lines.index('git clone "$REPO_URL" mxfp8-hicache && cd mxfp8-hicache')
    assert lines.index("python3 -m venv .venv && . .venv/bin/activate") > clone
    assert 'pip install . "sglang==0.5.23"' in lines
    assert 'pip install -e ".[test]" "sglang==0.5.23"' in lines


def test_readme_install_names_the_extras_and_the_wheel():
    """The plain install needs no extra; the README says what each extra
    adds (pyproject.toml's lists) and names the wheel a build makes."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    install = " ".join(_section(README.read_text(), "## Install").split())
    extras = pyproject["project"]["optional-dependencies"]
    named = {"mooncake": "Mooncake", "nixl": "NIXL", "seaweedfs": "SeaweedFS"}
    for requirement in extras["test"]:
        package = re.split(r"[=<>\[]", requirement, maxsplit=1)[0]
        word = next((w for k, w in named.items() if package.startswith(k)), package)
        assert word in install, requirement
    for requirement in set(extras["dev"]) - set(extras["test"]):
        assert requirement.split("=")[0] in install, requirement
    project = pyproject["project"]
    wheel = f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any"
    assert f"`dist/{wheel}.whl`" in install
    assert "`pip wheel --no-deps -w dist .`" in install


def test_readme_releases_are_the_served_ones():
    from sglang_mxfp8_hicache.releases import NEWEST, SUPPORTED_SGLANG_VERSIONS

    rows = _table(_section(README.read_text(), "## SGLang releases"))
    assert rows[0][0] == ", ".join(SUPPORTED_SGLANG_VERSIONS)
    assert rows[0][1].startswith("served")
    assert rows[-1][0] == f"newer than {NEWEST}"
    assert rows[-1][1].startswith("refused at startup until tested")
    assert rows[1][0] == "0.5.16-0.5.20" and rows[1][1].startswith("refused")
    releases = (DOCS / "releases.md").read_text()
    served = ", ".join(f"**{v}**" for v in SUPPORTED_SGLANG_VERSIONS[:-1])
    assert f"Served: {served} and **{NEWEST}**" in releases


def test_readme_headline_is_the_committed_run():
    """The headline figure is the beside-GEMM run of docs/benchmarks.md: the
    most our backups and loads, and SGLang's class, slow the loop."""
    run = json.loads((DOCS / "data" / "bench-h100-beside-loops.json").read_bytes())
    gemm = [row for row in run["rows"] if row["beside"] == "gemm"]

    def most(direction: str | None, pool: str) -> str:
        ratios = [
            row["loop_ratio"][pool]
            for row in gemm
            if direction in (None, row["direction"])
        ]
        return f"{max(ratios):.2f}x"

    said = " ".join(_section(README.read_text(), "## Performance").split())
    assert (
        f"slow the loop by at most {most('backup', 'ours')} and "
        f"{most('load', 'ours')}; SGLang's own MXFP8 host class slows it by up "
        f"to {most(None, 'sglang')}"
    ) in said
    assert run["device"].startswith("NVIDIA H100") and "on an H100" in said


@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_readme_log_line_is_the_pools(make_pools, caplog):
    """The README's log line is what a pool of its geometry logs (its "..."
    elides the rest)."""
    from sglang_mxfp8_hicache import host_pool

    quoted = [
        line
        for line in _blocks(_section(README.read_text(), "## Run"))
        if "HiCache host pool" in line
    ]
    assert len(quoted) == 1
    with caplog.at_level(logging.INFO, logger=host_pool.__name__):
        make_pools(heads=8, head_dim=128, layers=32, pages=2)
    logged = [r.getMessage() for r in caplog.records if r.name == host_pool.__name__]
    assert len(logged) == 1
    assert quoted[0].endswith("...")
    assert logged[0].startswith(quoted[0].removesuffix("...").rstrip()), logged[0]


def test_readme_metrics_are_the_pools():
    """The README names each metric in full as ``/metrics`` shows it, and
    every value of its labels."""
    from sglang_mxfp8_hicache import metrics

    said = " ".join(_section(README.read_text(), "## Metrics").split())
    spans = set(_spans(said))
    for family in metrics._families().values():
        name = family._name + ("_total" if family._type == "counter" else "")
        labels = [label for label in family._labelnames if label != "tp_rank"]
        if "pool" in labels:
            labels.remove("pool")
            shown = f"{name}{{{','.join(labels)}}}" if labels else name
        else:
            shown = f"{name}{{tp_rank}}"
        assert shown in spans, shown
    values = (*metrics.MISS_REASONS, *metrics.PATHS, "load", "backup")
    values += ("kv", "full", "swa", "draft", "draft_swa")
    assert not [value for value in values if value not in spans]
    assert "`http://HOST:PORT/metrics`" in said


# Every page: links, paths, commands


@per_page
def test_links_resolve(page):
    """Every relative link names a file of the clone, and its anchor a
    heading of that file."""
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{target} (from {_page_id(page)})"
        if anchor:
            assert anchor in _anchors(resolved), f"{target} (from {_page_id(page)})"


PATH = re.compile(r"(?<![\w./$-])(test|docs|python|\.ci|csrc)/[\w./*-]*")
PYTHON_FILE = re.compile(r"(?<![\w./*-])([\w/]+\.py)\b")


@cache
def _known_python_files() -> frozenset[str]:
    """Every ``.py`` of the clone (relative to it) and of the installed
    SGLang (relative to the folder above it), so that ``pool_host/mha.py``
    matches as a suffix."""
    import sglang

    clone = [(ROOT, ROOT / "python"), (ROOT, ROOT / "test")]
    sglang_root = Path(sglang.__file__).parent
    return frozenset(
        p.relative_to(base).as_posix()
        for base, root in [*clone, (sglang_root.parent, sglang_root)]
        for p in root.rglob("*.py")
    )


@per_page
def test_paths_and_modules_named_exist(page):
    """A path of the clone (``test/...``, ``docs/...``, ``.ci/...``, the
    kernels' ``csrc/...``) exists, a glob matches something, and a Python file
    named in code is one of the clone's or SGLang's."""
    text = page.read_text()
    code = [*_spans(text), *_blocks(text)]
    for piece in code:
        for match in PATH.finditer(piece):
            path = match.group(0).rstrip(".")
            base = PACKAGE if path.startswith("csrc/") else ROOT
            found = list(base.glob(path.rstrip("/"))) if "*" in path else None
            assert found or (base / path).exists(), f"{path} ({_page_id(page)})"
        for name in PYTHON_FILE.findall(piece):
            known = _known_python_files()
            assert any(k == name or k.endswith("/" + name) for k in known), (
                f"{name} ({_page_id(page)})"
            )


def _top_level_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id: node for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


@cache
def _package_modules() -> dict[str, dict[str, ast.stmt]]:
    """Each module of the package (core and tools) by its name, with its
    top-level names."""
    return {
        path.stem: _top_level_names(ast.parse(path.read_text()).body)
        for path in [*PACKAGE.glob("*.py"), *(PACKAGE / "tools").glob("*.py")]
    }


@per_page
def test_code_names_exist(page):
    """``module.Name`` (and ``module.Class.attribute``) named in code is
    defined there: a page never names what the code no longer has."""
    modules = _package_modules()
    qualified = re.compile(r"(\w+)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?(\(\))?")
    for span in _spans(page.read_text()):
        match = qualified.fullmatch(span)
        if not match or match[1] not in modules or span.endswith((".py", ".md")):
            continue
        module, name, attribute = match[1], match[2], match[3]
        defined = modules[module].get(name)
        assert defined is not None, f"{span} ({_page_id(page)})"
        if attribute:
            assert isinstance(defined, ast.ClassDef), f"{span} ({_page_id(page)})"
            assert attribute in _top_level_names(defined.body), (
                f"{span} ({_page_id(page)})"
            )


def _commands(text: str) -> list[list[str]]:
    """The commands a page gives, in blocks or inline, as words: environment
    assignments and a virtualenv's ``bin/`` dropped, comments cut."""
    found = []
    for line in [*_blocks(text), *_spans(text)]:
        line = line.split(" #", 1)[0].strip()
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words:
            words[0] = words[0].rsplit("/bin/", 1)[-1]
            found.append(words)
    return found


def _flags(words: list[str]) -> list[str]:
    return [
        w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)
    ]


@cache
def _cli_flags() -> dict[str, set[str]]:
    """Each ``sglang-mxfp8-hicache`` command's flags."""
    from sglang_mxfp8_hicache.tools.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        name: {*command._option_string_actions, "--help"}
        for name, command in sub.choices.items()
    }


def _launcher_source(name: str) -> str:
    """The source behind ``python test/NAME.py``: its testkit module or package."""
    module = ROOT / "test" / "testkit" / f"{name}.py"
    package = ROOT / "test" / "testkit" / name
    files = [module] if module.exists() else sorted(package.glob("*.py"))
    assert files, f"test/{name}.py has no testkit module"
    return "\n".join(f.read_text() for f in files)


XDIST_FLAGS = {"--dist"}


@per_page
def test_commands_take_their_flags(page):
    """``sglang-mxfp8-hicache COMMAND --flag``, ``python test/NAME.py --flag``
    and ``python -m pytest --flag``: each command and flag a page gives is one
    the program takes."""
    conftest = (ROOT / "test" / "conftest.py").read_text()
    for words in _commands(page.read_text()):
        program, *rest = words
        if program == PROG and rest and re.fullmatch(r"[a-z][a-z_-]*", rest[0]):
            command, *args = rest
            assert command in _cli_flags(), f"{' '.join(words)} ({_page_id(page)})"
            unknown = set(_flags(args)) - _cli_flags()[command]
            assert not unknown, f"{' '.join(words)}: {unknown} ({_page_id(page)})"
        elif program in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
            for flag in _flags(rest):
                if flag in XDIST_FLAGS:  # pytest-xdist's, from the test extra
                    assert "pytest-xdist" in (ROOT / "pyproject.toml").read_text()
                    continue
                assert f'"{flag}"' in conftest, f"{flag} ({_page_id(page)})"
        elif program in ("python", "python3") and rest and rest[0].startswith("test/"):
            script = ROOT / rest[0]
            assert script.exists(), f"{rest[0]} ({_page_id(page)})"
            source = _launcher_source(script.stem)
            for flag in set(_flags(rest[1:])) - {"--help"}:
                assert flag in source, f"{rest[0]} {flag} ({_page_id(page)})"


def test_cli_page_flags_are_its_commands():
    """In docs/cli.md, a flag named under a command's heading is one that
    command takes."""
    text = (DOCS / "cli.md").read_text()
    for command in _cli_flags():
        section = _section(text, f"## {command}")
        named = {
            span.split()[0].split("=")[0]
            for span in _spans(section)
            if span.startswith("--")
        }
        for words in _commands(section):
            if words[0] == command:
                named |= set(_flags(words[1:]))
        assert named, command
        assert not named - _cli_flags()[command], (
            command,
            named - _cli_flags()[command],
        )


def test_cli_page_numbers_are_the_tools():
    from sglang_mxfp8_hicache.tools import results

    said = " ".join((DOCS / "cli.md").read_text().split())
    geometries = ",".join("x".join(map(str, g)) for g in results.BENCH_GEOMETRIES)
    assert f"(default `{geometries}`)" in said
    assert (
        f"at most {results.L3_GOAL_RATIO}x payload-only's time from "
        f"{results.L3_GOAL_FROM_PAGES} pages, {results.L3_SMALL_BATCH_GOAL_RATIO}x below"
    ) in said
    assert f"batches of 1 to {max(results.BENCH_PAGES)} pages" in said
    backends = ", ".join(f"`{b}`" for b in results.L3_BACKENDS)
    assert f"`bench --l3 BACKEND` ({backends})" in said
    ablations = ",".join(results.BENCH_ABLATIONS)
    assert f"`--ablations {ablations}`" in said


def test_cli_page_size_bounds_are_the_planners():
    from sglang_mxfp8_hicache.tools import sizing

    said = " ".join((DOCS / "cli.md").read_text().split())
    bounds = sizing.MODEL_BOUNDS
    assert f"more than {bounds['layers']} layers or KV heads" in said
    assert bounds["layers"] == bounds["kv_heads"]
    assert f"a page of more than {sizing.MAX_PAGE_SIZE} tokens" in said
    assert f"past {sizing.MAX_DEVICE_BYTES >> 40} TiB per rank" in said
    assert f"past {sizing.MAX_NODE_HOST_BYTES >> 40} TiB per node" in said


# docs/configuration.md


def _variable_rows(text: str, heading: str) -> dict[str, list[str]]:
    rows = _table(_section(text, heading))
    return {_code(row[0])[0]: row for row in rows}


def _shown(value: object) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _defaults(monkeypatch, cores: int) -> dict[str, str]:
    """Each variable's default on a machine of ``cores`` cores."""
    from sglang_mxfp8_hicache import settings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    read = settings.Settings.from_environ({})
    return {
        v.name: _shown(getattr(read, v.name.removeprefix(settings.PREFIX).lower()))
        for v in settings.VARIABLES
    }


def test_configuration_lists_every_variable(monkeypatch):
    """docs/configuration.md's table is ``settings.VARIABLES``: every name, in
    order, its default (and where it depends on the cores, says so), and
    bounds the settings accept and refuse."""
    from sglang_mxfp8_hicache import settings
    from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

    rows = _variable_rows(
        (DOCS / "configuration.md").read_text(), "## Environment variables"
    )
    assert list(rows) == [v.name for v in settings.VARIABLES]
    many, one = _defaults(monkeypatch, 64), _defaults(monkeypatch, 1)
    for name, (_, default, accepts, _what) in rows.items():
        assert _code(default)[0] == many[name], name
        assert (many[name] != one[name]) == ("fewer" in default), name
        field = name.removeprefix(settings.PREFIX).lower()

        def read(text: str, name: str = name, field: str = field) -> object:
            return getattr(settings.Settings.from_environ({name: text}), field)

        bounds = re.fullmatch(r"(\d+)-(\d+)( \(.*\))?", accepts)
        if bounds:
            low, high = int(bounds[1]), int(bounds[2])
            assert read(str(low)) == low and read(str(high)) == high, name
            for outside in (str(high + 1), str(low - 1), "x"):
                with pytest.raises(BlockScaledHiCacheConfigError, match=name):
                    read(outside)
        else:
            on, off = accepts.split(";")
            assert all(read(word) is True for word in _code(on)), name
            assert all(read(word) is False for word in _code(off)), name
            with pytest.raises(BlockScaledHiCacheConfigError, match=name):
                read("maybe")


def test_readme_settings_are_the_variables(monkeypatch):
    from sglang_mxfp8_hicache import settings

    rows = _variable_rows(README.read_text(), "## Settings")
    assert list(rows) == [v.name for v in settings.VARIABLES]
    many, one = _defaults(monkeypatch, 64), _defaults(monkeypatch, 1)
    for name, row in rows.items():
        assert _code(row[1])[0] == many[name], name
        assert (many[name] != one[name]) == ("fewer" in row[1]), name


def test_configuration_lists_every_flag_refused():
    """Every flag the package reads (the refusal table's, the flags the pool
    plans from, those the plugin reads at launch) has a row, and on the
    newest served release every flag of the table is one of SGLang's server
    arguments."""
    import inspect

    from sglang_mxfp8_hicache import plugin, releases
    from sglang_mxfp8_hicache.refusals import REFUSALS, HiCacheFlags

    rows = _table(_section((DOCS / "configuration.md").read_text(), "## SGLang flags"))
    flags = {flag for row in rows for flag in _code(row[0])}
    assert {r.flag for r in REFUSALS} <= flags
    readers = (HiCacheFlags.from_server_args, plugin._block_scaled_hicache)
    read = {
        name
        for reader in readers
        for name in re.findall(
            r"(?:args|view)\.(\w+)|\(view, \"(\w+)\"", inspect.getsource(reader)
        )
    }
    read = {"--" + (a or b).replace("_", "-") for a, b in read}
    assert read <= flags, read - flags
    if releases.sglang_version() != releases.NEWEST:
        return
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    fields = getattr(ServerArgs, "__struct_fields__", None) or [
        f.name for f in dataclasses.fields(ServerArgs)
    ]
    assert not {f for f in flags if f[2:].replace("-", "_") not in fields}


def test_configuration_layouts_are_sglangs_choices():
    """The layouts the pool serves and refuses are choices of SGLang's own
    ``--hicache-mem-layout``; the one said to be no choice of it is none."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_mxfp8_hicache import releases
    from sglang_mxfp8_hicache.refusals import SERVED_LAYOUTS

    if releases.sglang_version() != releases.NEWEST:
        pytest.skip(f"SGLang's choices are checked on {releases.NEWEST}")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    [action] = [
        a for a in parser._actions if "--hicache-mem-layout" in a.option_strings
    ]
    rows = _table(_section((DOCS / "configuration.md").read_text(), "## SGLang flags"))
    [row] = [row for row in rows if _code(row[0]) == ["--hicache-mem-layout"]]
    refused, internal = row[2].split(";")
    assert set(_code(row[1])) == set(SERVED_LAYOUTS)
    assert set(_code(row[1]) + _code(refused)) == set(action.choices)
    assert _code(internal) and not set(_code(internal)) & set(action.choices)
    assert "no choice of its CLI" in internal


def test_staging_and_fp4_figures_are_the_code():
    from sglang_mxfp8_hicache import settings
    from sglang_mxfp8_hicache.refusals import HiCacheFlags, PageShape, plan_page

    said = " ".join((DOCS / "configuration.md").read_text().split())
    staging = settings.Settings.from_environ({}).staging_mb
    assert f"**{staging} MiB of GPU memory** per GPU by default" in said
    assert f"two slots of {staging // 4} MiB" in said
    page = plan_page(
        HiCacheFlags("fp4_mx_block16", 128, "page_first"), PageShape(8, 128, 128, 32)
    )
    before_seals = page.bytes_per_token - page.seal_bytes // page.page_size
    assert (
        f"32 layers of 8x128 take {before_seals:,} B per token before the seal areas"
        in said
    )


# docs/storage.md


def _refused(
    backend: str, layout: str = "page_first", v_head_dim: int = 128, fmt="mxfp8"
):
    from sglang_mxfp8_hicache.refusals import HiCacheFlags, PageShape, refusal

    flags = HiCacheFlags(fmt, 128, layout, storage_backend=backend)
    return refusal(flags, PageShape(8, 128, v_head_dim, 4))


def _backend_rows(text: str, heading: str) -> dict[str, str]:
    """Each backend a table names, with its second cell."""
    return {
        name: row[1]
        for row in _table(_section(text, heading))
        for name in _code(row[0])
        if not name.startswith("--")
    }


def test_storage_backends_are_served_and_refused_as_documented():
    """Each backend of docs/storage.md's table is served or refused as it
    says (every layout, or every layout but page_head; K and V head dims
    alike or any), for MXFP8 and FP4, and zero-copy, sealed and key-prefixed
    as the policy (``storage.BACKENDS``) has it; the README's table says the
    same; and together they name every backend SGLang offers."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from sglang_mxfp8_hicache import releases

    documented = _backend_rows((DOCS / "storage.md").read_text(), "## Backends")
    for backend, said in documented.items():
        if said.startswith("refused"):
            refused = _refused(backend)
            assert refused is not None and backend in refused.reason, backend
            assert refused.flag == "--hicache-storage-backend"
            continue
        assert said.startswith("served"), backend
        for fmt in ("mxfp8", "fp4_mx_block16"):
            assert _refused(backend, fmt=fmt) is None, (backend, fmt)
        assert (_refused(backend, "page_head") is None) == (
            "but `page_head`" not in said
        )
        assert (_refused(backend, v_head_dim=64) is None) == ("dims alike" not in said)

    from sglang_mxfp8_hicache.storage import BACKENDS

    rows = _table(_section((DOCS / "storage.md").read_text(), "## Backends"))
    for row in rows:
        for backend in _code(row[0]):
            policy = BACKENDS.get(backend)
            if policy is None:
                assert row[1] == "refused" and row[2:5] == ["", "", ""], backend
                continue
            said = row[2].startswith("yes"), row[3] == "yes", row[4] == "yes"
            assert said == (policy.zero_copy, policy.sealed, policy.key_prefixed), (
                backend
            )
            if not policy.zero_copy:
                assert row[2] in ("no", "with `interface_v1`"), backend

    readme = _backend_rows(README.read_text(), "## L3 storage")
    assert readme.keys() == documented.keys()
    for backend, said in readme.items():
        assert said.split()[0].strip(",") == documented[backend].split()[0].strip(
            ","
        ), backend
        assert ("but `page_head`" in said) == ("but `page_head`" in documented[backend])

    offered = {*StorageBackendFactory._registry, "dynamic"}
    assert offered <= documented.keys()
    if releases.sglang_version() == releases.NEWEST:
        assert offered == documented.keys()


def test_storage_log_line_is_the_page():
    """docs/storage.md's log line describes the page its geometry plans, under
    its key tag; the words around them are the guard's."""
    from sglang_mxfp8_hicache.refusals import HiCacheFlags, PageShape, plan_page

    (line,) = [
        line
        for line in _blocks((DOCS / "storage.md").read_text())
        if "pages go to L3 backend" in line
    ]
    page = plan_page(
        HiCacheFlags("mxfp8", 128, "page_first"), PageShape(8, 128, 128, 8)
    )
    assert f" as {page.describe()}, key tag '{page.storage_format_tag()}';" in line
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "pages go to L3 backend" in sources


# docs/design.md and every page's key tags


def _constant(name: str) -> int:
    """The value of ``name = <arithmetic>`` at a module's or a class's top
    level anywhere in the package (it may move between modules)."""
    values = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        for node in [*tree.body, *(n for c in classes for n in c.body)]:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = [node.target]
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                expression = ast.Expression(node.value)
                values.add(eval(compile(expression, str(path), "eval"), {}))
    assert len(values) == 1, (name, values)
    return values.pop()


def _cuda_constant(name: str) -> int:
    source = "\n".join(p.read_text() for p in (PACKAGE / "csrc").glob("*.cuh"))
    (value,) = re.findall(rf"\b{name} = (\d+);", source)
    return int(value)


def test_design_numbers_are_the_code():
    """The figures docs/design.md gives for the page, the kernels and the
    load groups are the package's constants."""
    from sglang_mxfp8_hicache import page

    said = " ".join((DOCS / "design.md").read_text().split())
    expected = {
        f"`page.STORAGE_FORMAT_VERSION` is {page.STORAGE_FORMAT_VERSION}": True,
        f"at least the seal's {page.SEAL_CONTENT_BYTES} B": True,
        f"up to the next whole {page.PART_ALIGN >> 10} KiB block": True,
        f"at most {_constant('MAX_BLOCKS')} blocks of {_constant('BLOCK_SIZE')} threads": True,
        f"({_cuda_constant('kMaxParamPages')} pages per launch)": True,
        f"a transfer of {_constant('min_bytes') >> 20} MiB or more": True,
        f"spread over {_constant('COPY_LANES')} streams": True,
        f"until each carries {_constant('MIN_LOAD_GROUP_BYTES') >> 20} MiB": True,
        f"carry under {_constant('ONE_LAUNCH_BYTES') >> 10} KiB": True,
    }
    assert {phrase: phrase in said for phrase in expected} == expected


@per_page
def test_key_tags_name_the_current_page_format(page):
    from sglang_mxfp8_hicache.page import STORAGE_FORMAT_VERSION

    text = page.read_text()
    tags = re.findall(r"\b(?:mxfp8|fp4_mx_block16|nvfp4)v(\d+)-", text)
    assert all(int(v) == STORAGE_FORMAT_VERSION for v in tags), (_page_id(page), tags)


# docs/benchmarks.md


def test_benchmarks_doc_is_the_current_tables_only():
    """docs/benchmarks.md holds the method, the current tables and a paragraph
    per design choice, no history: 150 lines at most."""
    doc = (DOCS / "benchmarks.md").read_text()
    assert len(doc.splitlines()) <= BENCHMARKS_LINE_BUDGET


def test_l3_tables_are_the_committed_runs():
    """Each row of the L3 tables in docs/benchmarks.md (the CI machine's, then
    the GPU host's) is its committed JSON: every ratio, bold where it meets
    its goal, and the cells met."""
    import msgspec

    from sglang_mxfp8_hicache.tools.results import L3_DIRECTIONS, Report

    doc = (DOCS / "benchmarks.md").read_text()
    section = doc.split("**L3, every served backend**")[1].split("\n## ")[0]
    cpu, gpu = [b for b in section.split("\n\n") if b.startswith("| backend")]

    for table, host, count in ((cpu, "cpu", 7), (gpu, "h100", 5)):
        rows = [line for line in table.splitlines() if line.startswith("| `")]
        assert len(rows) == count
        for row in rows:
            label, *cells, met = [c.strip() for c in row.strip("|").split("|")]
            backend = re.match(r"`(\w+)`", label).group(1)
            data = (DOCS / "data" / f"bench-l3-{backend}-{host}.json").read_bytes()
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
