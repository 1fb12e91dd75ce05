"""The plan of a block-scaled host page: the page a setup gets, or why not.

:func:`plan_page` is a pure function of the server's flags
(:class:`HiCacheFlags`, read by the caller) and the pool's shape
(:class:`PageShape`: heads, head dims, layers). It returns the
:class:`~sglang_mxfp8_hicache.page.HostPage`, or the first row of the refusal
table that applies (:class:`Refused`: the flag an operator changes and why,
naming what to set instead). Rows on flags come first, then rows on the shape,
then the storage backend's, so every caller that knows the facts of a row gets
the same first refusal:

- the plugin, right after SGLang resolves its server arguments
  (``ServerArgs.resolve_once``, flags only): ``launch_server`` with flags the
  pool cannot serve fails within seconds, before a model loads;
- the pool's constructor (``host_pool``): flags and the device pool's shape;
  it then checks what only the device buffers tell (scale layout, drafts,
  contiguity);
- the storage factory hook (``storage``): the pool's flags and shape, with the
  backend being built;
- ``size``: the flags and the model's shape, for its bytes per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_mxfp8_hicache import releases
from sglang_mxfp8_hicache.errors import refusal_error
from sglang_mxfp8_hicache.geometry import FORMATS, INTERLEAVED_PAGE_SIZE, ScaleGeometry
from sglang_mxfp8_hicache.page import HostPage
from sglang_mxfp8_hicache.storage import NO_STORAGE, storage_refusal

SERVED_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")
"""Host layouts SGLang offers for MHA pools, all served: ``page_head`` by the
heads-major page (L3 head groups shared across TP sizes), the others by the
layer-major one; SGLang's controller places a transfer's indices by the name."""
HEADS_MAJOR_LAYOUT = "page_head"
SERVED_IO_BACKENDS = ("kernel", "direct")


@dataclass(frozen=True)
class HiCacheFlags:
    """The flags the table reads, as the server resolved them."""

    kv_cache_dtype: str
    page_size: int
    mem_layout: str
    io_backend: str = "kernel"
    storage_backend: str | None = None
    """``--hicache-storage-backend``, or None (also SGLang's "default")."""
    decode_host_receive: bool = False
    device_kernels: bool = True
    """Whether the platform runs SGLang's JIT HiCache kernels (CUDA, ROCm)."""

    @classmethod
    def from_server_args(cls, args: Any) -> HiCacheFlags:
        """From a resolved ``ServerArgs`` (or its resolving view)."""
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
    """What a pool's host page holds: one layer's K and V heads and the layers
    (packed draft layers included)."""

    head_num: int
    head_dim: int
    v_head_dim: int
    layer_num: int


@dataclass(frozen=True)
class Refusal:
    """A row of the table: the flag, when it applies, and why."""

    flag: str
    applies: Callable[[HiCacheFlags, PageShape], bool]
    reason: Callable[[HiCacheFlags, PageShape], str]
    needs_shape: bool = False


@dataclass(frozen=True)
class Refused:
    """The first row that applies to a setup: its flag and its reason."""

    flag: str
    reason: str

    def error(self, fmt_name: str, pool_label: str | None = None):
        """The error to raise (``errors.refusal_error``)."""
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
            f"{f.page_size}: SGLang 0.5.23 builds such pools with per-token scales, "
            "but none of its write paths writes them (set_kv_buffer needs the "
            f"page-interleaved scales of page_size {INTERLEAVED_PAGE_SIZE}), so "
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
            "0.5.23's FP4 KV pool builds V's payload and scales at K's head_dim "
            "(its quant method's create_buffers takes one head_dim), so the device "
            "V rows are not the V heads; SGLang serves no asymmetric FP4 KV cache. "
            "Use --kv-cache-dtype mxfp8 for this model."
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
    """The first row of the table that applies to what is known (rows on the
    shape apply only where it is), or None if none does."""
    for row in REFUSALS:
        if (shape is not None or not row.needs_shape) and row.applies(flags, shape):
            return Refused(row.flag, row.reason(flags, shape))
    return None


def plan_page(flags: HiCacheFlags, shape: PageShape) -> HostPage | Refused:
    """The host page of a pool of ``shape`` under ``flags``, or its refusal."""
    refused = refusal(flags, shape)
    if refused is not None:
        return refused
    k, v = (
        ScaleGeometry(
            head_num=shape.head_num,
            head_dim=dim,
            page_size=flags.page_size,
            fmt=FORMATS[flags.kv_cache_dtype],
        )
        for dim in (shape.head_dim, shape.v_head_dim)
    )
    return HostPage(
        k,
        v,
        layer_num=shape.layer_num,
        heads_major=flags.mem_layout == HEADS_MAJOR_LAYOUT,
    )
