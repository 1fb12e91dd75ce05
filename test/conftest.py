from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from kernel_emulation import EmulatedKernels, PointerMap  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (SGLang's JIT kernels)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_kernels(monkeypatch) -> EmulatedKernels:
    """SGLang's JIT HiCache kernels and ours replaced by CPU emulations of their contracts.

    Patched where they are looked up: our scale_kernel module, hicache.py and the
    aliases mha.py imported, and the platform gate that lets the base class
    enable its staged write-back.
    """
    from sglang.kernels.ops.kvcache import hicache
    from sglang.srt.mem_cache.pool_host import mha

    from sglang_mxfp8_hicache import host_pool, scale_kernel

    kernels = EmulatedKernels(PointerMap())
    monkeypatch.setattr(scale_kernel, "scale_rows_module", kernels.scale_rows_module)
    for name in (
        "can_use_hicache_jit_kernel",
        "can_use_write_back_jit_kernel",
        "transfer_hicache_one_layer",
        "transfer_hicache_all_layer",
        "transfer_hicache_all_layer_staged_lf_pf",
        "_jit_hicache_module",
    ):
        monkeypatch.setattr(hicache, name, getattr(kernels, name))
    monkeypatch.setattr(
        mha, "can_use_hicache_jit_kernel", kernels.can_use_hicache_jit_kernel
    )
    monkeypatch.setattr(
        mha, "can_use_write_back_jit_kernel", kernels.can_use_write_back_jit_kernel
    )
    monkeypatch.setattr(
        mha, "jit_transfer_hicache_one_layer", kernels.transfer_hicache_one_layer
    )
    monkeypatch.setattr(
        mha,
        "jit_transfer_hicache_all_layer_staged_lf_pf",
        kernels.transfer_hicache_all_layer_staged_lf_pf,
    )
    platform = SimpleNamespace(
        capabilities=SimpleNamespace(hicache_device_kernels=True)
    )
    monkeypatch.setattr(mha, "current_platform", platform)
    monkeypatch.setattr(mha, "_is_cuda", True)
    monkeypatch.setattr(host_pool, "current_platform", platform)
    return kernels
