"""The staged path: page chunks through device staging and the copy engines.

Every transfer test runs on the CPU with the kernel emulations and, on a CUDA
machine, with our real kernel, SGLang's real device pools and the copy
engines. A ring whose slots hold three pages (``ring_of``) makes every
transfer several chunks through both slots; ``ForcedStaged`` drops the size
floors so every layer range that can be staged is.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from sglang_mxfp8_hicache import plugin, settings, transfer
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.geometry import FORMATS, ScaleGeometry
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import even_layer_groups
from sglang_mxfp8_hicache.page import PARTS, HostPage
from sglang_mxfp8_hicache.tools.pools import fill_random, page_token_indices
from testkit import metrics as counted
from testkit.pools import device_buffers, round_trip


class ForcedStaged(transfer.StagedPageChunks):
    """Staged wherever a layer range can be, however small the transfer."""

    min_bytes = 0
    min_piece_bytes = 0


STAGING = "SGLANG_MXFP8_HICACHE_STAGING_MB"


@pytest.fixture
def ring_of(monkeypatch):
    """``ring_of(pages)``: our pool class moving through ``ForcedStaged`` and
    new rings whose slots hold at least ``pages`` of its pages (a few more:
    the budget is whole MiB, and slot 1 starts at a page past slot 0's
    bytes)."""
    monkeypatch.setattr(transfer, "_rings", {})

    def use(pages: int):
        def mover(tables: transfer.PageChunkTables) -> ForcedStaged:
            slots = 2 * transfer.StagingRing.SLOTS  # both directions
            mib = math.ceil(slots * (pages + 1) * tables.host_stride / 2**20)
            return ForcedStaged(tables, staging_bytes=mib << 20)

        choice = TransferChoice(mover=mover)
        return MHATokenToKVPoolMXFP8Host.with_transfer(choice)

    return use


def _page(heads=2, layers=3, heads_major=False, fmt="mxfp8", v_head_dim=128):
    k, v = (
        ScaleGeometry(head_num=heads, head_dim=d, page_size=128, fmt=FORMATS[fmt])
        for d in (128, v_head_dim)
    )
    return HostPage(k, v, layer_num=layers, heads_major=heads_major)


@pytest.mark.parametrize(
    "page",
    [
        _page(),
        _page(heads=1, layers=5),
        _page(heads=3, layers=4, v_head_dim=64),
        _page(heads=2, layers=3, fmt="fp4_mx_block16"),
        _page(heads=4, layers=3, heads_major=True),
    ],
    ids=["mxfp8", "one_head", "asymmetric", "fp4", "heads_major"],
)
def test_staged_layout_holds_the_runs_the_page_holds(page):
    """A staged page built from a host page's pieces holds every run of the
    range where its layout says; a heads-major page stages all its layers
    or none."""
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (page.span_bytes,), dtype=torch.uint8, generator=gen)
    ranges = [range(page.layer_num), range(0, 1), range(1, page.layer_num)]
    for layers in ranges:
        layout = page.staged_layout(layers)
        if page.heads_major and layers != range(page.layer_num):
            assert layout is None
            continue
        staged = torch.zeros(layout.stride, dtype=torch.uint8)
        for host_at, staged_at, size in layout.pieces:
            staged[staged_at : staged_at + size] = host[host_at : host_at + size]
        sizes = page.run_bytes()
        if page.heads_major:
            # The staged page is the host page.
            assert torch.equal(staged, host)
            continue
        for n, layer in enumerate(layers):
            for part, size in enumerate(sizes):
                at, want = layout.run_offsets[n][part], page.run_offsets(layer)[part]
                assert torch.equal(staged[at : at + size], host[want : want + size]), (
                    PARTS[part],
                    layer,
                )


@pytest.mark.parametrize("stride", [4096, 270_336, 528 << 10, 1_351_680, 5 << 20])
def test_slot_pages_are_whole_staged_pages_of_either_slot(stride):
    """A slot holds ``slot_pages`` whole staged pages of ``stride`` or more:
    slot 0's from byte 0, slot 1's from the first page past slot 0's bytes,
    each within its own slot's bytes (so one slot's reuse waits only for
    that slot's last use)."""
    ring = transfer.StagingRing(
        torch.empty(2 * (10_747_904 + 4096), dtype=torch.uint8), lanes=1
    )
    half = ring.slot_bytes
    in_slot = [
        sum(
            1
            for p in range(2 * half // stride + 1)
            if s * half <= p * stride and (p + 1) * stride <= (s + 1) * half
        )
        for s in (0, 1)
    ]
    assert ring.slot_pages(stride) == min(in_slot) >= 1


def test_transfers_fill_a_slot_before_entering_the_other(
    make_pools, ring_of, device, request
):
    """Each staged chunk starts where the ring's last one ended; only a chunk
    that finds its slot full enters the other (and waits for that slot's last
    use). Loads of 9 pages whose groups fit twice in a slot: the first enters
    slot 0, the second follows it there, the third fills it and enters slot
    1. Every load restores its backup byte for byte."""
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=13, pages=9, host_cls=ring_of(20)
    )
    kernels = request.getfixturevalue("cpu_kernels") if device == "cpu" else None
    entered = []
    for seed in range(3):
        if kernels:
            kernels.placements.clear()
        result = round_trip(device_pool, host, pages=9, seed=seed)
        assert result.payload_restored and result.scales_restored
        assert result.host_untouched and result.device_untouched
        if kernels:
            load_ring = max(ring for ring, *_ in kernels.placements)  # made second
            entered.append(
                [
                    (slot, e)
                    for ring, slot, e, _ in kernels.placements
                    if ring == load_ring
                ]
            )
    if kernels:
        assert entered[0] == [(0, True)]
        assert entered[1] == [(0, False)]
        assert (1, True) in entered[2] and (0, True) not in entered[2]


@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_staging_budget_is_the_operators(make_pools, monkeypatch):
    """The pool's rings hold the staging the operator allows (512 MiB unless
    set), read through the settings; a value it does not accept refuses the
    pool, naming the variable."""
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    assert host.settings.staging_bytes == 512 << 20
    monkeypatch.setenv(STAGING, "64")
    monkeypatch.setattr(transfer, "_rings", {})
    settings.current.cache_clear()
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    assert host.settings.staging_bytes == 64 << 20
    rings = [ring for ring in transfer._rings.values() if ring is not None]
    assert sum(ring.buffer.numel() for ring in rings) == 64 << 20
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv(STAGING, bad)
        settings.current.cache_clear()
        with pytest.raises(BlockScaledHiCacheConfigError, match=STAGING):
            make_pools(heads=2, head_dim=128, layers=2, pages=2)


def test_no_staging_moves_by_sm_copies(make_pools, monkeypatch):
    monkeypatch.setenv(STAGING, "0")
    _, host = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    assert type(host._mover) is transfer.PageChunkKernel


def test_groups_hold_layers_enough_for_the_copy_engines():
    """One KV head of 128 at 128 tokens is 17 KiB per layer and side: pieces
    of 64 KiB need four layers, so a 16-page load's groups after layer 0 hold
    four layers or five where two would carry the bytes; no short last group."""
    layer, mib = 16 * 34 << 10, 1 << 20
    assert even_layer_groups(8, layer, mib, min_layers=4) == [range(0, 1), range(1, 8)]
    groups = even_layer_groups(80, layer, mib, min_layers=4)
    assert {len(g) for g in groups[1:]} == {4, 5} and len(groups) == 20
    assert even_layer_groups(8, layer, mib, min_layers=1) == [
        range(0, 1),
        range(1, 3),
        range(3, 5),
        range(5, 8),
    ]


@pytest.mark.parametrize(
    "heads, layers, pages, layout, kv_cache_dtype, drafts, v_head_dim",
    [
        (8, 4, 7, "page_first", "mxfp8", 0, None),
        (1, 3, 40, "page_first", "mxfp8", 0, None),
        (8, 13, 9, "page_first", "mxfp8", 0, None),  # groups 0 | 1-12
        (8, 4, 9, "page_first", "mxfp8", 2, None),  # packed drafts
        (8, 4, 9, "layer_first", "mxfp8", 0, None),
        (4, 3, 9, "page_head", "mxfp8", 0, None),  # whole spans only
        (4, 3, 9, "page_first", "mxfp8", 0, 64),  # asymmetric heads
        (8, 4, 9, "page_first", "fp4_mx_block16", 0, None),
        (4, 3, 9, "page_head", "nvfp4", 1, None),
    ],
    ids=str,
)
def test_round_trip_staged(
    make_pools,
    ring_of,
    heads,
    layers,
    pages,
    layout,
    kv_cache_dtype,
    drafts,
    v_head_dim,
):
    """Backups and loads through a ring of two small slots, byte for byte,
    every page outside the transfer untouched."""
    device_pool, host, draft_pools = make_pools(
        heads=heads,
        head_dim=128,
        layers=layers,
        pages=pages,
        drafts=drafts,
        layout=layout,
        kv_cache_dtype=kv_cache_dtype,
        v_head_dim=v_head_dim,
        host_cls=ring_of(3),
    )
    slot_pages = host._backup_prepared.staged[True].slot_pages
    assert 3 <= slot_pages < pages, "the transfer is not chunks through both slots"
    result = round_trip(
        device_pool, host, pages=pages, seed=pages + heads, drafts=draft_pools
    )
    assert result.payload_restored and result.scales_restored
    assert result.host_untouched and result.device_untouched


@pytest.mark.parametrize(
    "draft_first", [False, True], ids=["draft_after", "draft_first"]
)
def test_each_load_restores_the_backup_just_before_it(
    make_pools, ring_of, device, draft_first
):
    """Backup, load, a backup of other bytes to the same host pages, load
    again: on one stream, with the same index tensors and no synchronisation
    between them. Each load restores what the backup just before it saved (a
    load's copies wait for what came before it on the stream: they start
    once per load, after layer 0, or before a draft layer a hybrid stack's
    controller loads first; not each behind the load's earlier groups), and
    the pages backed up stay as they were."""
    pages, layers = 9, 15  # groups 0 | 1-7 | 8-14, each several chunks
    device_pool, host, (draft,) = make_pools(
        heads=8, head_dim=128, layers=layers, pages=pages, drafts=1, host_cls=ring_of(3)
    )
    calls: list[str] = []
    host._mover._module = _Recording(host._mover._module, calls)
    tensors = device_buffers(device_pool) + device_buffers(draft)
    gen = torch.Generator(device=device).manual_seed(11)
    hosts = page_token_indices(
        torch.randperm(host.page_num, generator=torch.Generator().manual_seed(2))[
            :pages
        ]
    )
    src = page_token_indices(torch.arange(pages) + 1).to(device)
    dst = page_token_indices(torch.arange(pages) + pages + 1).to(device)
    rows = [t.view(torch.uint8).view(2 * pages + 2, -1) for t in tensors]
    order = [(draft, layers, True)] + [(device_pool, n, False) for n in range(layers)]
    if not draft_first:  # SGLang's MHA controller: draft depth 0 after layer 0
        order[:2] = order[1::-1]
    for _ in range(2):
        fill_random(tensors, gen)
        saved = [r[1 : pages + 1].clone() for r in rows]
        calls.clear()
        host.backup_from_device_all_layer(device_pool, hosts, src, "kernel")
        for pool, layer, is_draft in order:
            host.load_to_device_per_layer(
                pool, hosts, dst, layer, "kernel", is_draft=is_draft
            )
        # The backup; the load: its copies' start after layer 0 by SM (which
        # so has the link to itself) or before the draft loaded first, then
        # the draft, layer 0 and two staged groups.
        start = ["begin_load", "staged_transfer", "transfer"]
        if not draft_first:
            start = ["transfer", "begin_load", "staged_transfer"]
        assert calls == ["staged_transfer", *start] + ["staged_transfer"] * 2
        restored = [r[pages + 1 : 2 * pages + 1].cpu() for r in rows]
        backed_up = [r[1 : pages + 1].cpu() for r in rows]
        for was, now, source in zip(saved, restored, backed_up, strict=True):
            assert torch.equal(was.cpu(), now)
            assert torch.equal(was.cpu(), source)


def test_loads_on_two_streams_share_the_ring(make_pools, ring_of, device):
    """Two pools load through the process's one ring, each on a stream of
    its own, their layer groups interleaved, the ring's slots passed several
    times: a call from another stream than the ring's last waits for that
    call's end, so no copy overwrites staged bytes a scatter of the other
    stream has yet to read. Both loads restore their backups byte for byte."""
    pages, layers = 9, 13
    built = [
        make_pools(
            heads=8, head_dim=128, layers=layers, pages=pages, host_cls=ring_of(3)
        )
        for _ in range(2)
    ]
    assert built[0][1]._mover._rings == built[1][1]._mover._rings
    src = page_token_indices(torch.arange(pages) + 1).to(device)
    dst = page_token_indices(torch.arange(pages) + pages + 1).to(device)
    hosts = page_token_indices(torch.arange(pages) + 1)
    saved = []
    for n, (device_pool, host) in enumerate(built):
        tensors = device_buffers(device_pool)
        fill_random(tensors, torch.Generator(device=device).manual_seed(20 + n))
        rows = [t.view(torch.uint8).view(2 * pages + 2, -1) for t in tensors]
        saved.append([r[1 : pages + 1].cpu() for r in rows])
        host.backup_from_device_all_layer(device_pool, hosts, src, "kernel")
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    streams = [torch.cuda.Stream() if on_gpu else None for _ in built]
    for layer in range(layers):
        for (device_pool, host), stream in zip(built, streams, strict=True):
            with torch.cuda.stream(stream) if on_gpu else nullcontext():
                host.load_to_device_per_layer(device_pool, hosts, dst, layer, "kernel")
    if on_gpu:
        torch.cuda.synchronize()
    for (device_pool, _), was in zip(built, saved, strict=True):
        rows = [
            t.view(torch.uint8).view(2 * pages + 2, -1)
            for t in device_buffers(device_pool)
        ]
        for before, row in zip(was, rows, strict=True):
            assert torch.equal(before, row[pages + 1 : 2 * pages + 1].cpu())


def test_staged_path_is_taken_for_cpu_host_indices(make_pools, device):
    """With host indices on the CPU (the controller's, with the plugin's hook)
    a transfer of 4 MiB or more goes through staging; on the GPU, by SM
    copies. The pool's counters say which path moved how much, and the
    staging it holds."""
    device_pool, host = make_pools(heads=8, head_dim=128, layers=2, pages=10)
    mover = host._mover
    assert isinstance(mover, transfer.StagedPageChunks)
    assert counted.staging_reserved() == transfer.ring_bytes(mover._rings.values()) > 0
    calls: list[str] = []
    mover._module = _Recording(mover._module, calls)
    fill_random(
        device_buffers(device_pool), torch.Generator(device=device).manual_seed(3)
    )
    tokens = page_token_indices(torch.arange(10) + 1)
    page_bytes = host.layer_num * sum(host.host_page.run_bytes())
    before = counted.moved(host.pool_label)
    host.backup_from_device_all_layer(
        device_pool, page_token_indices(torch.arange(10)), tokens.to(device), "kernel"
    )
    assert calls == ["staged_transfer"]
    moved = counted.grown(before, counted.moved(host.pool_label))
    assert moved == {("copy_engines", "backup"): (10, 10 * page_bytes)}
    if device == "cuda":
        calls.clear()
        before = counted.moved(host.pool_label)
        host.backup_from_device_all_layer(
            device_pool,
            page_token_indices(torch.arange(10)).to(device),
            tokens.to(device),
            "kernel",
        )
        assert calls == ["transfer"]
        moved = counted.grown(before, counted.moved(host.pool_label))
        assert moved == {("sm_kernel", "backup"): (10, 10 * page_bytes)}


class _Recording:
    """A kernel module that names each entry point called."""

    def __init__(self, module, calls: list[str]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name):
        target = getattr(self._module, name)

        def call(*args):
            self._calls.append(name)
            return target(*args)

        return call


@pytest.mark.parametrize("kind", ["misaligned", "partial"])
def test_staged_refuses_cpu_pages_before_a_byte_moves(
    make_pools, device, ring_of, kind
):
    device_pool, host = make_pools(
        heads=8, head_dim=128, layers=2, pages=4, host_cls=ring_of(2)
    )
    fill_random([host.kv_buffer], torch.Generator().manual_seed(3))
    before = [
        t.view(torch.uint8).cpu().clone()
        for t in (host.kv_buffer, *device_buffers(device_pool))
    ]
    host_tokens = page_token_indices(torch.tensor([0, 1, 2]))
    device_tokens = page_token_indices(torch.tensor([3, 1, 2]))
    if kind == "misaligned":
        host_tokens[256:] += 1
        match = "page 2 is not one aligned run"
    else:
        host_tokens, device_tokens = host_tokens[:320], device_tokens[:320]
        match = "are not whole pages of 128"
    with pytest.raises(RuntimeError, match=match):
        host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens.to(device), "kernel"
        )
    if device == "cuda":
        torch.cuda.synchronize()
    after = [
        t.view(torch.uint8).cpu()
        for t in (host.kv_buffer, *device_buffers(device_pool))
    ]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_controllers_keep_cpu_host_indices_for_our_pools(make_pools):
    """The plugin's hooks on the controllers' index moves: with the kernel io
    backend a pool of ours keeps its CPU host indices; any other pool, or
    another io backend, gets SGLang's own move."""
    from types import SimpleNamespace

    _, ours = make_pools(heads=2, head_dim=128, layers=2, pages=2)
    hosts = page_token_indices(torch.tensor([1]))
    devices = hosts + 128
    moved = []

    def original(controller, *args, **kwargs):
        moved.append(args)
        return "sglang's move"

    kernel = SimpleNamespace(io_backend="kernel", mem_pool_host=ours)
    assert plugin.keep_host_indices_on_cpu(original, kernel, hosts, devices) == (
        hosts,
        devices,
    )
    other = SimpleNamespace(io_backend="kernel", mem_pool_host=object())
    direct = SimpleNamespace(io_backend="direct", mem_pool_host=ours)
    for controller in (other, direct):
        assert (
            plugin.keep_host_indices_on_cpu(original, controller, hosts, devices)
            == "sglang's move"
        )
    assert plugin.keep_pool_host_indices_on_cpu(
        original, kernel, ours, hosts, devices, write_back_jit=False
    ) == (hosts, devices)
    assert (
        plugin.keep_pool_host_indices_on_cpu(
            original, kernel, object(), hosts, devices, write_back_jit=False
        )
        == "sglang's move"
    )
    assert len(moved) == 3


def test_pool_says_what_goes_through_staging(make_pools, monkeypatch, caplog):
    """The pool's one log line says how much device staging it uses, and when
    its pages do not fit a slot, that backups go by SM copies."""
    caplog.set_level("INFO", logger="sglang_mxfp8_hicache.host_pool")
    make_pools(heads=8, head_dim=128, layers=4, pages=2)
    assert "go through device staging and the copy engines (512 MiB" in caplog.text
    assert "backups excepted" not in caplog.text
    caplog.clear()
    monkeypatch.setenv(STAGING, "1")
    monkeypatch.setattr(transfer, "_rings", {})
    settings.current.cache_clear()  # a server reads it once, at start
    make_pools(heads=8, head_dim=128, layers=4, pages=2)
    assert "(1 MiB on this GPU" in caplog.text
    assert (
        "backups excepted: a page of 1.0 MiB does not fit a staging slot of 0.2 MiB"
        in caplog.text
    )
