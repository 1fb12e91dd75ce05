"""The scripts in ``test/`` behave as commands: ``--help`` prints help and
exits; a bad flag or value is refused with exit 2 and one ``error:`` line
naming it, no traceback, before any work and with nothing created; SIGTERM
stops a loopback service as Ctrl-C does, its folder, sockets and server gone.

Most refusals come before torch or SGLang is imported (``e2e_cpu`` checks
its names against ``testkit/e2e_names.py``). The soak's come after torch (its
package imports it), and ``e2e.py``'s skip without CUDA after SGLang.
"""

from __future__ import annotations

import getpass
import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import script

TIMEOUT_S = 300


def _run(name: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """``python test/NAME.py ARGS`` in an empty folder, with an empty TMPDIR."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    return subprocess.run(
        [sys.executable, script(name), *args],
        cwd=cwd,
        env=dict(os.environ, TMPDIR=str(tmp)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _created(tmp_path: Path) -> list[str]:
    """What the run left in its folder and its TMPDIR, but for the cache that
    importing SGLang makes (cutlass's, in ``$TMPDIR/$USER``)."""
    cache = tmp_path / "tmp" / getpass.getuser() / "cutlass_python_cache"
    return sorted(
        str(path.relative_to(tmp_path))
        for path in (*(tmp_path / "cwd").iterdir(), *(tmp_path / "tmp").iterdir())
        if path != cache.parent or list(path.iterdir()) != [cache]
    )


@pytest.mark.parametrize(
    "name, args, flag",
    [
        pytest.param("e2e_cpu", [], "required: MODE, SETUPS", id="e2e_cpu-no-args"),
        pytest.param("e2e_cpu", ["nope", "kv"], "MODE", id="e2e_cpu-mode"),
        pytest.param("e2e_cpu", ["ours", "kv,nope"], "SETUPS", id="e2e_cpu-setup"),
        pytest.param("soak", ["--seconds", "-5"], "--seconds", id="soak-seconds"),
        pytest.param("soak", ["--heads", "0"], "--heads", id="soak-heads"),
        pytest.param(
            "soak", ["--l3-dir", "{tmp}/missing/l3"], "--l3-dir", id="soak-l3-dir"
        ),
        pytest.param("seal_throughput", ["--pages", "0"], "--pages", id="seal-pages"),
        pytest.param(
            "seal_throughput", ["--threads", "0"], "--threads", id="seal-threads"
        ),
        pytest.param("l3_breakdown", ["--pages", "0"], "--pages", id="l3-pages"),
        pytest.param("l3_breakdown", ["--chunks", "x"], "--chunks", id="l3-chunks"),
        pytest.param(
            "l3_breakdown", ["--backends", "nope"], "--backends", id="l3-backends"
        ),
        pytest.param(
            "l3_breakdown", ["--backends", "mooncake"], "--l3-config", id="l3-config"
        ),
        pytest.param(
            "l3_breakdown", ["--l3-config", "{"], "--l3-config", id="l3-config-json"
        ),
        pytest.param(
            "l3_breakdown", ["--out", "{tmp}/missing"], "--out", id="l3-out-missing"
        ),
        pytest.param(
            "mooncake_loopback",
            ["--segment-size", "lots"],
            "--segment-size",
            id="mooncake-segment-size",
        ),
        pytest.param("sizing_vs_sglang", ["kv:2"], "CASE", id="sizing-case"),
        pytest.param(
            "sglang_write_back_oom", ["--bogus"], "--bogus", id="write-back-oom-flag"
        ),
        pytest.param("probe", ["--bogus"], "--bogus", id="probe-flag"),
    ],
)
def test_bad_input_is_refused(tmp_path, name, args, flag):
    """Exit 2, one error line naming the flag, no traceback, nothing created."""
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    done = _run(name, args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if " error: " in line]
    assert len(errors) == 1 and flag in errors[0], done.stderr[-2000:]
    assert done.stderr.rstrip().endswith(errors[0])
    assert not (tmp_path / "missing").exists()
    assert _created(tmp_path) == []


def test_l3_breakdown_refuses_cuda_without_a_gpu(tmp_path):
    """``--device cuda`` on a machine without CUDA: one line (the default is
    the machine's device)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    done = _run("l3_breakdown", ["--device", "cuda"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].endswith(
        "error: argument --device: cuda, on a machine without a CUDA GPU"
    )


@pytest.mark.parametrize("name", ["e2e_cpu", "seaweedfs_loopback"])
def test_help_prints_and_exits(tmp_path, name):
    """``--help`` prints the usage and exits 0, running nothing."""
    done = _run(name, ["--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: {name}.py"), done.stdout
    assert _created(tmp_path) == []


def test_e2e_without_cuda_skips_every_setup(tmp_path):
    """``test/e2e.py`` on a machine without CUDA: one skipped verdict per setup."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    done = _run("e2e", ["--setup", "kv,draft,mamba"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(v["setup"], v["skipped"]) for v in verdicts] == [
        ("kv", "no CUDA GPU"),
        ("draft", "no CUDA GPU"),
        ("mamba", "no CUDA GPU"),
    ]


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    children = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.split("/")[2]))
    return children


def test_seaweedfs_loopback_stops_on_sigterm(tmp_path):
    """SIGTERM to a running ``seaweedfs_loopback``: it exits 0, ``weed`` is
    gone, and so are its folder and the sockets of its ports."""
    from testkit.seaweedfs_loopback import GRPC_OFFSET, seaweedfs_available

    if reason := seaweedfs_available():
        pytest.skip(reason)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = subprocess.Popen(
        [sys.executable, script("seaweedfs_loopback")],
        env=dict(os.environ, TMPDIR=str(tmp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        config = json.loads(server.stdout.readline())
        (weed,) = _children(server.pid)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    s3_port = int(config["endpoint"].rsplit(":", 1)[1])
    assert not os.path.exists(f"/proc/{weed}"), "weed is still running"
    assert list(tmp.iterdir()) == []
    for port in (s3_port, s3_port + GRPC_OFFSET):
        assert glob.glob(f"/tmp/seaweedfs-*-{port}.sock") == []
