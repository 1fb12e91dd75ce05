"""Our host pool with one design choice undone, for ``bench --ablations``.

Each class moves the same bytes as :class:`MHATokenToKVPoolMXFP8Host` (the
tests round-trip every one of them); the bench times them side by side to show
what each choice is worth.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.kvcache import hicache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import scale_kernel
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host


class UncheckedIndicesHost(MHATokenToKVPoolMXFP8Host):
    """Our kernel without its checks of GPU-resident token indices."""

    def _init_scale_transfer(self) -> None:
        super()._init_scale_transfer()
        self._scale_kernel = scale_kernel.ScaleRowKernel(
            self.scale_geometry.row_bytes, check_gpu_indices=False
        )


class StockKernelHost(MHATokenToKVPoolMXFP8Host):
    """SGLang's all-layer kernel with prepared indices: the fallback path."""

    prefer_own_scale_kernel = False


class NarrowRowsHost(MHATokenToKVPoolMXFP8Host):
    """Page chunks of at least 128 B (the kernel's minimum) instead of 512 B."""

    scale_min_row_bytes = 128


class LoadAtLayerZeroHost(MHATokenToKVPoolMXFP8Host):
    """Every layer's scales with layer 0, a worker walking a chunk's layers:
    the load before layer groups."""

    load_walks_layers = True

    def _load_layer_groups(self) -> list[range]:
        return [range(self.target_layer_num)]


class LoadEachLayerHost(MHATokenToKVPoolMXFP8Host):
    """Each layer's scales with its own layer: one launch per layer."""

    def _load_layer_groups(self) -> list[range]:
        return [range(layer, layer + 1) for layer in range(self.target_layer_num)]


class LoadWalkLayersHost(MHATokenToKVPoolMXFP8Host):
    """Layer groups, but a load's worker walks a chunk through its group's layers."""

    load_walks_layers = True


class StagedScalesHost(MHATokenToKVPoolMXFP8Host):
    """Ours as first shipped: staged D2H, one single-layer gather per layer for H2D."""

    def _init_scale_transfer(self) -> None:
        super()._init_scale_transfer()
        self.device_k_scale_ptrs, self.device_v_scale_ptrs = self._backup_tables[2:]
        page_bytes = self.scale_geometry.page_bytes
        # The first version's host layout: one page row per layer.
        self.k_pages_host, self.v_pages_host = self.scale_host.view(
            2, self.page_num, self.layer_num, page_bytes
        )
        self.k_scale_staging, self.v_scale_staging = torch.empty(
            (2, min(self.page_num, 64), self.layer_num, page_bytes),
            dtype=torch.uint8,
            device=self._transfer_device,
        )
        # Target layers, then packed draft layers, as the host rows hold them.
        self.device_k_rows = [
            s.view(torch.uint8).view(-1, page_bytes)
            for info in self._scaled_infos
            for s in info.scales.k
        ]
        self.device_v_rows = [
            s.view(torch.uint8).view(-1, page_bytes)
            for info in self._scaled_infos
            for s in info.scales.v
        ]

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        MHATokenToKVPoolHost.backup_from_device_all_layer(
            self, device_pool, host_indices, device_indices, io_backend
        )
        ps = self.page_size
        hicache.transfer_hicache_all_layer_staged_lf_pf(
            k_ptr_src=self.device_k_scale_ptrs,
            v_ptr_src=self.device_v_scale_ptrs,
            src_indices=device_indices[::ps] // ps,
            dst_indices=host_indices[::ps] // ps,
            staging_k=self.k_scale_staging,
            staging_v=self.v_scale_staging,
            dst_k=self.k_pages_host,
            dst_v=self.v_pages_host,
            page_size=1,
        )

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
    ) -> None:
        MHATokenToKVPoolHost.load_to_device_per_layer(
            self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
        )
        ps = self.page_size
        hicache.transfer_hicache_one_layer(
            k_cache_dst=self.device_k_rows[layer_id],
            v_cache_dst=self.device_v_rows[layer_id],
            indices_dst=device_indices[::ps] // ps,
            k_cache_src=self.k_pages_host[:, layer_id],
            v_cache_src=self.v_pages_host[:, layer_id],
            indices_src=host_indices[::ps] // ps,
            element_dim=self.scale_geometry.page_bytes,
        )


ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    "stock": StockKernelHost,
    "unchecked": UncheckedIndicesHost,
    "load_at_layer0": LoadAtLayerZeroHost,
    "load_each_layer": LoadEachLayerHost,
    "load_walk_layers": LoadWalkLayersHost,
    "rows128": NarrowRowsHost,
    "v1": StagedScalesHost,
}
