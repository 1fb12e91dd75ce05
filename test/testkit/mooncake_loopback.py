"""A real Mooncake store on 127.0.0.1 for the tests and, run as a script, for
``bench --l3 mooncake --l3-config``: a master and one storage node.

Why two processes: when the client that SGLang's ``MooncakeStore`` creates holds
the segment itself, Mooncake serves its own objects by memcpy and the transfer
engine is never used. Here the test client holds no segment
(``global_segment_size`` 0) and a separate ``mooncake_client`` process holds
all the memory, so every byte a test puts or gets crosses Mooncake's TCP
transport over loopback, as it would cross the network in production.

Everything binds or publishes 127.0.0.1 (P2PHANDSHAKE metadata: no metadata
server). The processes are started with their own pids kept and are stopped by
those pids only. Their logs go to files in a temporary directory, so a failure
can show what the processes said. The recipe is described in
docs/design.md (L3 storage).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from testkit.command import interrupt_on_sigterm

READY_TIMEOUT_S = 15.0
LEASE_TTL = "10s"
"""How long a read pins an object, Mooncake's default as a server sees it: a
batch read that takes longer fails with LEASE_EXPIRED (200 ms broke 128-page
batches of 8 MiB pages over TCP); while it holds, a remove fails with -706
OBJECT_HAS_LEASE unless forced."""
STOP_TIMEOUT_S = 5.0
# Starting again with fresh ports when a process dies before it is ready: the
# ports are picked free, but another process may take one before Mooncake binds.
START_ATTEMPTS = 3

# Bypasses any http_proxy of the environment: the endpoints are on loopback.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

HOST = "127.0.0.1"


def free_ports(count: int, *, also_free_at: int = 0) -> list[int]:
    """``count`` distinct ports that were free on 127.0.0.1 a moment ago (all
    sockets are held open together so that the ports differ). With
    ``also_free_at``, each port p below 65536 - ``also_free_at`` with
    p + ``also_free_at`` free too (SeaweedFS listens there for gRPC)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            port = random.randrange(20000, 65536 - also_free_at) if also_free_at else 0
            try:
                sock = stack.enter_context(socket.socket())
                sock.bind((HOST, port))
                port = sock.getsockname()[1]
                if also_free_at:
                    pair = stack.enter_context(socket.socket())
                    pair.bind((HOST, port + also_free_at))
            except OSError:
                continue
            if port not in ports:
                ports.append(port)
        return ports


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the parent dies, so a
    crashed or killed pytest leaves no service behind (Linux only). The
    signal follows the *thread* that started the child: start the service from
    a thread that lives as long as it (pytest's main thread does)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


try:  # resolved in the parent: the child after fork only calls it
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def binary(name: str) -> Path:
    """``mooncake_master`` or ``mooncake_client`` as the wheel ships them, inside
    the ``mooncake`` package: the console scripts only exec these, and they
    exist also where the package was installed with ``pip --target``."""
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / name


def mooncake_available() -> str | None:
    """None when a loopback Mooncake can run here, else why not.

    Checks the three things that are missing on a fresh machine: the Python
    package (``mooncake-transfer-engine-non-cuda``), the system library that
    every Mooncake binary links even with TCP (``libibverbs.so.1``, Debian
    ``libibverbs1``), and the two binaries.
    """
    if importlib.util.find_spec("mooncake") is None:
        return "Python package mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as err:
        if "libibverbs" in str(err):
            return f"libibverbs.so.1 is missing (apt-get install libibverbs1): {err}"
        return f"mooncake.store does not import: {err}"
    for name in ("mooncake_master", "mooncake_client"):
        if not os.access(binary(name), os.X_OK):
            return f"{binary(name)} is missing or not executable"
    return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Stops ``proc`` by its pid: SIGTERM, then SIGKILL if it is still there
    after ``grace_s`` (a no-op once it has exited)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MooncakeError(RuntimeError):
    """A Mooncake process exited early or did not become ready in time."""


class _Processes:
    """Mooncake's processes by name (``master``, ``node``): each started from
    its binary with ``MC_TCP_BIND_ADDRESS`` 127.0.0.1 and its log in
    ``log_dir``, watched while it gets ready, stopped by its own pid."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, script: str, *args: str) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST)
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.running[name] = subprocess.Popen(
                [str(binary(script)), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent,
            )

    def wait(self, name: str, ready: Callable[[], bool], what: str) -> None:
        """Polls ``ready`` until it is true; raises with the logs' tails when any
        started process exits first (the master, having answered /health, still
        exits when its RPC port turns out to be taken) or after the timeout."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for other, proc in self.running.items():
                if proc.poll() is not None:
                    raise _EarlyExit(
                        f"Mooncake {other} (pid {proc.pid}) exited with "
                        f"{proc.returncode} while waiting for {name}: {what}\n"
                        f"{self.log_tail()}"
                    )
            with contextlib.suppress(OSError, ValueError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise MooncakeError(
                    f"Mooncake {name} (pid {self.running[name].pid}) not ready after "
                    f"{READY_TIMEOUT_S:.0f} s waiting for {what}\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        """SIGKILLs ``name`` and reaps it."""
        proc = self.running.pop(name)
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        # The storage node first: it unmounts its segment from a live master.
        for name in ("node", "master"):
            proc = self.running.pop(name, None)
            if proc is not None:
                stop_process(proc, STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of each process's log."""
        parts = []
        for name in ("master", "node"):
            path = self.log_dir / f"{name}.log"
            if path.exists():
                parts.append(
                    f"--- {name}.log (last {lines} lines) ---\n{_tail(path, lines)}"
                )
        return "\n".join(parts)


class MooncakeLoopback:
    """A Mooncake master and one storage node on 127.0.0.1, for one test session.

    Use as a context manager (or call ``start`` and ``stop``). While started,
    ``MC_TCP_BIND_ADDRESS`` is 127.0.0.1 in this process, so that the client
    SGLang creates in-process publishes a loopback address, and
    ``extra_config()`` is what ``--hicache-storage-backend-extra-config``
    (``HiCacheStorageConfig.extra_config``) needs to reach the store.
    """

    def __init__(
        self, *, segment_size: str = "512MB", client_ttl_s: int | None = None
    ) -> None:
        """``segment_size``: memory of the storage node, in mooncake_client's
        syntax; tests that fill it see evictions (high watermark 0.95).
        ``client_ttl_s``: how long the master waits for a silent client's
        heartbeat before it unmounts the client's segment (Mooncake's default,
        10 s, when None); a test that kills the node shortens it."""
        self.segment_size, self.client_ttl_s = segment_size, client_ttl_s
        self.rpc_port = self.metrics_port = self.node_port = 0
        self._processes: _Processes | None = None
        self._saved_bind: str | None = None
        self._env_set = False

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def pids(self) -> dict[str, int]:
        """The pid of each running process, by name (``master``, ``node``)."""
        running = self._processes.running if self._processes else {}
        return {name: p.pid for name, p in running.items() if p.poll() is None}

    def extra_config(self, **overrides: Any) -> dict[str, Any]:
        """The Mooncake part of SGLang's storage-backend extra config.

        ``global_segment_size`` 0 makes the SGLang client a pure client (SGLang
        passes it through, and Mooncake accepts 0 or at least 16 MiB), so its
        puts and gets go to the storage node over TCP. ``overrides`` are
        merged in (e.g. ``extra_backend_tag``, ``enable_group_semantics``).
        """
        config: dict[str, Any] = {
            "master_server_address": self.master_address,
            "master_metrics_port": self.metrics_port,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "local_hostname": HOST,
            "global_segment_size": 0,
        }
        config.update(overrides)
        return config

    def segments(self) -> list[str]:
        """The segments mounted at the master (``host:port`` of each holder)."""
        text = self._http_get("/get_all_segments").decode(errors="replace")
        return [line for line in text.split() if line]

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of each process's log, for failure messages."""
        if self._processes is None:
            return "(not started)"
        return self._processes.log_tail(lines)

    def start(self) -> MooncakeLoopback:
        """Starts the master, then the storage node, each waited for; retries
        with fresh ports when a process exits early (port taken meanwhile)."""
        if self._processes is not None and self._processes.running:
            raise RuntimeError("MooncakeLoopback is already started")
        self._processes = _Processes(
            Path(tempfile.mkdtemp(prefix="mooncake-loopback-"))
        )
        self._set_env()
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                try:
                    self._start_once()
                    return self
                except _EarlyExit:
                    self._processes.stop()
                    if attempt == START_ATTEMPTS:
                        raise
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stops both processes by pid (SIGTERM, then SIGKILL after
        ``STOP_TIMEOUT_S``), restores ``MC_TCP_BIND_ADDRESS`` and removes the logs."""
        if self._processes is not None:
            self._processes.stop()
        self._restore_env()
        if self._processes is not None:
            shutil.rmtree(self._processes.log_dir, ignore_errors=True)
            self._processes = None

    def __enter__(self) -> MooncakeLoopback:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start_once(self) -> None:
        assert self._processes is not None
        self.rpc_port, self.metrics_port, self.node_port = free_ports(3)
        self._processes.spawn(
            "master",
            "mooncake_master",
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--eviction_high_watermark_ratio=0.95",
            f"--default_kv_lease_ttl={LEASE_TTL}",
            # No periodic metrics lines in the log: its tail stays readable.
            "--enable_metric_reporting=false",
            "--logtostderr",
            *([f"--client_ttl={self.client_ttl_s}"] if self.client_ttl_s else []),
        )
        self._processes.wait("master", self._master_ready, "/health to answer ok")
        self.start_node()

    def start_node(self) -> None:
        """Starts the storage node on its port and waits for its segment."""
        assert self._processes is not None
        self._processes.spawn(
            "node",
            "mooncake_client",
            f"--host={HOST}",
            f"--port={self.node_port}",
            f"--global_segment_size={self.segment_size}",
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            "--logtostderr",
        )
        self._processes.wait(
            "node", lambda: bool(self.segments()), "its segment to be mounted"
        )

    def kill_node(self) -> None:
        """SIGKILLs the storage node, as a crash: its segment and every object
        in it are gone. The master learns of it by itself, ``client_ttl_s``
        later; until then it still places new objects there (``segments()``
        still lists it) and clients' transfers to it fail."""
        assert self._processes is not None
        self._processes.kill("node")

    def _http_get(self, path: str) -> bytes:
        url = f"http://{HOST}:{self.metrics_port}{path}"
        with _HTTP.open(url, timeout=2) as resp:
            return resp.read()

    def _master_ready(self) -> bool:
        return json.loads(self._http_get("/health")).get("status") == "ok"

    def _set_env(self) -> None:
        if not self._env_set:
            self._saved_bind = os.environ.get("MC_TCP_BIND_ADDRESS")
            os.environ["MC_TCP_BIND_ADDRESS"] = HOST
            self._env_set = True

    def _restore_env(self) -> None:
        if self._env_set:
            if self._saved_bind is None:
                os.environ.pop("MC_TCP_BIND_ADDRESS", None)
            else:
                os.environ["MC_TCP_BIND_ADDRESS"] = self._saved_bind
            self._env_set = False


class _EarlyExit(MooncakeError):
    """A process exited before it was ready (worth one more try on new ports)."""


def _segment_size(text: str) -> str:
    """A size in mooncake_client's syntax: a whole number of bytes, KB, MB, GB
    or TB (``4GB``)."""
    if not re.fullmatch(r"[1-9][0-9]*([KMGT]B)?", text, flags=re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 512MB or 4GB")
    return text


def main() -> None:
    """A master and storage node until Ctrl-C or SIGTERM, which stop both and
    remove their logs (``python test/mooncake_loopback.py``)."""
    parser = argparse.ArgumentParser(
        description="A Mooncake master and storage node on 127.0.0.1 until "
        "Ctrl-C or SIGTERM; prints the --l3-config of bench --l3 mooncake (run "
        "the bench with MC_TCP_BIND_ADDRESS=127.0.0.1)."
    )
    parser.add_argument(
        "--segment-size", type=_segment_size, default="4GB", help="the node's memory"
    )
    args = parser.parse_args()
    interrupt_on_sigterm()
    if reason := mooncake_available():
        sys.exit(f"mooncake_loopback: {reason}")
    with MooncakeLoopback(segment_size=args.segment_size) as service:
        print(json.dumps(service.extra_config()), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
