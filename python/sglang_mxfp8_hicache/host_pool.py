"""HiCache host pool for SGLang's block-scaled KV caches: the pool owns its page.

A host page is one span: the K part (every layer's payload run then scale
run), then the V part (``page.HostPage``). Transfers are whole pages, indices
on the GPU or the CPU (int64); a malformed page moves no byte. Every byte moves
on the current stream inside the pool call, so the controller's completion
events cover payload and scales alike.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np
import torch
from sglang.srt.mem_cache.pool_host import common
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import (
    hooks,
    loads,
    metrics,
    refusals,
    releases,
    settings,
    transfer,
)
from sglang_mxfp8_hicache.errors import refusal_error
from sglang_mxfp8_hicache.geometry import ScaleFormat
from sglang_mxfp8_hicache.page import HostPage

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

logger = logging.getLogger(__name__)


def payload_buffer_info(info: MHABufferInfo, fmt: ScaleFormat) -> MHABufferInfo:
    """``info`` as the base class sees it: no scales, payload bytes per head."""
    itemsize = info.dtype.itemsize
    return msgspec.structs.replace(
        info,
        head_dim=fmt.payload_bytes(info.head_dim) // itemsize,
        v_head_dim=fmt.payload_bytes(info.v_head_dim) // itemsize,
        scales=None,
    )


@dataclass(frozen=True)
class TransferChoice:
    """How a pool moves its pages (``mover`` None: ``transfer.choose_mover``'s)."""

    mover: transfer.MoverFactory | None = None
    layer_groups: loads.LayerGroups = loads.even_layer_groups

    def for_page(
        self, page: HostPage, staging_bytes: int, label: str
    ) -> TransferChoice:
        if self.mover is not None:
            return self
        mover = transfer.choose_mover(
            page, staging_bytes=staging_bytes, pool_label=label
        )
        return dataclasses.replace(self, mover=mover)


class MHATokenToKVPoolMXFP8Host(MHATokenToKVPoolHost):
    """MHA host pool of block-scaled KV, payload and scales in one span per page;
    named as SGLang's MXFP8 class. ``kv_buffer``: ``(pages, span bytes)``."""

    transfer_choice: ClassVar[TransferChoice] = TransferChoice()

    @classmethod
    def with_transfer(cls, choice: TransferChoice) -> type[MHATokenToKVPoolMXFP8Host]:
        body = {"transfer_choice": choice, "__module__": cls.__module__}
        return type(cls.__name__, (cls,), body)

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
        draft_buffer_infos: Sequence[MHABufferInfo] = (),
        pool_label: str = "kv",
        **base: Any,
    ):
        # All is checked before a byte is allocated; the base reads the page.
        self._scaled_infos = (buffer_info, *draft_buffer_infos)
        self.flags, self.page_shape, self.host_page = refusals.plan_pool(
            self._scaled_infos, page_size, layout, allocator_type, pool_label
        )
        self.settings = settings.current()
        hooks_account = hooks.hooks_in_force()
        self.metrics = metrics.PoolMetrics(pool_label)
        self._page_layer_bytes = sum(self.host_page.run_bytes())
        self.transfer_choice = self.transfer_choice.for_page(
            self.host_page, self.settings.staging_bytes, pool_label
        )
        self._init_base(
            host_to_device_ratio=host_to_device_ratio,
            host_size=host_size,
            page_size=page_size,
            layout=layout,
            pin_memory=pin_memory,
            device=device,
            allocator_type=allocator_type,
            pool_label=pool_label,
            **base,
        )
        self.storage_format_tag = self.host_page.storage_format_tag()
        self.metrics.staging_reserved(transfer.ring_bytes())
        page, size = self.host_page, self.size
        scale_bytes = size * page.scale_bytes_per_token
        seal_bytes = self.page_num * page.seal_bytes
        payload_bytes = size * self.size_per_token - scale_bytes - seal_bytes
        logger.info(
            "%s: %s HiCache host pool: --hicache-mem-layout %s and "
            "--hicache-io-backend %s are served by one owned %s page, %s; "
            "%d tokens, payload %.3f GB + scales %.3f GB (+ seal areas %.3f GB), "
            "moved as page chunks by %s; loads in up to %d layer groups%s; %s.",
            self.pool_label,
            page.fmt.name,
            self.layout,
            self.flags.io_backend,
            "heads-major" if page.heads_major else "layer-major",
            page.describe(),
            size,
            payload_bytes / 1e9,
            scale_bytes / 1e9,
            seal_bytes / 1e9,
            self._mover.name,
            self._loads.most_groups,
            self._mover.describe(self._backup_prepared),
            hooks_account,
        )

    def _init_base(self, **geometry: Any) -> None:
        """SGLang's constructor, given the payload alone; releases on failure."""
        payload = functools.partial(payload_buffer_info, fmt=self.host_page.fmt)
        info, *drafts = map(payload, self._scaled_infos)
        geometry.update(draft_buffer_infos=tuple(drafts), write_back_staging=None)
        try:
            releases.init_host_base(self, info, **geometry)
        except BaseException:
            self.destroy()
            raise

    def refusal_with_storage(self, backend: str) -> refusals.Refused | None:
        """The plan's first refusal of this pool with L3 ``backend``, or None."""
        flags = dataclasses.replace(self.flags, storage_backend=backend)
        return refusals.refusal(flags, self.page_shape)

    def get_size_per_token(self) -> int:
        return self.host_page.bytes_per_token

    def get_ksize_per_token(self) -> int:
        return self.host_page.k_part.span_bytes // self.page_size

    def init_kv_buffer(self) -> torch.Tensor:
        span = self.host_page.span_bytes
        return common.ALLOC_MEMORY_FUNCS[self._transfer_device.type](
            (self.page_num, span // self.dtype.itemsize),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
            allocator=self.allocator,
            registration_granularity_bytes=span,
        )

    def _parts(self, spans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.host_page.k_part.span_bytes // self.dtype.itemsize
        return spans[..., :k], spans[..., k:]

    @property
    def k_buffer(self) -> torch.Tensor:
        return self._parts(self.kv_buffer)[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self._parts(self.kv_buffer)[1]

    def _initialize_transfer_views(self, buffer_info, write_back_staging) -> None:
        """Builds the mover and load planner instead of SGLang's per-layer views."""
        self.k_data_refs, self.v_data_refs, self.host_kv_data_refs = [], [], []
        self.can_use_jit = False
        self.staging_k_buffer = self.staging_v_buffer = None
        # Keeps a page_first backup's host indices on the CPU: nothing uploads.
        self.can_use_write_back_jit = self.layout == "page_first"
        page, device = self.host_page, self._transfer_device
        (host_base,) = common.make_kernel_ptr_table(
            [self.kv_buffer], device, host_memory_registered=self.pin_memory
        ).tolist()
        device_bases = [
            (k.data_ptr(), ks.data_ptr(), v.data_ptr(), vs.data_ptr())
            for info in self._scaled_infos
            for k, ks, v, vs in zip(
                info.buffers.k,
                info.scales.k,
                info.buffers.v,
                info.scales.v,
                strict=True,
            )
        ]
        tables = transfer.PageChunkTables(
            bases=tuple(
                (*bases, *(host_base + off for off in page.run_offsets(layer)))
                for layer, bases in enumerate(device_bases)
            ),
            host_stride=page.span_bytes,
            page_size=page.page_size,
            parts=page.chunk_shapes(),
            heads=page.heads,
            device=torch.device(device),
            host_address=self.kv_buffer.data_ptr(),
            staged_layout=page.staged_layout,
        )
        self._mover = self.transfer_choice.mover(tables)
        self._backup_prepared = self._mover.prepare(range(self.layer_num))
        self._loads = loads.LoadPlanner(
            self._mover,
            self.host_page,
            target_layers=self.target_layer_num,
            layer_groups=self.transfer_choice.layer_groups,
        )

    def _require_io(self, io_backend: str) -> None:
        if io_backend not in refusals.SERVED_IO_BACKENDS:
            raise refusal_error(
                f"pages move with --hicache-io-backend "
                f"{' or '.join(refusals.SERVED_IO_BACKENDS)}, got {io_backend!r}.",
                self.host_page.fmt.name,
                self.pool_label,
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        self._require_io(io_backend)
        self._mover.raise_if_refused()
        path = self._mover.move(
            self._backup_prepared, host_indices, device_indices, to_host=True
        )
        self._count_moved(path, True, host_indices, self.layer_num)

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
        """Issues ``layer_id``'s group with the first of its layers loaded."""
        self._require_io(io_backend)
        group = self._loads.issue(
            layer_id, host_indices, device_indices, is_draft=is_draft
        )
        if group is not None:
            prepared, layers = group
            self._mover.raise_if_refused()
            path = self._mover.move(
                prepared, host_indices, device_indices, to_host=False
            )
            self._count_moved(path, False, host_indices, layers)

    def _count_moved(
        self, path: str, to_host: bool, host_indices: torch.Tensor, layers: int
    ) -> None:
        pages = len(host_indices) // self.page_size
        nbytes = pages * layers * self._page_layer_bytes
        self.metrics.moved(path, to_host, pages, nbytes)

    def _page_of(self, index) -> int:
        index = int(index)
        if index % self.page_size or not 0 <= index < self.size:
            raise ValueError(
                f"{self.pool_label}: L3 page index {index} is not a page start "
                f"of this pool (page_size {self.page_size}, {self.size} tokens)"
            )
        return index // self.page_size

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """The page's span; ``flat=False``: its K and V parts, as rows if equal."""
        span = self.kv_buffer[self._page_of(index)]
        if flat:
            return span
        k, v = self._parts(span)
        return span.view(2, -1) if k.numel() == v.numel() else (k, v)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        # Pinned as SGLang's is: torch caches pinned blocks.
        return torch.empty(
            self.kv_buffer.shape[1], dtype=self.dtype, pin_memory=self.pin_memory
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        span = self.kv_buffer[self._page_of(index)]
        data = data_page.reshape(-1).view(torch.uint8)
        if data.numel() != span.numel() * span.element_size():
            raise ValueError(
                f"{self.pool_label}: flat page of {data.numel()} bytes, a "
                f"{self.host_page.fmt.name} page of this pool is "
                f"{self.host_page.describe()}"
            )
        span.view(torch.uint8).copy_(data)

    def page_numbers(self, indices) -> np.ndarray:
        """Each page's host page; raises on one not at a page start (numpy: cheap)."""
        starts = indices[:: self.page_size].cpu().numpy().astype(np.int64, copy=False)
        pages, offsets = np.divmod(starts, self.page_size)
        if offsets.any():
            self._page_of(int(starts[offsets.nonzero()[0][0]]))
        return pages

    def _page_addresses(self, indices) -> np.ndarray:
        span = self.host_page.span_bytes
        return self.kv_buffer.data_ptr() + self.page_numbers(indices) * span

    def get_page_buffer_meta(self, indices):
        """Per page, the K part's then the V part's host pointer and size."""
        k_part, v_part = self.host_page.k_part, self.host_page.v_part
        pointers = np.add.outer(self._page_addresses(indices), (0, k_part.span_bytes))
        sizes = [k_part.span_bytes, v_part.span_bytes] * len(pointers)
        return pointers.ravel().tolist(), sizes

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.kv_buffer]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        k, v = self.host_page.k_part.span_bytes, self.host_page.v_part.span_bytes
        starts = (self.kv_buffer.data_ptr(), k, v)
        return all(start % page_size_bytes == 0 for start in starts)

    def get_split_heads_page_buffer_meta(self, indices, split_factor):
        """Per page and head group, its K then V pointers and sizes."""
        page, heads = self.host_page, self.host_page.k.head_num
        if not page.heads_major or split_factor <= 0 or heads % split_factor:
            raise NotImplementedError(
                f"{self.pool_label}: {page.fmt.name} pages split into "
                f"{split_factor} head groups only with --hicache-mem-layout "
                f"{refusals.HEADS_MAJOR_LAYOUT} and a head count ({heads}) the split divides"
            )
        group = heads // split_factor
        k_head, v_head = page.head_span_bytes()
        base = self._page_addresses(indices)
        offsets = np.arange(split_factor) * group
        k = base[:, None] + offsets * k_head
        v = base[:, None] + page.k_part.span_bytes + offsets * v_head
        pointers = np.stack([k, v], axis=2).ravel().tolist()
        sizes = [group * k_head, group * v_head] * (split_factor * len(base))
        return pointers, sizes
