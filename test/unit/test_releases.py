"""``releases`` on SGLang 0.5.23 (skipped on older releases): it builds host pools
from ``MHABufferInfo``; a buffer info made from a device pool, as a release
without one needs, carries what SGLang's own does, and a pool built from the
device pool is the pool built from SGLang's buffer info."""

from __future__ import annotations

import pytest
import torch

from sglang_mxfp8_hicache import releases
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.pools import build_device_pool, build_host_pool

pytestmark = pytest.mark.skipif(
    releases.builds_from_device_pool(),
    reason="compares with SGLang's MHABufferInfo, which releases before 0.5.23 lack",
)


def test_this_sglang_builds_from_buffer_info():
    assert not releases.builds_from_device_pool()
    assert releases.failure_injector_type() is not None


@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", "fp4_mx_block16", "nvfp4"])
def test_buffer_info_from_a_device_pool_is_sglangs(kv_cache_dtype):
    pool = build_device_pool(
        head_num=2,
        head_dim=128,
        layer_num=2,
        pages=2,
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )
    sglang = pool.get_device_pool_infos()[0].buffer_info
    ours = releases.buffer_info(pool)
    assert releases.buffer_info(sglang) is sglang
    for name in ("page_size", "head_num", "head_dim", "v_head_dim", "dtype", "device"):
        assert getattr(ours, name) == getattr(sglang, name), name
    for side in ("k", "v"):
        for mine, theirs in (
            (getattr(ours.buffers, side), getattr(sglang.buffers, side)),
            (getattr(ours.scales, side), getattr(sglang.scales, side)),
        ):
            assert [t.data_ptr() for t in mine] == [t.data_ptr() for t in theirs]


def test_a_pool_built_from_the_device_pool_is_the_same_pool(cpu_kernels):
    """What a release that hands host pools the device pool builds: the same
    page, size and layers as from SGLang's buffer info."""
    pool = build_device_pool(
        head_num=2, head_dim=128, layer_num=3, pages=4, device="cpu"
    )
    draft = build_device_pool(
        head_num=2, head_dim=128, layer_num=1, pages=4, device="cpu"
    )
    cls = releases.built_from_device_pool(MHATokenToKVPoolMXFP8Host)
    assert issubclass(cls, MHATokenToKVPoolMXFP8Host)
    assert cls.__qualname__ == MHATokenToKVPoolMXFP8Host.__qualname__
    from_pool = cls(
        pool,
        2.0,
        0,
        128,
        "page_first",
        pin_memory=False,
        mtp_draft_device_pools=(draft,),
        pool_label="draft_swa",
    )
    from_info = build_host_pool(
        pool,
        MHATokenToKVPoolMXFP8Host,
        host_to_device_ratio=2.0,
        pin_memory=False,
        drafts=(draft,),
    )
    try:
        assert from_pool.device_pool is pool
        assert from_pool.pool_label == "draft_swa"
        for name in ("size", "size_per_token", "layer_num", "target_layer_num"):
            assert getattr(from_pool, name) == getattr(from_info, name), name
        assert from_pool.host_page == from_info.host_page
        assert from_pool.kv_buffer.shape == from_info.kv_buffer.shape
        assert torch.equal(
            torch.tensor([b.data_ptr() for b in from_pool.device_k_buffers]),
            torch.tensor([b.data_ptr() for b in from_info.device_k_buffers]),
        )
    finally:
        from_pool.destroy()
        from_info.destroy()
