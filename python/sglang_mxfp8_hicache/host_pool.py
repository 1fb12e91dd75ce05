"""HiCache host pool for SGLang's block-scaled KV caches: the payload plus its scales.

MXFP8 is drawn below; the FP4 recipes (``geometry.FORMATS``) differ only in
their device tensors (payload (tokens, H, D // 2) uint8, scales one row of s =
H * D // 16 bytes per token, so a page is again one contiguous run of P * s
bytes), and the base class sees their payload at its real width
(``payload_buffer_info``).

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
         scales issued with the first of its layers the transfer loads (the
         first in order from layer 0): layer 0 waits for its own scales only,
         and a load of L layers costs 1 + ceil(log2 L) launches; a packed
         draft layer's scales come with its own is_draft load

The payload moves through the base class unchanged.

L3 storage (``file``, ``mooncake``; see ``storage``) sees a page as two parts,
K payload then K scales and V payload then V scales, each one contiguous host
span: zero-copy backends get ``[[k, k_scale], [v, v_scale]]`` pointers per page,
the flat page is the four spans in that order, and ``storage_format_tag`` puts
the format, its version and the byte geometry into SGLang's keys.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgspec
import torch
from sglang.kernels.ops.kvcache import hicache as hicache_jit
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
from sglang_mxfp8_hicache.geometry import (
    FORMATS,
    SCALE_ROW_BYTES,
    ScaleFormat,
    ScaleGeometry,
    buffer_scale_format,
    is_packed_fp4,
)
from sglang_mxfp8_hicache.scale_kernel import ScaleKernelUnavailable, ScaleRowStrides
from sglang_mxfp8_hicache.storage import NO_STORAGE, storage_refusal

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "layer_first")
"""Host payload layouts served with the ``kernel`` io backend: the scale mirror
has a layout of its own, and SGLang's JIT kernels move either payload layout."""
STORAGE_LAYOUT = "page_first"
"""The payload layout of an L3 page (``_storage_rows``)."""
SUPPORTED_IO_BACKEND = "kernel"
COMPILED_ONLY = (
    "SGLang 0.5.23 moves that payload only through sgl_kernel's compiled ops "
    "({ops}), never through its JIT kernels, and this plugin serves only paths "
    "proven with SGLang's JIT kernels"
)
REFUSED_LAYOUTS = {
    "page_head": COMPILED_ONLY.format(
        ops="transfer_kv_per_layer_ph_lf / transfer_kv_all_layer_lf_ph"
    ),
    "page_first_direct": COMPILED_ONLY.format(
        ops="the direct transfer_kv_*_direct_* copies of --hicache-io-backend direct"
    ),
}
"""Host layouts SGLang builds that this pool refuses, and why (README table)."""
STORAGE_FORMAT_VERSION = 1
"""Bumped whenever the bytes of a stored page change meaning; it is in the keys."""


class MXFP8HiCacheConfigError(ValueError):
    """A configuration this pool cannot serve; the message names the flag to change."""


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
        return get_disagg().disaggregation_decode_host_receive_threshold < 1
    except (ValueError, AttributeError):
        return False


def doubling_layer_groups(layer_num: int) -> list[range]:
    """Layers 0 | 1 | 2-3 | 4-7 | ...: a load issues each group's scales with its
    first layer. Layer 0 then waits for its own scales only, and every later
    layer's scales are on the device before its payload (a load goes up from
    layer 0), for 1 + ceil(log2 L) launches instead of one per layer."""
    starts = [0, *(1 << k for k in range(layer_num.bit_length()) if 1 << k < layer_num)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], layer_num], strict=True)]


def payload_buffer_info(info: MHABufferInfo, fmt: ScaleFormat) -> MHABufferInfo:
    """``info`` as the base class must see it: no scales (they are the
    sidecar's), and head_dim the payload bytes of one head, as the device rows
    hold them. For MXFP8 that is head_dim itself; an FP4 pool reports the
    logical head_dim of a uint8 payload, twice its rows, which would size the
    host tier and the JIT kernels' rows at twice the real payload."""
    width = fmt.payload_bytes(info.head_dim) // info.dtype.itemsize
    return msgspec.structs.replace(info, head_dim=width, v_head_dim=width, scales=None)


@dataclass
class _LoadProgress:
    """What one load transfer has issued so far: its target layers and the
    layer groups whose scales are on their way."""

    host_indices: torch.Tensor | None
    device_indices: torch.Tensor | None
    layers: set[int] = field(default_factory=set)
    groups: set[int] = field(default_factory=set)


class MHATokenToKVPoolMXFP8Host(MHATokenToKVPoolHost):
    """MHA host pool that mirrors scale pages beside the payload, for MXFP8 and
    the FP4 recipes alike (one ``ScaleGeometry`` of the pool's format); the
    class keeps the name it was introduced with for MXFP8.

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
        fmt = self.scale_geometry.fmt
        try:
            self._scale_kernel = scale_kernel.build_scale_kernel(
                self.scale_geometry.row_bytes,
                pool_label=pool_label,
                prefer_ours=self.prefer_own_scale_kernel,
            )
        except ScaleKernelUnavailable as exc:
            raise MXFP8HiCacheConfigError(
                f"{pool_label}: {fmt.name} HiCache: {exc}; run without "
                "--enable-hierarchical-cache."
            ) from exc
        self.scale_host: torch.Tensor | None = None
        # The scales are ours; the base class sees the payload alone, at its
        # real width (see payload_buffer_info).
        self._scaled_infos = (buffer_info, *draft_buffer_infos)
        try:
            super().__init__(
                payload_buffer_info(buffer_info, fmt),
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
                draft_buffer_infos=tuple(
                    payload_buffer_info(d, fmt) for d in draft_buffer_infos
                ),
                write_back_staging=write_back_staging,
                pool_label=pool_label,
                head_group_num=head_group_num,
                host_token_capacity=host_token_capacity,
            )
            self._init_scale_transfer()
            self.storage_format_tag = self.scale_geometry.storage_format_tag(
                layer_num=self.layer_num, version=STORAGE_FORMAT_VERSION
            )
            self._k_ptr, self._v_ptr, self._k_scale_ptr, self._v_scale_ptr = (
                buf.data_ptr() for buf in self.get_hybrid_pool_buffer()
            )
        except BaseException:
            self.destroy()
            raise
        scale_bytes = self.scale_host.numel()
        logger.info(
            "%s: %s HiCache host pool: %d tokens, payload %.3f GB + scales %.3f GB "
            "(%d B per page and layer for each of K and V), moved in page chunks "
            "of %d B by %s; loads in %d layer groups.",
            pool_label,
            fmt.name,
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
    ) -> ScaleGeometry:
        fmt = buffer_scale_format(buffer_info)
        name = fmt.name if fmt is not None else "block-scaled"

        def refuse(reason: str) -> MXFP8HiCacheConfigError:
            return MXFP8HiCacheConfigError(f"{pool_label}: {name} HiCache: {reason}")

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
        scales = buffer_info.scales
        interleaved = scales.layout == KVScaleLayout.MXFP8_INTERLEAVED
        if interleaved != fmt.interleaved:
            raise refuse(
                f"device scales use the {scales.layout.value!r} layout (page_size "
                f"{buffer_info.page_size}). SGLang 0.5.23 builds such MXFP8 pools "
                "but none of its write paths writes them (set_kv_buffer needs the "
                "page-interleaved layout of page_size 128), so there is nothing "
                "to serve; set --page-size 128."
            )
        if page_size != buffer_info.page_size:
            raise refuse(
                f"host page_size {page_size} != device page_size "
                f"{buffer_info.page_size}; a host page must hold exactly one device "
                "page of scales. Give both the same --page-size."
            )
        if buffer_info.head_dim != buffer_info.v_head_dim:
            raise refuse(
                f"K head_dim {buffer_info.head_dim} != V head_dim "
                f"{buffer_info.v_head_dim}: "
                + COMPILED_ONLY.format(
                    ops="the host-to-device transfer_kv_per_layer_mla_pf_lf of "
                    "asymmetric heads"
                )
                + "; run without --enable-hierarchical-cache."
            )
        if layout not in SUPPORTED_LAYOUTS:
            reason = REFUSED_LAYOUTS.get(layout, "it has no transfer path")
            raise refuse(
                f"host layout {layout!r} is not served: {reason}. Use "
                f"--hicache-mem-layout {' or '.join(SUPPORTED_LAYOUTS)} with "
                f"--hicache-io-backend {SUPPORTED_IO_BACKEND} (--hicache-io-backend "
                "direct turns the layout into page_first_direct)."
            )
        if layout != STORAGE_LAYOUT and allocator_type != NO_STORAGE:
            raise refuse(
                f"L3 storage of {name} pages needs --hicache-mem-layout "
                f"{STORAGE_LAYOUT}, got {layout!r}."
            )
        io_backend = configured_io_backend()
        if io_backend not in (None, SUPPORTED_IO_BACKEND):
            raise refuse(
                f"io backend {io_backend!r} is not served: "
                + COMPILED_ONLY.format(ops=f"the {io_backend} transfer_kv_* copies")
                + f"; use --hicache-io-backend {SUPPORTED_IO_BACKEND}."
            )
        if decode_host_receive():
            raise refuse(
                "--disaggregation-decode-host-receive-threshold < 1 receives KV "
                "into the host pool, and SGLang's decode side rejects block-scaled "
                f"({name}) KV state there whatever the host pool "
                "(StateType.BLOCK_SCALE); leave the threshold at 1."
            )
        storage_reason = storage_refusal(allocator_type, name)
        if storage_reason is not None:
            raise refuse(storage_reason)
        if not current_platform.capabilities.hicache_device_kernels:
            raise refuse(
                "the JIT HiCache kernels need a CUDA or ROCm GPU; this platform has "
                "none, run without --enable-hierarchical-cache."
            )
        device_rows = (*buffer_info.buffers.k, *buffer_info.buffers.v)
        if not all(buf.is_contiguous() for buf in device_rows):
            raise refuse(
                "device KV rows are strided (a unified KV pool), which no "
                "block-scaled device pool builds; run without "
                "--enable-hierarchical-cache."
            )
        geometry = ScaleGeometry.from_device_scales(
            scales.k[0],
            scales.v[0],
            fmt=fmt,
            head_num=buffer_info.head_num,
            head_dim=buffer_info.head_dim,
            page_size=buffer_info.page_size,
            min_row_bytes=cls.scale_min_row_bytes,
        )
        payload_row = geometry.payload_bytes_per_token
        if not hicache_jit.can_use_hicache_jit_kernel(
            element_size=payload_row, page_size=page_size
        ):
            raise refuse(
                f"SGLang's JIT HiCache payload kernel does not serve rows of "
                f"{payload_row} B per token, side and layer ({buffer_info.head_num} "
                f"heads of {geometry.payload_head_bytes} B; on CUDA it moves rows "
                "of whole 128 B groups, and a failed build is logged above); "
                + COMPILED_ONLY.format(ops="transfer_kv_per_layer_pf_lf")
                + ". Give each rank more KV heads (a lower --tp-size), or run "
                "without --enable-hierarchical-cache."
            )
        heads = (buffer_info.head_num, buffer_info.head_dim)
        for depth, draft in enumerate(draft_buffer_infos):
            # Packed MTP/NextN draft layers are tail layers of this pool: their
            # scales travel in the same host rows, so they must be the same.
            draft_heads = (draft.head_num, draft.head_dim)
            if buffer_scale_format(draft) != fmt or draft_heads != heads:
                raise refuse(
                    f"packed draft layer {depth} is not a layer of the target's "
                    f"format ({name}) and heads; give the draft the target's "
                    f"--kv-cache-dtype {name}, or drop --speculative-algorithm or "
                    "--enable-hierarchical-cache."
                )
            ScaleGeometry.from_device_scales(
                draft.scales.k[0],
                draft.scales.v[0],
                fmt=fmt,
                head_num=draft.head_num,
                head_dim=draft.head_dim,
                page_size=buffer_info.page_size,
                min_row_bytes=cls.scale_min_row_bytes,
            )
        return geometry

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

    def _init_scale_transfer(self) -> None:
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

        # Target layers, then packed draft layers, as the base class orders them.
        infos = self._scaled_infos
        layer_bases = (
            host_layers(self.k_scale_host),
            host_layers(self.v_scale_host),
            device_layers([k for info in infos for k in info.scales.k]),
            device_layers([v for info in infos for v in info.scales.v]),
        )

        def tables(layers: range) -> torch.Tensor:
            # [4, layers] uint64: host K, host V, device K, device V.
            bases = [side[layers.start : layers.stop] for side in layer_bases]
            return torch.tensor(bases, dtype=torch.uint64, device=device)

        # Every layer for a backup; for a load, each group of the target
        # model's layers (with each layer's group), and each packed draft layer
        # alone, keyed by its layer id: its load arrives as is_draft, after the
        # target layer of its depth.
        self._backup_tables = tables(range(self.layer_num))
        groups = self._load_layer_groups()
        self._load_group_tables = [tables(group) for group in groups]
        self._load_group_of = {
            layer: n for n, group in enumerate(groups) for layer in group
        }
        self._load_progress = _LoadProgress(None, None)
        self._draft_load_tables = {
            layer: tables(range(layer, layer + 1))
            for layer in range(self.target_layer_num, self.layer_num)
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
                "block-scaled HiCache moves scales with the JIT kernels only, got "
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
        """Payload per layer as the base class does; scales per layer group,
        issued with the first of the group's layers that the transfer loads
        (``_target_load_tables``), so they are on the device before any of
        the group's payload, whatever order the layer mapper gives."""
        self._require_kernel_io(io_backend)
        self._scale_kernel.raise_if_refused()
        if is_draft:
            group_tables = self._draft_load_tables.get(layer_id)
        else:
            group_tables = self._target_load_tables(
                layer_id, host_indices, device_indices
            )
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

    def _target_load_tables(
        self, layer_id: int, host_indices, device_indices
    ) -> torch.Tensor | None:
        """The tables of ``layer_id``'s group if this transfer has not issued
        them yet, else None.

        SGLang's engine walks transfer layer ids 0, 1, ... and each pool's
        layer mapper turns them into its own layer ids; a hybrid pool's layers
        start wherever its first mapped layer is. So no order is assumed: a
        transfer is one pair of index tensors (one ``L2Transfer``, the same
        objects for all its layers; kept referenced here, so a later pair
        cannot reuse their identity), and a layer seen again begins a new
        transfer. In ascending order from layer 0 this issues each group with
        its first layer (``doubling_layer_groups``).
        """
        group = self._load_group_of.get(layer_id)
        if group is None:  # a draft layer id without is_draft: no payload either
            return None
        progress = self._load_progress
        if (
            progress.host_indices is not host_indices
            or progress.device_indices is not device_indices
            or layer_id in progress.layers
        ):
            progress = self._load_progress = _LoadProgress(host_indices, device_indices)
        progress.layers.add(layer_id)
        if group in progress.groups:
            return None
        progress.groups.add(group)
        return self._load_group_tables[group]

    def destroy(self) -> None:
        if not getattr(self, "_destroyed", False) and self.scale_host is not None:
            # Same rule as HostKVCache.destroy(): only CUDA/ROCm registered it.
            if self.pin_memory and (is_cuda() or is_hip()):
                _cuda_host_unregister(self.scale_host)
        self.scale_host = None
        super().destroy()

    # L3 storage: a page is [K payload | K scales] [V payload | V scales].

    def _storage_page(self, index: int) -> int:
        """The host page that starts at token ``index``; L3 moves whole pages."""
        if index % self.page_size:
            raise ValueError(
                f"{self.pool_label}: L3 page index {index} is not a page start "
                f"(page_size {self.page_size})"
            )
        return index // self.page_size

    def _storage_rows(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The host page at token ``index`` as two uint8 views with one row for
        K and one for V: its payload bytes (2, P) and its scale bytes (2, S).
        Row by row, payload then scales, is the page's L3 byte order."""
        page = self._storage_page(index)
        tokens = slice(index, index + self.page_size)
        payload = self.kv_buffer[:, tokens].view(torch.uint8).view(2, -1)
        return payload, self.scale_host[:, page].view(2, -1)

    @property
    def storage_part_bytes(self) -> tuple[int, int]:
        """Bytes of one page's K (or V) payload and of its scales on L3."""
        payload = (
            self.page_size
            * self.layer_num
            * self.scale_geometry.payload_bytes_per_token
        )
        return payload, self.layer_num * self.scale_geometry.page_bytes

    def describe_storage_page(self) -> str:
        payload, scales = self.storage_part_bytes
        return (
            f"[K {payload} B | K scales {scales} B] [V {payload} B | V scales "
            f"{scales} B] per page"
        )

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """The page as one flat uint8 copy in L3 byte order (pinned like the
        read target: torch reuses pinned blocks, plain ones fault in afresh)."""
        if not flat:
            raise NotImplementedError(
                f"{self.pool_label}: a {self.scale_geometry.fmt.name} page has no "
                "non-flat shape that "
                "holds its scales; only flat pages and get_page_buffer_meta exist."
            )
        page = self.get_dummy_flat_data_page()
        torch.cat(self._storage_rows(int(index)), dim=1, out=page.view(2, -1))
        return page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        # A read target for one page, pinned as SGLang's base class makes it:
        # torch caches pinned blocks, where plain pages of this size would be
        # mapped and faulted in afresh for every page read (2x the read time
        # on an H200 host, docs/benchmarks.md).
        return torch.empty(
            2 * sum(self.storage_part_bytes),
            dtype=torch.uint8,
            pin_memory=self.pin_memory,
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        payload, scales = self._storage_rows(int(index))
        data = data_page.view(-1).view(torch.uint8)
        if data.numel() != payload.numel() + scales.numel():
            raise ValueError(
                f"{self.pool_label}: flat page of {data.numel()} bytes, a "
                f"{self.scale_geometry.fmt.name} "
                f"page of this pool is {payload.numel() + scales.numel()}: "
                f"{self.describe_storage_page()}"
            )
        rows = data.view(2, -1)
        payload.copy_(rows[:, : payload.shape[1]])
        scales.copy_(rows[:, payload.shape[1] :])

    def get_page_buffer_meta(self, indices):
        """Per page ``[k, k_scale]`` then ``[v, v_scale]`` host pointers and sizes.

        Two entries per page, as Mooncake's MHA path demands; each is a list of
        two spans, which it stores as one object, the parts concatenated. The
        pointers are those of ``_storage_rows``, computed for all pages at once.
        """
        payload_bytes, scale_bytes = self.storage_part_bytes
        starts = indices[:: self.page_size].to(device="cpu", dtype=torch.int64)
        misaligned = starts[starts % self.page_size != 0]
        if len(misaligned):
            self._storage_page(int(misaligned[0]))  # raises, naming the index
        payload = starts * (payload_bytes // self.page_size)
        scales = starts // self.page_size * scale_bytes
        pointers = torch.stack(
            [
                self._k_ptr + payload,
                self._k_scale_ptr + scales,
                self._v_ptr + payload,
                self._v_scale_ptr + scales,
            ],
            dim=1,
        )
        return pointers.view(-1, 2).tolist(), [[payload_bytes, scale_bytes]] * (
            2 * len(starts)
        )

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int:
        """Bytes of one stored object: a page's K (or V) payload and its scales."""
        if split_factor != 1:
            self.get_split_heads_page_buffer_meta(None, split_factor)
        return sum(self.storage_part_bytes)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        # Every host tensor a zero-copy backend must register.
        return [self.k_buffer, self.v_buffer, self.k_scale_host, self.v_scale_host]

    def get_split_heads_page_buffer_meta(self, indices, split_factor):
        raise NotImplementedError(
            f"{self.pool_label}: {self.scale_geometry.fmt.name} pages cannot be "
            "split by heads "
            "(the page_head layout is not served)"
        )
