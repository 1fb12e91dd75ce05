"""``test/e2e.py`` on the CPU: SGLang's assembler, controller and transfer engine
run for real, the kernels are the emulations of ``kernel_emulation`` and pinned
host memory is plain memory.

    python test/e2e_cpu.py MODE SETUP[,SETUP...] [L3_BACKEND]

One process per mode, since the plugin hook is process-wide; prints one JSON
verdict per setup, as ``python test/e2e.py`` does on a GPU.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec
import pytest

from testkit import script
from testkit.e2e import Verdict
from testkit.kernel_emulation import install_stack_emulation


def run_cpu(
    modes, setups, timeout: float = 600, l3: str | None = None, l3_config=None
) -> dict[str, Verdict]:
    """``main`` in a fresh process per mode; the verdicts keyed as
    ``e2e.run_modes`` keys them. ``l3``: then through that L3 backend,
    with ``l3_config`` as its extra config where it needs one."""
    import subprocess

    from testkit.e2e import L3_CONFIG_ENV

    env = dict(os.environ)
    if l3_config is not None:
        env[L3_CONFIG_ENV] = json.dumps(l3_config)
    verdicts = {}
    for mode in modes:
        done = subprocess.run(
            [
                sys.executable,
                script("e2e_cpu"),
                mode,
                ",".join(setups),
                *([l3] if l3 else []),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
        if done.returncode:
            raise RuntimeError(f"e2e_cpu {mode}: {done.stderr.strip()[-2000:]}")
        for line in done.stdout.splitlines():
            if line.startswith("{"):  # NIXL logs to stdout too
                verdict = msgspec.json.decode(line, type=Verdict)
                verdicts[verdict.key] = verdict
    return verdicts


def assert_exact(verdict: Verdict) -> None:
    """Payload and scales of every MXFP8 layer restored, dequantized difference
    0, and every device page outside the load kept."""
    assert verdict.error is None, verdict.error
    assert verdict.payload_restored and verdict.scales_restored, verdict
    assert verdict.dequantized_max_diff == 0.0, verdict
    assert verdict.untouched_pages_kept, verdict
    if verdict.write_path.startswith("set_kv_buffer"):
        assert verdict.quantized_within_error, verdict


def assert_control_loses_scales(verdict: Verdict) -> None:
    """The payload-only host pool restores the payload and loses the scales."""
    assert verdict.error is None, verdict.error
    assert verdict.payload_restored, verdict
    assert not verdict.scales_restored, verdict
    assert verdict.dequantized_max_diff > 0, verdict


def plain_class_takes_fp4(setup: str) -> bool:
    """Whether ``setup`` is an FP4 stack on a release before 0.5.23, whose plain
    host class takes an FP4 pool without refusing it, sized a byte per element,
    with no payload-only view: there is no payload-only control to run."""
    from sglang_mxfp8_hicache import releases

    return "fp4" in setup and releases.builds_from_device_pool()


def main() -> None:
    from testkit.e2e import run_setups

    mode, setups = sys.argv[1], sys.argv[2].split(",")
    l3 = sys.argv[3] if len(sys.argv) > 3 else None
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_stack_emulation(monkeypatch)
        for verdict in run_setups(mode, setups, l3, device="cpu"):
            print(msgspec.json.encode(verdict).decode(), flush=True)
