"""HiCache host pool for SGLang's block-scaled KV caches: the pool owns its page.

A host page is one span: the K part (every layer's payload run then scale
run), then the V part (``page.HostPage``). Every byte moves as page chunks: a
(page, layer) run between a device page number times the run's bytes and a
host page number times the span's bytes (``transfer``). That one page serves
every host layout and io backend SGLang offers for MHA pools (the layout string
is kept, since SGLang's controller places indices by it), asymmetric K and V
heads, any payload row width, and every L3 backend that stores a page's bytes
as the pool hands them (the flat page is a view of the span).

    D2H  every layer in one call: through device staging and the copy
         engines (``transfer.StagedPageChunks``), or one launch of SM copies
         for a small transfer or GPU host indices
    H2D  layer 0 alone by SM copies, then doubling groups (1 | 2-3 | 4-7 | ...)
         merged until each carries MIN_LOAD_GROUP_BYTES and, when staged,
         pieces the copy engines move at speed; each group is issued with
         the first of its layers the transfer loads: layer 0 waits for its own
         bytes only, and a load of L layers costs at most 1 + ceil(log2 L)
         calls (one under ONE_LAUNCH_BYTES after layer 0); a packed draft
         layer comes with its own is_draft load

Contracts a caller relies on:

- Transfers are whole pages, each as its token indices in order, as HiCache
  hands them. Counts and CPU-resident indices are checked before a byte moves;
  GPU-resident index values are checked by our kernel, which moves no byte of a
  malformed page and makes the pool's next transfer raise ``PageIndexError``.
- Every byte of a transfer moves on the current stream inside the pool call,
  so the controller's completion events (per write-back, per loaded layer)
  cover payload and scales alike.
- Host indices may be on the GPU or the CPU for either direction; device
  indices on the CPU too (``--hicache-io-backend direct``). CPU indices must be
  int64.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
from sglang.srt.mem_cache.pool_host.common import (
    ALLOC_MEMORY_FUNCS,
    make_kernel_ptr_table,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.platforms import current_platform

from sglang_mxfp8_hicache import releases, transfer
from sglang_mxfp8_hicache.errors import (  # the first name, kept importable here
    BlockScaledHiCacheConfigError,
    MXFP8HiCacheConfigError,  # noqa: F401
    refusal_error,
)
from sglang_mxfp8_hicache.geometry import (
    FORMATS,
    ScaleFormat,
    ScaleGeometry,
    buffer_scale_format,
    is_packed_fp4,
)
from sglang_mxfp8_hicache.page import PARTS, HostPage
from sglang_mxfp8_hicache.refusals import (
    HEADS_MAJOR_LAYOUT,
    SERVED_IO_BACKENDS,
    HiCacheFlags,
    PageShape,
    Refused,
    plan_page,
    refusal,
)

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

logger = logging.getLogger(__name__)


def configured_io_backend() -> str | None:
    """`--hicache-io-backend` of the running server, or None outside a server."""
    from sglang.srt.runtime_context import get_memory

    try:
        return get_memory().hicache_io_backend
    except (ValueError, AttributeError):
        return None


def decode_host_receive() -> bool:
    """Whether the running server receives PD decode KV into the host pool."""
    from sglang.srt.runtime_context import get_disagg

    try:
        threshold = get_disagg().disaggregation_decode_host_receive_threshold
        return releases.decode_host_receive(threshold)
    except (ValueError, AttributeError):
        return False


MIN_LOAD_GROUP_BYTES = 1 << 20
"""The least a load's layer group after layer 0 carries (20 us at 50 GB/s): a
group costs its launch, the per-layer calls before it and the kernel's start,
some 20-30 us on an H200 host, so a smaller one gains less by arriving early
than it costs."""
ONE_LAUNCH_BYTES = 256 << 10
"""A load whose layers after layer 0 carry less moves in one launch: the link
moves them in about the time the CPU takes to issue a second launch (some
6 us), so layer 0 waits barely longer and every other layer comes sooner."""


def doubling_layer_groups(layer_num: int) -> list[range]:
    """Layers 0 | 1 | 2-3 | 4-7 | ...: a load issues each group with its first
    layer. Layer 0 then waits for its own bytes only, and every later layer is
    on the device before the forward pass reaches it (a load goes up from layer
    0), for 1 + ceil(log2 L) launches instead of one per layer."""
    starts = [0, *(1 << k for k in range(layer_num.bit_length()) if 1 << k < layer_num)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], layer_num], strict=True)]


def load_layer_groups(
    layer_num: int,
    layer_bytes: int,
    min_group_bytes: int = MIN_LOAD_GROUP_BYTES,
    one_launch_bytes: int = ONE_LAUNCH_BYTES,
    min_layers: int = 1,
) -> list[range]:
    """Layer 0 alone, then the doubling groups (``doubling_layer_groups``),
    each merged with the next until it carries ``min_group_bytes`` of a load
    whose layers are ``layer_bytes`` each and holds ``min_layers`` layers (a
    staged group's pieces are its layers of one page); a last group short of
    either joins the one before it. Every layer at once if those after layer
    0 carry less than ``one_launch_bytes``."""
    if (layer_num - 1) * layer_bytes < one_launch_bytes:
        return [range(layer_num)]

    def short(group: range) -> bool:
        return len(group) * layer_bytes < min_group_bytes or len(group) < min_layers

    first, *rest = doubling_layer_groups(layer_num)
    merged: list[range] = []
    for group in rest:
        if merged and short(merged[-1]):
            merged[-1] = range(merged[-1].start, group.stop)
        else:
            merged.append(group)
    if len(merged) > 1 and short(merged[-1]):
        tail = merged.pop()
        merged[-1] = range(merged[-1].start, tail.stop)
    return [first, *merged]


def payload_buffer_info(info: MHABufferInfo, fmt: ScaleFormat) -> MHABufferInfo:
    """``info`` as the base class must see it: no scales (they are in our
    page), and head dims the payload bytes of one head, as the device rows hold
    them. For MXFP8 that is the head dim itself; an FP4 pool reports the
    logical head dim of a uint8 payload, twice its rows."""
    itemsize = info.dtype.itemsize
    return msgspec.structs.replace(
        info,
        head_dim=fmt.payload_bytes(info.head_dim) // itemsize,
        v_head_dim=fmt.payload_bytes(info.v_head_dim) // itemsize,
        scales=None,
    )


@dataclass(frozen=True)
class _LoadPlan:
    """The layer groups of a load of one size, with their prepared tables."""

    prepared: list[object]
    group_of: dict[int, int]


@dataclass
class _LoadProgress:
    """What one load transfer has issued so far: its plan, its target layers
    and the layer groups on their way."""

    host_indices: torch.Tensor | None
    device_indices: torch.Tensor | None
    plan: _LoadPlan | None = None
    layers: set[int] = field(default_factory=set)
    groups: set[int] = field(default_factory=set)


class MHATokenToKVPoolMXFP8Host(MHATokenToKVPoolHost):
    """MHA host pool of block-scaled KV (MXFP8 and the FP4 recipes) whose page
    holds payload and scales in one span (see the module docstring); the class
    keeps the name it was introduced with for MXFP8.

    Sizing counts the scale bytes; ``kv_buffer`` is the one host allocation,
    ``(pages, span bytes)``, and ``k_buffer`` / ``v_buffer`` are its K and V
    parts.
    """

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
        # calls get_size_per_token(), so the page must exist before it runs.
        self.flags, self.page_shape, self.host_page = self._check_config(
            buffer_info,
            page_size=page_size,
            layout=layout,
            allocator_type=allocator_type,
            draft_buffer_infos=draft_buffer_infos,
            pool_label=pool_label,
        )
        fmt = self.host_page.fmt
        try:
            self._mover_factory = self._choose_mover(self.host_page, pool_label)
        except transfer.TransferUnavailable as exc:
            raise refusal_error(
                f"{exc}; run without --enable-hierarchical-cache.", fmt.name, pool_label
            ) from exc
        self._scaled_infos = (buffer_info, *draft_buffer_infos)
        try:
            # The payload staging SGLang may hand over is for its own page_first
            # kernel; this pool never uses it (the plugin keeps SGLang from
            # allocating it for our pools).
            releases.init_host_base(
                self,
                payload_buffer_info(buffer_info, fmt),
                host_to_device_ratio=host_to_device_ratio,
                host_size=host_size,
                page_size=page_size,
                layout=layout,
                pin_memory=pin_memory,
                device=device,
                allocator_type=allocator_type,
                device_capacity_tokens=device_capacity_tokens,
                start_layer=start_layer,
                end_layer=end_layer,
                draft_buffer_infos=tuple(
                    payload_buffer_info(d, fmt) for d in draft_buffer_infos
                ),
                write_back_staging=None,
                pool_label=pool_label,
                head_group_num=head_group_num,
                host_token_capacity=host_token_capacity,
            )
        except BaseException:
            self.destroy()
            raise
        self.storage_format_tag = self.host_page.storage_format_tag()
        page = self.host_page
        scale_bytes = self.size * page.scale_bytes_per_token
        seal_bytes = self.page_num * page.seal_bytes
        logger.info(
            "%s: %s HiCache host pool: --hicache-mem-layout %s and "
            "--hicache-io-backend %s are served by one owned %s page, %s; "
            "%d tokens, payload %.3f GB + scales %.3f GB (+ seal areas %.3f GB), "
            "moved as page chunks by %s; loads in up to %d layer groups%s.",
            pool_label,
            fmt.name,
            layout,
            configured_io_backend() or "kernel",
            "heads-major" if self.host_page.heads_major else "layer-major",
            self.host_page.describe(),
            self.size,
            (self.size * self.size_per_token - scale_bytes - seal_bytes) / 1e9,
            scale_bytes / 1e9,
            seal_bytes / 1e9,
            self._mover.name,
            len(self._load_plan(self._full_group_pages).prepared),
            self._describe_staging(),
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
    ) -> tuple[HiCacheFlags, PageShape, HostPage]:
        """The server's flags, the pool's shape and its page (``plan_page``), or
        the refusal, before a byte is allocated; then what only the device
        buffers tell: their format, scale layout, drafts and contiguity."""
        fmt = buffer_scale_format(buffer_info)
        name = fmt.name if fmt is not None else "block-scaled"

        def refuse(reason: str) -> BlockScaledHiCacheConfigError:
            return refusal_error(reason, name, pool_label)

        if fmt is None:
            if is_packed_fp4(buffer_info):
                raise refuse(
                    "the FP4 device pool reports no per-token scale buffers: its "
                    "scales are nvfp4's native trtllm_mha layout (SM100), which "
                    "SGLang keeps outside the buffers a host pool is given, or it "
                    "has none. A host tier would restore pages without them; use "
                    "--attention-backend flashinfer (per-token scales), or run "
                    "without --enable-hierarchical-cache."
                )
            raise refuse(
                "the device pool has no scale buffers of a format this host pool "
                f"serves (--kv-cache-dtype {', '.join(FORMATS)})."
            )
        flags = HiCacheFlags(
            kv_cache_dtype=name,
            page_size=buffer_info.page_size,
            mem_layout=layout,
            io_backend=configured_io_backend() or "kernel",
            storage_backend=allocator_type,
            decode_host_receive=decode_host_receive(),
            device_kernels=releases.hicache_device_kernels(current_platform),
        )
        shape = PageShape(
            head_num=buffer_info.head_num,
            head_dim=buffer_info.head_dim,
            v_head_dim=buffer_info.v_head_dim,
            layer_num=len(buffer_info.buffers.k) + len(draft_buffer_infos),
        )
        page = plan_page(flags, shape)
        if isinstance(page, Refused):
            raise refuse(page.reason)
        if page_size != buffer_info.page_size:
            raise refuse(
                f"host page_size {page_size} != device page_size "
                f"{buffer_info.page_size}; a host page must hold exactly one device "
                "page. Give both the same --page-size."
            )
        scales = buffer_info.scales
        heads = (buffer_info.head_num, buffer_info.head_dim, buffer_info.v_head_dim)
        for depth, draft in enumerate(draft_buffer_infos):
            # Packed MTP/NextN draft layers are tail layers of this pool's pages.
            draft_heads = (draft.head_num, draft.head_dim, draft.v_head_dim)
            if buffer_scale_format(draft) != fmt or draft_heads != heads:
                raise refuse(
                    f"packed draft layer {depth} is not a layer of the target's "
                    f"format ({name}) and heads; give the draft the target's "
                    f"--kv-cache-dtype {name}, or drop --speculative-algorithm or "
                    "--enable-hierarchical-cache."
                )
        try:  # the device scales are laid out as the planned page's
            for side, side_scales, geometry in (
                ("k", scales.k, page.k),
                ("v", scales.v, page.v),
            ):
                ScaleGeometry.from_device_scales(
                    side_scales[0],
                    fmt=fmt,
                    head_num=geometry.head_num,
                    head_dim=geometry.head_dim,
                    page_size=page_size,
                    side=side,
                )
        except ValueError as exc:
            raise refuse(str(exc)) from None
        run_bytes = dict(zip(PARTS, page.run_bytes(), strict=True))
        for info in (buffer_info, *draft_buffer_infos):
            runs = (
                *(("k_payload", b) for b in info.buffers.k),
                *(("k_scales", b) for b in info.scales.k),
                *(("v_payload", b) for b in info.buffers.v),
                *(("v_scales", b) for b in info.scales.v),
            )
            for part, buf in runs:
                if not buf.is_contiguous() or (
                    buf.numel() * buf.element_size() % run_bytes[part]
                ):
                    raise refuse(
                        f"a device {part} buffer {tuple(buf.shape)} is not whole "
                        f"contiguous pages of {run_bytes[part]} B (strided rows "
                        "of a unified KV pool, which no block-scaled device pool "
                        "builds); run without --enable-hierarchical-cache."
                    )
        return flags, shape, page

    def refusal_with_storage(self, backend: str) -> Refused | None:
        """The plan's first refusal of this pool's flags with L3 ``backend``
        (at startup, or attached at run time), or None."""
        flags = dataclasses.replace(self.flags, storage_backend=backend)
        return refusal(flags, self.page_shape)

    def get_size_per_token(self) -> int:
        return self.host_page.bytes_per_token

    def get_ksize_per_token(self) -> int:
        return self.host_page.k_part.span_bytes // self.page_size

    def init_kv_buffer(self) -> torch.Tensor:
        """One allocation of whole page spans, registered page by page."""
        span = self.host_page.span_bytes
        return ALLOC_MEMORY_FUNCS[self._transfer_device.type](
            (self.page_num, span // self.dtype.itemsize),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
            allocator=self.allocator,
            registration_granularity_bytes=span,
        )

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[
            :, : self.host_page.k_part.span_bytes // self.dtype.itemsize
        ]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[
            :, self.host_page.k_part.span_bytes // self.dtype.itemsize :
        ]

    def _initialize_transfer_views(self, buffer_info, write_back_staging) -> None:
        """The base class's per-layer payload views and staging do not apply
        to the owned page; this builds the page-chunk tables and the mover."""
        # No per-layer host regions: PD decode host receive, which writes
        # them, is refused (``_check_config``).
        self.k_data_refs, self.v_data_refs, self.host_kv_data_refs = [], [], []
        self.can_use_jit = False
        self.staging_k_buffer = self.staging_v_buffer = None
        # SGLang's controller keeps a page_first backup's host indices on the
        # CPU when this is set; ours reads their page starts there, so nothing
        # is uploaded.
        self.can_use_write_back_jit = self.layout == "page_first"
        page = self.host_page
        (host_base,) = make_kernel_ptr_table(
            [self.kv_buffer],
            self._transfer_device,
            host_memory_registered=self.pin_memory,
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
                (*device, *(host_base + off for off in page.run_offsets(layer)))
                for layer, device in enumerate(device_bases)
            ),
            host_stride=page.span_bytes,
            page_size=self.page_size,
            parts=page.chunk_shapes(),
            heads=page.heads,
            device=torch.device(self._transfer_device),
            host_address=self.kv_buffer.data_ptr(),
            staged_layout=page.staged_layout,
        )
        self._mover = self._mover_factory(tables)
        # A staged load group's pieces are its layers of one page: groups
        # after layer 0 hold enough layers for the copy engines.
        piece = getattr(self._mover, "min_piece_bytes", 0)
        layer_piece = min(page.k_part.layer_bytes, page.v_part.layer_bytes)
        self._min_group_layers = (
            1 if page.heads_major else max(1, -(-piece // layer_piece))
        )
        # Every layer for a backup; for a load, each group of the target
        # model's layers (per load size, ``_load_plan``), and each packed draft
        # layer alone, keyed by its layer id: its load arrives as is_draft,
        # after the target layer of its depth.
        self._backup_prepared = self._mover.prepare(range(self.layer_num))
        self._page_layer_bytes = page.span_bytes // page.layer_num
        # From this many pages on, every doubling group carries the minimum.
        self._full_group_pages = -(-MIN_LOAD_GROUP_BYTES // self._page_layer_bytes)
        self._load_plans: dict[int, _LoadPlan] = {}
        self._draft_prepared = {
            layer: self._mover.prepare(range(layer, layer + 1))
            for layer in range(self.target_layer_num, self.layer_num)
        }
        self._load_progress = _LoadProgress(None, None)

    def _describe_staging(self) -> str:
        """What goes through device staging, for the pool's log line."""
        mover = self._mover
        if not isinstance(mover, transfer.StagedPageChunks):
            return ""
        said = (
            f"; transfers of {mover.min_bytes >> 20} MiB or more with host "
            "indices on the CPU go through device staging and the copy engines "
            f"({mover.staging_bytes >> 20} MiB on this GPU, shared by the "
            f"process's block-scaled host pools; {transfer.STAGING_ENV})"
        )
        if True not in self._backup_prepared.staged:
            slot = max((r.slot_bytes for r in mover.rings if r), default=0)
            said += (
                f", backups excepted: a page of {self.host_page.span_bytes / 2**20:.1f} "
                f"MiB does not fit a staging slot of {slot / 2**20:.1f} MiB (it "
                "takes pages of up to two thirds of its size)"
            )
        return said

    def _choose_mover(self, page: HostPage, pool_label: str) -> transfer.MoverFactory:
        """Our kernel if it builds, else SGLang's (``transfer.choose_mover``);
        called before the pool allocates."""
        return transfer.choose_mover(page, pool_label=pool_label)

    def _load_layer_groups(self, pages: int) -> list[range]:
        return load_layer_groups(
            self.target_layer_num,
            pages * self._page_layer_bytes,
            min_layers=self._min_group_layers,
        )

    def _load_plan(self, pages: int) -> _LoadPlan:
        """The layer groups of a load of ``pages`` pages, built once per size
        below ``_full_group_pages`` (one plan serves every size above)."""
        pages = min(pages, self._full_group_pages)
        plan = self._load_plans.get(pages)
        if plan is None:
            groups = self._load_layer_groups(pages)
            prepared = [self._mover.prepare(g) for g in groups]
            prepared[0] = transfer.loads_by_sm(prepared[0])
            plan = self._load_plans[pages] = _LoadPlan(
                prepared=prepared,
                group_of={layer: n for n, g in enumerate(groups) for layer in g},
            )
        return plan

    def _require_io(self, io_backend: str) -> None:
        if io_backend not in SERVED_IO_BACKENDS:
            raise refusal_error(
                f"pages move with --hicache-io-backend "
                f"{' or '.join(SERVED_IO_BACKENDS)}, got {io_backend!r}.",
                self.host_page.fmt.name,
                self.pool_label,
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        self._require_io(io_backend)
        self._mover.raise_if_refused()
        self._mover.move(
            self._backup_prepared, host_indices, device_indices, to_host=True
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
        """Issues ``layer_id``'s layer group with the first of its layers this
        transfer loads (``_target_load_group``), so every layer is on its way
        before its own call returns, whatever order the layer mapper gives."""
        if io_backend not in SERVED_IO_BACKENDS:
            self._require_io(io_backend)
        if is_draft:
            prepared = self._draft_prepared.get(layer_id)
        else:
            prepared = self._target_load_group(layer_id, host_indices, device_indices)
        if prepared is not None:
            self._mover.raise_if_refused()
            self._mover.move(prepared, host_indices, device_indices, to_host=False)

    def _target_load_group(self, layer_id: int, host_indices, device_indices):
        """The prepared tables of ``layer_id``'s group if this transfer has not
        issued them yet, else None.

        SGLang's engine walks transfer layer ids 0, 1, ... and each pool's
        layer mapper turns them into its own layer ids; a hybrid pool's layers
        start wherever its first mapped layer is. So no order is assumed: a
        transfer is one pair of index tensors (one ``L2Transfer``, the same
        objects for all its layers; kept referenced here, so a later pair
        cannot reuse their identity), and a layer seen again begins a new
        transfer. In ascending order from layer 0 this issues each group with
        its first layer (``load_layer_groups``).
        """
        if layer_id >= self.target_layer_num:  # a draft layer without is_draft
            return None
        progress = self._load_progress
        if (
            progress.host_indices is not host_indices
            or progress.device_indices is not device_indices
            or layer_id in progress.layers
        ):
            plan = self._load_plan(len(host_indices) // self.page_size)
            progress = self._load_progress = _LoadProgress(
                host_indices, device_indices, plan
            )
        progress.layers.add(layer_id)
        group = progress.plan.group_of[layer_id]
        if group in progress.groups:
            return None
        progress.groups.add(group)
        return progress.plan.prepared[group]

    # L3: the host page is the stored page.

    def _page_of(self, index) -> int:
        """The host page that starts at token ``index``; L3 moves whole pages."""
        index = int(index)
        if index % self.page_size or not 0 <= index < self.size:
            raise ValueError(
                f"{self.pool_label}: L3 page index {index} is not a page start "
                f"of this pool (page_size {self.page_size}, {self.size} tokens)"
            )
        return index // self.page_size

    def describe_storage_page(self) -> str:
        return self.host_page.describe()

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """The page's span, a view (no copy). ``flat=False``: its K and V parts
        as two rows, for backends that store them as two objects; with
        asymmetric heads the parts differ in size, so they come as a tuple."""
        span = self.kv_buffer[self._page_of(index)]
        if flat:
            return span
        k_part = self.host_page.k_part.span_bytes // self.dtype.itemsize
        if 2 * k_part == span.numel():
            return span.view(2, k_part)
        return span[:k_part], span[k_part:]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        # A read target for one page, pinned as SGLang's base class makes it:
        # torch caches pinned blocks, where plain pages of this size would be
        # mapped and faulted in afresh for every page read.
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
        """The host page of each page of ``indices`` (token indices of whole
        pages, on any device); raises, naming the index, on a page that does
        not start at a page boundary. In numpy: a backend asks for every L3
        batch, and torch's per-op cost would be most of a one-page get."""
        starts = indices[:: self.page_size].cpu().numpy().astype(np.int64, copy=False)
        pages, offsets = np.divmod(starts, self.page_size)
        if offsets.any():
            self._page_of(int(starts[offsets.nonzero()[0][0]]))
        return pages

    def _page_addresses(self, indices) -> np.ndarray:
        """The host address of each page of ``indices`` (``page_numbers``)."""
        span = self.host_page.span_bytes
        return self.kv_buffer.data_ptr() + self.page_numbers(indices) * span

    def get_page_buffer_meta(self, indices):
        """Per page, the K part's then the V part's host pointer and size."""
        k_part, v_part = self.host_page.k_part, self.host_page.v_part
        pointers = np.add.outer(self._page_addresses(indices), (0, k_part.span_bytes))
        sizes = [k_part.span_bytes, v_part.span_bytes] * len(pointers)
        return pointers.ravel().tolist(), sizes

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        # The one allocation covers every span a zero-copy backend reads.
        return [self.kv_buffer]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        k, v = self.host_page.k_part.span_bytes, self.host_page.v_part.span_bytes
        return (
            self.kv_buffer.data_ptr() % page_size_bytes == 0
            and k % page_size_bytes == 0
            and v % page_size_bytes == 0
        )

    def get_split_heads_page_buffer_meta(self, indices, split_factor):
        """Per page and head group, the group's K then V bytes: pointers and
        sizes (mooncake's split heads, ``page_head`` only)."""
        page = self.host_page
        heads = page.k.head_num
        if not page.heads_major or split_factor <= 0 or heads % split_factor:
            raise NotImplementedError(
                f"{self.pool_label}: {page.fmt.name} pages split into "
                f"{split_factor} head groups only with --hicache-mem-layout "
                f"{HEADS_MAJOR_LAYOUT} and a head count ({heads}) the split divides"
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
