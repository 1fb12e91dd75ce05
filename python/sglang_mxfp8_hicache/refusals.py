"""The plan of a block-scaled host page: the page a setup gets, or why not.

:func:`plan_page` is a pure function of the server's flags
(:class:`HiCacheFlags`) and the pool's shape (:class:`PageShape`): the host page,
or the first row of the refusal table that applies. Rows on flags come first,
so every caller that knows a row's facts gets the same first refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_mxfp8_hicache import releases
from sglang_mxfp8_hicache.errors import refusal_error
from sglang_mxfp8_hicache.geometry import (
    FORMATS,
    INTERLEAVED_PAGE_SIZE,
    ScaleFormat,
    ScaleGeometry,
    buffer_scale_format,
    is_packed_fp4,
)
from sglang_mxfp8_hicache.page import PARTS, HostPage
from sglang_mxfp8_hicache.storage import NO_STORAGE, storage_refusal

if TYPE_CHECKING:
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo

SERVED_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")
"""Host layouts SGLang offers for MHA pools, all served."""
HEADS_MAJOR_LAYOUT = "page_head"
SERVED_IO_BACKENDS = ("kernel", "direct")


@dataclass(frozen=True)
class HiCacheFlags:
    kv_cache_dtype: str
    page_size: int
    mem_layout: str
    io_backend: str = "kernel"
    storage_backend: str | None = None
    decode_host_receive: bool = False
    device_kernels: bool = True

    @classmethod
    def from_server_args(cls, args: Any) -> HiCacheFlags:
        threshold = args.disaggregation_decode_host_receive_threshold
        return cls(
            kv_cache_dtype=args.kv_cache_dtype,
            page_size=args.page_size,
            mem_layout=args.hicache_mem_layout,
            io_backend=args.hicache_io_backend or "kernel",
            storage_backend=args.hicache_storage_backend,
            decode_host_receive=releases.decode_host_receive(threshold),
        )


@dataclass(frozen=True)
class PageShape:
    """One layer's K and V heads, and the layers (packed drafts included)."""

    head_num: int
    head_dim: int
    v_head_dim: int
    layer_num: int


@dataclass(frozen=True)
class Refusal:
    flag: str
    applies: Callable[[HiCacheFlags, PageShape], bool]
    reason: Callable[[HiCacheFlags, PageShape], str]
    needs_shape: bool = False


@dataclass(frozen=True)
class Refused:
    flag: str
    reason: str

    def error(self, fmt_name: str, pool_label: str | None = None):
        return refusal_error(self.reason, fmt_name, pool_label)


def _storage_reason(flags: HiCacheFlags, shape: PageShape | None) -> str | None:
    return storage_refusal(
        flags.storage_backend or NO_STORAGE,
        flags.kv_cache_dtype,
        sealed=flags.mem_layout != HEADS_MAJOR_LAYOUT,
        symmetric=shape is None or shape.head_dim == shape.v_head_dim,
    )


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "--page-size",
        lambda f, _: (
            FORMATS[f.kv_cache_dtype].interleaved
            and f.page_size != INTERLEAVED_PAGE_SIZE
        ),
        lambda f, _: (
            f"--kv-cache-dtype {f.kv_cache_dtype} at --page-size "
            f"{f.page_size}: SGLang {releases.NEWEST} builds such pools with "
            "per-token scales, but none of its write paths writes them "
            "(set_kv_buffer needs the page-interleaved scales of page_size "
            f"{INTERLEAVED_PAGE_SIZE}), so "
            f"there is nothing to serve; set --page-size {INTERLEAVED_PAGE_SIZE}."
        ),
    ),
    Refusal(
        "--hicache-mem-layout",
        lambda f, _: f.mem_layout not in SERVED_LAYOUTS,
        lambda f, _: (
            f"--hicache-mem-layout {f.mem_layout} is not served: SGLang "
            "offers it for no MHA host pool. Use --hicache-mem-layout "
            f"{', '.join(SERVED_LAYOUTS)}."
        ),
    ),
    Refusal(
        "--hicache-io-backend",
        lambda f, _: f.io_backend not in SERVED_IO_BACKENDS,
        lambda f, _: (
            f"--hicache-io-backend {f.io_backend} is not served (it is a "
            "vendor path with its own page layout); use --hicache-io-backend "
            f"{' or '.join(SERVED_IO_BACKENDS)}."
        ),
    ),
    Refusal(
        "--disaggregation-decode-host-receive-threshold",
        lambda f, _: f.decode_host_receive,
        lambda f, _: (
            "--disaggregation-decode-host-receive-threshold < 1 receives "
            "KV into the host pool, and SGLang's decode side rejects block-scaled "
            f"({f.kv_cache_dtype}) KV state there whatever the host pool "
            "(StateType.BLOCK_SCALE); leave the threshold at 1."
        ),
    ),
    Refusal(
        "--enable-hierarchical-cache",
        lambda f, _: not f.device_kernels,
        lambda f, _: (
            "the JIT HiCache kernels need a CUDA or ROCm GPU; this platform has "
            "none, run without --enable-hierarchical-cache."
        ),
    ),
    Refusal(
        "--kv-cache-dtype",
        lambda f, s: any(d % FORMATS[f.kv_cache_dtype].sf_block for d in _dims(s)),
        lambda f, s: (
            f"head_dim must be a multiple of {FORMATS[f.kv_cache_dtype].sf_block} "
            f"({f.kv_cache_dtype} keeps one scale byte per "
            f"{FORMATS[f.kv_cache_dtype].sf_block} elements of a head), got "
            f"{'/'.join(map(str, _dims(s)))}; use another --kv-cache-dtype."
        ),
        needs_shape=True,
    ),
    Refusal(
        "--kv-cache-dtype",
        lambda f, s: (
            not FORMATS[f.kv_cache_dtype].interleaved and s.head_dim != s.v_head_dim
        ),
        lambda f, s: (
            f"K head_dim {s.head_dim} != V head_dim {s.v_head_dim}, and SGLang "
            f"{releases.NEWEST}'s FP4 KV pool builds V's payload and scales at K's "
            "head_dim (its quant method's create_buffers takes one head_dim), so "
            "the device V rows are not the V heads; SGLang serves no asymmetric "
            "FP4 KV cache. Use --kv-cache-dtype mxfp8 for this model."
        ),
        needs_shape=True,
    ),
    Refusal(
        "--hicache-storage-backend",
        lambda f, s: _storage_reason(f, s) is not None,
        lambda f, s: _storage_reason(f, s) or "",
    ),
)


def _dims(shape: PageShape) -> tuple[int, ...]:
    return tuple(dict.fromkeys((shape.head_dim, shape.v_head_dim)))


def refusal(flags: HiCacheFlags, shape: PageShape | None = None) -> Refused | None:
    """The first row that applies to what is known, or None."""
    for row in REFUSALS:
        if (shape is not None or not row.needs_shape) and row.applies(flags, shape):
            return Refused(row.flag, row.reason(flags, shape))
    return None


def plan_page(flags: HiCacheFlags, shape: PageShape) -> HostPage | Refused:
    refused = refusal(flags, shape)
    if refused is not None:
        return refused
    side = dict(fmt=FORMATS[flags.kv_cache_dtype], head_num=shape.head_num)
    dims = (shape.head_dim, shape.v_head_dim)
    k, v = (ScaleGeometry(head_dim=d, page_size=flags.page_size, **side) for d in dims)
    heads_major = flags.mem_layout == HEADS_MAJOR_LAYOUT
    return HostPage(k, v, layer_num=shape.layer_num, heads_major=heads_major)


def configured_io_backend() -> str | None:
    """The running server's io backend, or None outside a server."""
    from sglang.srt.runtime_context import get_memory

    try:
        return get_memory().hicache_io_backend
    except (ValueError, AttributeError):
        return None


def decode_host_receive() -> bool:
    from sglang.srt.runtime_context import get_disagg

    try:
        threshold = get_disagg().disaggregation_decode_host_receive_threshold
        return releases.decode_host_receive(threshold)
    except (ValueError, AttributeError):
        return False


def platform_kernels() -> bool:
    from sglang.srt.platforms import current_platform

    return releases.hicache_device_kernels(current_platform)


def buffer_format(info: MHABufferInfo, pool_label: str) -> ScaleFormat:
    """The device pool's format, or the refusal of a pool without scales."""
    fmt = buffer_scale_format(info)
    if fmt is not None:
        return fmt
    if is_packed_fp4(info):
        reason = (
            "the FP4 device pool reports no per-token scale buffers: its "
            "scales are nvfp4's native trtllm_mha layout (SM100), which "
            "SGLang keeps outside the buffers a host pool is given, or it "
            "has none. A host tier would restore pages without them; use "
            "--attention-backend flashinfer (per-token scales), or run "
            "without --enable-hierarchical-cache."
        )
    else:
        reason = (
            "the device pool has no scale buffers of a format this host pool "
            f"serves (--kv-cache-dtype {', '.join(FORMATS)})."
        )
    raise refusal_error(reason, "block-scaled", pool_label)


@dataclass(frozen=True)
class DeviceBuffers:
    """A pool's device buffers; each check gives its refusal's reason, or None."""

    info: MHABufferInfo
    drafts: Sequence[MHABufferInfo]
    page: HostPage
    page_size: int

    def page_size_reason(self) -> str | None:
        if self.page_size == self.info.page_size:
            return None
        return (
            f"host page_size {self.page_size} != device page_size "
            f"{self.info.page_size}; a host page must hold exactly one device "
            "page. Give both the same --page-size."
        )

    def drafts_reason(self) -> str | None:
        info, name = self.info, self.page.fmt.name
        heads = (info.head_num, info.head_dim, info.v_head_dim)
        for depth, draft in enumerate(self.drafts):
            draft_heads = (draft.head_num, draft.head_dim, draft.v_head_dim)
            if buffer_scale_format(draft) != self.page.fmt or draft_heads != heads:
                return (
                    f"packed draft layer {depth} is not a layer of the target's "
                    f"format ({name}) and heads; give the draft the target's "
                    f"--kv-cache-dtype {name}, or drop --speculative-algorithm or "
                    "--enable-hierarchical-cache."
                )
        return None

    def scale_layout_reason(self) -> str | None:
        page, scales = self.page, self.info.scales
        sides = zip("kv", (scales.k[0], scales.v[0]), (page.k, page.v), strict=True)
        try:
            for side, scale, geometry in sides:
                ScaleGeometry.from_device_scales(
                    scale,
                    fmt=page.fmt,
                    head_num=geometry.head_num,
                    head_dim=geometry.head_dim,
                    page_size=self.page_size,
                    side=side,
                )
        except ValueError as exc:
            return str(exc)
        return None

    def contiguity_reason(self) -> str | None:
        run_bytes = dict(zip(PARTS, self.page.run_bytes(), strict=True))
        for info in (self.info, *self.drafts):
            runs = (("k_payload", info.buffers.k), ("k_scales", info.scales.k))
            runs += (("v_payload", info.buffers.v), ("v_scales", info.scales.v))
            for part, buffers in runs:
                for buf in buffers:
                    whole = buf.numel() * buf.element_size() % run_bytes[part] == 0
                    if buf.is_contiguous() and whole:
                        continue
                    return (
                        f"a device {part} buffer {tuple(buf.shape)} is not whole "
                        f"contiguous pages of {run_bytes[part]} B (strided rows "
                        "of a unified KV pool, which no block-scaled device pool "
                        "builds); run without --enable-hierarchical-cache."
                    )
        return None


BUFFER_CHECKS = (
    DeviceBuffers.page_size_reason,
    DeviceBuffers.drafts_reason,
    DeviceBuffers.scale_layout_reason,
    DeviceBuffers.contiguity_reason,
)
"""What only the device buffers tell, in the order a refusal names it."""


def plan_pool(
    infos: Sequence[MHABufferInfo],
    page_size: int,
    layout: str,
    allocator_type: str,
    pool_label: str,
) -> tuple[HiCacheFlags, PageShape, HostPage]:
    """The flags, shape and page of a pool; raises the first refusal."""
    info, *drafts = infos
    fmt = buffer_format(info, pool_label)
    flags = HiCacheFlags(  # the pool's own, then the running server's
        kv_cache_dtype=fmt.name,
        page_size=info.page_size,
        mem_layout=layout,
        io_backend=configured_io_backend() or "kernel",
        storage_backend=allocator_type,
        decode_host_receive=decode_host_receive(),
        device_kernels=platform_kernels(),
    )
    layers = len(info.buffers.k) + len(drafts)
    shape = PageShape(info.head_num, info.head_dim, info.v_head_dim, layers)
    page = plan_page(flags, shape)
    if isinstance(page, Refused):
        raise page.error(fmt.name, pool_label)
    buffers = DeviceBuffers(info, drafts, page, page_size)
    for check in BUFFER_CHECKS:
        reason = check(buffers)
        if reason is not None:
            raise refusal_error(reason, fmt.name, pool_label)
    return flags, shape, page
