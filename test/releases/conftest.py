"""The releases' own sources: ``sglang/`` of each release's wheel, run on this
environment's dependencies (0.5.20-0.5.22 import beside 0.5.23's), or the
installed SGLang where a test asks for its release (``.ci/run`` gives each
served release an environment of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from testkit import TEST_DIR

PARTS = Path(__file__).with_name("parts.py")
PART_PREFIX = "PART "
"""``parts.PREFIX``: the line of a part's result."""


@pytest.fixture(scope="session")
def release_source(tmp_path_factory):
    """``sglang/`` of a release's wheel (``pip download --no-deps``), by version."""
    trees: dict[str, Path] = {}

    def source(version: str) -> Path | None:
        """None for the installed release: its own environment runs it."""
        from sglang.version import __version__

        from sglang_mxfp8_hicache.releases import SUPPORTED_SGLANG_VERSIONS

        if version == __version__:
            return None
        newest = SUPPORTED_SGLANG_VERSIONS[-1]
        if version in SUPPORTED_SGLANG_VERSIONS and __version__ != newest:
            pytest.skip(
                f"sglang {version} runs in an environment of its own (.ci/run), "
                f"and from its source in {newest}'s"
            )
        if version not in trees:
            where = tmp_path_factory.mktemp(f"sglang-{version}")
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
                + ["--only-binary=:all:", "-d", str(where), f"sglang=={version}"],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            wheels = list(where.glob("sglang-*.whl"))
            if done.returncode or not wheels:
                pytest.skip(
                    f"pip could not download sglang=={version}: {done.stderr[-300:]}"
                )
            with zipfile.ZipFile(wheels[0]) as wheel:
                members = [n for n in wheel.namelist() if n.startswith("sglang/")]
                wheel.extractall(where, members)
            trees[version] = where
        return trees[version]

    return source


@pytest.fixture(scope="session")
def _release_process(release_source):
    """``run(version, argv, stdin=None, **env)``: ``argv`` in a process whose
    ``sglang`` is that release's source, or the installed SGLang if it is that
    release (the plugin loads through its ``load_plugins``), with ``testkit``
    importable."""

    def run(
        version: str, argv: list[str], stdin: str | None = None, **env: str
    ) -> subprocess.CompletedProcess:
        source = release_source(version)
        # after the release's source and testkit, the caller's own path (a
        # clone's python/ ahead of an installed package)
        paths = [str(p) for p in (source, TEST_DIR) if p is not None]
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        environ = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(paths)}
        environ.pop("SGLANG_PLUGINS", None)
        return subprocess.run(
            [sys.executable, *argv],
            input=stdin,
            capture_output=True,
            text=True,
            env=environ,
            timeout=1800,
            check=False,
        )

    return run


@pytest.fixture
def on_release(_release_process):
    """``run(version, argv, **env)``: ``argv`` in a process of that release
    (``_release_process``)."""

    def run(version: str, argv: list[str], **env: str) -> subprocess.CompletedProcess:
        return _release_process(version, argv, **env)

    return run


@pytest.fixture(scope="session")
def release_parts(_release_process):
    """``parts(version, {name: code}, **env)``: each part's result
    (``parts.py``: ``name``, ``stdout``, ``error``), all of one version and
    environment run in one process, once a session. A process that dies
    fails every test that asks for one of its parts, with its stderr."""
    runs: dict[tuple, dict[str, dict]] = {}

    def parts(version: str, codes: dict[str, str], **env: str) -> dict[str, dict]:
        key = (version, tuple(codes.items()), tuple(sorted(env.items())))
        if key not in runs:
            spec = [{"name": name, "code": code} for name, code in codes.items()]
            done = _release_process(
                version, [str(PARTS)], stdin=json.dumps(spec), **env
            )
            found = {
                part["name"]: part
                for part in (
                    json.loads(line[len(PART_PREFIX) :])
                    for line in done.stdout.splitlines()
                    if line.startswith(PART_PREFIX)
                )
            }
            crash = f"parts.py exited {done.returncode}: {done.stderr[-3000:]}"
            runs[key] = {
                name: found.get(name, {"name": name, "stdout": "", "error": crash})
                for name in codes
            }
        return runs[key]

    return parts
