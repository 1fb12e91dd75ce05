"""The movers of page chunks: our kernel, and SGLang's JIT kernel as the fallback.

A transfer moves whole pages of some layers: for each (page, layer), the four
runs of ``page.PARTS`` between a device page number times the run's bytes and
a host page number times the span's. A mover binds one pool's base addresses
(:class:`PageChunkTables`) and answers the pool as :class:`PageChunkMover`:

- :class:`PageChunkKernel` (``csrc/page_chunks.cuh``): one launch per transfer.
  It reads each page's token indices itself and checks GPU-resident ones: a
  page that is not one aligned run is not moved, and the next transfer raises
  :class:`PageIndexError` (the CPU reading them would synchronise every call).
- :class:`StagedPageChunks`: that kernel between the device pages and a device
  staging ring, and the copy engines across the link
  (``csrc/staged_copies.cuh``), so the forward pass's SMs are not held for
  the link's time.
- :class:`SGLangChunkKernels`: SGLang's JIT kernel, for when ours does not build.

All refuse, before a byte moves, a transfer whose index count is not whole
pages, and CPU index tensors whose pages are not aligned runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from sglang.kernels.jit.utils import cache_once, load_jit, make_cpp_args
from sglang.kernels.ops.kvcache import hicache

from sglang_mxfp8_hicache.errors import refusal_error
from sglang_mxfp8_hicache.page import PARTS, ChunkShape, HostPage, StagedLayout

if TYPE_CHECKING:
    from tvm_ffi.module import Module

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "page_chunks.cuh"
STAGED_SOURCE = CSRC / "staged_copies.cuh"
BLOCK_SIZE = 1024
UNROLL = 4
MAX_BLOCKS = 8
"""Thread blocks of 1024 one launch of ours may take: enough to fill the link,
few enough to leave the forward pass its SMs (``docs/benchmarks.md``)."""
VECTOR_BYTES = (16, 8, 4, 2, 1)
FALLBACK_MAX_ELEMENT = 32 * 1024
"""Largest element SGLang's JIT kernels move (its TMA kernel's row limit)."""
COPY_LANES = 8
"""Streams a staged transfer's copies are spread over: a copy of a few
hundred KiB is bound by its copy engine's per-copy cost, which engines share."""


class PageIndexError(RuntimeError):
    """A transfer named GPU token indices that are not whole aligned pages."""


class TransferUnavailable(RuntimeError):
    """Neither our kernel nor SGLang's moves these page chunks."""


def vector_bytes(sizes: Sequence[int]) -> int:
    """The widest vector that divides every run size and offset."""
    return next(v for v in VECTOR_BYTES if all(size % v == 0 for size in sizes))


@dataclass(frozen=True)
class PageChunkTables:
    """Per layer, the device base address of each run, then its host base
    address (device-accessible) in host page 0; host page h adds h *
    ``host_stride``."""

    bases: tuple[tuple[int, ...], ...]
    host_stride: int
    page_size: int
    parts: tuple[ChunkShape, ...]
    """How each part (``PARTS``) moves, ``heads`` chunks per page and layer."""
    heads: int
    device: torch.device
    host_address: int = 0
    """The CPU address of host page 0 (the copy engines' side of a staged move)."""
    staged_layout: Callable[[range], StagedLayout | None] | None = None
    """How a range of layers sits in staging (``HostPage.staged_layout``)."""

    @property
    def run_bytes(self) -> tuple[int, ...]:
        """Bytes of each part of one page and layer (all heads)."""
        return tuple(part.bytes * self.heads for part in self.parts)


def check_transfer_pages(
    host_indices: torch.Tensor, device_indices: torch.Tensor, page_size: int, what: str
) -> None:
    """Counts of whole pages, and on each CPU-resident side, every page one
    aligned run (its first and last token), as ``csrc/page_chunks.cuh`` checks."""
    count = device_indices.numel()
    if host_indices.numel() != count:
        raise RuntimeError(
            f"{what}: {host_indices.numel()} host and {count} device token indices"
        )
    if count % page_size:
        raise RuntimeError(
            f"{what}: {count} token indices are not whole pages of {page_size} tokens"
        )
    for indices in (host_indices, device_indices):
        if indices.device.type != "cpu":
            continue
        pages = indices.view(-1, page_size)
        starts = pages[:, 0]
        runs = (starts >= 0) & (starts % page_size == 0)
        runs &= pages[:, -1] == starts + page_size - 1
        bad = (~runs).nonzero()
        if bad.numel():
            page = int(bad[0])
            raise RuntimeError(
                f"{what}: page {page} is not one aligned run of {page_size} "
                f"tokens (it starts at token {int(starts[page])})"
            )


class PageChunkMover:
    """What a pool asks of its mover, which binds the pool's tables."""

    name = ""
    min_piece_bytes = 0
    """Staged pieces of fewer bytes move by SM copies; a load's layer groups
    carry at least this much of a page."""

    def __init__(self, tables: PageChunkTables) -> None:
        self._tables = tables

    def prepare(self, layers: range, *, by_sm: bool = False) -> object:
        """What ``move`` needs for these layers, made once, not per transfer;
        ``by_sm``: loads by SM copies only (a load's first group, which the
        forward pass waits for)."""
        raise NotImplementedError

    def move(self, prepared, host_indices, device_indices, *, to_host: bool) -> None:
        raise NotImplementedError

    def raise_if_refused(self) -> None:
        """Raises if an earlier launch refused a page (module docstring)."""

    def describe(self, backup: object) -> str:
        """What the pool's log line says of staging, given the pool's
        prepared ``backup`` of every layer: "" or a clause."""
        return ""


@cache_once
def page_chunks_module(vector: int) -> Module:
    """Our entry points for runs of whole ``vector``-byte words: ``transfer``
    (``csrc/page_chunks.cuh``), ``staged_transfer`` and ``create_lanes``
    (``csrc/staged_copies.cuh``)."""
    args = make_cpp_args(vector, UNROLL, BLOCK_SIZE)
    staged = f"sglang_mxfp8_hicache::StagedPageChunks<{args}>"
    return load_jit(
        "sglang_mxfp8_hicache_page_chunks",
        *args,
        cuda_files=[str(STAGED_SOURCE)],
        cuda_wrappers=[
            ("transfer", f"&sglang_mxfp8_hicache::PageChunkKernel<{args}>::transfer"),
            ("staged_transfer", f"&{staged}::transfer"),
            ("create_lanes", f"&{staged}::create_lanes"),
        ],
    )


class PageChunkKernel(PageChunkMover):
    """Ours: one FFI call and one launch per transfer."""

    name = "sglang-mxfp8-hicache page_chunks"
    max_blocks = MAX_BLOCKS

    def __init__(self, tables: PageChunkTables) -> None:
        super().__init__(tables)
        addresses = [base for layer in tables.bases for base in layer]
        fields = [field for part in tables.parts for field in part.fields()]
        self._module = page_chunks_module(
            vector_bytes([*fields, tables.host_stride, *addresses])
        )
        self._all = torch.tensor(tables.bases, dtype=torch.uint64, device=tables.device)
        self._parts = torch.tensor(fields, dtype=torch.int64).view(len(PARTS), -1)
        # Pinned, so the kernel can write it and the CPU read it without a copy.
        pinned = torch.cuda.is_available()
        self._refused = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)
        self._refused_words = self._refused.numpy()

    def prepare(self, layers: range, *, by_sm: bool = False) -> torch.Tensor:
        return self._all[layers.start : layers.stop]

    def move(self, prepared, host_indices, device_indices, *, to_host) -> None:
        tables = self._tables
        self._module.transfer(
            prepared,
            self._refused,
            host_indices,
            device_indices,
            self._parts,
            tables.heads,
            tables.host_stride,
            tables.page_size,
            to_host,
            self.max_blocks,
        )

    def raise_if_refused(self) -> None:
        side, first_token = self._refused_words.tolist()
        if not side:
            return
        self._refused.zero_()
        raise PageIndexError(
            f"an earlier block-scaled HiCache transfer named a "
            f"{('device', 'host')[side - 1]} page starting at token {first_token} "
            "that is not one aligned run of whole-page token indices: that page "
            "was not moved. HiCache hands a host pool whole pages; whatever sent "
            "these did not."
        )


@dataclass
class StagingRing:
    """Device staging of one direction on one GPU and its copy lanes, shared
    by the process's pools (a server moves one transfer per direction at a
    time)."""

    SLOTS = 2

    buffer: torch.Tensor
    lanes: int
    """The lanes' handle (a C++ ``CopyLanes``)."""

    @property
    def slot_bytes(self) -> int:
        return self.buffer.numel() // self.SLOTS

    def slot_pages(self, stride: int) -> tuple[int, int]:
        """(staged pages per slot, the staged page where slot 1 begins) for
        staged pages of ``stride`` bytes. Each slot's pages lie within its own
        half whatever the stride, so the events that order a slot's reuse hold
        for moves of any stride (layer groups, other pools) from any stream."""
        second = -(-self.slot_bytes // stride)
        return self.SLOTS * self.slot_bytes // stride - second, second


_rings: dict[tuple[str, bool], StagingRing | None] = {}


def staging_ring(
    device: torch.device, module: Module, staging_bytes: int, *, to_host: bool
) -> StagingRing | None:
    """The process's ring of ``device`` for one direction (half of
    ``staging_bytes``), made on first use; None if that leaves no slot."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), to_host)
    if key not in _rings:
        slot = staging_bytes // 2 // StagingRing.SLOTS // 4096 * 4096
        ring = None
        if slot:
            buffer = torch.empty(
                StagingRing.SLOTS * slot, dtype=torch.uint8, device=device
            )
            handle = torch.zeros(1, dtype=torch.int64)
            on_device = (
                torch.cuda.device(device) if device.type == "cuda" else nullcontext()
            )
            with on_device:  # the lanes' streams and events are made on it
                module.create_lanes(handle, COPY_LANES)
            ring = StagingRing(buffer, int(handle))
        _rings[key] = ring
    return _rings[key]


def reserve_staging(device: torch.device, staging_bytes: int) -> int:
    """Makes the process's staging rings on a CUDA ``device`` now (SGLang
    measures the KV budget after its own staging is prepared, and these then
    count against it as that would have); their bytes."""
    if device.type != "cuda" or not staging_bytes:
        return 0
    module = page_chunks_module(16)
    rings = [
        staging_ring(device, module, staging_bytes, to_host=d) for d in (True, False)
    ]
    return sum(ring.buffer.numel() for ring in rings if ring is not None)


@dataclass(frozen=True)
class _StagedPlan:
    """A layer range's staged move in one direction: the staged page's stride,
    the staged pages of a slot, and the kernel's arguments before and after
    the transfer's indices."""

    stride: int
    slot_pages: int
    before: tuple
    after: tuple


@dataclass(frozen=True)
class StagedPrepared:
    """What ``StagedPageChunks.move`` takes for one layer range."""

    direct: torch.Tensor
    staged: dict[bool, _StagedPlan] = field(default_factory=dict)
    """By direction (``to_host``); a direction without a plan moves by SM."""


class StagedPageChunks(PageChunkKernel):
    """Ours through device staging and the copy engines (module docstring),
    for a transfer whose host indices are CPU int64, whose bytes reach
    ``min_bytes`` and whose layer range's pieces reach ``min_piece_bytes``;
    every other transfer moves as :class:`PageChunkKernel` moves it."""

    name = "sglang-mxfp8-hicache page_chunks through device staging"
    min_bytes = 4 << 20
    """A transfer of less moves by the SM kernel: it holds the SMs too briefly
    to slow the forward pass, and a staged move takes longer to start."""
    min_piece_bytes = 64 << 10
    """The copy engines move smaller copies far below the link's speed."""
    gather_blocks_per_sm = 2
    """The staging kernel takes every SM, for the shortest time."""

    def __init__(self, tables: PageChunkTables, *, staging_bytes: int) -> None:
        super().__init__(tables)
        device, sms = tables.device, 1
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._gather_blocks = self.gather_blocks_per_sm * sms
        self._rings = {
            to_host: staging_ring(device, self._module, staging_bytes, to_host=to_host)
            for to_host in (True, False)
        }

    def describe(self, backup: StagedPrepared) -> str:
        rings = [ring for ring in self._rings.values() if ring is not None]
        said = (
            f"; transfers of {self.min_bytes >> 20} MiB or more with host "
            "indices on the CPU go through device staging and the copy engines "
            f"({sum(r.buffer.numel() for r in rings) >> 20} MiB on this GPU, "
            "shared by the process's block-scaled host pools; "
            "SGLANG_MXFP8_HICACHE_STAGING_MB)"
        )
        if True not in backup.staged:
            page = self._tables.host_stride
            slot = max((r.slot_bytes for r in rings), default=0)
            said += (
                f", backups excepted: a page of {page / 2**20:.1f} MiB does not "
                f"fit a staging slot of {slot / 2**20:.1f} MiB (it takes pages "
                "of up to two thirds of its size)"
            )
        return said

    def prepare(self, layers: range, *, by_sm: bool = False) -> StagedPrepared:
        prepared = StagedPrepared(direct=super().prepare(layers))
        tables = self._tables
        layout = tables.staged_layout and tables.staged_layout(layers)
        if layout is None or layout.piece_bytes < self.min_piece_bytes:
            return prepared
        for to_host, ring in self._rings.items():
            if ring is None or (by_sm and not to_host):
                continue
            slot_pages, second_slot = ring.slot_pages(layout.stride)
            if slot_pages < 1:
                continue
            address = ring.buffer.data_ptr()
            bases = [
                (*tables.bases[layer][: len(PARTS)],)
                + tuple(address + off for off in offsets)
                for layer, offsets in zip(layers, layout.run_offsets, strict=True)
            ]
            table = torch.tensor(bases, dtype=torch.uint64, device=tables.device)
            pieces = torch.tensor(layout.pieces, dtype=torch.int64)
            prepared.staged[to_host] = _StagedPlan(
                layout.stride,
                slot_pages,
                (table, self._refused),
                (self._parts, tables.heads, tables.page_size, address, layout.stride)
                + (slot_pages, second_slot, pieces, tables.host_address)
                + (tables.host_stride, ring.lanes, to_host, self._gather_blocks),
            )
        return prepared

    def move(self, prepared, host_indices, device_indices, *, to_host) -> None:
        plan = prepared.staged.get(to_host)
        pages = host_indices.numel() // self._tables.page_size
        if (
            plan is None
            or host_indices.device.type != "cpu"
            or host_indices.dtype != torch.int64
            or pages * plan.stride < self.min_bytes
        ):
            super().move(prepared.direct, host_indices, device_indices, to_host=to_host)
            return
        self._module.staged_transfer(
            *plan.before, host_indices, device_indices, *plan.after
        )


def fallback_element(run_bytes: int) -> int | None:
    """The largest slice of a run that SGLang's JIT kernels move, or None."""
    for pieces in range(1, run_bytes // 16 + 1):
        element, rest = divmod(run_bytes, pieces)
        if rest or element > FALLBACK_MAX_ELEMENT or element % 16:
            continue
        if hicache.can_use_hicache_jit_kernel(element_size=element):
            return element
    return None


class SGLangChunkKernels(PageChunkMover):
    """SGLang's ``transfer_hicache_all_layer_mla`` over page numbers, one
    pointer-table entry per (layer, slice of a run), one launch per run size.
    It checks no index values, so nothing is ever refused."""

    name = "SGLang's transfer_hicache_all_layer_mla"

    def __init__(self, tables: PageChunkTables) -> None:
        super().__init__(tables)
        self._elements = self.check(tables.parts, tables.heads)
        self._groups: dict[int, list[int]] = {}
        for part, size in enumerate(tables.run_bytes):
            self._groups.setdefault(size, []).append(part)

    @staticmethod
    def check(parts: Sequence[ChunkShape], heads: int) -> dict[int, int]:
        """The slice SGLang's kernels move for each run size; raises if none.
        Runs only: a heads-major page's strided head chunks have no index
        that addresses them on both sides."""
        if heads != 1 or any(part.row_bytes != part.bytes for part in parts):
            raise TransferUnavailable(
                "SGLang's JIT HiCache kernels address no heads-major page"
            )
        elements = {part.bytes: fallback_element(part.bytes) for part in parts}
        missing = sorted(size for size, element in elements.items() if element is None)
        if missing:
            raise TransferUnavailable(
                f"SGLang's JIT HiCache kernels move no slice of runs of {missing} B"
            )
        return elements

    def prepare(self, layers: range, *, by_sm: bool = False) -> list[tuple]:
        """Per run size: device and host tables, slice bytes, device stride."""
        tables, launches = self._tables, []
        for size, parts in self._groups.items():
            element = self._elements[size]
            device, host = (
                torch.tensor(
                    [
                        tables.bases[layer][part + side] + offset
                        for part in parts
                        for layer in layers
                        for offset in range(0, size, element)
                    ],
                    dtype=torch.uint64,
                    device=tables.device,
                )
                for side in (0, len(PARTS))
            )
            launches.append((device, host, element, size))
        return launches

    def _page_numbers(self, host_indices, device_indices) -> list[torch.Tensor]:
        """Each page's number, host then device side, on the GPU in one dtype."""
        page_size, device = self._tables.page_size, self._tables.device
        on_cpu = device_indices.device.type == "cpu"
        dtype = torch.int64 if on_cpu else device_indices.dtype
        pages = []
        for indices in (host_indices, device_indices):
            numbers = indices[::page_size] // page_size
            if numbers.device.type != device.type:  # "cuda" is "cuda:0" here
                if device.type == "cuda":
                    numbers = numbers.pin_memory()
                numbers = numbers.to(device, non_blocking=True)
            pages.append(numbers.to(dtype).contiguous())
        return pages

    def move(self, prepared, host_indices, device_indices, *, to_host) -> None:
        what = "block-scaled HiCache " + ("backup" if to_host else "load")
        check_transfer_pages(host_indices, device_indices, self._tables.page_size, what)
        host_pages, device_pages = self._page_numbers(host_indices, device_indices)
        for device_table, host_table, element, device_stride in prepared:
            device = (device_table, device_pages, device_stride)
            host = (host_table, host_pages, self._tables.host_stride)
            (src, src_pages, src_stride), (dst, dst_pages, dst_stride) = (
                (device, host) if to_host else (host, device)
            )
            hicache.transfer_hicache_all_layer_mla(
                dst,
                dst_pages,
                src,
                src_pages,
                cache_src_stride_bytes=src_stride,
                cache_dst_stride_bytes=dst_stride,
                element_size=element,
            )


MoverFactory = Callable[[PageChunkTables], PageChunkMover]


def page_vector_bytes(page: HostPage) -> int:
    """The widest vector our kernel can use for ``page``: it divides every
    chunk's rows and strides, the host span and every chunk's offset in it
    (allocations are aligned wider)."""
    offsets = [
        off for layer in range(page.layer_num) for off in page.run_offsets(layer)
    ]
    fields = [field for part in page.chunk_shapes() for field in part.fields()]
    return vector_bytes([*fields, page.span_bytes, *offsets])


def choose_mover(
    page: HostPage, *, staging_bytes: int, pool_label: str
) -> MoverFactory:
    """Ours if it builds (through ``staging_bytes`` of device staging, if
    any), else SGLang's JIT kernel (one warning), else the pool's refusal;
    decided before the pool allocates: what it returns binds its addresses."""
    try:
        page_chunks_module(page_vector_bytes(page))
    except Exception as exc:
        ours_error = exc
    else:
        if staging_bytes:
            return functools.partial(StagedPageChunks, staging_bytes=staging_bytes)
        return PageChunkKernel
    try:
        SGLangChunkKernels.check(page.chunk_shapes(), page.heads)
    except Exception as exc:
        raise refusal_error(
            f"no kernel moves these page chunks (ours: {ours_error}; SGLang's: "
            f"{exc}); run without --enable-hierarchical-cache.",
            page.fmt.name,
            pool_label,
        ) from exc
    logger.warning(
        "%s: the page-chunk kernel (%s) failed to build: %s. Pages move through "
        "%s instead: the same bytes, slower on small transfers.",
        pool_label,
        SOURCE.name,
        ours_error,
        SGLangChunkKernels.name,
    )
    return SGLangChunkKernels
