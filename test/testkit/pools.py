"""What the tests build and check pools with beyond the tools' pools
(``sglang_mxfp8_hicache.tools.pools``): an FP4 recipe's quant method for any
attention backends, a device pool's tensors, and a byte-exact L2 round trip:
random bytes (0xFF included) in every device and host byte, permuted page ids,
then back pages up to the host, overwrite the whole device, load them into
other device pages layer by layer (packed drafts as SGLang's transfer engine
loads them, any layer order, either io backend), and compare payload and
scales with what was saved, and every page outside the transfer with what it
held before."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache.tools.pools import (
    IO_BACKEND,
    fill_random,
    host_indices_for,
    host_page_rows,
    page_token_indices,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8


def fp4_quant_method(
    name: str,
    *,
    layer_num: int,
    page_size: int,
    device: str,
    backends: tuple[str, str] = ("flashinfer", "flashinfer"),
    **method_kwargs,
):
    """SGLang's quant method for an FP4 recipe, configured as the configurator
    does for the (prefill, decode) ``backends`` (FlashInfer: nvfp4's per-token
    scales), less the checkpoint's scales (nvfp4's global scales stay 1);
    ``method_kwargs`` go to its constructor (nvfp4: ``native_scale_layout``)."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        get_kv_cache_quant_method,
    )

    method = get_kv_cache_quant_method(
        name, num_layers=layer_num, device=device, page_size=page_size, **method_kwargs
    )
    method.configure_attention_backends(*backends)
    return method


def device_buffers(pool: MHATokenToKVPoolMXFP8) -> list[torch.Tensor]:
    """Every per-layer payload and scale tensor of the device pool."""
    return [*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer]


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    torch.get_device_module(device).synchronize()


@dataclass(frozen=True)
class RoundTripResult:
    """What :func:`round_trip` found, and how long each direction took."""

    pages: int
    payload_restored: bool
    scales_restored: bool
    host_untouched: bool
    device_untouched: bool
    bytes_per_direction: int
    backup_seconds: float
    load_seconds: float

    @property
    def ok(self) -> bool:
        return (
            self.payload_restored
            and self.scales_restored
            and self.host_untouched
            and self.device_untouched
        )


def _device_pages(
    pool: MHATokenToKVPoolMXFP8, tensors: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each tensor as [page, bytes] rows on the CPU (the pool holds size + 1 pages)."""
    page_num = pool.size // pool.page_size + 1
    return [
        t.view(torch.uint8).reshape(page_num, -1).to("cpu", copy=True) for t in tensors
    ]


def round_trip(
    device_pool: MHATokenToKVPoolMXFP8,
    host_pool: MHATokenToKVPoolHost,
    *,
    pages: int,
    seed: int = 0,
    drafts: Sequence[MHATokenToKVPoolMXFP8] = (),
    layer_order: Sequence[int] | None = None,
    io_backend: str = IO_BACKEND,
) -> RoundTripResult:
    """Back up ``pages`` random device pages, clobber the device, load them elsewhere.

    ``drafts``: the packed draft pools of ``host_pool``. Their layers are backed
    up by the same call and loaded as SGLang's transfer engine loads them: draft
    ``d`` (``is_draft``, layer id ``target layers + d``) right after the
    ``d``-th target layer load. ``layer_order``: the target layers in load
    order (default ascending), as a hybrid pool's layer mapper may give them.
    """
    device = torch.device(device_pool.device)
    page_size = device_pool.page_size
    src_pages, dst_pages, host_pages = _pick_pages(device_pool, host_pool, pages, seed)
    pools = (device_pool, *drafts)
    device_tensors = [t for pool in pools for t in device_buffers(pool)]
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random(device_tensors, gen)
    fill_random([host_pool.kv_buffer], torch.Generator().manual_seed(seed + 1))
    index_device = "cpu" if io_backend == "direct" else device
    src_tokens = page_token_indices(src_pages, page_size).to(index_device)
    dst_tokens = page_token_indices(dst_pages, page_size).to(index_device)
    host_tokens = page_token_indices(host_pages, page_size)

    saved = _device_pages(device_pool, device_tensors)
    host_before = host_page_rows(host_pool).clone()
    backup_seconds = _timed(
        device, _back_up, host_pool, device_pool, host_tokens, src_tokens, io_backend
    )
    host_untouched = _host_untouched(host_pool, host_before, host_pages)

    fill_random(device_tensors, gen)
    clobbered = _device_pages(device_pool, device_tensors)
    host_tokens_dev = host_indices_for(
        host_pool, host_tokens, device, backup=False, io_backend=io_backend
    )
    load_seconds = _timed(
        device,
        lambda: _load_layer_by_layer(
            host_pool, pools, host_tokens_dev, dst_tokens, layer_order, io_backend
        ),
    )
    restored = _device_pages(device_pool, device_tensors)
    return RoundTripResult(
        pages=pages,
        **_compare_device(pools, saved, clobbered, restored, src_pages, dst_pages),
        host_untouched=host_untouched,
        bytes_per_direction=sum(t[0].numel() for t in saved) * pages,  # all tensors
        backup_seconds=backup_seconds,
        load_seconds=load_seconds,
    )


def _timed(device: torch.device, work, *args) -> float:
    """Seconds ``work(*args)`` took on ``device``, its queued work included."""
    synchronize(device)
    start = time.perf_counter()
    work(*args)
    synchronize(device)
    return time.perf_counter() - start


def _pick_pages(device_pool, host_pool, pages: int, seed: int):
    """``pages`` random device pages to back up, as many other device pages
    to load them into (never page 0, the padding) and ``pages`` host pages."""
    device_page_num = device_pool.size // device_pool.page_size
    host_page_num = host_pool.page_num
    if pages > min(device_page_num // 2, host_page_num):
        raise ValueError(
            f"{pages} pages do not fit {device_page_num // 2} device / {host_page_num} host pages"
        )
    cpu = torch.Generator().manual_seed(seed)
    perm = torch.randperm(device_page_num, generator=cpu) + 1
    host_pages = torch.randperm(host_page_num, generator=cpu)[:pages]
    return perm[:pages], perm[pages : 2 * pages], host_pages


def _back_up(host_pool, device_pool, host_tokens, src_tokens, io_backend) -> None:
    """Every layer's ``src_tokens`` backed up to ``host_tokens`` in one call,
    the host indices made as the controller makes them."""
    device = torch.device(device_pool.device)
    host_indices = host_indices_for(
        host_pool, host_tokens, device, backup=True, io_backend=io_backend
    )
    host_pool.backup_from_device_all_layer(
        device_pool, host_indices, src_tokens, io_backend
    )


def _load_layer_by_layer(
    host_pool, pools, host_tokens, dst_tokens, layer_order, io_backend
) -> None:
    """Every target layer of ``pools[0]`` loaded in ``layer_order`` (default
    ascending), draft ``d`` (``pools[1 + d]``) right after the ``d``-th, as
    SGLang's transfer engine loads them."""
    device_pool, *drafts = pools
    target_layers = device_pool.layer_num
    order = list(range(target_layers) if layer_order is None else layer_order)
    if sorted(order) != list(range(target_layers)):
        raise ValueError(f"layer_order {order} is not a permutation of the layers")
    for step in range(max(target_layers, len(drafts))):
        if step < target_layers:
            host_pool.load_to_device_per_layer(
                device_pool, host_tokens, dst_tokens, order[step], io_backend
            )
        if step < len(drafts):
            host_pool.load_to_device_per_layer(
                drafts[step],
                host_tokens,
                dst_tokens,
                target_layers + step,
                io_backend,
                is_draft=True,
            )


def _compare_device(pools, saved, clobbered, restored, src_pages, dst_pages):
    """Whether the ``dst_pages`` of every payload and every scale tensor of
    ``pools`` now hold what the ``src_pages`` held when ``saved``, and every
    other page what it held once ``clobbered``."""
    # device_buffers() lists each pool's 2 * layers payload tensors, then its scales.
    is_scale = [
        n >= 2 * pool.layer_num for pool in pools for n in range(4 * pool.layer_num)
    ]
    untouched = torch.ones(restored[0].shape[0], dtype=torch.bool)
    untouched[dst_pages] = False
    restored_ok = [
        torch.equal(now[dst_pages], before[src_pages])
        for now, before in zip(restored, saved, strict=True)
    ]
    return dict(
        payload_restored=all(
            ok for ok, scale in zip(restored_ok, is_scale, strict=True) if not scale
        ),
        scales_restored=all(
            ok for ok, scale in zip(restored_ok, is_scale, strict=True) if scale
        ),
        device_untouched=all(
            torch.equal(now[untouched], before[untouched])
            for now, before in zip(restored, clobbered, strict=True)
        ),
    )


def _host_untouched(
    host_pool: MHATokenToKVPoolHost, before: torch.Tensor, host_pages: torch.Tensor
) -> bool:
    """Host pages outside the backup still hold their random bytes (``before``:
    a copy of :func:`host_page_rows` taken before it)."""
    untouched = torch.ones(host_pool.page_num, dtype=torch.bool)
    untouched[host_pages] = False
    return torch.equal(host_page_rows(host_pool)[untouched], before[untouched])
