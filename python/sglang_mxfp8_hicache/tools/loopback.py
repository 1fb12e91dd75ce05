"""What the services the tools start on 127.0.0.1 share (Mooncake, SeaweedFS,
SGLang's 3FS metadata server in the tests): free ports, and children that
die with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import random
import signal
import socket
from typing import Any

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
