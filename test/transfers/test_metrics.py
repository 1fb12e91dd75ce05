"""The package's counters reach SGLang's ``/metrics``: in a process started
as SGLang starts its scheduler with ``--enable-metrics`` (with
``PROMETHEUS_MULTIPROC_DIR`` set), a pool's counters land in the multiprocess
files that the server's metrics endpoint collects, with their labels."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_mxfp8_hicache.metrics import PREFIX
from sglang_mxfp8_hicache.settings import Settings
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
    from prometheus_client.parser import text_string_to_metric_families

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
    exposed = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    pool = (("pool", "kv"), ("tp_rank", "0"))
    moved = (("direction", "backup"), ("path", "sm_kernel"), *pool)
    assert exposed[PREFIX + "moved_pages_total", moved] == 3
    page_bytes = 2 * 2 * (128 * 2 * 128 + 128 * 2 * 4)  # K and V, 2 layers
    assert exposed[PREFIX + "moved_bytes_total", moved] == 3 * page_bytes
    missed = (*pool[:1], ("reason", "seal_mismatch"), *pool[1:])
    assert exposed[PREFIX + "l3_missed_pages_total", missed] == 0
    staging = exposed[PREFIX + "staging_reserved_bytes", (("tp_rank", "0"),)]
    assert staging == Settings.from_environ({}).staging_bytes
