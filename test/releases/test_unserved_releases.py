"""The releases this package does not serve, with their real sources: SGLang
0.5.19 and 0.5.20 (an MXFP8 KV pool, no block-scaled host pool: silent scale
loss; the first to resolve arguments in ``resolve_once``). The plugin
loads through the release's own ``load_plugins`` and must refuse a
block-scaled KV cache with HiCache when the launcher resolves its arguments,
and leave everything else alone.
Installing the package where SGLang is moves neither SGLang nor torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RESOLVE = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.version import __version__
base = ["--model-path", "dummy", "--page-size", "128"]
cases = {
    "mxfp8_hicache": ["--kv-cache-dtype", "mxfp8", "--enable-hierarchical-cache"],
    "nvfp4_hicache": ["--kv-cache-dtype", "nvfp4", "--enable-hierarchical-cache"],
    "bf16_hicache": ["--enable-hierarchical-cache"],
    "mxfp8_alone": ["--kv-cache-dtype", "mxfp8"],
}
found = {"version": __version__}
for name, argv in cases.items():
    try:
        prepare_server_args(base + argv).resolve_once()
        found[name] = None
    except Exception as exc:
        found[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


@pytest.mark.parametrize(
    "version, says",
    [
        ("0.5.20", "sglang 0.5.20 has an MXFP8 KV pool but no block-scaled HiCache"),
        ("0.5.19", "sglang 0.5.19 has an MXFP8 KV pool but no block-scaled HiCache"),
    ],
)
def test_unserved_release_refuses_at_startup(on_release, version, says):
    _in_the_newest_environment()
    done = on_release(version, ["-c", RESOLVE])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["version"] == version
    for dtype in ("mxfp8", "nvfp4"):
        refusal = found[f"{dtype}_hicache"]
        assert refusal.startswith(f"BlockScaledHiCacheConfigError: {dtype} HiCache:")
        assert says in refusal and "Install sglang==0.5.23" in refusal
    assert found["bf16_hicache"] is None
    assert found["mxfp8_alone"] is None


def _in_the_newest_environment() -> None:
    """The unserved releases' sources run on the newest served release's
    dependencies: the refusal is the plugin's, the same whichever served
    release's environment runs it, and .ci/run gives the older served
    releases their own environments for what differs between them."""
    from sglang_mxfp8_hicache.releases import NEWEST, sglang_version

    if sglang_version() != NEWEST:
        pytest.skip(
            f"the unserved releases' refusal runs in sglang {NEWEST}'s environment"
        )


def test_installing_the_package_leaves_sglang_where_it_is():
    """The package bounds SGLang below only, and a dry-run install of this
    clone into this environment (SGLang installed) installs nothing but the
    package: neither SGLang nor its torch moves."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    [sglang] = [
        Requirement(r)
        for r in requires("sglang-mxfp8-hicache") or ()
        if Requirement(r).name == "sglang"
    ]
    assert {spec.operator for spec in sglang.specifier} == {">="}
    checked = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True
    )
    unmet = [line for line in checked.stdout.splitlines() if line.startswith("sglang ")]
    if unmet:
        pytest.skip(
            f"pip cannot resolve this SGLang's own pins here ({unmet[0]}); "
            ".ci/run installed the package into this environment after SGLang, "
            "with uv's override of that pin, and checked SGLang and torch stayed"
        )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
        + ["--report", "-", "--no-build-isolation", "-e", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == [
        "sglang-mxfp8-hicache"
    ]
