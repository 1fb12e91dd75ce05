"""Test bodies run twice: on the CPU with the kernel emulations, and on a GPU."""

from __future__ import annotations

import pytest
import torch

from sglang_mxfp8_hicache.tools.selfcheck import IO_BACKEND, fill_random, page_token_indices


def backup_refuses_misaligned_host_page(device_pool, host) -> None:
    """A host page that is not one aligned run of tokens stops the scale backup
    before any scale row moves: the kernel reads only each page's first token."""
    device = torch.device(device_pool.device)
    fill_random([host.scale_host], torch.Generator().manual_seed(3))
    before = host.scale_host.clone()
    device_tokens = page_token_indices(torch.tensor([2, 1])).to(device)
    host_tokens = page_token_indices(torch.tensor([0, 1]))
    host_tokens[128:] = host_tokens[128:].flip(0)  # page 1 runs backwards
    with pytest.raises(RuntimeError, match="host page 1 is not one aligned run"):
        host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens, IO_BACKEND
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host.scale_host, before)


def _scale_pages(device_pool, host) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host scales as [K/V, layer, page, page bytes] on the CPU."""
    layers = range(host.layer_num)
    device = torch.stack(
        [
            torch.stack([side[layer].view(torch.uint8).flatten(1) for layer in layers])
            for side in (device_pool.k_scale_buffer, device_pool.v_scale_buffer)
        ]
    ).cpu()
    page_layer = host.scale_geometry.host_page_layer
    host_pages = torch.stack(
        [
            torch.stack([page_layer(host.scale_host[side], layer) for layer in layers])
            for side in range(2)
        ]
    )
    return device, host_pages


def scale_kernel_moves_exactly_its_rows(device_pool, host, index_dtype) -> None:
    """Our kernel alone, with ``index_dtype`` device indices: a backup, then a
    load to other device pages; the named pages' rows arrive, nothing else moves."""
    device = torch.device(device_pool.device)
    scales = [*device_pool.k_scale_buffer, *device_pool.v_scale_buffer]
    fill_random(scales, torch.Generator(device=device).manual_seed(1))
    fill_random([host.scale_host], torch.Generator().manual_seed(2))
    device_pages, host_pages = torch.tensor([4, 1, 3]), torch.tensor([2, 0, 5])
    kernel = host._scale_rows
    strides = (host._host_stride, host._device_stride, host._row_tokens)

    device_before, host_before = _scale_pages(device_pool, host)
    kernel.backup(
        host._backup_tables,
        page_token_indices(host_pages),
        page_token_indices(device_pages).to(device, index_dtype),
        *strides,
        host.page_size,
    )
    device_after, host_after = _scale_pages(device_pool, host)
    expected = host_before.clone()
    expected[:, :, host_pages] = device_before[:, :, device_pages]
    assert torch.equal(host_after, expected)
    assert torch.equal(device_after, device_before)

    fill_random(scales, torch.Generator(device=device).manual_seed(3))
    device_before, host_before = _scale_pages(device_pool, host)
    load_pages = torch.tensor([2, 5, 1])
    kernel.load(
        host._load_tables,
        page_token_indices(host_pages).to(device, index_dtype),
        page_token_indices(load_pages).to(device, index_dtype),
        *strides,
    )
    device_after, host_after = _scale_pages(device_pool, host)
    expected = device_before.clone()
    expected[:, :, load_pages] = host_before[:, :, host_pages]
    assert torch.equal(device_after, expected)
    assert torch.equal(host_after, host_before)
