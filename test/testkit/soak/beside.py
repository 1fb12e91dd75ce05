"""SGLang's own MXFP8 host class beside ours on the same device pool
(``--beside-sglang``): an independent implementation to compare with, page
by page, while the scheduler's tree drives ours.

Every backup ours makes, SGLang's class makes too, from the same device pages
into the same host indices of its own pool; right after it, each page's
payload and scales, every layer, K and V, must be the same bytes on the
device, in our host page and in SGLang's. After each load of ours (its last
layer), the device pages it wrote must hold the bytes both host pages hold.
A host page another writer filled (an L3 prefetch) has no copy in SGLang's
pool: it is left out until a backup writes it again. SGLang's class serves
page_first MXFP8 pools without drafts, so that is where this runs.

The control (``--beside-sglang-control``) flips a scale byte of each page
SGLang's class backs up before the comparison, which must then see it.
"""

from __future__ import annotations

import torch

from testkit.soak.figures import SoakFigures
from testkit.soak.stacks import HICACHE_RATIO, PAGE

PARTS = ("K payload", "K scales", "V payload", "V scales")


class BesideSGLang:
    """SGLang's MXFP8 host pool beside ours, compared after every backup and load."""

    def __init__(
        self, cache, device_pool, figures: SoakFigures, device: str, control: bool
    ) -> None:
        from sglang.srt.mem_cache.pool_host.mha_mxfp8 import (
            MHATokenToKVPoolMXFP8Host as SGLangMXFP8Host,
        )

        from sglang_mxfp8_hicache.tools.pools import build_host_pool

        self.ours = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        self.device_pool, self.figures, self.device = device_pool, figures, device
        self.control = control
        self.theirs = build_host_pool(
            device_pool,
            SGLangMXFP8Host,
            host_to_device_ratio=HICACHE_RATIO,
            pin_memory=device != "cpu",
        )
        assert self.theirs.size >= self.ours.size, (self.theirs.size, self.ours.size)
        self.mirrored: set[int] = set()
        """Host pages whose last write was a backup both pools made."""
        self._wrap_ours()

    def _wrap_ours(self) -> None:
        """Ours' alloc, backup and load, each followed by SGLang's side of it."""
        ours, theirs = self.ours, self.theirs
        alloc = ours.alloc
        backup = ours.backup_from_device_all_layer
        load = ours.load_to_device_per_layer
        last_layer = ours.target_layer_num - 1

        def allocated(need_size: int, **kwargs):
            indices = alloc(need_size, **kwargs)
            if indices is not None:  # to be written afresh, by a backup or L3
                self.mirrored.difference_update(self._pages(indices))
            return indices

        def backed_up(device_pool, host_indices, device_indices, io_backend):
            backup(device_pool, host_indices, device_indices, io_backend)
            theirs.backup_from_device_all_layer(
                device_pool, host_indices, device_indices, io_backend
            )
            self._synchronize()
            pages = self._pages(host_indices)
            if self.control:
                theirs.k_scale_host[pages, 0, 0] ^= 0xFF
            self._compare("backup", pages, self._pages(device_indices))
            self.mirrored.update(pages)
            self.figures.beside_sglang_backed_up += len(pages)

        def loaded(device_pool, host_indices, device_indices, layer_id, *args, **kw):
            load(device_pool, host_indices, device_indices, layer_id, *args, **kw)
            if layer_id != last_layer or kw.get("is_draft"):
                return
            self._synchronize()
            pairs = [
                (h, d)
                for h, d in zip(
                    self._pages(host_indices), self._pages(device_indices), strict=True
                )
                if h in self.mirrored
            ]
            if pairs:
                hosts, devices = zip(*pairs, strict=True)
                self._compare("load", list(hosts), list(devices))
                self.figures.beside_sglang_loaded += len(pairs)

        ours.alloc = allocated
        ours.backup_from_device_all_layer = backed_up
        ours.load_to_device_per_layer = loaded

    def _synchronize(self) -> None:
        torch.get_device_module(self.device).synchronize()

    @staticmethod
    def _pages(indices: torch.Tensor) -> list[int]:
        return (indices[::PAGE] // PAGE).tolist()

    def _compare(self, what: str, host_pages: list[int], device_pages: list[int]):
        """Each page's runs, every layer: the device's, ours and SGLang's."""
        for host_page, device_page in zip(host_pages, device_pages, strict=True):
            for layer in range(self.ours.target_layer_num):
                runs = zip(
                    self._device_runs(device_page, layer),
                    self._our_runs(host_page, layer),
                    self._their_runs(host_page, layer),
                    strict=True,
                )
                for part, (device, ours, theirs) in zip(PARTS, runs, strict=True):
                    if torch.equal(device, ours) and torch.equal(device, theirs):
                        continue
                    self.figures.mismatches += 1
                    if len(self.figures.first_mismatches) >= 10:
                        continue
                    self.figures.first_mismatches.append(
                        f"beside SGLang after a {what}: host page {host_page}, "
                        f"device page {device_page}, layer {layer}, {part}: "
                        f"ours {'==' if torch.equal(device, ours) else '!='} device, "
                        f"SGLang's {'==' if torch.equal(device, theirs) else '!='} device"
                    )

    def _device_runs(self, page: int, layer: int) -> list[torch.Tensor]:
        pool = self.device_pool
        tokens = slice(page * PAGE, (page + 1) * PAGE)
        return [
            _flat(pool.k_buffer[layer][tokens]),
            _flat(pool.k_scale_buffer[layer][page]),
            _flat(pool.v_buffer[layer][tokens]),
            _flat(pool.v_scale_buffer[layer][page]),
        ]

    def _our_runs(self, page: int, layer: int) -> list[torch.Tensor]:
        host_page = self.ours.host_page
        span = self.ours.kv_buffer[page].view(torch.uint8)
        return [
            span[offset : offset + size]
            for offset, size in zip(
                host_page.run_offsets(layer), host_page.run_bytes(), strict=True
            )
        ]

    def _their_runs(self, page: int, layer: int) -> list[torch.Tensor]:
        theirs = self.theirs
        tokens = slice(page * PAGE, (page + 1) * PAGE)
        return [
            _flat(theirs.k_buffer[tokens, layer]),
            _flat(theirs.k_scale_host[page, layer]),
            _flat(theirs.v_buffer[tokens, layer]),
            _flat(theirs.v_scale_host[page, layer]),
        ]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)
