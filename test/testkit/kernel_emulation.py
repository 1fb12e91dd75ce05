"""CPU stand-ins for SGLang's JIT HiCache transfer kernels, emulating their contracts.

Only for machines without CUDA. Each function takes the same arguments as its
counterpart in ``sglang.kernels.ops.kvcache.hicache`` and moves the same bytes:

- ``transfer_hicache_all_layer_staged_lf_pf``: chunks of at most
  ``staging.shape[0] // page_size`` pages; a relayout gathers, for every page and
  layer, ``page_size`` rows starting at token ``src_indices[::page_size][p]`` of the
  layer that the uint64 pointer table names, into staging ``[tokens, layers,
  elem]``; then each staged page is copied whole to the host tensor at row
  ``dst_indices[p * page_size]`` (only the first index of each page is read).
  ``dst_indices`` must be CPU int64 and the element size a multiple of 16 B
  (``staged_write_back.cuh``).
- ``transfer_hicache_all_layer``: for every layer ``l`` of the four uint64
  pointer tables and every ``i``, ``element_size`` bytes go from
  ``k_ptr_src[l] + indices_src[i] * src_stride`` to
  ``k_ptr_dst[l] + indices_dst[i] * dst_stride``, and likewise for V
  (``hicache.cuh`` ``run_all``).
- ``_jit_hicache_module(...).launch_all``: the same copy as
  ``transfer_hicache_all_layer``, called positionally as ``HiCacheKernel::run_all``
  is (destination, then source, then the source and destination strides), with
  the row size fixed by the module; index tensors must be packed 1-D and of
  one dtype (``TensorMatcher``).
- ``transfer_hicache_all_layer_mla``: the same copy for one pointer table,
  ``element_size`` at most 32 KiB (the TMA kernel's row limit).
- ``page_chunks_module(vector)`` (ours, ``csrc/page_chunks.cuh``): ``tables`` is
  a packed [layers, 8] uint64 table (device bases of K payload, K scales, V
  payload, V scales, then their host bases) and ``parts`` a CPU [4, 6] int64
  table of each part's chunk (bytes, row bytes, device page / head / row
  strides, host head stride). For every page, layer, part and head, the
  chunk's device rows (device page number times the page stride, plus head
  and row strides) move to consecutive host bytes at host page number times
  ``host_stride`` plus the host head stride, or back. Without a GPU every index
  tensor is CPU-resident: int64 only, and a page that is not one aligned run
  refuses the whole transfer before anything moves (the package's own
  ``transfer.check_transfer_pages``, the check the kernel makes).
- ``page_chunks_module(vector).staged_transfer`` (ours, ``csrc/staged_copies.cuh``):
  the same chunks through a staging ring of two slots of ``slot_bytes``: each
  transfer's staged pages follow the ring's last ones in the slot being
  filled (rounded up to whole staged pages of ``stage_stride``), the other
  slot taken when it is full, each chunk what one slot holds
  (``PageChunksModule.placements`` records them); a backup moves each page's chunks to its
  staged page (the ring's base plus the staged page number times
  ``stage_stride``, with the table's host bases naming staged page 0), then
  copies each ``(host offset, staged offset, bytes)`` piece to its host page
  (``host_base`` plus the host page number times ``host_stride``); a load
  copies the pieces in first, then moves the chunks to the device. Host
  indices are CPU int64, every page checked before anything moves. A load's
  copies wait for the caller's stream as it stood at the last
  ``begin_load``: a staged load with a backup since then (host pages written
  that its copies might read early) fails.
- ``transfer_hicache_one_layer``: all four caches are viewed as
  ``[-1, element_dim]``; row ``indices_src[i]`` of each source goes to row
  ``indices_dst[i]`` of its destination (``hicache.cuh`` ``run_one``).

Pointer tables are resolved against the tensors registered with
:class:`PointerMap` (an address may point inside one), so a wrong pointer fails
loudly instead of reading garbage.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.kvcache import hicache as hicache_jit

from sglang_mxfp8_hicache import transfer

transfer_launch_pages = 128
"""Pages per launch when indices travel by value (``kMaxParamPages``)."""


class PointerMap:
    """Resolves uint64 addresses of a kernel pointer table inside registered tensors."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def register(self, tensors) -> None:
        for tensor in tensors:
            assert tensor.is_contiguous(), "registered buffers must be packed"
            self._tensors.append(tensor)

    def locate(self, address: int) -> tuple[torch.Tensor, int]:
        """The flat bytes of the tensor holding ``address``, and its offset there."""
        for tensor in self._tensors:
            start = tensor.data_ptr()
            if start <= address < start + tensor.numel() * tensor.element_size():
                return tensor.view(torch.uint8).reshape(-1), address - start
        raise KeyError(f"address {address:#x} is in no registered tensor")

    def rows(self, address: int, element_size: int) -> torch.Tensor:
        flat, offset = self.locate(address)
        assert offset == 0, "packed device rows start at their tensor"
        return flat.view(-1, element_size)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


class _RowCopies:
    """What every emulation shares: the pointer map its tables resolve
    against, the launches it made (``calls``: name and element size or
    vector), and the byte copy they all come down to."""

    def __init__(self, pointers: PointerMap) -> None:
        self.pointers = pointers
        self.calls: list[tuple[str, int]] = []

    def _copy_rows(self, src_bases, dst_bases, src_offsets, dst_offsets, row_bytes):
        """Per layer: row_bytes from src_bases[l] + src_offsets[i] to dst_bases[l] + dst_offsets[i]."""
        span = torch.arange(row_bytes)
        for src_address, dst_address in zip(src_bases, dst_bases, strict=True):
            src, src_base = self.pointers.locate(src_address)
            dst, dst_base = self.pointers.locate(dst_address)
            dst[dst_base + dst_offsets[:, None] + span] = src[
                src_base + src_offsets[:, None] + span
            ]


class SGLangDirectCopies(_RowCopies):
    """SGLang's direct copies (``hicache.cuh``): the all-layer copy through
    pointer tables (K and V, or MLA's one table), the JIT module's
    ``launch_all``, and the one-layer copy."""

    @staticmethod
    def can_use_hicache_jit_kernel(
        *, element_size, unroll=None, block_quota=None, page_size=None
    ) -> bool:
        # The register kernel's rule; TMA is off unless SGLANG_HICACHE_TMA_TRANSFER.
        unroll = unroll or hicache_jit._default_unroll(element_size)
        return hicache_jit._tiles_across_lanes(element_size, unroll)

    def transfer_hicache_all_layer(
        self,
        k_ptr_dst,
        v_ptr_dst,
        indices_dst,
        k_ptr_src,
        v_ptr_src,
        indices_src,
        *,
        kv_cache_src_stride_bytes,
        kv_cache_dst_stride_bytes,
        element_size=None,
        unroll=None,
        block_quota=None,
        page_size=None,
    ) -> None:
        if element_size is None:
            assert kv_cache_dst_stride_bytes == kv_cache_src_stride_bytes
            element_size = kv_cache_dst_stride_bytes
        self.calls.append(("all_layer", element_size))
        assert k_ptr_dst.numel() == v_ptr_dst.numel(), "pointer tables differ in layers"
        # K and V: each the one-table copy of the MLA variant.
        for src_table, dst_table in ((k_ptr_src, k_ptr_dst), (v_ptr_src, v_ptr_dst)):
            self._all_layer_copy(
                dst_table,
                indices_dst,
                src_table,
                indices_src,
                src_stride=kv_cache_src_stride_bytes,
                dst_stride=kv_cache_dst_stride_bytes,
                element_size=element_size,
            )

    def transfer_hicache_all_layer_mla(
        self,
        ptr_dst,
        indices_dst,
        ptr_src,
        indices_src,
        *,
        cache_src_stride_bytes,
        cache_dst_stride_bytes,
        element_size=None,
        unroll=None,
        block_quota=None,
        page_size=None,
    ) -> None:
        if element_size is None:
            assert cache_dst_stride_bytes == cache_src_stride_bytes
            element_size = cache_dst_stride_bytes
        self.calls.append(("all_layer_mla", element_size))
        assert element_size <= transfer.FALLBACK_MAX_ELEMENT
        self._all_layer_copy(
            ptr_dst,
            indices_dst,
            ptr_src,
            indices_src,
            src_stride=cache_src_stride_bytes,
            dst_stride=cache_dst_stride_bytes,
            element_size=element_size,
        )

    def _all_layer_copy(
        self,
        ptr_dst,
        indices_dst,
        ptr_src,
        indices_src,
        *,
        src_stride,
        dst_stride,
        element_size,
    ) -> None:
        """One pointer table of ``hicache.cuh``'s all-layer copy: for every
        layer and ``i``, ``element_size`` bytes from ``ptr_src[l] +
        indices_src[i] * src_stride`` to ``ptr_dst[l] + indices_dst[i] *
        dst_stride``."""
        assert self.can_use_hicache_jit_kernel(element_size=element_size)
        for table in (ptr_dst, ptr_src):
            assert table.dtype == torch.uint64 and table.dim() == 1
        assert ptr_dst.numel() == ptr_src.numel(), "pointer tables differ in layers"
        for indices in (indices_dst, indices_src):
            assert indices.dim() == 1
            assert indices.dtype in (torch.int32, torch.int64)
        assert indices_src.numel() == indices_dst.numel()
        self._copy_rows(
            ptr_src.tolist(),
            ptr_dst.tolist(),
            indices_src.long() * src_stride,
            indices_dst.long() * dst_stride,
            element_size,
        )

    def _jit_hicache_module(self, *, element_size, unroll, block_quota):
        kernels = self

        class Module:
            @staticmethod
            def launch_all(*args) -> None:
                # (K dst, V dst, indices dst, K src, V src, indices src,
                #  src stride bytes, dst stride bytes), as HiCacheKernel::run_all.
                *tensors, src_stride, dst_stride = args
                indices_dst, indices_src = tensors[2], tensors[5]
                for indices in (indices_dst, indices_src):
                    assert indices.dim() == 1 and indices.is_contiguous()
                assert indices_dst.dtype == indices_src.dtype
                kernels.transfer_hicache_all_layer(
                    *tensors,
                    kv_cache_src_stride_bytes=src_stride,
                    kv_cache_dst_stride_bytes=dst_stride,
                    element_size=element_size,
                )

        return Module()

    def transfer_hicache_one_layer(
        self,
        k_cache_dst,
        v_cache_dst,
        indices_dst,
        k_cache_src,
        v_cache_src,
        indices_src,
        *,
        element_dim=None,
        unroll=None,
        block_quota=None,
        page_size=None,
    ) -> None:
        self._one_layer(
            "one_layer",
            ((k_cache_src, k_cache_dst), (v_cache_src, v_cache_dst)),
            indices_dst,
            indices_src,
            element_dim,
        )

    def transfer_hicache_one_layer_mla(
        self,
        cache_dst,
        indices_dst,
        cache_src,
        indices_src,
        *,
        element_dim=None,
        unroll=None,
        block_quota=None,
        page_size=None,
    ) -> None:
        """MLA's one buffer of one layer: rows of ``element_dim`` elements
        (SGLang's MXFP8 host pool loads its scale pages with it, over page
        numbers)."""
        self._one_layer(
            "one_layer_mla",
            ((cache_src, cache_dst),),
            indices_dst,
            indices_src,
            element_dim,
        )

    def _one_layer(self, name, caches, indices_dst, indices_src, element_dim) -> None:
        """Rows of ``element_dim`` elements (the first destination's last dim
        by default) from each source cache to its destination, row
        ``indices_src[i]`` to row ``indices_dst[i]``."""
        element_dim = element_dim or caches[0][1].size(-1)
        self.calls.append((name, element_dim * caches[0][1].element_size()))
        assert indices_dst.dtype in (torch.int32, torch.int64)
        assert indices_src.dtype in (torch.int32, torch.int64)
        assert indices_dst.numel() == indices_src.numel()
        for src, dst in caches:
            src_rows = _bytes(src.view(-1, element_dim))
            dst_rows = _bytes(dst.view(-1, element_dim))
            dst_rows[indices_dst.long()] = src_rows[indices_src.long()]


class SGLangStagedWriteBack(_RowCopies):
    """SGLang's staged write-back (``staged_write_back.cuh``): device pages
    gathered through a staging buffer, then copied whole to the host."""

    @staticmethod
    def can_use_write_back_jit_kernel(
        *, element_size, unroll=None, block_quota=None
    ) -> bool:
        return element_size % 16 == 0

    def transfer_hicache_all_layer_staged_lf_pf(
        self,
        k_ptr_src,
        v_ptr_src,
        src_indices,
        dst_indices,
        staging_k,
        staging_v,
        dst_k,
        dst_v,
        *,
        page_size,
        element_size=None,
        unroll=None,
        block_quota=None,
    ) -> None:
        self._staged_lf_pf(
            ((k_ptr_src, staging_k, dst_k), (v_ptr_src, staging_v, dst_v)),
            src_indices,
            dst_indices,
            page_size,
            element_size,
        )

    def transfer_hicache_all_layer_mla_staged_lf_pf(
        self,
        ptr_src,
        src_indices,
        dst_indices,
        staging,
        dst,
        *,
        page_size,
        element_size=None,
        unroll=None,
        block_quota=None,
    ) -> None:
        """MLA's one buffer per layer (SGLang's MXFP8 host pool moves its scale
        pages with it, ``page_size`` 1 over page numbers)."""
        self._staged_lf_pf(
            ((ptr_src, staging, dst),),
            src_indices,
            dst_indices,
            page_size,
            element_size,
        )

    def _staged_lf_pf(
        self, sides, src_indices, dst_indices, page_size, element_size
    ) -> None:
        """Each side's (pointer table, staging, host) pages: the device pages
        of ``src_indices`` gathered into staging, every layer, then copied
        whole to the host pages of ``dst_indices``, one staging load at a time."""
        staging_k = sides[0][1]
        element_size = (
            element_size or staging_k[0, 0].numel() * staging_k.element_size()
        )
        self.calls.append(("staged_write_back", element_size))
        assert element_size % 16 == 0, "element size must be 16-byte aligned"
        assert dst_indices.device.type == "cpu" and dst_indices.dtype == torch.int64
        assert src_indices.dtype in (torch.int32, torch.int64)
        layer_num = staging_k.shape[1]
        for ptrs, _, _ in sides:
            assert ptrs.dtype == torch.uint64 and ptrs.numel() == layer_num
        src_pages = src_indices[::page_size].tolist()
        capacity = staging_k.shape[0] // page_size
        for begin in range(0, len(src_pages), capacity):
            chunk = src_pages[begin : begin + capacity]
            tokens = len(chunk) * page_size
            chunk_dst = dst_indices[begin * page_size : begin * page_size + tokens]
            assert chunk_dst.numel() == tokens, "staging token count mismatch"
            for ptrs, staging, dst in sides:
                staged = _bytes(staging[:tokens]).view(tokens, layer_num, element_size)
                for layer, address in enumerate(ptrs.tolist()):
                    rows = self.pointers.rows(address, element_size)
                    for p, first in enumerate(chunk):
                        staged[p * page_size : (p + 1) * page_size, layer] = rows[
                            first : first + page_size
                        ]
                host = _bytes(dst).view(dst.shape[0], layer_num, element_size)
                for p in range(len(chunk)):
                    first = int(chunk_dst[p * page_size])
                    host[first : first + page_size] = staged[
                        p * page_size : (p + 1) * page_size
                    ]


class EmulatedKernels(SGLangDirectCopies, SGLangStagedWriteBack):
    """The hicache.py entry points our path and the base class use, on CPU:
    SGLang's JIT kernels (direct and staged) and ours (``page_chunks_module``),
    over one pointer map."""

    host_written_since_begin = True
    """Whether a backup wrote host pages after the last ``begin_load``."""

    def __init__(self, pointers: PointerMap) -> None:
        super().__init__(pointers)
        self.ring_fill: list[tuple[int, int]] = []
        """Per staging ring (its lanes handle less one): the slot being filled, its bytes taken."""
        self.placements: list[tuple[int, int, bool, int]] = []
        """Each staged chunk: its ring's handle, slot, whether it entered the slot, pages."""

    def page_chunks_module(self, vector: int) -> PageChunksModule:
        """Ours (``csrc/page_chunks.cuh``, ``csrc/staged_copies.cuh``)."""
        return PageChunksModule(self, vector)


class PageChunksModule:
    """Our kernels' module for one copy ``vector`` (``csrc/page_chunks.cuh``,
    ``csrc/staged_copies.cuh``). Without a GPU every index tensor is
    CPU-resident: int64, every page checked (first and last token) before
    anything moves, and its page numbers passed by value, 128 pages a
    launch. The in-kernel checks of GPU-resident indices run on a GPU."""

    def __init__(self, kernels: EmulatedKernels, vector: int) -> None:
        self.kernels, self.vector = kernels, vector

    def transfer(
        self,
        tables,
        refused,
        host_indices,
        device_indices,
        parts,
        heads,
        host_stride,
        page_size,
        to_host,
        max_blocks,
    ) -> None:
        """Every page's chunks between the device and its host page."""
        what = "block-scaled HiCache " + ("backup" if to_host else "load")
        if to_host:
            self.kernels.host_written_since_begin = True
        _check_indices(what, host_indices, device_indices, page_size)
        shapes = _check_parts(
            what, tables, refused, parts, heads, page_size, max_blocks, self.vector
        )
        host_pages, device_pages = _page_numbers(
            host_indices, device_indices, page_size, what
        )
        for _ in range(0, len(device_pages), transfer_launch_pages):
            self.kernels.calls.append(("page_chunks", self.vector))
        self._move_chunks(
            tables, shapes, heads, host_pages, device_pages, host_stride, to_host
        )

    def create_lanes(self, handle, lanes) -> None:
        assert handle.dtype == torch.int64 and handle.numel() == 1
        assert 1 <= lanes <= 8, "1 to 8 copy lanes"
        self.kernels.ring_fill.append((0, 0))
        handle[0] = len(self.kernels.ring_fill)  # each ring its own

    def begin_load(self, on_device, lanes) -> None:
        assert lanes, "block-scaled HiCache load: no staging ring"
        self.kernels.calls.append(("begin_load", self.vector))
        self.kernels.host_written_since_begin = False

    def staged_transfer(
        self,
        tables,
        refused,
        host_indices,
        device_indices,
        parts,
        heads,
        page_size,
        stage_base,
        stage_stride,
        slot_bytes,
        pieces,
        host_base,
        host_stride,
        lanes,
        to_host,
        max_blocks,
    ) -> None:
        """Per chunk, placed as ``csrc/staged_copies.cuh`` places it: a backup
        gathers the chunks into staged pages then copies each piece to its
        host page; a load copies the pieces in, then scatters."""
        what = "block-scaled HiCache " + ("backup" if to_host else "load")
        if to_host:
            self.kernels.host_written_since_begin = True
        assert host_indices.device.type == "cpu"
        assert host_indices.dtype == torch.int64, "host indices: CPU int64"
        assert pieces.dtype == torch.int64 and pieces.shape[1] == 3
        if (
            stage_stride <= 0
            or not lanes
            or not all(_slot_pages(s, slot_bytes, stage_stride) for s in (0, 1))
        ):
            raise RuntimeError(f"{what}: no staging ring")
        _check_indices(what, host_indices, device_indices, page_size)
        shapes = _check_parts(
            what, tables, refused, parts, heads, page_size, max_blocks, self.vector
        )
        host_pages, device_pages = _page_numbers(
            host_indices, device_indices, page_size, what
        )
        if not to_host:
            assert not self.kernels.host_written_since_begin, (
                f"{what}: staged copies with no begin_load since the last backup"
            )
        first = 0
        while first < len(host_pages):
            slot, staged, entering = self._place(
                lanes, slot_bytes, stage_stride, len(host_pages) - first
            )
            self.kernels.calls.append(("staged", self.vector))
            self.kernels.placements.append((lanes, slot, entering, len(staged)))
            hosts = host_pages[first : first + len(staged)]
            devices = device_pages[first : first + len(staged)]
            first += len(staged)
            ring = (stage_base, stage_stride, host_base, host_stride)
            if not to_host:
                self._copy_pieces(pieces, hosts, staged, ring, to_host)
            self._move_chunks(
                tables, shapes, heads, staged, devices, stage_stride, to_host
            )
            if to_host:
                self._copy_pieces(pieces, hosts, staged, ring, to_host)

    def _place(
        self, lanes, slot_bytes, stride, pages
    ) -> tuple[int, torch.Tensor, bool]:
        """The ring's next chunk of up to ``pages`` staged pages: its slot, its
        staged page numbers, and whether it enters the slot (waits for the
        slot's last use), the ring's fill moved past it."""
        slot, fill = self.kernels.ring_fill[lanes - 1]
        in_slot = _slot_pages(slot, slot_bytes, stride)
        begin = -(-(slot * slot_bytes + fill) // stride)
        if begin >= in_slot.stop:
            slot, fill = (slot + 1) % 2, 0
            in_slot = _slot_pages(slot, slot_bytes, stride)
            begin = in_slot.start
        end = min(begin + pages, in_slot.stop)
        self.kernels.ring_fill[lanes - 1] = (slot, end * stride - slot * slot_bytes)
        return slot, torch.arange(begin, end), fill == 0

    def _copy_pieces(self, pieces, hosts, staged, ring, to_host) -> None:
        """Each piece of every staged page, to or from its host page."""
        stage_base, stage_stride, host_base, host_stride = ring
        for host_off, staged_off, size in pieces.tolist():
            host = ([host_base], hosts * host_stride + host_off)
            stage = ([stage_base], staged * stage_stride + staged_off)
            (src, src_off), (dst, dst_off) = (stage, host) if to_host else (host, stage)
            self.kernels._copy_rows(src, dst, src_off, dst_off, size)

    def _move_chunks(
        self, tables, shapes, heads, host_pages, device_pages, host_stride, to_host
    ) -> None:
        """page_chunks_kernel: every (page, layer, part, head) chunk."""
        for bases in tables.tolist():
            for part, shape in enumerate(shapes):
                size, row_bytes, page_stride, head_stride, row_stride, host_head = shape
                rows = torch.arange(size // row_bytes)
                for head in range(heads):
                    device = (
                        [bases[part]],
                        (
                            device_pages[:, None] * page_stride
                            + head * head_stride
                            + rows * row_stride
                        ).reshape(-1),
                    )
                    host = (
                        [bases[4 + part]],
                        (
                            host_pages[:, None] * host_stride
                            + head * host_head
                            + rows * row_bytes
                        ).reshape(-1),
                    )
                    (src, src_off), (dst, dst_off) = (
                        (device, host) if to_host else (host, device)
                    )
                    self.kernels._copy_rows(src, dst, src_off, dst_off, row_bytes)


def _slot_pages(slot: int, slot_bytes: int, stride: int) -> range:
    """The staged pages of ``stride`` bytes that lie wholly in ``slot``
    (``slot_pages`` in ``csrc/staged_copies.cuh`` counts them)."""
    return range(-(-(slot * slot_bytes) // stride), (slot + 1) * slot_bytes // stride)


def _page_numbers(host_indices, device_indices, page_size, what):
    """Each side's page numbers, every page of both (CPU) sides one aligned
    run before anything moves: the package's own check of what
    ``csrc/page_chunks.cuh`` checks (``check_transfer_pages``)."""
    for indices in (host_indices, device_indices):
        if indices.dtype != torch.int64:
            raise RuntimeError(f"{what}: token indices on the CPU must be int64")
    transfer.check_transfer_pages(host_indices, device_indices, page_size, what)
    return [
        indices[::page_size] // page_size for indices in (host_indices, device_indices)
    ]


def _check_parts(what, tables, refused, parts, heads, page_size, max_blocks, vector):
    """The pointer table, the parts table and the launch's sizes, as the
    kernel's host side checks them; each part's shape."""
    assert tables.dtype == torch.uint64 and tables.is_contiguous()
    assert tables.dim() == 2 and tables.shape[1] == 2 * 4
    assert parts.dtype == torch.int64 and parts.device.type == "cpu"
    assert tuple(parts.shape) == (4, 6)
    assert refused.dtype == torch.int64 and refused.numel() == 2
    if page_size <= 0 or max_blocks <= 0 or heads <= 0:
        raise RuntimeError(f"{what}: page_size, heads and max_blocks must be positive")
    shapes = parts.tolist()
    for part, (size, row_bytes, *_) in enumerate(shapes):
        if size % row_bytes or row_bytes % vector:
            raise RuntimeError(
                f"{what}: part {part} is not whole rows of whole vectors"
            )
    return shapes


def _check_indices(what, host_indices, device_indices, page_size) -> None:
    """Both index tensors packed 1-D of one length, whole pages."""
    for indices in (host_indices, device_indices):
        assert indices.dtype in (torch.int32, torch.int64)
        assert indices.dim() == 1 and indices.is_contiguous()
    if host_indices.numel() != device_indices.numel():
        raise RuntimeError(f"{what}: index lengths differ")
    if device_indices.numel() % page_size:
        raise RuntimeError(
            f"{what}: {device_indices.numel()} token indices are not "
            f"whole pages of {page_size}"
        )


UINT4_BYTES = 16


class EmulatedMambaKernels:
    """CPU stand-ins for SGLang's JIT Mamba state transfer kernels, emulating their contracts.

    Only for machines without CUDA. Each function takes the same arguments as its
    counterpart in ``sglang.kernels.ops.mamba.transfer_mamba`` (the Python wrapper
    that ``sglang.srt.mem_cache.pool_host.mamba`` imports by name on CUDA/ROCm) and
    moves the same bytes as ``sglang/kernels/jit/csrc/kvcacheio/transfer_mamba.cuh``
    (``TransferMambaKernel::run_pf_lf`` / ``run_lf_pf``):

    - ``transfer_kv_mamba_pf_lf`` (load, host page_first -> one device layer): for
      every ``i``, ``item_size`` bytes go from
      ``src.data_ptr() + src_indices[i] * src_layout_dim + layer_id * item_size`` to
      ``dst.data_ptr() + dst_indices[i] * item_size`` (``transfer_mamba_load_kernel``).
      ``src`` / ``dst`` are only base addresses: their shapes, strides and dtypes are
      never read. ``num_warps_per_item`` is accepted and ignored, as the wrapper does.
    - ``transfer_kv_mamba_lf_pf`` (backup, every device layer -> host page_first):
      for every ``i`` and every layer ``l < num_layers``, ``item_size`` bytes go from
      ``src_ptrs[l] + src_indices[i] * item_size`` to
      ``dst.data_ptr() + dst_indices[i] * dst_layout_dim + l * item_size``
      (``transfer_mamba_backup_kernel``).

    Checks, as the host side of the kernel makes them (``TensorMatcher`` /
    ``RuntimeCheck``): ``src_indices`` and ``dst_indices`` are 1-D int64 of one
    length on one device (``kDLGPU`` there: the CPU stands in for the GPU here, so
    both must simply share a device); ``src_ptrs`` is 1-D uint64 of ``num_layers``
    entries on that same device; ``item_size > 0`` and a multiple of 16 (the kernel
    copies in ``uint4`` steps); ``num_layers > 0`` for the backup. An empty index
    list moves nothing. What the kernel does not check but would fault on is
    asserted too: every address it touches is 16-byte aligned (``uint4`` loads and
    stores). ``get_device_accessible_ptr`` maps a host tensor through
    ``cudaHostGetDevicePointer``, so on a GPU the host buffers must be
    registered (pinned); here registration is patched out and the host pointer is used as is.

    Indices are not range-checked by the kernel: a wrong one writes out of bounds.
    Here every source and destination range is resolved against the tensors
    registered with :class:`kernel_emulation.PointerMap` (whole range inside one
    registered tensor), so a wrong index or pointer fails loudly instead of
    reading or writing garbage.
    """

    def __init__(self, pointers: PointerMap) -> None:
        self.pointers = pointers
        self.calls: list[tuple] = []

    # -- checks, as run_pf_lf / run_lf_pf make them ------------------------------

    @staticmethod
    def _check_indices(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> int:
        for name, indices in (
            ("src_indices", src_indices),
            ("dst_indices", dst_indices),
        ):
            if indices.dim() != 1 or indices.dtype != torch.int64:
                raise RuntimeError(
                    f"transfer_mamba: {name} must be 1-D int64, got "
                    f"{tuple(indices.shape)} {indices.dtype}"
                )
        if src_indices.numel() != dst_indices.numel():
            raise RuntimeError("transfer_mamba: num_indices differ")
        if src_indices.device != dst_indices.device:
            raise RuntimeError("transfer_mamba: indices on different devices")
        return src_indices.numel()

    @staticmethod
    def _check_item_size(item_size: int) -> None:
        if item_size <= 0:
            raise RuntimeError("transfer_mamba: item_size must be positive")
        if item_size % UINT4_BYTES:
            raise RuntimeError(
                "transfer_mamba: item_size must be 16-byte aligned (uint4)"
            )

    def _span(self, address: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes at ``address``, inside one registered tensor."""
        if address % UINT4_BYTES:
            raise RuntimeError(f"transfer_mamba: misaligned uint4 address {address:#x}")
        flat, offset = self.pointers.locate(address)
        if offset + nbytes > flat.numel():
            raise KeyError(
                f"transfer_mamba: {nbytes} bytes at {address:#x} run past their tensor"
            )
        return flat[offset : offset + nbytes]

    # -- the two entry points ------------------------------------------------------

    def transfer_kv_mamba_pf_lf(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        item_size: int,
        src_layout_dim: int,
        num_warps_per_item: int = 32,
    ) -> None:
        num_items = self._check_indices(src_indices, dst_indices)
        self._check_item_size(item_size)
        self.calls.append(("mamba_pf_lf", int(layer_id), item_size, num_items))
        if num_items == 0:
            return
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        for s, d in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
            source = self._span(
                src_base + s * src_layout_dim + layer_id * item_size, item_size
            )
            self._span(dst_base + d * item_size, item_size).copy_(source)

    def transfer_kv_mamba_lf_pf(
        self,
        src_ptrs: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        item_size: int,
        dst_layout_dim: int,
        num_layers: int,
        num_warps_per_item: int = 32,
    ) -> None:
        num_items = self._check_indices(src_indices, dst_indices)
        if (
            src_ptrs.dim() != 1
            or src_ptrs.dtype != torch.uint64
            or src_ptrs.numel() != num_layers
            or src_ptrs.device != src_indices.device
        ):
            raise RuntimeError(
                "transfer_mamba: src_ptrs must be 1-D uint64 of num_layers "
                "entries on the indices' device"
            )
        self._check_item_size(item_size)
        if num_layers <= 0:
            raise RuntimeError("transfer_mamba: num_layers must be positive")
        self.calls.append(("mamba_lf_pf", int(num_layers), item_size, num_items))
        if num_items == 0:
            return
        layer_bases = src_ptrs.tolist()
        dst_base = dst.data_ptr()
        for s, d in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
            for layer, layer_base in enumerate(layer_bases):
                source = self._span(layer_base + s * item_size, item_size)
                self._span(
                    dst_base + d * dst_layout_dim + layer * item_size, item_size
                ).copy_(source)


def install_emulation(monkeypatch) -> EmulatedKernels:
    """SGLang's JIT HiCache kernels and ours replaced by the emulations above.

    Patched where they are looked up: our scale_kernel module, hicache.py and the
    aliases mha.py imported, and the platform gate that lets the base class
    enable its staged write-back.
    """
    from types import SimpleNamespace

    from sglang.srt.mem_cache.pool_host import mha

    from sglang_mxfp8_hicache import refusals

    kernels = EmulatedKernels(PointerMap())
    monkeypatch.setattr(transfer, "page_chunks_module", kernels.page_chunks_module)
    # Staging rings of this emulation's own, their buffers in its pointer map.
    monkeypatch.setattr(transfer, "_rings", {})
    make_ring = transfer.staging_ring

    def staging_ring(device, module, staging_bytes, *, to_host):
        ring = make_ring(device, module, staging_bytes, to_host=to_host)
        if ring is not None and all(
            t is not ring.buffer for t in kernels.pointers._tensors
        ):
            kernels.pointers.register([ring.buffer])
        return ring

    monkeypatch.setattr(transfer, "staging_ring", staging_ring)
    for name in (
        "can_use_hicache_jit_kernel",
        "can_use_write_back_jit_kernel",
        "transfer_hicache_one_layer",
        "transfer_hicache_all_layer",
        "transfer_hicache_all_layer_mla",
        "transfer_hicache_all_layer_staged_lf_pf",
        "transfer_hicache_all_layer_mla_staged_lf_pf",
        "transfer_hicache_one_layer_mla",
        "_jit_hicache_module",
    ):
        monkeypatch.setattr(hicache_jit, name, getattr(kernels, name))
    for name in ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel"):
        monkeypatch.setattr(mha, name, getattr(kernels, name))
    for name in (
        "transfer_hicache_one_layer",
        "transfer_hicache_all_layer",
        "transfer_hicache_all_layer_staged_lf_pf",
    ):
        monkeypatch.setattr(mha, f"jit_{name}", getattr(kernels, name))
    _install_sglang_mxfp8_host_emulation(monkeypatch, kernels)
    platform = SimpleNamespace(
        capabilities=SimpleNamespace(hicache_device_kernels=True)
    )
    # 0.5.21's host pools gate on _is_cuda alone; later ones on the platform.
    monkeypatch.setattr(mha, "current_platform", platform, raising=False)
    monkeypatch.setattr(mha, "_is_cuda", True)
    monkeypatch.setattr(refusals, "platform_kernels", lambda: True)
    return kernels


def _install_sglang_mxfp8_host_emulation(monkeypatch, kernels: EmulatedKernels):
    """SGLang's own MXFP8 host pool (0.5.21 on) moves its scale pages with the
    MLA entry points, under names of its own."""
    try:
        from sglang.srt.mem_cache.pool_host import mha_mxfp8
    except ImportError:  # a release without it
        return
    monkeypatch.setattr(
        mha_mxfp8,
        "can_use_write_back_jit_kernel",
        kernels.can_use_write_back_jit_kernel,
    )
    for name in (
        "transfer_hicache_all_layer_mla_staged_lf_pf",
        "transfer_hicache_one_layer_mla",
    ):
        monkeypatch.setattr(mha_mxfp8, f"jit_{name}", getattr(kernels, name))


def install_stack_emulation(monkeypatch) -> EmulatedKernels:
    """``install_emulation`` for whole stacks that SGLang's assembler builds
    (``test/e2e.py`` on the CPU): SGLang's Mamba state kernels emulated too,
    every block-scaled device pool and host pool registers its buffers with
    the pointer map as it is built, and pinned host memory is plain memory
    (no cudaHostRegister on a CPU-only torch)."""
    kernels = install_emulation(monkeypatch)
    _install_mamba_emulation(monkeypatch, kernels.pointers)
    _plain_host_memory(monkeypatch)
    _register_buffers_when_built(monkeypatch, kernels.pointers)
    _cpu_device_module(monkeypatch)
    return kernels


def _cpu_device_module(monkeypatch) -> None:
    """The CPU's device module where a release bound CUDA's without a GPU:
    0.5.21 asks torch for it bare, which its pinned torch (2.13) answers with
    the CPU's here, and torch 2.14, which the tests run it on, with CUDA's."""
    import torch
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import l2_transfer

    if torch.cuda.is_available():
        return
    for module in (cache_controller, l2_transfer):
        if getattr(module, "device_module", None) is torch.cuda:
            monkeypatch.setattr(module, "device_module", torch.get_device_module("cpu"))


def _install_mamba_emulation(monkeypatch, pointers: PointerMap) -> None:
    from sglang.kernels.ops.mamba import transfer_mamba
    from sglang.srt.mem_cache.pool_host import mamba as mamba_host

    mamba_kernels = EmulatedMambaKernels(pointers)
    for name in ("transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf"):
        # mamba.py binds these at import, and only under CUDA/ROCm.
        monkeypatch.setattr(
            mamba_host, name, getattr(mamba_kernels, name), raising=False
        )
        monkeypatch.setattr(transfer_mamba, name, getattr(mamba_kernels, name))


def _plain_host_memory(monkeypatch) -> None:
    """Host registration a no-op, a CPU stream's synchronise a no-op, and the
    flat page a pinned pool would pin for the generic L3 read left unpinned."""
    from sglang.srt.mem_cache.pool_host import base, common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from sglang_mxfp8_hicache import host_pool

    for module in (common, base, host_pool):
        for name in ("_cuda_host_register", "_cuda_host_unregister"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *args, **kwargs: None)
    # SGLang's L2 engine synchronises its stream when a submission raises; a
    # CPU stream runs everything at once and has no such method.
    monkeypatch.setattr(
        torch.cpu.Stream, "synchronize", lambda self: None, raising=False
    )

    def unpinned(get_page):
        """A flat page target that a pinned pool would pin (the generic L3 read)."""

        def wrapped(self):
            pinned, self.pin_memory = self.pin_memory, False
            try:
                return get_page(self)
            finally:
                self.pin_memory = pinned

        return wrapped

    for cls in (MHATokenToKVPoolHost, host_pool.MHATokenToKVPoolMXFP8Host):
        get_page = cls.__dict__["get_dummy_flat_data_page"]
        monkeypatch.setattr(cls, "get_dummy_flat_data_page", unpinned(get_page))


def _register_buffers_when_built(monkeypatch, pointers: PointerMap) -> None:
    """Each device and host pool's buffers registered with ``pointers`` as
    the pool builds them: MXFP8 and FP4 device pools, Mamba state, host pools."""
    from sglang.srt.mem_cache.memory_pool import (
        MambaPool,
        MHATokenToKVPool,
        MHATokenToKVPoolMXFP8,
    )
    from sglang.srt.mem_cache.pool_host import mamba as mamba_host
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from sglang_mxfp8_hicache import host_pool
    from testkit.pools import device_buffers

    def registering(owner, method: str, buffers) -> None:
        """``owner.method`` patched to register ``buffers(self, result)``."""
        init = getattr(owner, method)

        def wrapped(self, *args, **kwargs):
            result = init(self, *args, **kwargs)
            pointers.register(buffers(self, result))
            return result

        monkeypatch.setattr(owner, method, wrapped)

    registering(MHATokenToKVPoolMXFP8, "__init__", lambda pool, _: device_buffers(pool))
    # FP4 pools are SGLang's plain MHA pool with a quant method.
    registering(
        MHATokenToKVPool,
        "__init__",
        lambda pool, _: (
            device_buffers(pool)
            if type(pool) is MHATokenToKVPool and pool.k_scale_buffer is not None
            else []
        ),
    )
    registering(
        MambaPool,
        "__init__",
        lambda pool, _: [pool.mamba_cache.temporal, *pool.mamba_cache.conv],
    )
    registering(mamba_host.MambaPoolHost, "init_kv_buffer", lambda _, kv: kv)
    registering(MHATokenToKVPoolHost, "init_kv_buffer", lambda _, kv: [kv])
    registering(
        host_pool.MHATokenToKVPoolMXFP8Host, "init_kv_buffer", lambda _, kv: [kv]
    )
