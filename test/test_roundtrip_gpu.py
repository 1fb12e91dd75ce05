"""The CPU round trip again, with SGLang's real JIT kernels on a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.pool_host import common
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

import scenarios
from sglang_mxfp8_hicache.tools.bench import ABLATIONS
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.selfcheck import (
    build_device_pool,
    build_host_pool,
    round_trip,
)

pytestmark = pytest.mark.gpu

LAYERS = 4


def pools(heads, head_dim, pages, host_cls=MHATokenToKVPoolMXFP8Host):
    device_pool = build_device_pool(
        head_num=heads,
        head_dim=head_dim,
        layer_num=LAYERS,
        pages=2 * pages + 1,
        device="cuda",
    )
    host = build_host_pool(
        device_pool, host_cls, host_to_device_ratio=0.75, pin_memory=True
    )
    return device_pool, host


@pytest.mark.parametrize("heads, head_dim", [(1, 128), (8, 128), (32, 128), (8, 256)])
@pytest.mark.parametrize("pages", [1, 64, 300])  # 300: two backup launches
def test_round_trip_real_kernels(heads, head_dim, pages):
    device_pool, host = pools(heads, head_dim, pages)
    try:
        result = round_trip(device_pool, host, pages=pages, seed=pages + heads)
        assert result.payload_restored
        assert result.scales_restored
        assert result.host_untouched
        assert result.device_untouched
    finally:
        host.destroy()


@pytest.mark.parametrize("pages", [1, 9])
def test_round_trip_one_token_rows(pages):
    """64 heads of 256: 512 B of scales per token, so a row is one token and the
    token indices reach the kernel unchanged (no gather on a load)."""
    device_pool, host = pools(64, 256, pages)
    try:
        assert host.scale_geometry.row_tokens == 1
        result = round_trip(device_pool, host, pages=pages, seed=pages)
        assert result.payload_restored and result.scales_restored
        assert result.host_untouched and result.device_untouched
    finally:
        host.destroy()


def test_backup_refuses_misaligned_host_page_on_gpu():
    device_pool, host = pools(8, 128, 2)
    try:
        scenarios.backup_refuses_misaligned_host_page(device_pool, host)
    finally:
        host.destroy()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_scale_kernel_moves_exactly_its_rows(index_dtype):
    """The kernel alone, on random bytes and permuted pages: the rows of the
    named pages arrive, every other byte on both sides stays as it was."""
    device_pool, host = pools(8, 128, 5)
    try:
        scenarios.scale_kernel_moves_exactly_its_rows(device_pool, host, index_dtype)
    finally:
        host.destroy()


def test_plain_host_pool_loses_scales_on_gpu():
    device_pool, host = pools(8, 128, 16, host_cls=MHATokenToKVPoolHost)
    try:
        result = round_trip(device_pool, host, pages=16)
        assert result.payload_restored and not result.scales_restored
    finally:
        host.destroy()


def test_dispatch_on_cuda_pool():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.mem_cache.pool_host import mha

    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=2, pages=4, device="cuda"
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    assert mha.get_mha_host_pool_cls(info) is MHATokenToKVPoolMXFP8Host


def test_destroy_unregisters_pinned_scales():
    device_pool, host = pools(8, 128, 4)
    scale_host = host.scale_host
    assert getattr(scale_host, common._CUDA_HOST_REGISTERED_RANGES_ATTR)
    host.destroy()
    assert getattr(scale_host, common._CUDA_HOST_REGISTERED_RANGES_ATTR) == []


def test_half_built_pool_unregisters_pinned_scales(monkeypatch):
    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=2, pages=4, device="cuda"
    )
    seen = {}

    def fail_payload(self):
        seen["scale_host"] = self.scale_host
        raise MemoryError("payload allocation failed")

    monkeypatch.setattr(MHATokenToKVPoolHost, "init_kv_buffer", fail_payload)
    with pytest.raises(MemoryError):
        build_host_pool(
            device_pool,
            MHATokenToKVPoolMXFP8Host,
            host_to_device_ratio=1.0,
            pin_memory=True,
        )
    assert getattr(seen["scale_host"], common._CUDA_HOST_REGISTERED_RANGES_ATTR) == []
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", sorted(ABLATIONS))
@pytest.mark.parametrize("pages", [1, 300])
def test_bench_ablations_round_trip_on_gpu(name, pages):
    """What `bench --ablations` times moves the same bytes as ours."""
    device_pool, host = pools(8, 128, pages, host_cls=ABLATIONS[name])
    try:
        result = round_trip(device_pool, host, pages=pages, seed=7)
        assert result.payload_restored and result.scales_restored
        assert result.host_untouched and result.device_untouched
    finally:
        host.destroy()
