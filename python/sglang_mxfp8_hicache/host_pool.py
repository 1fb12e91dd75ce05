"""HiCache host pool for SGLang's MXFP8 KV cache: the fp8 payload plus its UE8M0 scales.

Byte layouts, per pool (L layers, H KV heads, D head_dim, P = page_size = 128,
s = H * D // 32 scale bytes per token, chunks of k * s >= 512 bytes):

    device  k_buffer[l]        (tokens, H, D)                   fp8 e4m3  SGLang's MHATokenToKVPoolMXFP8
            k_scale_buffer[l]  (pages, H, 32, P // 32, D // 32) UE8M0     FA4 interleaved atom
                               = one contiguous run of P * s bytes per page
    host    kv_buffer          (2, tokens, L, H, D)             fp8       MHATokenToKVPoolHost, page_first
            scale_host         (2, pages, P // k, L, k * s)     uint8     this class, K then V

A page's scales are cut into P // k page chunks of k * s bytes. A chunk is not
the scales of k tokens (the interleaved atom puts head 0's scales for all 128
tokens first), but since a page is one contiguous run, chunk j of page p starts
at byte (p * P + j * k) * s of its layer: the token index of the page's token
j * k times s. On the host the layers of a chunk sit side by side, so the same
chunk of layer l starts at (host token) * L * s + l * k * s. Both are a token
index times a fixed stride per side, the addressing of SGLang's JIT all-layer
kernel; our kernel (``scale_kernel``, ``csrc/scale_rows.cuh``) reads every k-th
token index of the transfer itself, so no index is prepared on the CPU:

    D2H  every layer in one launch (one per 256 pages), issued before the
         payload, so that the CPU-side page checks refuse a bad backup before
         any byte moves; host indices on the CPU (the staged write-back) or
         on the GPU (without it)
    H2D  layers in doubling groups (0 | 1 | 2-3 | 4-7 | ...), each group's
         scales issued with its first layer: layer 0 waits for its own scales
         only, and a load of L layers costs 1 + ceil(log2 L) launches

The payload moves through the base class unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from sglang.srt.mem_cache.device_pool_info import KVScaleLayout
from sglang.srt.mem_cache.pool_host.common import (
    ALLOC_MEMORY_FUNCS,
    _cuda_host_unregister,
    make_kernel_ptr_table,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.platforms import current_platform
from sglang.srt.utils import is_cuda, is_hip

from sglang_mxfp8_hicache import scale_kernel
from sglang_mxfp8_hicache.geometry import SCALE_ROW_BYTES, MXFP8ScaleGeometry
from sglang_mxfp8_hicache.scale_kernel import ScaleKernelUnavailable, ScaleRowStrides

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUT = "page_first"
SUPPORTED_IO_BACKEND = "kernel"
NO_STORAGE_ALLOCATOR = "default"


class MXFP8HiCacheConfigError(ValueError):
    """A configuration this pool cannot serve; the message names the flag to change."""


def configured_io_backend() -> str | None:
    """`--hicache-io-backend` of the running server, or None outside a server."""
    from sglang.srt.runtime_context import get_memory

    try:
        return get_memory().hicache_io_backend
    except (ValueError, AttributeError):
        return None


def doubling_layer_groups(layer_num: int) -> list[range]:
    """Layers 0 | 1 | 2-3 | 4-7 | ...: a load issues each group's scales with its
    first layer. Layer 0 then waits for its own scales only, and every later
    layer's scales are on the device before its payload (a load goes up from
    layer 0), for 1 + ceil(log2 L) launches instead of one per layer."""
    starts = [0, *(1 << k for k in range(layer_num.bit_length()) if 1 << k < layer_num)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], layer_num], strict=True)]


def _storage_unsupported(method: str) -> NotImplementedError:
    return NotImplementedError(
        f"MXFP8 HiCache host pool: {method} would move the fp8 payload without its "
        "scales, so L3 storage is not supported; run without --hicache-storage-backend."
    )


class MHATokenToKVPoolMXFP8Host(MHATokenToKVPoolHost):
    """MHA host pool that mirrors MXFP8 scale pages beside the fp8 payload.

    Adds the scale sidecar and nothing else: sizing counts the scale bytes, and
    every transfer moves the scales of the same pages on the same stream as the
    payload, so the controller's completion events cover both. Transfers rely
    on what HiCache hands a pool: whole pages, each as its token indices in
    order. What the CPU can see of that is checked before any byte moves (see
    ``scale_kernel``).
    """

    scale_min_row_bytes: ClassVar[int] = SCALE_ROW_BYTES
    """Narrowest page chunk one kernel worker moves (see the geometry)."""
    prefer_own_scale_kernel: ClassVar[bool] = True
    """Our kernel if it builds; SGLang's all-layer kernel otherwise (or if False)."""
    backup_walks_layers: ClassVar[bool] = True
    """A backup's kernel worker takes one chunk through every layer, as SGLang's
    kernel does: faster than a worker per (chunk, layer) on large backups."""
    load_walks_layers: ClassVar[bool] = False
    """A load group's kernel worker takes one (chunk, layer): groups are short
    and a small load has few chunks, so walking chains PCIe round trips."""

    def __init__(
        self,
        buffer_info: MHABufferInfo,
        host_to_device_ratio: float,
        host_size: int,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        *,
        device_capacity_tokens: int,
        start_layer: int,
        end_layer: int,
        draft_buffer_infos: Sequence[MHABufferInfo] = (),
        write_back_staging: tuple[torch.Tensor, torch.Tensor] | None = None,
        pool_label: str = "kv",
        head_group_num: int = 1,
        host_token_capacity: int | None = None,
    ):
        # Everything is checked before a byte is allocated; the base constructor
        # calls get_size_per_token(), so the geometry must exist before it runs.
        self.scale_geometry = self._check_config(
            buffer_info,
            page_size=page_size,
            layout=layout,
            allocator_type=allocator_type,
            draft_buffer_infos=draft_buffer_infos,
            pool_label=pool_label,
        )
        try:
            self._scale_kernel = scale_kernel.build_scale_kernel(
                self.scale_geometry.row_bytes,
                pool_label=pool_label,
                prefer_ours=self.prefer_own_scale_kernel,
            )
        except ScaleKernelUnavailable as exc:
            raise MXFP8HiCacheConfigError(
                f"{pool_label}: MXFP8 HiCache: {exc}; run without "
                "--enable-hierarchical-cache."
            ) from exc
        self.scale_host: torch.Tensor | None = None
        try:
            super().__init__(
                buffer_info,
                host_to_device_ratio,
                host_size,
                page_size,
                layout,
                pin_memory,
                device,
                allocator_type,
                device_capacity_tokens=device_capacity_tokens,
                start_layer=start_layer,
                end_layer=end_layer,
                draft_buffer_infos=draft_buffer_infos,
                write_back_staging=write_back_staging,
                pool_label=pool_label,
                head_group_num=head_group_num,
                host_token_capacity=host_token_capacity,
            )
            self._init_scale_transfer(buffer_info)
        except BaseException:
            self.destroy()
            raise
        scale_bytes = self.scale_host.numel()
        logger.info(
            "%s: MXFP8 HiCache host pool: %d tokens, payload %.3f GB + scales %.3f GB "
            "(%d B per page and layer for each of K and V), moved in page chunks "
            "of %d B by %s; loads in %d layer groups.",
            pool_label,
            self.size,
            (self.size * self.size_per_token - scale_bytes) / 1e9,
            scale_bytes / 1e9,
            self.scale_geometry.page_bytes,
            self.scale_geometry.row_bytes,
            self._scale_kernel.name,
            len(self._load_group_tables),
        )

    @classmethod
    def _check_config(
        cls,
        buffer_info: MHABufferInfo,
        *,
        page_size: int,
        layout: str,
        allocator_type: str,
        draft_buffer_infos: Sequence[MHABufferInfo],
        pool_label: str,
    ) -> MXFP8ScaleGeometry:
        def refuse(reason: str) -> MXFP8HiCacheConfigError:
            return MXFP8HiCacheConfigError(f"{pool_label}: MXFP8 HiCache: {reason}")

        scales = buffer_info.scales
        if scales is None:
            raise refuse(
                "the device pool has no scale buffers; this host pool serves "
                "--kv-cache-dtype mxfp8 only."
            )
        if scales.layout != KVScaleLayout.MXFP8_INTERLEAVED:
            raise refuse(
                f"device scales use the {scales.layout.value!r} layout (page_size "
                f"{buffer_info.page_size}); HiCache needs the page-interleaved "
                "layout, set --page-size 128."
            )
        if page_size != buffer_info.page_size:
            raise refuse(
                f"host page_size {page_size} != device page_size "
                f"{buffer_info.page_size}; a host page must hold exactly one device "
                "page of scales. Leave --page-size at 128 for both."
            )
        if buffer_info.head_dim != buffer_info.v_head_dim:
            raise refuse(
                f"K head_dim {buffer_info.head_dim} != V head_dim "
                f"{buffer_info.v_head_dim}; no MXFP8 host pool exists for asymmetric "
                "heads, run without --enable-hierarchical-cache."
            )
        if layout != SUPPORTED_LAYOUT:
            raise refuse(
                f"host layout {layout!r} is not supported; use --hicache-mem-layout "
                f"{SUPPORTED_LAYOUT} with --hicache-io-backend {SUPPORTED_IO_BACKEND} "
                "(--hicache-io-backend direct turns the layout into page_first_direct)."
            )
        io_backend = configured_io_backend()
        if io_backend not in (None, SUPPORTED_IO_BACKEND):
            raise refuse(
                f"io backend {io_backend!r} is not supported; use "
                f"--hicache-io-backend {SUPPORTED_IO_BACKEND}."
            )
        if draft_buffer_infos:
            raise refuse(
                f"{len(draft_buffer_infos)} packed draft layer(s) (MTP/NextN "
                "speculative decoding) are not supported yet; drop "
                "--speculative-algorithm or --enable-hierarchical-cache."
            )
        if allocator_type != NO_STORAGE_ALLOCATOR:
            raise refuse(
                f"L3 storage (allocator {allocator_type!r}) would persist pages "
                "without their scales; run without --hicache-storage-backend."
            )
        if not current_platform.capabilities.hicache_device_kernels:
            raise refuse(
                "the JIT HiCache kernels need a CUDA or ROCm GPU; this platform has "
                "none, run without --enable-hierarchical-cache."
            )
        device_rows = (*buffer_info.buffers.k, *buffer_info.buffers.v)
        if not all(buf.is_contiguous() for buf in device_rows):
            raise refuse(
                "device KV rows are strided (a unified KV pool), which the MXFP8 "
                "device pool never builds; run without --enable-hierarchical-cache."
            )
        return MXFP8ScaleGeometry.from_device_scales(
            scales.k[0],
            scales.v[0],
            head_num=buffer_info.head_num,
            head_dim=buffer_info.head_dim,
            page_size=buffer_info.page_size,
            min_row_bytes=cls.scale_min_row_bytes,
        )

    def get_size_per_token(self) -> int:
        return (
            super().get_size_per_token()
            + 2 * self.scale_geometry.bytes_per_token * self.layer_num
        )

    def init_kv_buffer(self) -> torch.Tensor:
        # Scales first: if the payload allocation then fails, destroy() still
        # finds the scale mirror and releases it.
        geometry = self.scale_geometry
        page_row_bytes = self.layer_num * geometry.page_bytes
        self.scale_host = ALLOC_MEMORY_FUNCS[self._transfer_device.type](
            (
                2,
                self.page_num,
                geometry.rows_per_page,
                self.layer_num,
                geometry.row_bytes,
            ),
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
            allocator=self.allocator,
            registration_granularity_bytes=page_row_bytes,
        )
        return super().init_kv_buffer()

    def _load_layer_groups(self) -> list[range]:
        return doubling_layer_groups(self.target_layer_num)

    def _init_scale_transfer(self, buffer_info: MHABufferInfo) -> None:
        """Precompute the kernel's pointer tables and strides."""
        geometry = self.scale_geometry
        device = self._transfer_device
        self.k_scale_host, self.v_scale_host = self.scale_host

        def host_layers(host: torch.Tensor) -> list[int]:
            # Layer l's rows start l * row_bytes into each host row group.
            views = [host[:, :, layer] for layer in range(self.layer_num)]
            table = make_kernel_ptr_table(
                views, device, host_memory_registered=self.pin_memory
            )
            return table.tolist()

        def device_layers(scales: Sequence[torch.Tensor]) -> list[int]:
            return [buf.data_ptr() for buf in scales]

        layer_bases = (
            host_layers(self.k_scale_host),
            host_layers(self.v_scale_host),
            device_layers(buffer_info.scales.k),
            device_layers(buffer_info.scales.v),
        )

        def tables(layers: range) -> torch.Tensor:
            # [4, layers] uint64: host K, host V, device K, device V.
            bases = [side[layers.start : layers.stop] for side in layer_bases]
            return torch.tensor(bases, dtype=torch.uint64, device=device)

        # Every layer for a backup; for a load, each group of the target
        # model's layers, keyed by the layer it is issued with.
        self._backup_tables = tables(range(self.layer_num))
        self._load_group_tables = {
            group.start: tables(group) for group in self._load_layer_groups()
        }
        # A chunk's byte offset in its layer is a token index times these
        # strides, on either side.
        self._scale_strides = ScaleRowStrides(
            host_stride=self.layer_num * geometry.bytes_per_token,
            device_stride=geometry.bytes_per_token,
            row_tokens=geometry.row_tokens,
            page_size=self.page_size,
        )

    @staticmethod
    def _require_kernel_io(io_backend: str) -> None:
        if io_backend != SUPPORTED_IO_BACKEND:
            raise MXFP8HiCacheConfigError(
                f"MXFP8 HiCache moves scales with the JIT kernels only, got "
                f"io_backend={io_backend!r}; use --hicache-io-backend "
                f"{SUPPORTED_IO_BACKEND}."
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        self._require_kernel_io(io_backend)
        self._scale_kernel.raise_if_refused()
        # Scales first: their CPU-side checks refuse a bad backup before any
        # byte moves, and the kernel runs while the payload's work is issued.
        self._scale_kernel.backup(
            self._backup_tables,
            host_indices,
            device_indices,
            self._scale_strides,
            walk_layers=self.backup_walks_layers,
        )
        super().backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend
        )

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id,
        io_backend,
        *,
        is_draft: bool = False,
    ) -> None:
        """Payload per layer as the base class does; scales per layer group.

        SGLang's transfer engine loads a transfer's layers in order from 0 (the
        layer-done events the attention layers wait on count up), so a group's
        scales, issued before the payload of its first layer, are on the device
        before any of its layers' events (see ``doubling_layer_groups``).
        """
        self._require_kernel_io(io_backend)
        self._scale_kernel.raise_if_refused()
        group_tables = self._load_group_tables.get(layer_id)
        if group_tables is not None:
            self._scale_kernel.load(
                group_tables,
                host_indices,
                device_indices,
                self._scale_strides,
                walk_layers=self.load_walks_layers,
            )
        super().load_to_device_per_layer(
            device_pool,
            host_indices,
            device_indices,
            layer_id,
            io_backend,
            is_draft=is_draft,
        )

    def destroy(self) -> None:
        if not getattr(self, "_destroyed", False) and self.scale_host is not None:
            # Same rule as HostKVCache.destroy(): only CUDA/ROCm registered it.
            if self.pin_memory and (is_cuda() or is_hip()):
                _cuda_host_unregister(self.scale_host)
        self.scale_host = None
        super().destroy()

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise _storage_unsupported("get_data_page")

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise _storage_unsupported("get_dummy_flat_data_page")

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise _storage_unsupported("set_from_flat_data_page")

    def get_page_buffer_meta(self, indices):
        raise _storage_unsupported("get_page_buffer_meta")

    def get_split_heads_page_buffer_meta(self, indices, split_factor):
        raise _storage_unsupported("get_split_heads_page_buffer_meta")
