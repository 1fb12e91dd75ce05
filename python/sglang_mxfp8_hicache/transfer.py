"""The movers of page chunks: our kernel, and SGLang's JIT kernel as the fallback.

For each (page, layer) a transfer moves the four runs of ``page.PARTS``. Our
kernel moves no page that is not one aligned run: the next transfer raises
:class:`PageIndexError`. All refuse, before a byte moves, a count that is not
whole pages and CPU indices whose pages are not aligned runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
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
BLOCK_SIZE = 1024
UNROLL = 4
MAX_BLOCKS = 8
"""Blocks per launch: enough to fill the link, few enough to spare the SMs."""
FALLBACK_MAX_ELEMENT = 32 * 1024
"""Largest element SGLang's JIT kernels move (its TMA kernel's row limit)."""
COPY_LANES = 8
"""Streams a staged transfer's copies are spread over (per-copy cost bound)."""


class PageIndexError(RuntimeError):
    """A transfer named GPU token indices that are not whole aligned pages."""


class TransferUnavailable(RuntimeError):
    """Neither our kernel nor SGLang's moves these page chunks."""


def vector_bytes(sizes: Sequence[int]) -> int:
    """The widest vector that divides every run size and offset."""
    return next(v for v in (16, 8, 4, 2, 1) if all(size % v == 0 for size in sizes))


@dataclass(frozen=True)
class PageChunkTables:
    """Per layer, each run's device base, then its host base in host page 0."""

    bases: tuple[tuple[int, ...], ...]
    host_stride: int
    page_size: int
    parts: tuple[ChunkShape, ...]
    """How each part (``PARTS``) moves, ``heads`` chunks per page and layer."""
    heads: int
    device: torch.device
    host_address: int = 0  # the CPU address of host page 0
    staged_layout: Callable[[range], StagedLayout | None] | None = None

    @property
    def run_bytes(self) -> tuple[int, ...]:
        return tuple(part.bytes * self.heads for part in self.parts)


def check_transfer_pages(
    host_indices: torch.Tensor, device_indices: torch.Tensor, page_size: int, what: str
) -> None:
    """Whole pages, and on each CPU side every page one aligned run."""
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
    """A load's layer groups carry at least this much of a page."""

    def __init__(self, tables: PageChunkTables) -> None:
        self._tables = tables

    def prepare(self, layers: range, *, by_sm: bool = False) -> object:
        """What ``move`` needs, made once; ``by_sm``: loads by SM copies only."""
        raise NotImplementedError

    def move(self, prepared, host_indices, device_indices, *, to_host: bool) -> str:
        """Moves the pages; which of ``metrics.PATHS`` they took."""
        raise NotImplementedError

    def begin_load(self) -> None:
        """A load begins; every load's ``move`` calls follow one (``loads``)."""

    def raise_if_refused(self) -> None:
        """Raises if an earlier launch refused a page."""

    def describe(self, backup: object) -> str:
        """The log line's clause on staging, or ""."""
        return ""


@cache_once
def page_chunks_module(vector: int) -> Module:
    """Our entry points for runs of whole ``vector``-byte words."""
    args = make_cpp_args(vector, UNROLL, BLOCK_SIZE)
    staged = f"sglang_mxfp8_hicache::StagedPageChunks<{args}>"
    return load_jit(
        "sglang_mxfp8_hicache_page_chunks",
        *args,
        cuda_files=[str(CSRC / "staged_copies.cuh")],
        cuda_wrappers=[
            ("transfer", f"&sglang_mxfp8_hicache::PageChunkKernel<{args}>::transfer"),
            ("staged_transfer", f"&{staged}::transfer"),
            ("create_lanes", f"&{staged}::create_lanes"),
            ("begin_load", f"&{staged}::begin_load"),
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
        pinned = torch.cuda.is_available()
        self._refused = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)
        self._refused_words = self._refused.numpy()
        self._args = (self._parts, tables.heads, tables.host_stride, tables.page_size)

    def prepare(self, layers: range, *, by_sm: bool = False) -> torch.Tensor:
        return self._all[layers.start : layers.stop]

    def move(self, prepared, host_indices, device_indices, *, to_host) -> str:
        indices = (prepared, self._refused, host_indices, device_indices)
        self._module.transfer(*indices, *self._args, to_host, self.max_blocks)
        return "sm_kernel"

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
    """One direction's device staging and copy lanes, shared by the process."""

    SLOTS = 2

    buffer: torch.Tensor
    lanes: int

    @property
    def slot_bytes(self) -> int:
        return self.buffer.numel() // self.SLOTS

    def slot_pages(self, stride: int) -> int:
        """Staged pages of ``stride`` bytes each slot holds wholly, at least
        (slot 1 begins at the first such page after slot 0's bytes)."""
        size = self.slot_bytes
        return min(size // stride, 2 * size // stride + -size // stride)


_rings: dict[tuple[str, bool], StagingRing | None] = {}


def staging_ring(
    device: torch.device, module: Module, staging_bytes: int, *, to_host: bool
) -> StagingRing | None:
    """The process's ring of ``device`` for one direction, or None if no slot fits."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), to_host)
    slot = staging_bytes // 2 // StagingRing.SLOTS // 4096 * 4096
    if key in _rings or not slot:
        return _rings.setdefault(key, None)
    buffer = torch.empty(StagingRing.SLOTS * slot, dtype=torch.uint8, device=device)
    handle = torch.zeros(1, dtype=torch.int64)
    cuda = device.type == "cuda"
    with torch.cuda.device(device) if cuda else nullcontext():  # the lanes' streams
        module.create_lanes(handle, COPY_LANES)
    _rings[key] = StagingRing(buffer, int(handle))
    return _rings[key]


def ring_bytes(rings: Iterable[StagingRing | None] | None = None) -> int:
    """Bytes of ``rings``, or of every staging ring this process holds."""
    rings = _rings.values() if rings is None else rings
    return sum(ring.buffer.numel() for ring in rings if ring is not None)


def reserve_staging(device: torch.device, staging_bytes: int) -> int:
    """Makes the staging rings now, before SGLang measures the KV budget."""
    if device.type != "cuda" or not staging_bytes:
        return 0
    module = page_chunks_module(16)
    return ring_bytes(
        staging_ring(device, module, staging_bytes, to_host=d) for d in (True, False)
    )


@dataclass(frozen=True)
class _StagedPlan:
    """The staged kernel's arguments before and after the transfer's indices."""

    stride: int
    slot_pages: int
    before: tuple
    after: tuple


@dataclass(frozen=True)
class StagedPrepared:
    """A layer range's moves; a direction without a staged plan moves by SM."""

    direct: torch.Tensor
    staged: dict[bool, _StagedPlan] = field(default_factory=dict)


class StagedPageChunks(PageChunkKernel):
    """Ours through device staging and the copy engines, for CPU int64 host
    indices of ``min_bytes``; others move as :class:`PageChunkKernel` moves."""

    name = "sglang-mxfp8-hicache page_chunks through device staging"
    min_bytes = 4 << 20
    """Less holds the SMs too briefly to matter; staging starts slower."""
    min_piece_bytes = 64 << 10
    """The copy engines move smaller copies far below the link's speed."""
    gather_blocks_per_sm = 2

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
        self._load_begun = False

    def describe(self, backup: StagedPrepared) -> str:
        rings = [ring for ring in self._rings.values() if ring is not None]
        said = (
            f"; transfers of {self.min_bytes >> 20} MiB or more with host "
            "indices on the CPU go through device staging and the copy engines "
            f"({ring_bytes(rings) >> 20} MiB on this GPU, "
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

    def begin_load(self) -> None:
        """A load's copies start after its first group by SM (layer 0, the link
        its own) or before its first staged one, not each behind the last."""
        self._load_begun = False

    def _mark_load_start(self, to_host: bool, may_stage: bool) -> None:
        """Once per load that may stage; again after a backup (host written)."""
        ring = self._rings[False]
        if not (to_host or self._load_begun) and ring is not None and may_stage:
            self._module.begin_load(self._all, ring.lanes)
        self._load_begun = not to_host

    def prepare(self, layers: range, *, by_sm: bool = False) -> StagedPrepared:
        prepared = StagedPrepared(direct=super().prepare(layers))
        tables = self._tables
        layout = tables.staged_layout and tables.staged_layout(layers)
        if layout is None or layout.piece_bytes < self.min_piece_bytes:
            return prepared
        for to_host, ring in self._rings.items():
            if ring is None or (by_sm and not to_host):
                continue
            slot_pages = ring.slot_pages(layout.stride)
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
                + (ring.slot_bytes, pieces, tables.host_address)
                + (tables.host_stride, ring.lanes, to_host, self._gather_blocks),
            )
        return prepared

    def move(self, prepared, host_indices, device_indices, *, to_host) -> str:
        plan = prepared.staged.get(to_host)
        pages = host_indices.numel() // self._tables.page_size
        on_cpu = host_indices.device.type == "cpu"
        may_stage = on_cpu and pages * self._tables.host_stride >= self.min_bytes
        if (
            plan is None
            or not on_cpu
            or host_indices.dtype != torch.int64
            or pages * plan.stride < self.min_bytes
        ):
            path = super().move(
                prepared.direct, host_indices, device_indices, to_host=to_host
            )
            self._mark_load_start(to_host, may_stage)  # after a group by SM (layer 0)
            return path
        self._mark_load_start(to_host, may_stage)  # before the staged copies
        self._module.staged_transfer(
            *plan.before, host_indices, device_indices, *plan.after
        )
        return "copy_engines"


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
    """SGLang's kernel over page numbers; it checks no index values."""

    name = "SGLang's transfer_hicache_all_layer_mla"

    def __init__(self, tables: PageChunkTables) -> None:
        super().__init__(tables)
        self._elements = self.check(tables.parts, tables.heads)
        self._groups: dict[int, list[int]] = {}
        for part, size in enumerate(tables.run_bytes):
            self._groups.setdefault(size, []).append(part)

    @staticmethod
    def check(parts: Sequence[ChunkShape], heads: int) -> dict[int, int]:
        """The slice SGLang's kernels move for each run size; raises if none."""
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
        tables, launches = self._tables, []
        for size, parts in self._groups.items():
            element = self._elements[size]
            runs = list(itertools.product(parts, layers, range(0, size, element)))
            device, host = (
                torch.tensor(
                    [tables.bases[n][p + side] + off for p, n, off in runs],
                    dtype=torch.uint64,
                    device=tables.device,
                )
                for side in (0, len(PARTS))
            )
            launches.append((device, host, element, size))
        return launches

    def move(self, prepared, host_indices, device_indices, *, to_host) -> str:
        page_size, device = self._tables.page_size, self._tables.device
        what = "block-scaled HiCache " + ("backup" if to_host else "load")
        check_transfer_pages(host_indices, device_indices, page_size, what)
        on_cpu = device_indices.device.type == "cpu"
        dtype = torch.int64 if on_cpu else device_indices.dtype
        pages = []  # each page's number, host then device side, on the GPU
        for indices in (host_indices, device_indices):
            numbers = indices[::page_size] // page_size
            if numbers.device.type != device.type:  # "cuda" is "cuda:0" here
                if device.type == "cuda":
                    numbers = numbers.pin_memory()
                numbers = numbers.to(device, non_blocking=True)
            pages.append(numbers.to(dtype).contiguous())
        host_pages, device_pages = pages
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
        return "sglang_kernel"


MoverFactory = Callable[[PageChunkTables], PageChunkMover]


def choose_mover(
    page: HostPage, *, staging_bytes: int, pool_label: str
) -> MoverFactory:
    """Ours if it builds, else SGLang's JIT kernel, else the pool's refusal."""
    layers = range(page.layer_num)
    offsets = [off for layer in layers for off in page.run_offsets(layer)]
    fields = [field for part in page.chunk_shapes() for field in part.fields()]
    try:
        page_chunks_module(vector_bytes([*fields, page.span_bytes, *offsets]))
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
