"""Pools built as SGLang builds them, the payload-only control, a transfer's
index helpers, and the L2 round trip ``check`` runs (the tests' full round
trip is ``test/testkit/pools.py``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache.tools.sizing import PAGE_SIZE

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

IO_BACKEND = "kernel"


def build_device_pool(
    *,
    head_num: int,
    head_dim: int,
    layer_num: int,
    pages: int,
    device: str,
    page_size: int = PAGE_SIZE,
    v_head_dim: int | None = None,
    payload_dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "mxfp8",
    quant_method=None,
) -> MHATokenToKVPoolMXFP8:
    """The device pool SGLang's configurator builds for ``kv_cache_dtype`` (an FP4
    recipe's quant method by default for FlashInfer, less the checkpoint's scales),
    or with ``payload_dtype`` a plain MHA pool; page 0 is its padding page."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolMXFP8

    common = dict(size=pages * page_size, page_size=page_size, device=device)
    common.update(head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim)
    common.update(layer_num=layer_num, enable_memory_saver=False)
    if payload_dtype is not None:
        return MHATokenToKVPool(dtype=payload_dtype, **common)
    if kv_cache_dtype == "mxfp8":
        return MHATokenToKVPoolMXFP8(dtype=torch.float8_e4m3fn, **common)
    if quant_method is None:
        from sglang.srt.layers.quantization import fp4_kv_cache_quant_method as fp4

        quant_method = fp4.get_kv_cache_quant_method(
            kv_cache_dtype, num_layers=layer_num, device=device, page_size=page_size
        )
        quant_method.configure_attention_backends("flashinfer", "flashinfer")
    return MHATokenToKVPool(
        dtype=torch.float4_e2m1fn_x2, quant_method=quant_method, **common
    )


def build_host_pool(
    device_pool: MHATokenToKVPoolMXFP8,
    host_cls: type[MHATokenToKVPoolHost],
    *,
    host_to_device_ratio: float,
    pin_memory: bool,
    drafts: Sequence[MHATokenToKVPoolMXFP8] = (),
    layout: str = "page_first",
) -> MHATokenToKVPoolHost:
    """The host pool SGLang's assembler builds (from the device pool where the
    release does); ``drafts``: one-layer device pools packed as tail layers."""
    from sglang_mxfp8_hicache import releases
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

    args = (host_to_device_ratio, 0, device_pool.page_size, layout)
    if releases.builds_from_device_pool():
        if issubclass(host_cls, MHATokenToKVPoolMXFP8Host):
            host_cls = releases.built_from_device_pool(host_cls)
        drafts = dict(mtp_draft_device_pools=tuple(drafts)) if drafts else {}
        return host_cls(device_pool, *args, pin_memory=pin_memory, **drafts)
    inputs = releases.host_pool_inputs(device_pool, drafts)
    return host_cls(inputs.pop("buffer_info"), *args, pin_memory=pin_memory, **inputs)


class PayloadOnlyHost(MHATokenToKVPoolHost):
    """The payload-only control: SGLang's MHA host pool given a block-scaled pool's
    payload at its real width and no scales (what 0.5.16-0.5.20 do with MXFP8)."""

    def __init__(self, buffer_info, *args, draft_buffer_infos=(), **kwargs):
        from sglang_mxfp8_hicache import releases

        if releases.builds_from_device_pool():
            # Handed the device pool, whose scales SGLang's class never reads.
            super().__init__(buffer_info, *args, **kwargs)
            return
        super().__init__(
            _payload_only(buffer_info),
            *args,
            draft_buffer_infos=tuple(_payload_only(d) for d in draft_buffer_infos),
            **kwargs,
        )


def _payload_only(info):
    from sglang_mxfp8_hicache.geometry import buffer_scale_format
    from sglang_mxfp8_hicache.host_pool import payload_buffer_info

    fmt = buffer_scale_format(info)
    return info if fmt is None else payload_buffer_info(info, fmt)


def host_page_rows(pool: MHATokenToKVPoolHost) -> torch.Tensor:
    """A host pool's bytes with the page first, as a uint8 view: ours is
    (pages, span bytes); SGLang's page_first / layer_first payload pools are
    (pages, K/V, bytes) and (pages, K/V, layers, bytes)."""
    raw = pool.kv_buffer.view(torch.uint8)
    if raw.dim() == 2 and raw.shape[0] == pool.page_num:
        return raw
    if pool.layout == "layer_first":
        return raw.reshape(2, pool.layer_num, pool.page_num, -1).permute(2, 0, 1, 3)
    return raw.reshape(2, pool.page_num, -1).transpose(0, 1)


def fill_random(tensors: list[torch.Tensor], generator: torch.Generator) -> None:
    """Every byte of ``tensors`` uniform over 0-255 (0xFF included); CPU tensors of
    a CPU generator in place, without a copy of their size (GBs for the L3 bench)."""
    for tensor in tensors:
        raw = tensor.view(torch.uint8)
        if raw.device.type == "cpu" and generator.device.type == "cpu":
            raw.random_(0, 256, generator=generator)
            continue
        drawn = dict(dtype=torch.uint8, generator=generator, device=generator.device)
        raw.copy_(torch.randint(0, 256, raw.shape, **drawn))


def page_token_indices(pages: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)


def host_indices_for(
    host_pool: MHATokenToKVPoolHost,
    host_tokens: torch.Tensor,
    device,
    *,
    backup: bool,
    io_backend: str = IO_BACKEND,
) -> torch.Tensor:
    """A transfer's CPU host indices where SGLang's controller (with the
    plugin's hooks) puts them: on the CPU for ``direct`` io, a pool of ours and
    page_first's staged write-back (``_move_write_operation``), else on ``device``."""
    from sglang_mxfp8_hicache.plugin import keeps_cpu_host_indices

    staged_write_back = backup and host_pool.layout == "page_first"
    if staged_write_back and getattr(host_pool, "can_use_write_back_jit", False):
        return host_tokens
    ours = keeps_cpu_host_indices(io_backend, host_pool, host_tokens)
    if io_backend == "direct" or ours:
        return host_tokens
    return host_tokens.to(device)


def round_trip(device_pool, host_pool, *, pages: int, seed: int) -> tuple[bool, str]:
    """``check``'s: ``pages`` random device pages backed up to random host pages,
    the device overwritten, loaded into other pages layer by layer. Ok if they came
    back byte for byte and every other page kept its bytes; what it found."""
    device, page_size = torch.device(device_pool.device), device_pool.page_size
    rows = device_pool.size // page_size + 1  # page 0: padding
    payload = [*device_pool.k_buffer, *device_pool.v_buffer]
    tensors = payload + [*device_pool.k_scale_buffer, *device_pool.v_scale_buffer]
    split = sum(t.view(torch.uint8).numel() // rows for t in payload)
    sync = torch.get_device_module(device).synchronize

    def snapshot() -> torch.Tensor:  # [page, bytes]: the payload, then the scales
        rows_of = [t.view(torch.uint8).reshape(rows, -1) for t in tensors]
        return torch.cat(rows_of, 1).cpu()

    cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random(tensors, gen)
    fill_random([host_pool.kv_buffer], cpu)
    src, dst = (torch.randperm(rows - 1, generator=cpu) + 1)[: 2 * pages].chunk(2)
    host_pages = torch.randperm(host_pool.page_num, generator=cpu)[:pages]
    host = page_token_indices(host_pages, page_size)
    saved, host_before = snapshot(), host_page_rows(host_pool).clone()
    out = host_indices_for(host_pool, host, device, backup=True)
    src_tokens = page_token_indices(src, page_size).to(device)
    sync()
    start = time.perf_counter()
    host_pool.backup_from_device_all_layer(device_pool, out, src_tokens, IO_BACKEND)
    sync()
    backup_s = time.perf_counter() - start
    fill_random(tensors, gen)
    clobbered = snapshot()
    back = host_indices_for(host_pool, host, device, backup=False)
    dst_tokens = page_token_indices(dst, page_size).to(device)
    sync()
    start = time.perf_counter()
    for layer in range(device_pool.layer_num):
        host_pool.load_to_device_per_layer(
            device_pool, back, dst_tokens, layer, IO_BACKEND
        )
    sync()
    load_s = time.perf_counter() - start
    now, others = snapshot(), torch.ones(rows, dtype=torch.bool)
    host_others = torch.ones(host_pool.page_num, dtype=torch.bool)
    others[dst] = host_others[host_pages] = False
    payload_ok = now[dst, :split].equal(saved[src, :split])
    scales_ok = now[dst, split:].equal(saved[src, split:])
    kept = now[others].equal(clobbered[others])
    kept &= host_page_rows(host_pool)[host_others].equal(host_before[host_others])
    gb = pages * saved.shape[1] / 1e9
    return payload_ok and scales_ok and kept, (
        f"{pages} pages: backup {gb / backup_s:.1f} GB/s, load {gb / load_s:.1f} GB/s; "
        f"payload {'exact' if payload_ok else 'DIFFERS'}, scales "
        f"{'exact' if scales_ok else 'DIFFER'}, untouched pages "
        f"{'kept' if kept else 'CHANGED'}"
    )
