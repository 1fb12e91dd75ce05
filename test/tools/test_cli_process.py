"""The CLI as a process meets them: an output it cannot write (a full disk, a
closed pipe) and a signal (Ctrl-C, SIGTERM) end it in one line on stderr,
without a traceback, its temp folders removed and its child ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROG = "sglang-mxfp8-hicache"
SIZE = ["size", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
SIZE += ["--device-tokens", "1000"]
CLI = [sys.executable, "-m", "sglang_mxfp8_hicache.tools.cli"]

HOLD_SIZE = """
import sys, time
from pathlib import Path
from sglang_mxfp8_hicache.tools import cli, sizing

def hold(*args):
    Path(sys.argv[1]).write_text(str(len(list(Path(sys.argv[2]).iterdir()))))
    time.sleep(60)

sizing._read_model_config = hold
sys.exit(cli.main(sys.argv[3:]))
"""
"""``size --config`` whose read of the model, inside its temp folder, waits
for a signal once it has said how many entries the temp dir holds."""

HOLD_CHECK = """
import sys
from sglang_mxfp8_hicache.tools import cli

sys.executable = sys.argv[1]
cli._check_version = lambda: (cli.OK, "stand-in")  # SGLang's import: seconds
sys.exit(cli.main(["check"]))
"""
"""``check`` whose fresh process is ``sys.argv[1]``: a child that waits."""

CHILD = '#!/bin/sh\necho $$ > "$CHILD_PID_FILE"\nexec sleep 60\n'
"""The stand-in fresh process: writes its pid, then sleeps in that pid."""


def _one_line(stderr: str, said: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == said, stderr


def _wait_for(path: Path, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text().strip()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text().strip()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_size_into_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [*CLI, *SIZE], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60
        )
    assert done.returncode == 1
    assert done.stderr == (
        f"{PROG} size: error: cannot write to stdout: No space left on device\n"
    )


def test_size_into_a_closed_pipe_is_one_line():
    """``size --json | head -c 20`` where the reader has gone before the
    write: the reading end is closed before the command starts."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [*CLI, *SIZE, "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 1
    assert done.stderr == f"{PROG} size: error: cannot write to stdout: Broken pipe\n"


STOPS = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "stopped by SIGTERM",
}
by_signal = pytest.mark.parametrize("signum", list(STOPS), ids=[s.name for s in STOPS])


@by_signal
def test_size_stopped_removes_its_temp_folder(tmp_path, signum):
    temp = tmp_path / "tmp"
    temp.mkdir()
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    ready = tmp_path / "ready"
    argv = ["size", "--config", str(config), "--device-tokens", "1000"]
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_SIZE, str(ready), str(temp), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert _wait_for(ready, process) == "1"  # its temp folder, with the config
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    assert out == "" and err == f"{PROG} size: {STOPS[signum]}\n"
    assert not list(temp.iterdir())


@by_signal
def test_check_stopped_ends_its_fresh_process(tmp_path, signum):
    child = tmp_path / "fresh-python"
    child.write_text(CHILD)
    child.chmod(0o755)
    pid_file = tmp_path / "child.pid"
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_CHECK, str(child)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CHILD_PID_FILE": str(pid_file)},
    )
    pid = int(_wait_for(pid_file, process))
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum
    assert out == ""
    _one_line(err, f"{PROG} check: {STOPS[signum]}")
    assert _ended(pid)


def _ended(pid: int, within_s: float = 5) -> bool:
    """Whether process ``pid`` is gone, or a zombie (killed, but left for
    init to reap: on Ctrl-C ``subprocess`` kills its child without waiting)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
