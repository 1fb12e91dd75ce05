"""The releases' own sources: ``sglang/`` of each release's wheel, run on this
environment's dependencies (0.5.20-0.5.22 import beside 0.5.23's), or the
installed SGLang where a test asks for its release (``.ci/run`` gives each
served release an environment of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from testkit import TEST_DIR


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


@pytest.fixture
def on_release(release_source):
    """``run(version, argv)``: ``argv`` in a process whose ``sglang`` is that
    release's source, or the installed SGLang if it is that release (the
    plugin loads through its ``load_plugins``), with ``testkit`` importable."""

    def run(version: str, argv: list[str], **env: str) -> subprocess.CompletedProcess:
        source = release_source(version)
        path = os.pathsep.join(str(p) for p in (source, TEST_DIR) if p is not None)
        environ = {**os.environ, **env, "PYTHONPATH": path}
        environ.pop("SGLANG_PLUGINS", None)
        return subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            env=environ,
            timeout=900,
            check=False,
        )

    return run
