"""``test/e2e.py`` on the CPU: SGLang's assembler, controller and transfer engine
run for real, the kernels are the emulations of ``kernel_emulation`` and pinned
host memory is plain memory.

    python test/e2e_cpu.py MODE SETUP[,SETUP...] [L3_BACKEND]

One process per mode, since the plugin hook is process-wide; prints one JSON
verdict per setup, as ``python test/e2e.py`` does on a GPU. An unknown mode,
setup or backend is refused (exit 2) before anything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

import msgspec

from testkit import script
from testkit.command import interrupt_on_sigterm
from testkit.e2e_names import L3_BACKENDS, MODES, SETUPS

if TYPE_CHECKING:
    from testkit.e2e import Verdict


def run_cpu(
    modes, setups, timeout: float = 600, l3: str | None = None, l3_config=None
) -> dict[str, Verdict]:
    """``main`` in a fresh process per mode; the verdicts keyed as
    ``e2e.run_modes`` keys them. ``l3``: then through that L3 backend,
    with ``l3_config`` as its extra config where it needs one."""
    import subprocess

    from testkit.e2e import L3_CONFIG_ENV, Verdict

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", metavar="MODE", help="ours, sglang or plain")
    parser.add_argument(
        "setups", metavar="SETUPS", help="comma separated, of test/e2e.py --setup"
    )
    parser.add_argument("l3", nargs="?", metavar="L3_BACKEND", help="then through L3")
    args = parser.parse_args(argv)
    interrupt_on_sigterm()
    setups = args.setups.split(",")
    if args.mode not in MODES:
        parser.error(f"argument MODE: {args.mode!r} is not one of {', '.join(MODES)}")
    if unknown := [setup for setup in setups if setup not in SETUPS]:
        parser.error(f"argument SETUPS: unknown {unknown}; of {', '.join(SETUPS)}")
    if args.l3 is not None and args.l3 not in L3_BACKENDS:
        parser.error(
            f"argument L3_BACKEND: {args.l3!r} is not one of {', '.join(L3_BACKENDS)}"
        )
    import pytest

    from testkit.e2e import run_setups
    from testkit.kernel_emulation import install_stack_emulation

    with pytest.MonkeyPatch.context() as monkeypatch:
        install_stack_emulation(monkeypatch)
        for verdict in run_setups(args.mode, setups, args.l3, device="cpu"):
            print(msgspec.json.encode(verdict).decode(), flush=True)
