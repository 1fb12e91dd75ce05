"""The kernels that move page chunks: ours, and SGLang's JIT kernels as the fallback.

A transfer moves whole pages of some layers. For each (page, layer) it moves
four runs (``page.PARTS``: K payload, K scales, V payload, V scales) between a
device page number times the run's bytes and a host page number times the host
page's bytes. Both movers take the same per-layer base addresses (device bases
of the four runs, then host bases, ``PageChunkTables``) and the transfer's own
token index tensors.

- :class:`PageChunkKernel` is ours (``csrc/page_chunks.cuh``, built by SGLang's
  JIT loader): one launch per transfer (per 128 pages when indices sit on the
  CPU), reading each page's first token index itself, so nothing is prepared
  per transfer. It checks GPU-resident index values in the kernel: a page that
  is not one aligned run is not moved, and the pool's next transfer raises
  :class:`PageIndexError` (the CPU reading them would synchronise every call).
- :class:`StagedPageChunks` is ours through device staging: the same kernel
  moves a transfer's chunks between the device pages and a slot of a small
  staging ring at HBM speed, and the copy engines move the staged pages
  across the link (``csrc/staged_copies.cuh``), so the SMs the forward pass
  runs on are held for microseconds, not for the link's milliseconds. It
  takes transfers whose host indices are on the CPU and that are large
  enough for the copy engines to move at the link's speed; the others go as
  :class:`PageChunkKernel` moves them.
- :class:`SGLangChunkKernels` is SGLang's own all-layer JIT kernel
  (``transfer_hicache_all_layer_mla``) with page numbers as indices and one
  pointer-table entry per (layer, slice of a run), so each element is at most
  32 KiB: one launch per run size (two for symmetric heads, four otherwise),
  and the page numbers are gathered on every transfer. It is what a pool uses
  when ours does not build (another CUDA toolchain, a change in the SGLang
  headers ours includes); it checks no index values.

Both refuse, before anything moves, a transfer whose index count is not whole
pages, and index tensors on the CPU whose pages are not aligned runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from sglang.kernels.jit.utils import cache_once, load_jit, make_cpp_args
from sglang.kernels.ops.kvcache import hicache

from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
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
"""Thread blocks of 1024 one launch of ours may take (``docs/benchmarks.md``)."""
VECTOR_BYTES = (16, 8, 4, 2, 1)
FALLBACK_MAX_ELEMENT = 32 * 1024
"""Largest element SGLang's JIT kernels move (its TMA kernel's row limit)."""


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


class PageChunkMover(Protocol):
    name: str

    def prepare(self, layers: range) -> object:
        """What ``move`` needs for these layers, made once (not per transfer)."""

    def move(
        self,
        prepared: object,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        *,
        to_host: bool,
    ) -> None: ...

    def raise_if_refused(self) -> None:
        """Raise if an earlier launch refused a page (see the module docstring)."""


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


class PageChunkKernel:
    """Ours: one FFI call and one launch per transfer."""

    name = "sglang-mxfp8-hicache page_chunks"
    max_blocks = MAX_BLOCKS

    def __init__(self, tables: PageChunkTables) -> None:
        self._tables = tables
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

    def prepare(self, layers: range) -> torch.Tensor:
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


STAGING_ENV = "SGLANG_MXFP8_HICACHE_STAGING_MB"
DEFAULT_STAGING_MB = 128
"""Device staging per GPU, both directions: two slots of 32 MiB each way, a
tenth of a percent of an H200, far below SGLang's own write-back staging (2 x
64 pages of every layer's payload)."""
COPY_LANES = 8
"""Streams a staged transfer's copies are spread over: copies of a few
hundred KiB are bound by each copy engine's per-copy cost, which several
engines share (``docs/benchmarks.md``)."""


def staging_bytes() -> int:
    """Device staging per GPU the operator allows (``SGLANG_MXFP8_HICACHE_STAGING_MB``,
    MiB, both directions; 0 moves every page with the SM kernel)."""
    text = os.environ.get(STAGING_ENV, "").strip()
    if not text:
        return DEFAULT_STAGING_MB << 20
    try:
        mib = int(text)
    except ValueError:
        mib = -1
    if mib < 0:
        raise BlockScaledHiCacheConfigError(
            f"{STAGING_ENV}={text!r}: give the device staging for block-scaled "
            f"HiCache transfers in whole MiB (0 for none; default {DEFAULT_STAGING_MB})."
        )
    return mib << 20


@dataclass
class StagingRing:
    """Device staging of one direction on one GPU: ``SLOTS`` slots of
    ``slot_bytes``, shared by every block-scaled host pool of the process
    (a server moves one transfer per direction at a time), and the copy
    lanes that go with it (``csrc/staged_copies.cuh``)."""

    SLOTS = 2

    buffer: torch.Tensor
    lanes: int
    """The lanes' handle (a C++ ``CopyLanes``)."""

    @property
    def slot_bytes(self) -> int:
        return self.buffer.numel() // self.SLOTS

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    def slot_pages(self, stride: int) -> tuple[int, int]:
        """(staged pages per slot, the staged page where slot 1 begins) for
        staged pages of ``stride`` bytes. Slot 1 begins at the first page past
        slot 0's bytes, so each slot's pages lie within its own bytes whatever
        the stride: the ring orders each slot's reuse by that slot's events
        alone, which then hold for moves of any stride (a load's layer groups,
        pools of other geometries) from any stream."""
        second = -(-self.slot_bytes // stride)
        return self.SLOTS * self.slot_bytes // stride - second, second


_rings: dict[tuple[str, bool], StagingRing | None] = {}


def staging_ring(
    device: torch.device, module: Module, *, to_host: bool
) -> StagingRing | None:
    """The process's ring of ``device`` for one direction, made on first use
    with ``module``'s ``create_lanes`` (half of ``staging_bytes()`` each way),
    or None if the operator allows none."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), to_host)
    if key not in _rings:
        slot = staging_bytes() // 2 // StagingRing.SLOTS // 4096 * 4096
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


def reserve_staging(device: torch.device) -> int:
    """Makes the process's staging rings on a CUDA ``device`` now (SGLang
    measures the KV budget after its own staging is prepared, and these then
    count against it as that would have); their bytes."""
    if device.type != "cuda" or not staging_bytes():
        return 0
    module = page_chunks_module(16)
    rings = [staging_ring(device, module, to_host=d) for d in (True, False)]
    return sum(ring.buffer.numel() for ring in rings if ring is not None)


@dataclass(frozen=True)
class _StagedPlan:
    """A layer range's staged move in one direction: the kernel's table with
    the ring's staged page 0 as its host side, and the copies' pieces."""

    ring: StagingRing
    layout: StagedLayout
    table: torch.Tensor
    pieces: torch.Tensor
    slot_pages: int
    second_slot: int
    """The staged page where slot 1 begins (``StagingRing.slot_pages``)."""


@dataclass(frozen=True)
class StagedPrepared:
    """What ``StagedPageChunks.move`` takes for one layer range."""

    direct: torch.Tensor
    staged: dict[bool, _StagedPlan] = field(default_factory=dict)
    """By direction (``to_host``); a direction without a plan moves by SM."""


def loads_by_sm(prepared: object) -> object:
    """``prepared`` with loads by SM copies only (a load's layer 0: the
    forward pass waits for it, so it must arrive soonest, and it is a layer's
    share of the load's time on the SMs)."""
    if not isinstance(prepared, StagedPrepared):
        return prepared
    return StagedPrepared(
        prepared.direct, {k: v for k, v in prepared.staged.items() if k}
    )


class StagedPageChunks(PageChunkKernel):
    """Ours through device staging and the copy engines (module docstring),
    for a transfer whose host indices are on the CPU, whose bytes reach
    ``min_bytes`` and whose layer range's pieces reach ``min_piece_bytes``;
    every other transfer moves as :class:`PageChunkKernel` moves it."""

    name = "sglang-mxfp8-hicache page_chunks through device staging"
    min_bytes = 4 << 20
    """A transfer of less moves by the SM kernel: it holds SMs for under 80 us,
    which costs a GEMM loop beside it nothing measurable, and arrives sooner
    than a staged move, whose copies and second kernel take some 30 us to
    start (``docs/benchmarks.md``)."""
    min_piece_bytes = 64 << 10
    """Pieces smaller than this move by the SM kernel: the copy engines move
    16 KiB copies at a twentieth of the link's speed (``docs/benchmarks.md``)."""
    gather_blocks_per_sm = 2
    """Thread blocks of 1024 per SM for the staging kernel: every SM, so that it
    holds them for the shortest time."""

    def __init__(self, tables: PageChunkTables) -> None:
        super().__init__(tables)
        device = tables.device
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        self._gather_blocks = self.gather_blocks_per_sm * sms
        self._rings = {
            to_host: staging_ring(device, self._module, to_host=to_host)
            for to_host in (True, False)
        }

    @property
    def rings(self) -> tuple[StagingRing | None, ...]:
        return tuple(self._rings.values())

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the rings this mover uses (shared with other pools)."""
        return sum(r.buffer.numel() for r in self.rings if r is not None)

    def prepare(self, layers: range) -> StagedPrepared:
        prepared = StagedPrepared(direct=super().prepare(layers))
        layout = self._tables.staged_layout and self._tables.staged_layout(layers)
        if layout is None or layout.piece_bytes < self.min_piece_bytes:
            return prepared
        for to_host, ring in self._rings.items():
            if ring is None:
                continue
            slot_pages, second_slot = ring.slot_pages(layout.stride)
            if slot_pages < 1:
                continue
            bases = [
                (*self._tables.bases[layer][: len(PARTS)],)
                + tuple(ring.address + off for off in offsets)
                for layer, offsets in zip(layers, layout.run_offsets, strict=True)
            ]
            prepared.staged[to_host] = _StagedPlan(
                ring=ring,
                layout=layout,
                table=torch.tensor(
                    bases, dtype=torch.uint64, device=self._tables.device
                ),
                pieces=torch.tensor(layout.pieces, dtype=torch.int64),
                slot_pages=slot_pages,
                second_slot=second_slot,
            )
        return prepared

    def move(self, prepared, host_indices, device_indices, *, to_host) -> None:
        plan = prepared.staged.get(to_host)
        tables = self._tables
        pages = host_indices.numel() // tables.page_size
        if (
            plan is None
            or host_indices.device.type != "cpu"
            or host_indices.dtype != torch.int64
            or pages * plan.layout.stride < self.min_bytes
        ):
            super().move(prepared.direct, host_indices, device_indices, to_host=to_host)
            return
        self._module.staged_transfer(
            plan.table,
            self._refused,
            host_indices,
            device_indices,
            self._parts,
            tables.heads,
            tables.page_size,
            plan.ring.address,
            plan.layout.stride,
            plan.slot_pages,
            plan.second_slot,
            plan.pieces,
            tables.host_address,
            tables.host_stride,
            plan.ring.lanes,
            to_host,
            self._gather_blocks,
        )


@dataclass(frozen=True)
class _SGLangLaunch:
    """One launch of SGLang's kernel: the runs of one device page size, as
    (layer, slice) entries of ``element`` bytes."""

    device_table: torch.Tensor
    host_table: torch.Tensor
    element: int
    device_stride: int


def fallback_element(run_bytes: int) -> int | None:
    """The largest slice of a run that SGLang's JIT kernels move, or None."""
    for pieces in range(1, run_bytes // 16 + 1):
        element, rest = divmod(run_bytes, pieces)
        if rest or element > FALLBACK_MAX_ELEMENT or element % 16:
            continue
        if hicache.can_use_hicache_jit_kernel(element_size=element):
            return element
    return None


class SGLangChunkKernels:
    """SGLang's ``transfer_hicache_all_layer_mla`` over page numbers."""

    name = "SGLang's transfer_hicache_all_layer_mla"

    def __init__(self, tables: PageChunkTables) -> None:
        self._tables = tables
        self._elements = self.check(tables.parts, tables.heads)
        # Runs with the same device page size share a launch (K and V of
        # symmetric heads).
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

    def prepare(self, layers: range) -> list[_SGLangLaunch]:
        tables = self._tables
        launches = []
        for size, parts in self._groups.items():
            element = self._elements[size]
            slices = range(0, size, element)
            device, host = (
                [
                    tables.bases[layer][part + side] + offset
                    for part in parts
                    for layer in layers
                    for offset in slices
                ]
                for side in (0, len(PARTS))
            )
            launches.append(
                _SGLangLaunch(
                    device_table=torch.tensor(
                        device, dtype=torch.uint64, device=tables.device
                    ),
                    host_table=torch.tensor(
                        host, dtype=torch.uint64, device=tables.device
                    ),
                    element=element,
                    device_stride=size,
                )
            )
        return launches

    def _page_numbers(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each page's number, both sides on the GPU in one dtype."""
        page_size, device = self._tables.page_size, self._tables.device
        dtype = (
            device_indices.dtype if device_indices.device.type != "cpu" else torch.int64
        )
        pages = []
        for indices in (host_indices, device_indices):
            numbers = indices[::page_size] // page_size
            if numbers.device.type != device.type:  # "cuda" is "cuda:0" here
                if device.type == "cuda":
                    numbers = numbers.pin_memory()
                numbers = numbers.to(device, non_blocking=True)
            pages.append(numbers.to(dtype).contiguous())
        return pages[0], pages[1]

    def move(self, prepared, host_indices, device_indices, *, to_host) -> None:
        what = "block-scaled HiCache " + ("backup" if to_host else "load")
        check_transfer_pages(host_indices, device_indices, self._tables.page_size, what)
        host_pages, device_pages = self._page_numbers(host_indices, device_indices)
        host_stride = self._tables.host_stride
        for launch in prepared:
            device = (launch.device_table, device_pages, launch.device_stride)
            host = (launch.host_table, host_pages, host_stride)
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
                element_size=launch.element,
            )

    def raise_if_refused(self) -> None:
        """SGLang's kernel checks no index values; nothing is ever refused."""


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


def choose_mover(page: HostPage, *, pool_label: str) -> MoverFactory:
    """Ours if it builds (through device staging unless the operator allows
    none, ``SGLANG_MXFP8_HICACHE_STAGING_MB=0``), else SGLang's JIT kernel (one
    warning), decided before the pool allocates: what it returns binds a
    pool's addresses."""
    staged = staging_bytes() > 0
    try:
        page_chunks_module(page_vector_bytes(page))
        return StagedPageChunks if staged else PageChunkKernel
    except Exception as exc:
        ours_error = exc
    try:
        SGLangChunkKernels.check(page.chunk_shapes(), page.heads)
    except Exception as exc:
        raise TransferUnavailable(
            f"no kernel moves these page chunks (ours: {ours_error}; SGLang's: {exc})"
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
