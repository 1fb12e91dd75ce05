"""Our host pool's construction: sizing, refusals before allocation, destroy.

Transfers are in ``test_transfers.py``. The CPU tests use the kernel emulations
(``cpu_kernels``); the ``gpu`` tests at the end need CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang.srt.mem_cache.pool_host import common
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import host_pool as host_pool_module
from sglang_mxfp8_hicache import refusals, releases, storage
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.geometry import FORMATS
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.refusals import SERVED_LAYOUTS
from sglang_mxfp8_hicache.releases import device_buffer_info, host_pool_selector_input
from sglang_mxfp8_hicache.tools.pools import build_device_pool, build_host_pool
from sglang_mxfp8_hicache.tools.sizing import dense_model, host_plan
from testkit.pools import fp4_quant_method

# Built and inspected on the CPU only: the transfers are in test_transfers.py.
on_cpu = pytest.mark.parametrize("device", ["cpu"], indirect=True)


@on_cpu
def test_sizing_counts_scales(make_pools):
    _, host = make_pools(heads=8, head_dim=128, layers=4, pages=2)
    payload = 2 * 8 * 128 * 4
    scales = 2 * 8 * 4 * 4
    seals = 2 * 4096 // 128  # each part ends in a 4 KiB block of seal area
    assert host.get_size_per_token() == payload + scales + seals
    assert host.size_per_token == payload + scales + seals
    assert host.get_ksize_per_token() == (payload + scales + seals) // 2
    # One span per page: K part then V part, each 4 layers of [payload | scales]
    # and a seal.
    assert host.kv_buffer.shape == (host.page_num, 128 * (payload + scales + seals))
    assert host.host_page.k_part.layer_bytes == 128 * 8 * 128 + 8 * 4 * 128


@pytest.mark.parametrize(
    "model, tp",
    [
        (dict(layers=32, kv_heads=8, head_dim=128), 1),
        (dict(layers=64, kv_heads=8, head_dim=128), 1),
        (dict(layers=80, kv_heads=8, head_dim=128), 8),
    ],
)
@pytest.mark.parametrize("hicache_size_gb, ratio", [(1, 0.0), (0, 3.0)])
@pytest.mark.parametrize("layout", SERVED_LAYOUTS)
def test_host_tokens_match_sizing(
    cpu_kernels, model, tp, hicache_size_gb, ratio, layout
):
    """`size` (the CLI) computes what the real host pool allocates, for every
    host layout (a ``page_head`` page has no seals)."""
    [pool] = dense_model(**model, tp_size=tp).pools
    device_pool = build_device_pool(
        head_num=pool.kv_heads,
        head_dim=pool.head_dim,
        layer_num=pool.layers,
        pages=2,
        device="cpu",
    )
    info = device_buffer_info(device_pool)
    host = MHATokenToKVPoolMXFP8Host(
        info,
        ratio,
        hicache_size_gb,
        128,
        layout,
        pin_memory=False,
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=pool.layers - 1,
    )
    [plan] = host_plan(
        dense_model(**model, tp_size=tp),
        device_tokens=device_pool.size,
        hicache_ratio=ratio,
        hicache_size_gb=hicache_size_gb,
        layout=layout,
    ).pools
    assert host.size_per_token == plan.bytes_per_token
    assert host.size == plan.host_tokens
    assert host.size * host.size_per_token == plan.host_bytes


@pytest.mark.parametrize("layout", SERVED_LAYOUTS)
def test_asymmetric_heads_match_sizing(cpu_kernels, layout):
    """K and V head dims that differ (K 192, V 128): ``size`` plans what the
    pool allocates, each side's runs at its own head dim."""
    from sglang_mxfp8_hicache.tools.sizing import KVPool, ModelKV

    device_pool = build_device_pool(
        head_num=4, head_dim=192, v_head_dim=128, layer_num=6, pages=2, device="cpu"
    )
    host = build_host_pool(
        device_pool,
        MHATokenToKVPoolMXFP8Host,
        host_to_device_ratio=2.0,
        pin_memory=False,
        layout=layout,
    )
    try:
        [plan] = host_plan(
            ModelKV((KVPool("kv", 6, 4, 192, 128),)),
            device_tokens=device_pool.size,
            hicache_ratio=2.0,
            layout=layout,
        ).pools
        assert host.size_per_token == plan.bytes_per_token
        assert host.size == plan.host_tokens
        assert plan.payload_bytes_per_token == 6 * 4 * (192 + 128)
    finally:
        host.destroy()


def _kwargs(device_pool):
    return dict(
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=device_pool.layer_num - 1,
        pin_memory=False,
    )


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a refusal lets the constructor reach the allocating base."""

    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    def allocate(*args, **kwargs):
        raise AssertionError("the host pool allocated before refusing")

    # The MHA base (0.5.23), or the host base that releases before it reach.
    monkeypatch.setattr(MHATokenToKVPoolHost, "__init__", allocate)
    monkeypatch.setattr(HostKVCache, "__init__", allocate)


@pytest.fixture
def mxfp8_pool():
    return build_device_pool(
        head_num=2, head_dim=128, layer_num=2, pages=2, device="cpu"
    )


def test_refuses_token_scale_layout(cpu_kernels, no_allocation):
    # A page size other than 128 gives SGLang's per-token scale layout.
    pool = build_device_pool(
        head_num=2, head_dim=128, layer_num=2, pages=4, page_size=64, device="cpu"
    )
    info = device_buffer_info(pool)
    with pytest.raises(BlockScaledHiCacheConfigError, match="set --page-size 128"):
        MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 64, "page_first", **_kwargs(pool))


@pytest.mark.parametrize("layout", ["page_unified", "page_first_kv_split"])
def test_refuses_layout_no_mha_pool_offers(
    cpu_kernels, no_allocation, mxfp8_pool, layout
):
    """SGLang's internal page_unified and its MLA/NPU-only kv_split layout."""
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match=f"--hicache-mem-layout {layout} is not served: SGLang offers it for "
        "no MHA host pool. Use --hicache-mem-layout page_first, page_first_direct, "
        "layer_first, page_head",
    ):
        MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 128, layout, **_kwargs(mxfp8_pool))


@on_cpu
@pytest.mark.parametrize(
    "layout", ["page_first", "page_first_direct", "layer_first", "page_head"]
)
def test_every_layout_is_the_owned_page(make_pools, layout, caplog):
    """Each layout SGLang offers is served by the same page; one log line says
    which layout was asked for and what the pool does."""
    import logging

    with caplog.at_level(logging.INFO, logger=host_pool_module.__name__):
        _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2, layout=layout)
    assert host.layout == layout
    assert host.kv_buffer.shape == (host.page_num, host.host_page.span_bytes)
    assert host.can_use_write_back_jit == (layout == "page_first")
    lines = [
        r.getMessage() for r in caplog.records if r.name == host_pool_module.__name__
    ]
    assert len(lines) == 1
    assert f"--hicache-mem-layout {layout}" in lines[0]
    major = "heads-major" if layout == "page_head" else "layer-major"
    assert f"served by one owned {major} page" in lines[0]


def test_refuses_decode_host_receive(
    cpu_kernels, no_allocation, mxfp8_pool, monkeypatch
):
    monkeypatch.setattr(refusals, "decode_host_receive", lambda: True)
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match="--disaggregation-decode-host-receive-threshold < 1 .*BLOCK_SCALE",
    ):
        MHATokenToKVPoolMXFP8Host(
            info, 2.0, 0, 128, "layer_first", **_kwargs(mxfp8_pool)
        )


def test_refuses_other_io_backend(cpu_kernels, no_allocation, mxfp8_pool, monkeypatch):
    monkeypatch.setattr(refusals, "configured_io_backend", lambda: "kernel_ascend")
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match="--hicache-io-backend kernel_ascend is not served .*"
        "use --hicache-io-backend kernel or direct",
    ):
        MHATokenToKVPoolMXFP8Host(
            info, 2.0, 0, 128, "page_first", **_kwargs(mxfp8_pool)
        )


def test_refuses_host_page_size_mismatch(cpu_kernels, no_allocation, mxfp8_pool):
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError, match="host page_size 64 != device page_size 128"
    ):
        MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 64, "page_first", **_kwargs(mxfp8_pool))


def test_refuses_draft_without_scales(cpu_kernels, no_allocation, mxfp8_pool):
    """An fp8 draft with no scales passes SGLang's own draft checks; its layers
    would come back with whatever scales the device holds."""
    info = device_buffer_info(mxfp8_pool)
    draft = build_device_pool(
        head_num=2,
        head_dim=128,
        layer_num=1,
        pages=2,
        device="cpu",
        payload_dtype=torch.float8_e4m3fn,
    )
    draft_info = device_buffer_info(draft)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match="packed draft layer 0 is not a layer of the target's format "
        r"\(mxfp8\).*--kv-cache-dtype mxfp8",
    ):
        MHATokenToKVPoolMXFP8Host(
            info,
            2.0,
            0,
            128,
            "page_first",
            draft_buffer_infos=(draft_info,),
            **_kwargs(mxfp8_pool),
        )


@pytest.mark.parametrize("backend", sorted(storage.REFUSED_STORAGE_BACKENDS))
def test_refuses_storage_backend(cpu_kernels, no_allocation, mxfp8_pool, backend):
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match=f"--hicache-storage-backend {backend} cannot store mxfp8 pages",
    ):
        MHATokenToKVPoolMXFP8Host(
            info,
            2.0,
            0,
            128,
            "page_first",
            allocator_type=backend,
            **_kwargs(mxfp8_pool),
        )


def test_refuses_dynamic_storage_with_page_head(cpu_kernels, no_allocation, mxfp8_pool):
    """A heads-major page has no seal to check a dynamic class's reads by:
    refused before the pool allocates."""
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError, match="a heads-major page has none"
    ):
        MHATokenToKVPoolMXFP8Host(
            info,
            2.0,
            0,
            128,
            "page_head",
            allocator_type="dynamic",
            **_kwargs(mxfp8_pool),
        )


def test_refuses_platform_without_kernels(no_allocation, mxfp8_pool):
    # No cpu_kernels: the real platform gate of a CPU-only machine.
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(BlockScaledHiCacheConfigError, match="need a CUDA or ROCm GPU"):
        MHATokenToKVPoolMXFP8Host(
            info, 2.0, 0, 128, "page_first", **_kwargs(mxfp8_pool)
        )


def test_refuses_when_no_kernel_builds(
    cpu_kernels, no_allocation, mxfp8_pool, monkeypatch
):
    """Neither ours nor SGLang's all-layer kernel (the fallback) builds."""
    from sglang.kernels.ops.kvcache import hicache

    from sglang_mxfp8_hicache import transfer

    def no_compiler(*args, **kwargs):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(transfer, "page_chunks_module", no_compiler)
    monkeypatch.setattr(hicache, "can_use_hicache_jit_kernel", lambda **kw: False)
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match=r"no kernel moves these page chunks \(ours: nvcc not found; "
        r"SGLang's: SGLang's JIT HiCache kernels move no slice of runs of "
        r"\[1024, 32768\] B\); run without --enable-hierarchical-cache",
    ):
        MHATokenToKVPoolMXFP8Host(
            info, 2.0, 0, 128, "page_first", **_kwargs(mxfp8_pool)
        )


def test_refuses_pool_without_scales(cpu_kernels, no_allocation):
    pool = build_device_pool(
        head_num=2,
        head_dim=128,
        layer_num=2,
        pages=2,
        device="cpu",
        payload_dtype=torch.float8_e4m3fn,
    )
    info = device_buffer_info(pool)
    with pytest.raises(
        BlockScaledHiCacheConfigError,
        match="no scale buffers of a format this host pool serves",
    ):
        MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 128, "page_first", **_kwargs(pool))


def test_destroy_after_half_built(cpu_kernels, mxfp8_pool, monkeypatch):
    """A failure after the host page is allocated still releases it."""
    seen = {}
    destroyed = []
    original_destroy = MHATokenToKVPoolMXFP8Host.destroy

    def fail_transfer_setup(self, buffer_info, write_back_staging):
        seen["kv_buffer"] = self.kv_buffer
        raise MemoryError("pointer tables failed")

    def record_destroy(self):
        destroyed.append(self.kv_buffer is not None)
        original_destroy(self)

    monkeypatch.setattr(
        MHATokenToKVPoolMXFP8Host, "_initialize_transfer_views", fail_transfer_setup
    )
    monkeypatch.setattr(MHATokenToKVPoolMXFP8Host, "destroy", record_destroy)
    info = device_buffer_info(mxfp8_pool)
    with pytest.raises(MemoryError):
        MHATokenToKVPoolMXFP8Host(
            info, 2.0, 0, 128, "page_first", **_kwargs(mxfp8_pool)
        )
    assert seen["kv_buffer"] is not None
    assert destroyed == [True]


@on_cpu
def test_destroy_is_idempotent(make_pools):
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    host.destroy()
    host.destroy()
    assert host.kv_buffer is None


@pytest.mark.gpu
def test_dispatch_on_cuda_pool():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.mem_cache.pool_host import mha

    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=2, pages=4, device="cuda"
    )
    chosen = mha.get_mha_host_pool_cls(host_pool_selector_input(device_pool))
    assert issubclass(chosen, MHATokenToKVPoolMXFP8Host)


@pytest.mark.gpu
def test_destroy_unregisters_pinned_pages():
    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=2, pages=4, device="cuda"
    )
    host = build_host_pool(
        device_pool,
        MHATokenToKVPoolMXFP8Host,
        host_to_device_ratio=1.0,
        pin_memory=True,
    )
    pages = host.kv_buffer
    assert getattr(pages, common._CUDA_HOST_REGISTERED_RANGES_ATTR)
    host.destroy()
    assert getattr(pages, common._CUDA_HOST_REGISTERED_RANGES_ATTR) == []


@pytest.mark.gpu
def test_half_built_pool_unregisters_pinned_pages(monkeypatch):
    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=2, pages=4, device="cuda"
    )
    seen = {}

    def fail_transfer_setup(self, buffer_info, write_back_staging):
        seen["kv_buffer"] = self.kv_buffer
        raise MemoryError("pointer tables failed")

    monkeypatch.setattr(
        MHATokenToKVPoolMXFP8Host, "_initialize_transfer_views", fail_transfer_setup
    )
    with pytest.raises(MemoryError):
        build_host_pool(
            device_pool,
            MHATokenToKVPoolMXFP8Host,
            host_to_device_ratio=1.0,
            pin_memory=True,
        )
    assert getattr(seen["kv_buffer"], common._CUDA_HOST_REGISTERED_RANGES_ATTR) == []
    torch.cuda.synchronize()


def _fp4_pool(name, *, heads=8, layers=2, pages=2, page_size=128, **method):
    """SGLang's FP4 pool for ``name``; ``method`` (``backends``, nvfp4's
    ``native_scale_layout``) configures its quant method as a server would
    (default: tools.pools' FlashInfer)."""
    return build_device_pool(
        head_num=heads,
        head_dim=128,
        layer_num=layers,
        pages=pages,
        page_size=page_size,
        device="cpu",
        kv_cache_dtype=name,
        quant_method=fp4_quant_method(
            name, layer_num=layers, page_size=page_size, device="cpu", **method
        ),
    )


@pytest.mark.parametrize("page_size", [128, 64])
@pytest.mark.parametrize("name", ["fp4_mx_block16", "nvfp4"])
def test_fp4_sizing_matches_the_device_pool(cpu_kernels, name, page_size):
    """Sizing from the tensors: the host's bytes per token are the device
    pool's payload and scale bytes per token (its fp8 dequant workspace, the
    nvfp4 FlashInfer scratch, excluded), not SGLang's host formula, which
    counts the uint8 payload at the logical head_dim (twice its rows)."""
    device_pool = _fp4_pool(name, layers=32, page_size=page_size)
    info = device_buffer_info(device_pool)
    host = MHATokenToKVPoolMXFP8Host(
        info, 2.0, 0, page_size, "page_first", **_kwargs(device_pool)
    )
    try:
        tensors = [
            *device_pool.k_buffer,
            *device_pool.v_buffer,
            *device_pool.k_scale_buffer,
            *device_pool.v_scale_buffer,
        ]
        device_bytes = sum(t.numel() * t.element_size() for t in tensors)
        # The device cell, and each part's seal area: its layers are whole
        # 4 KiB blocks, so one block.
        seals = 2 * 4096 // page_size
        assert (
            host.size_per_token
            == device_bytes // (device_pool.size + page_size) + seals
        )
        assert host.size_per_token == 36864 + seals  # 32 layers of 8x128
        assert 2 * info.head_num * info.head_dim * len(tensors) // 4 == 65536
        [plan] = host_plan(
            dense_model(layers=32, kv_heads=8, head_dim=128, tp_size=1),
            device_tokens=device_pool.size,
            fmt=host.host_page.fmt,
            page_size=page_size,
        ).pools
        assert host.size_per_token == plan.bytes_per_token
        assert host.size == plan.host_tokens
        # The packed payload of one head is 64 B of a page's K run per token.
        assert host.host_page.k_part.payload_bytes == page_size * 8 * 64
        assert host.storage_format_tag.startswith(f"{name}v4-l32h8d128p{page_size}")
    finally:
        host.destroy()


@pytest.mark.parametrize(
    "name, backends, kw, match",
    [
        (
            "nvfp4",
            ("triton", "triton"),
            {},
            "reports no per-token scale buffers",
        ),
        # SM100 trtllm_mha: only the native layout, outside MHABufferInfo.
        (
            "nvfp4",
            ("trtllm_mha", "trtllm_mha"),
            {"native_scale_layout": True},
            "reports no per-token scale buffers.*native trtllm_mha layout",
        ),
    ],
    ids=["nvfp4-triton", "nvfp4-native"],
)
def test_refuses_fp4_without_token_scales(
    cpu_kernels, no_allocation, name, backends, kw, match
):
    pool = _fp4_pool(name, backends=backends, **kw)
    info = device_buffer_info(pool)
    assert info.scales is None
    with pytest.raises(BlockScaledHiCacheConfigError, match=match):
        MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 128, "page_first", **_kwargs(pool))


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("name", ["fp4_mx_block16", "nvfp4"])
def test_serves_fp4_payload_rows_of_any_width(cpu_kernels, name, heads):
    """One or three KV heads of 128 are 64 B and 192 B payload rows, which no
    JIT kernel of SGLang moves as rows; a page chunk is whole pages of rows."""
    pool = _fp4_pool(name, heads=heads)
    info = device_buffer_info(pool)
    host = MHATokenToKVPoolMXFP8Host(info, 2.0, 0, 128, "page_first", **_kwargs(pool))
    try:
        assert host.host_page.k_part.payload_bytes == 128 * heads * 64
    finally:
        host.destroy()


def test_refuses_native_nvfp4_scales_wherever_a_stack_is_built(cpu_kernels):
    """nvfp4 for flashinfer prefill and trtllm_mha decode on SM100 keeps
    per-token scales (which MHABufferInfo reports) and a native copy (which it
    does not): the plugin's hook on the assembler refuses the pool before any
    host pool exists, naming the reason."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.plugins import load_plugins

    load_plugins()
    pool = _fp4_pool(
        "nvfp4",
        backends=("flashinfer", "trtllm_mha"),
        native_scale_layout=True,
    )
    assert pool.native_k_scale_buffer is not None
    assert device_buffer_info(pool).scales is not None

    def host_class(pool):
        """The assembler's choice: from ``_mha_host_inputs`` where the release
        has it (0.5.23), else from the device pool it hands the selector."""
        if releases.builds_from_device_pool():
            return assembler.get_mha_host_pool_cls(pool)
        return assembler._mha_host_inputs(pool)[0]

    with pytest.raises(BlockScaledHiCacheConfigError, match="native trtllm_mha scales"):
        host_class(pool)
    # Without native scales the inputs are SGLang's, with our class.
    plain = _fp4_pool("nvfp4")
    assert issubclass(host_class(plain), MHATokenToKVPoolMXFP8Host)
    assert device_buffer_info(plain).scales is not None


# -- one plan: every path's first refusal is the plan's ---------------------------

SEVERAL_PROBLEMS = {
    # name: (page_size, layout, io backend, storage backend, v_head_dim, format)
    "page_size_and_layout": (64, "page_unified", "kernel", None, 128, "mxfp8"),
    "layout_io_storage": (128, "page_unified", "kernel_ascend", "sim", 128, "mxfp8"),
    "io_and_storage": (128, "page_first", "kernel_ascend", "sim", 128, "mxfp8"),
    "asymmetric_fp4_and_hf3fs": (128, "page_first", "kernel", "hf3fs", 64, "fp4"),
    "sealed_storage_and_page_head": (128, "page_head", "kernel", "nixl", 128, "mxfp8"),
}


@pytest.mark.parametrize("case", SEVERAL_PROBLEMS)
def test_every_path_gives_the_plans_first_refusal(cpu_kernels, monkeypatch, case):
    """A configuration with several problems is refused for the same first one
    by the plugin's check of the server flags, the pool's constructor, the
    storage factory hook (a pool built without the backend, then attaching
    it) and ``size``, as far as each knows the facts: the plan's."""
    from sglang_mxfp8_hicache.refusals import HiCacheFlags, PageShape, refusal
    from sglang_mxfp8_hicache.tools import sizing

    page_size, layout, io, backend, v_head_dim, fmt = SEVERAL_PROBLEMS[case]
    fp4 = "fp4_mx_block16" if fmt == "fp4" else fmt
    flags = HiCacheFlags(fp4, page_size, layout, io, backend)
    shape = PageShape(2, 128, v_head_dim, 2)
    first = refusal(flags, shape)
    assert first is not None
    assert refusal(flags) in (first, None)  # the plugin, before the model

    monkeypatch.setattr(refusals, "configured_io_backend", lambda: io)
    pool = build_device_pool(
        head_num=2,
        head_dim=128,
        v_head_dim=v_head_dim,
        layer_num=2,
        pages=2,
        page_size=page_size,
        kv_cache_dtype=fp4,
        device="cpu",
    )
    info = device_buffer_info(pool)
    args = (info, 2.0, 0, page_size, layout)
    with pytest.raises(BlockScaledHiCacheConfigError) as refused:
        MHATokenToKVPoolMXFP8Host(*args, allocator_type=backend, **_kwargs(pool))
    assert str(refused.value) == first.error(fp4, "kv").args[0]

    if first.flag == "--hicache-storage-backend":  # the pool alone is served
        host = MHATokenToKVPoolMXFP8Host(*args, **_kwargs(pool))
        assert host.refusal_with_storage(backend) == first
    size_knows = dataclasses.replace(flags, io_backend="kernel", storage_backend=None)
    size_first = refusal(size_knows, shape)
    plan_args = dict(device_tokens=256, fmt=FORMATS[fp4], page_size=page_size)
    model = sizing.ModelKV((sizing.KVPool("kv", 2, 2, 128, v_head_dim),))
    if size_first is None:
        sizing.host_plan(model, layout=layout, **plan_args)
    else:
        with pytest.raises(sizing.SizingError) as sized:
            sizing.host_plan(model, layout=layout, **plan_args)
        assert str(sized.value) == f"kv pool: {size_first.reason}"
