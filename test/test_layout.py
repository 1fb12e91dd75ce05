"""The core a server imports never imports the tools a person runs."""

from __future__ import annotations

import subprocess
import sys

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
