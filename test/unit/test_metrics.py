"""The package's counters reach SGLang's ``/metrics``: in a process started
as SGLang starts its scheduler with ``--enable-metrics`` (with
``PROMETHEUS_MULTIPROC_DIR`` set), a pool's counters land in the multiprocess
files that the server's metrics endpoint collects, with their labels."""

from __future__ import annotations

import os
import subprocess
import sys

from testkit import ROOT

_SCHEDULER = """
import sys
import pytest
import torch
sys.path.insert(0, sys.argv[1])
from testkit.kernel_emulation import install_emulation
from testkit.pools import device_buffers
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host as Ours
from sglang_mxfp8_hicache.tools.pools import (
    build_device_pool, build_host_pool, fill_random, page_token_indices)
kernels = install_emulation(pytest.MonkeyPatch())
device_pool = build_device_pool(head_num=2, head_dim=128, layer_num=2, pages=5,
                                device="cpu")
kernels.pointers.register(device_buffers(device_pool))
host = build_host_pool(device_pool, Ours, host_to_device_ratio=1.0, pin_memory=False)
kernels.pointers.register([host.kv_buffer])
fill_random(device_buffers(device_pool), torch.Generator().manual_seed(1))
pages = page_token_indices(torch.arange(3))
host.backup_from_device_all_layer(device_pool, pages, pages + 128, "kernel")
"""


def test_counters_reach_sglangs_multiprocess_collector(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-c", _SCHEDULER, str(ROOT / "test")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    registry = CollectorRegistry()  # as SGLang's add_prometheus_middleware
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    exposed = generate_latest(registry).decode()
    labels = 'direction="backup",path="sm_kernel",pool="kv",tp_rank="0"'
    pages = f"sglang_mxfp8_hicache:moved_pages_total{{{labels}}} 3.0"
    assert pages in exposed, exposed
    missed = (
        'sglang_mxfp8_hicache:l3_missed_pages_total{pool="kv",reason="seal_mismatch"'
    )
    assert missed in exposed
    assert 'sglang_mxfp8_hicache:staging_reserved_bytes{tp_rank="0"}' in exposed
