"""Transfers of our host pool on SGLang's real block-scaled device pools, byte for byte.

Every test runs twice through the ``device`` fixture: on the CPU with the kernel
emulations (``kernel_emulation.py``) and, on a CUDA machine, with SGLang's real
JIT kernels and ours. Random bytes (0xFF included) and permuted page ids
throughout; pages outside a transfer must keep their bytes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import releases, transfer
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import even_layer_groups
from sglang_mxfp8_hicache.tools.ablations import ABLATIONS, doubling_load_groups
from sglang_mxfp8_hicache.tools.pools import (
    IO_BACKEND,
    PayloadOnlyHost,
    fill_random,
    page_token_indices,
)
from testkit.pools import device_buffers, round_trip


def assert_exact(result) -> None:
    assert result.payload_restored, "payload differs"
    assert result.scales_restored, "scales differ"
    assert result.host_untouched, "host pages outside the backup changed"
    assert result.device_untouched, "device pages outside the load changed"


@pytest.mark.parametrize(
    "heads, head_dim, layers, pages",
    [
        (1, 128, 3, 1),
        (2, 128, 1, 3),  # a single layer
        (1, 128, 3, 200),
        (1, 128, 2, 300),  # three launches of at most 128 pages by value
        (8, 128, 4, 64),
        (8, 128, 13, 5),  # layer 0, then one group
        (32, 128, 2, 67),
        (8, 256, 2, 70),
        (7, 128, 3, 9),
        (3, 64, 2, 9),  # payload runs of 24 KiB, scale runs of 768 B
        (64, 256, 1, 3),
    ],
    ids=lambda v: "page_span-" + str(v),
)
def test_round_trip(make_pools, heads, head_dim, layers, pages):
    device_pool, host = make_pools(
        heads=heads, head_dim=head_dim, layers=layers, pages=pages
    )
    assert host.page_num >= pages
    result = round_trip(device_pool, host, pages=pages, seed=pages + heads)
    assert_exact(result)
    # The host page is one span: per part, payload and scale runs of every
    # layer, then a seal area of at least 24 B up to a whole 4 KiB block.
    page = host.host_page
    assert host.kv_buffer.shape == (host.page_num, page.span_bytes)
    runs = layers * 128 * heads * (head_dim + head_dim // 32)
    assert page.span_bytes == 2 * (-(-(runs + 24) // 4096) * 4096)
    # Random bytes include 0xFF (UE8M0 NaN) in what the pages carried.
    assert (host.kv_buffer.view(torch.uint8) == 0xFF).any()


FP4_FORMATS = ["fp4_mx_block16", "nvfp4"]


@pytest.mark.parametrize("kv_cache_dtype", FP4_FORMATS)
@pytest.mark.parametrize(
    "heads, layers, pages, drafts, layout, page_size",
    [
        (2, 3, 1, 0, "page_first", 128),
        (1, 3, 9, 0, "page_first", 128),  # 64 B payload rows: one head per rank
        (3, 2, 9, 1, "page_first", 128),  # 192 B payload rows: 3 heads per rank
        (8, 4, 64, 0, "page_first", 128),
        (4, 13, 5, 0, "page_first", 128),  # layer 0, then one group
        (2, 2, 300, 0, "page_first", 128),
        (16, 2, 9, 0, "page_first_direct", 128),
        (8, 4, 5, 2, "page_first", 128),  # packed MTP/NextN drafts
        (8, 4, 9, 0, "layer_first", 128),
        (8, 4, 9, 2, "layer_first", 128),
        (8, 4, 33, 0, "page_first", 64),  # FP4 is not tied to page 128
        (2, 3, 70, 2, "page_first", 16),  # scale runs of 64 B
        (1, 2, 9, 0, "layer_first", 16),  # payload runs of 1 KiB
        (8, 4, 9, 0, "layer_first", 64),
        (4, 3, 9, 1, "page_head", 128),  # heads-major: 8 B strided scale rows
        (2, 2, 5, 0, "page_head", 16),
    ],
    ids=lambda v: "fp4-" + str(v),
)
def test_round_trip_fp4(
    make_pools, kv_cache_dtype, heads, layers, pages, drafts, layout, page_size
):
    """FP4 KV (SGLang's MHATokenToKVPool with the recipe's quant method): packed
    e2m1 payload at its real width and per-token scale rows, byte-exact,
    through the same page as MXFP8, at any page size and row width."""
    device_pool, host, draft_pools = make_pools(
        heads=heads,
        head_dim=128,
        layers=layers,
        pages=pages,
        drafts=drafts,
        layout=layout,
        kv_cache_dtype=kv_cache_dtype,
        page_size=page_size,
    )
    assert host.host_page.fmt.name == kv_cache_dtype
    assert host.page_size == page_size
    # Half a byte of payload and 1/16 of a scale byte per element.
    seals = host.host_page.seal_bytes // host.page_size
    assert host.get_size_per_token() == 2 * (layers + drafts) * heads * (64 + 8) + seals
    result = round_trip(
        device_pool, host, pages=pages, seed=pages + heads, drafts=draft_pools
    )
    assert_exact(result)


@pytest.mark.parametrize("kv_cache_dtype", FP4_FORMATS)
def test_plain_host_pool_refuses_fp4(make_pools, kv_cache_dtype):
    """The control: SGLang 0.5.23's own host pool cannot take an FP4 pool at
    all; the releases before it build one sized a byte per element, with no
    room for the scales (``test/releases`` shows them lost)."""
    geometry = dict(heads=8, head_dim=128, layers=2, pages=2)
    if not releases.builds_from_device_pool():
        with pytest.raises(ValueError, match="scale layout 'token'"):
            make_pools(
                **geometry, host_cls=MHATokenToKVPoolHost, kv_cache_dtype=kv_cache_dtype
            )
        return
    device_pool, host = make_pools(
        **geometry, host_cls=MHATokenToKVPoolHost, kv_cache_dtype=kv_cache_dtype
    )
    payload_per_token = (
        device_pool.k_buffer[0][0].nbytes + device_pool.v_buffer[0][0].nbytes
    )
    # A byte per element: twice the packed e2m1 payload, and nothing for scales.
    assert host.get_size_per_token() == 2 * geometry["layers"] * payload_per_token


@pytest.mark.parametrize(
    "heads, layers, drafts, pages",
    [(8, 4, 1, 5), (1, 3, 2, 3), (8, 13, 3, 64), (2, 1, 2, 2)],
    ids=lambda v: str(v),
)
def test_round_trip_draft(make_pools, heads, layers, drafts, pages):
    """Packed MTP/NextN draft layers: backed up with the target's layers in one
    call, loaded as is_draft after the target layer of their depth, byte-exact."""
    device_pool, host, draft_pools = make_pools(
        heads=heads, head_dim=128, layers=layers, pages=pages, drafts=drafts
    )
    assert host.layer_num == layers + drafts
    # Sizing counts every draft layer's payload and scale bytes.
    assert (
        host.get_size_per_token()
        == 2 * (layers + drafts) * (heads * 128 + heads * 4)
        + host.host_page.seal_bytes // host.page_size
    )
    result = round_trip(device_pool, host, pages=pages, seed=pages, drafts=draft_pools)
    assert_exact(result)


LAYOUT_IO = [
    ("page_first", "kernel"),
    ("layer_first", "kernel"),
    ("page_head", "kernel"),
    ("page_first_direct", "direct"),
    ("layer_first", "direct"),
]


@pytest.mark.parametrize(
    "heads, layers, drafts, pages",
    [(8, 4, 0, 5), (1, 3, 0, 200), (8, 13, 0, 64), (8, 4, 2, 9)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize(
    "layout, io_backend",
    LAYOUT_IO,
    ids=lambda v: {"page_first_direct": "page_first_direct", "direct": "io_direct"}.get(
        v, v
    ),
)
def test_round_trip_layouts(
    make_pools, layout, io_backend, heads, layers, drafts, pages
):
    """Every host layout and io backend SGLang offers for MHA pools is the one
    owned page; with --hicache-io-backend direct every index is on the CPU."""
    device_pool, host, draft_pools = make_pools(
        heads=heads,
        head_dim=128,
        layers=layers,
        pages=pages,
        drafts=drafts,
        layout=layout,
    )
    assert host.layout == layout
    result = round_trip(
        device_pool,
        host,
        pages=pages,
        seed=pages,
        drafts=draft_pools,
        io_backend=io_backend,
    )
    assert_exact(result)


@pytest.mark.parametrize(
    "heads, head_dim, v_head_dim, drafts",
    [(8, 192, 128, 0), (2, 128, 64, 1), (1, 64, 256, 0)],
    ids=lambda v: "asymmetric-" + str(v),
)
def test_round_trip_asymmetric(make_pools, heads, head_dim, v_head_dim, drafts):
    """K and V head dims differ (MXFP8, as SGLang's MXFP8 pool builds them):
    each part of the page has its own runs."""
    device_pool, host, draft_pools = make_pools(
        heads=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        layers=3,
        pages=5,
        drafts=drafts,
    )
    k, v = host.host_page.k_part, host.host_page.v_part
    assert k.span_bytes != v.span_bytes
    assert host.get_size_per_token() * host.page_size == k.span_bytes + v.span_bytes
    result = round_trip(device_pool, host, pages=5, seed=3, drafts=draft_pools)
    assert_exact(result)


@pytest.mark.parametrize("kv_cache_dtype", FP4_FORMATS)
def test_asymmetric_fp4_refused(make_pools, kv_cache_dtype):
    """SGLang's FP4 pool keeps V at K's head dim: refused, saying so."""
    with pytest.raises(
        BlockScaledHiCacheConfigError, match="SGLang serves no asymmetric FP4"
    ):
        make_pools(
            heads=2,
            head_dim=192,
            v_head_dim=128,
            layers=2,
            pages=2,
            kv_cache_dtype=kv_cache_dtype,
        )


@pytest.mark.parametrize(
    "order",
    [
        [5, 6, 7, 8, 0, 1, 2, 3, 4],  # starts in the middle of a group
        [8, 7, 6, 5, 4, 3, 2, 1, 0],
        [3, 0, 8, 1, 6, 2, 7, 5, 4],
    ],
    ids=["hybrid_swa-from_middle", "reversed", "shuffled"],
)
def test_round_trip_any_layer_order(make_pools, order):
    """A hybrid pool's layer mapper decides which of its layers a transfer
    loads first: in any order, a layer's scales are on the device when its
    payload load has been issued (checked after every call), and the whole
    transfer, drafts interleaved as SGLang does, is byte-exact."""
    device_pool, host, draft_pools = make_pools(
        heads=4, head_dim=128, layers=9, pages=6, drafts=2
    )
    result = round_trip(
        device_pool, host, pages=6, seed=11, drafts=draft_pools, layer_order=order
    )
    assert_exact(result)
    dev = device_pool.device
    src = page_token_indices(torch.tensor([1, 2])).to(dev)
    dst = page_token_indices(torch.tensor([3, 4])).to(dev)
    host_tokens = page_token_indices(torch.tensor([4, 0]))
    host.backup_from_device_all_layer(device_pool, host_tokens, src, IO_BACKEND)
    scales = [b.view(torch.uint8) for b in device_pool.k_scale_buffer]
    expected = [b[1:3].clone() for b in scales]
    for b in scales:
        b[3:5] = 0
    host_dev = host_tokens.to(dev)
    for layer in order:
        host.load_to_device_per_layer(device_pool, host_dev, dst, layer, IO_BACKEND)
        assert torch.equal(scales[layer][3:5], expected[layer]), f"layer {layer}"


def test_same_indices_twice_are_two_transfers(make_pools):
    """A second load with the very same index tensors (a layer seen again) is a
    new transfer: it moves every group's scales again."""
    device_pool, host = make_pools(heads=4, head_dim=128, layers=5, pages=3)
    result = round_trip(device_pool, host, pages=3, seed=5)
    assert_exact(result)
    gen = torch.Generator(device=device_pool.device).manual_seed(6)
    fill_random(device_buffers(device_pool), gen)
    src = page_token_indices(torch.tensor([1, 2, 3])).to(device_pool.device)
    host_tokens = page_token_indices(torch.tensor([0, 1, 2]))
    host.backup_from_device_all_layer(device_pool, host_tokens, src, IO_BACKEND)
    expected = [b.view(torch.uint8)[1:4].clone() for b in device_pool.k_scale_buffer]
    dst = page_token_indices(torch.tensor([4, 5, 6])).to(device_pool.device)
    host_dev = host_tokens.to(device_pool.device)
    for _ in range(2):
        for buf in device_pool.k_scale_buffer:
            buf.view(torch.uint8)[4:7] = 0
        for layer in range(device_pool.layer_num):
            host.load_to_device_per_layer(device_pool, host_dev, dst, layer, IO_BACKEND)
        restored = [b.view(torch.uint8)[4:7] for b in device_pool.k_scale_buffer]
        assert all(torch.equal(a, b) for a, b in zip(restored, expected, strict=True))


def test_draft_scales_load_only_with_is_draft(make_pools):
    """A non-draft call with a draft's layer id moves nothing (the base class
    returns early): no scales may move either."""
    device_pool, host, (draft,) = make_pools(
        heads=2, head_dim=128, layers=2, pages=2, drafts=1
    )
    fill_random(
        [*draft.k_scale_buffer, *draft.v_scale_buffer],
        torch.Generator(device=draft.device).manual_seed(3),
    )
    scales = [
        b.view(torch.uint8) for b in (*draft.k_scale_buffer, *draft.v_scale_buffer)
    ]
    before = [b.clone() for b in scales]
    tokens = page_token_indices(torch.tensor([1])).to(device_pool.device)
    # Loads get host indices on the device, as SGLang's transfer engine does.
    host.load_to_device_per_layer(draft, tokens, tokens, 2, IO_BACKEND)
    assert all(torch.equal(a, b) for a, b in zip(scales, before, strict=True))
    host.load_to_device_per_layer(draft, tokens, tokens, 2, IO_BACKEND, is_draft=True)
    assert not all(torch.equal(a, b) for a, b in zip(scales, before, strict=True))


def test_plain_host_pool_loses_scales(make_pools):
    """The control: SGLang's payload-only host pool restores the payload only."""
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=2, pages=8, host_cls=PayloadOnlyHost
    )
    result = round_trip(device_pool, host, pages=8)
    assert result.payload_restored
    assert not result.scales_restored


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_bench_ablation_round_trip(make_pools, name):
    """What `bench --ablations` times moves the same bytes as ours."""
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=5, pages=9, host_cls=ABLATIONS[name]
    )
    assert_exact(round_trip(device_pool, host, pages=9, seed=5))


def test_fallback_to_sglang_kernel(make_pools, monkeypatch, caplog):
    """Our kernel fails to build: one warning, SGLang's kernel moves the same bytes."""

    def no_compiler(vector):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(transfer, "page_chunks_module", no_compiler)
    with caplog.at_level(logging.WARNING, logger=transfer.__name__):
        device_pool, host = make_pools(heads=8, head_dim=128, layers=4, pages=20)
    assert isinstance(host._mover, transfer.SGLangChunkKernels)
    warnings = [
        r
        for r in caplog.records
        if r.name == transfer.__name__ and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    assert "nvcc not found" in warnings[0].getMessage()
    assert_exact(round_trip(device_pool, host, pages=20, seed=3))


def test_doubling_groups_carry_a_launch_worth_of_bytes():
    kib = 1024
    # Large loads: layer 0, then doubling groups.
    groups = doubling_load_groups(80, 1 << 20)
    assert [g.start for g in groups] == [0, 1, 2, 4, 8, 16, 32, 64]
    assert groups[-1] == range(64, 80)
    # Layer 0, then the rest at once; all at once if the rest is that small.
    assert doubling_load_groups(8, 66 * kib) == [range(0, 1), range(1, 8)]
    assert doubling_load_groups(8, 33 * kib) == [range(0, 8)]
    # Groups merge until they carry 1 MiB; a short tail joins the last.
    assert doubling_load_groups(80, 66 * kib) == [
        range(0, 1),
        range(1, 32),
        range(32, 64),
        range(64, 80),
    ]
    assert doubling_load_groups(80, 40 * kib) == [
        range(0, 1),
        range(1, 32),
        range(32, 80),
    ]
    assert doubling_load_groups(1, 1 << 30) == [range(0, 1)]
    for layers in (1, 2, 3, 61, 80):
        for layer_bytes in (1, 4 * kib, 300 * kib, 1 << 22):
            groups = doubling_load_groups(layers, layer_bytes)
            assert [i for g in groups for i in g] == list(range(layers))
            assert groups[0] == range(0, 1) or groups == [range(layers)]


def test_even_layer_groups_are_the_least_that_carry_the_minimum():
    kib, mib = 1024, 1 << 20
    # Each layer its own group once a layer carries the minimum (16 MiB).
    assert even_layer_groups(32, 16 * mib) == [range(n, n + 1) for n in range(32)]
    # Layer 0 alone, then groups a layer apart in length, none short.
    ends = (1, 5, 9, 14, 18, 23, 27, 32)
    assert even_layer_groups(32, 4 * mib) == [range(1), *map(range, ends, ends[1:])]
    assert even_layer_groups(10, 300 * kib, mib) == [
        range(0, 1),
        range(1, 5),
        range(5, 10),
    ]
    assert even_layer_groups(80, mib, mib, min_layers=4)[1:3] == [
        range(1, 5),
        range(5, 9),
    ]
    assert even_layer_groups(8, 20 * kib) == [range(0, 8)]
    for layers in (1, 2, 3, 61, 80):
        for layer_bytes in (1, 4 * kib, 300 * kib, 1 << 22):
            groups = even_layer_groups(layers, layer_bytes)
            assert [i for g in groups for i in g] == list(range(layers))
            assert groups[0] == range(0, 1) or groups == [range(layers)]
            lengths = [len(g) for g in groups[1:]] or [0]
            assert max(lengths) - min(lengths) <= 1


def _device_runs(device_pool, layers) -> torch.Tensor:
    """Device bytes as [part, layer, page, run bytes] on the CPU (``page.PARTS``)."""
    parts = (
        device_pool.k_buffer,
        device_pool.k_scale_buffer,
        device_pool.v_buffer,
        device_pool.v_scale_buffer,
    )
    pages = device_pool.size // device_pool.page_size + 1
    return [
        torch.stack(
            [part[layer].view(torch.uint8).reshape(pages, -1) for layer in layers]
        ).cpu()
        for part in parts
    ]


def _host_runs(host, layers) -> list[torch.Tensor]:
    """Host bytes as [part][layer, page, run bytes], from the page's byte order."""
    page = host.host_page
    raw = host.kv_buffer.view(torch.uint8).cpu()
    runs = []
    for part, size in enumerate(page.run_bytes()):
        runs.append(
            torch.stack(
                [raw[:, page.run_offsets(layer)[part] :][:, :size] for layer in layers]
            )
        )
    return runs


def test_load_issues_layers_no_later_than_their_call(make_pools):
    """Each layer is on the device once its own load call returns, and layer
    0's call moves layer 0 only (other layers keep their bytes until their
    group's call)."""
    device_pool, host = make_pools(heads=8, head_dim=128, layers=6, pages=4)
    fill_random([host.kv_buffer], torch.Generator().manual_seed(4))
    fill_random(
        device_buffers(device_pool),
        torch.Generator(device=device_pool.device).manual_seed(5),
    )
    host_pages, device_pages = torch.tensor([3, 0]), torch.tensor([5, 2])
    host_tokens = page_token_indices(host_pages).to(device_pool.device)
    device_tokens = page_token_indices(device_pages).to(device_pool.device)
    layers = range(6)
    expected = [run[:, host_pages] for run in _host_runs(host, layers)]

    def arrived(layer: int) -> bool:
        now = _device_runs(device_pool, [layer])
        return all(
            torch.equal(part[0, device_pages], want[layer])
            for part, want in zip(now, expected, strict=True)
        )

    for layer in layers:
        host.load_to_device_per_layer(
            device_pool, host_tokens, device_tokens, layer, IO_BACKEND
        )
        assert all(arrived(done) for done in range(layer + 1))
        if layer == 0:
            assert not any(arrived(later) for later in range(1, 6))


MOVERS = {
    name: MHATokenToKVPoolMXFP8Host.with_transfer(TransferChoice(mover=mover))
    for name, mover in (
        ("ours", transfer.PageChunkKernel),
        ("fallback", transfer.SGLangChunkKernels),
    )
}
"""Our pool moving its pages by one mover alone."""


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("host_indices_on", ["cpu", "gpu"])
@pytest.mark.parametrize("kernel", sorted(MOVERS))
def test_mover_moves_exactly_its_pages(
    make_pools, device, kernel, host_indices_on, index_dtype
):
    """A mover alone, both directions: the named pages' runs arrive, every
    other byte on both sides stays. A backup takes host indices on the CPU
    (page_first's write path) or on the GPU."""
    if device == "cpu" and (host_indices_on == "gpu" or index_dtype != torch.int64):
        pytest.skip("no GPU: index tensors are CPU int64 here")
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=3, pages=5, host_cls=MOVERS[kernel]
    )
    layers = range(3)
    fill_random(
        device_buffers(device_pool), torch.Generator(device=device).manual_seed(1)
    )
    fill_random([host.kv_buffer], torch.Generator().manual_seed(2))
    device_pages, host_pages = torch.tensor([4, 1, 3]), torch.tensor([2, 0, 5])
    backup_hosts = page_token_indices(host_pages)
    if host_indices_on == "gpu":
        backup_hosts = backup_hosts.to(device, index_dtype)
    moved = _move_and_compare(
        device_pool,
        host,
        layers,
        backup_hosts,
        page_token_indices(device_pages).to(device, index_dtype),
        to_host=True,
    )
    assert moved(host_pages, device_pages)
    fill_random(
        device_buffers(device_pool), torch.Generator(device=device).manual_seed(3)
    )
    load_pages = torch.tensor([2, 5, 1])
    moved = _move_and_compare(
        device_pool,
        host,
        layers,
        page_token_indices(host_pages).to(device, index_dtype),
        page_token_indices(load_pages).to(device, index_dtype),
        to_host=False,
    )
    assert moved(host_pages, load_pages)


def _move_and_compare(
    device_pool, host, layers, host_indices, device_indices, *, to_host
):
    """Moves every layer of the pages named with the host's mover; returns a
    check that exactly (host page, device page) pairs moved, in that direction,
    and that every other byte on both sides stayed."""
    device_before = _device_runs(device_pool, layers)
    host_before = _host_runs(host, layers)
    host._mover.move(
        host._backup_prepared, host_indices, device_indices, to_host=to_host
    )
    if device_pool.device != "cpu":
        torch.cuda.synchronize()
    device_after = _device_runs(device_pool, layers)
    host_after = _host_runs(host, layers)

    def moved(host_pages: torch.Tensor, device_pages: torch.Tensor) -> bool:
        for part in range(len(device_before)):
            dst_before, src, dst_after, src_after, dst_pages, src_pages = (
                (
                    host_before[part],
                    device_before[part],
                    host_after[part],
                    device_after[part],
                    host_pages,
                    device_pages,
                )
                if to_host
                else (
                    device_before[part],
                    host_before[part],
                    device_after[part],
                    host_after[part],
                    device_pages,
                    host_pages,
                )
            )
            expected = dst_before.clone()
            expected[:, dst_pages] = src[:, src_pages]
            if not (torch.equal(dst_after, expected) and torch.equal(src_after, src)):
                return False
        return True

    return moved


def _snapshot(device_pool, host) -> list[torch.Tensor]:
    """Every host byte and every device byte, as uint8 (fp8 NaN != NaN)."""
    tensors = [host.kv_buffer, *device_buffers(device_pool)]
    return [t.view(torch.uint8).cpu().clone() for t in tensors]


MISALIGNED = {
    "misaligned_host_page_backwards": "page 1 is not one aligned run",
    "misaligned_host_page_shifted": "page 0 is not one aligned run",
    "misaligned_partial_page": "are not whole pages of 128",
}


def _misaligned_indices(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    host_tokens = page_token_indices(torch.tensor([0, 1]))
    device_tokens = page_token_indices(torch.tensor([2, 1]))
    if case == "misaligned_host_page_backwards":
        host_tokens[128:] = host_tokens[128:].flip(0)
    elif case == "misaligned_host_page_shifted":
        host_tokens += 64
    else:
        host_tokens, device_tokens = host_tokens[:192], device_tokens[:192]
    return host_tokens, device_tokens


@pytest.mark.parametrize("kernel", sorted(MOVERS))
@pytest.mark.parametrize("case", sorted(MISALIGNED))
def test_backup_refuses_before_a_byte_moves(make_pools, device, kernel, case):
    """A backup of CPU host pages that are not whole aligned runs raises before
    any byte reaches the host."""
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=2, pages=2, host_cls=MOVERS[kernel]
    )
    fill_random([host.kv_buffer], torch.Generator().manual_seed(3))
    before = _snapshot(device_pool, host)
    host_tokens, device_tokens = _misaligned_indices(case)
    with pytest.raises(RuntimeError, match=MISALIGNED[case]):
        host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens.to(device), IO_BACKEND
        )
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(
        torch.equal(a, b)
        for a, b in zip(_snapshot(device_pool, host), before, strict=True)
    )


@pytest.mark.parametrize("kernel", sorted(MOVERS))
def test_load_refuses_partial_page_before_a_byte_moves(make_pools, device, kernel):
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=2, pages=2, host_cls=MOVERS[kernel]
    )
    fill_random(
        device_buffers(device_pool), torch.Generator(device=device).manual_seed(6)
    )
    before = _snapshot(device_pool, host)
    host_tokens, device_tokens = _misaligned_indices("misaligned_partial_page")
    with pytest.raises(RuntimeError, match="are not whole pages of 128"):
        host.load_to_device_per_layer(
            device_pool, host_tokens.to(device), device_tokens.to(device), 0, IO_BACKEND
        )
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(
        torch.equal(a, b)
        for a, b in zip(_snapshot(device_pool, host), before, strict=True)
    )


def test_other_io_backend_moves_nothing(make_pools, device):
    device_pool, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    fill_random([host.kv_buffer], torch.Generator().manual_seed(8))
    before = _snapshot(device_pool, host)
    tokens = page_token_indices(torch.tensor([1])).to(device)
    match = "--hicache-io-backend kernel or direct"
    with pytest.raises(BlockScaledHiCacheConfigError, match=match):
        host.backup_from_device_all_layer(
            device_pool, tokens.cpu(), tokens, "kernel_ascend"
        )
    with pytest.raises(BlockScaledHiCacheConfigError, match=match):
        host.load_to_device_per_layer(device_pool, tokens, tokens, 0, "kernel_ascend")
    assert all(
        torch.equal(a, b)
        for a, b in zip(_snapshot(device_pool, host), before, strict=True)
    )


def test_class_is_ours(make_pools):
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    # A release that builds host pools from the device pool has our class wrapped.
    assert isinstance(host, MHATokenToKVPoolMXFP8Host)
    assert isinstance(host._mover, transfer.PageChunkKernel)


@pytest.mark.parametrize(
    "direction, side",
    [("load", "device"), ("load", "host"), ("backup", "device")],
)
def test_misaligned_gpu_indices_move_nothing_and_raise_next(
    make_pools, device, direction, side
):
    """Token indices that live on the GPU are checked by the kernel itself: a
    page that is not one aligned run stays where it is, on both sides, and the
    pool's next transfer raises, naming the page (reading them on the CPU would
    synchronise every transfer)."""
    if device == "cpu":
        pytest.skip("no GPU: indices on the CPU are checked before the launch")
    device_pool, host = make_pools(heads=8, head_dim=128, layers=3, pages=2)
    fill_random([host.kv_buffer], torch.Generator().manual_seed(9))
    fill_random(
        device_buffers(device_pool), torch.Generator(device=device).manual_seed(10)
    )
    host_tokens = page_token_indices(torch.tensor([0, 1]))
    device_tokens = page_token_indices(torch.tensor([2, 1]))
    bad = host_tokens if side == "host" else device_tokens
    bad[128:] = bad[128:].flip(0)  # page 1 runs backwards from token 255
    layers = range(1) if direction == "load" else range(3)
    before = (_device_runs(device_pool, layers), _host_runs(host, layers))
    if direction == "load":
        # Layer 0 is its own group (the next call would raise).
        host.load_to_device_per_layer(
            device_pool, host_tokens.to(device), device_tokens.to(device), 0, IO_BACKEND
        )
    else:
        host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens.to(device), IO_BACKEND
        )
    torch.cuda.synchronize()
    after = (_device_runs(device_pool, layers), _host_runs(host, layers))
    moved, kept = (0, 1) if direction == "load" else (1, 0)
    # Page 0 of the transfer moved; page 1 did not, on either side, but a
    # backup through staging writes whatever its slot held to page 1's host
    # page (csrc/staged_copies.cuh): the host side never sees the refusal.
    src_page, dst_page = (0, 2) if direction == "load" else (2, 0)
    staged = direction == "backup" and getattr(host._backup_prepared, "staged", None)
    unspecified = {dst_page, 1} if staged else {dst_page}
    for part in range(4):
        assert torch.equal(
            after[moved][part][:, dst_page], before[kept][part][:, src_page]
        )
        assert torch.equal(after[kept][part], before[kept][part])
        pages = after[moved][part].shape[1]
        untouched = [p for p in range(pages) if p not in unspecified]
        assert torch.equal(
            after[moved][part][:, untouched], before[moved][part][:, untouched]
        )
    with pytest.raises(
        transfer.PageIndexError, match=f"{side} page starting at token 255"
    ):
        host.load_to_device_per_layer(
            device_pool, host_tokens.to(device), device_tokens.to(device), 0, IO_BACKEND
        )
    # Raised once: the pool serves the next transfer.
    host._mover.raise_if_refused()


@pytest.mark.parametrize("kv_cache_dtype", ["mxfp8", *FP4_FORMATS])
def test_page_head_groups_are_pages_of_fewer_heads(make_pools, device, kv_cache_dtype):
    """page_head: head group g of a heads-major page holds exactly the page of
    a rank that keeps only those heads (TP 4 against TP 2 of one model), so
    mooncake's split heads can share L3 objects across TP sizes; the split
    meta points at those bytes."""
    common = dict(head_dim=128, layers=3, pages=2, layout="page_head")
    dev4, host4 = make_pools(heads=4, kv_cache_dtype=kv_cache_dtype, **common)
    dev2, host2 = make_pools(heads=2, kv_cache_dtype=kv_cache_dtype, **common)
    fill_random(device_buffers(dev4), torch.Generator(device=device).manual_seed(12))
    for whole, half in zip(device_buffers(dev4), device_buffers(dev2), strict=True):
        # Heads 2-3 of the 4-head rank are the 2-head rank's heads.
        half.view(half.shape[0], 2, -1).copy_(whole.view(whole.shape[0], 4, -1)[:, 2:])
    host_tokens = page_token_indices(torch.tensor([1]))
    device_tokens = page_token_indices(torch.tensor([2])).to(device)
    for dev, host in ((dev4, host4), (dev2, host2)):
        host.backup_from_device_all_layer(dev, host_tokens, device_tokens, IO_BACKEND)
    if device == "cuda":
        torch.cuda.synchronize()
    assert host4.storage_format_tag == host2.storage_format_tag  # no head count
    ptrs4, sizes4 = host4.get_split_heads_page_buffer_meta(host_tokens, 2)
    ptrs2, sizes2 = host2.get_page_buffer_meta(host_tokens)
    assert sizes4 == sizes2 * 2
    raw4 = host4.kv_buffer.view(torch.uint8).view(-1)
    raw2 = host2.kv_buffer.view(torch.uint8).view(-1)
    base4, base2 = host4.kv_buffer.data_ptr(), host2.kv_buffer.data_ptr()
    # Group 1 (K, V) of the 4-head page is the 2-head page (K, V), byte for byte.
    for ptr4, ptr2, size in zip(ptrs4[2:], ptrs2, sizes2, strict=True):
        group = raw4[ptr4 - base4 :][:size]
        assert torch.equal(group.cpu(), raw2[ptr2 - base2 :][:size].cpu())
    assert not torch.equal(
        raw4[ptrs4[0] - base4 :][: sizes2[0]], raw2[ptrs2[0] - base2 :][: sizes2[0]]
    )
