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
- ``scale_rows_module(row_bytes)`` (ours, ``csrc/scale_rows.cuh``): ``tables`` is
  a packed [4, layers] uint64 table (host K, host V, device K, device V). Row
  ``i`` moves ``row_bytes`` per layer and side between host token ``h_i`` (times
  the host stride) and device token ``device_indices[i * row_tokens]`` (times
  the device stride). Both refuse a count that is not whole pages. ``load``
  reads ``h_i = host_indices[i * row_tokens]`` (same dtype as the device
  indices); ``backup`` takes CPU int64 host indices of whole pages, refuses a
  page that is not one run of ``page_size`` tokens from a multiple of
  ``page_size``, and reads ``h_i`` as the page's first token plus
  ``row * row_tokens``; one launch per 256 pages. On GPU-resident indices (the
  device side always, the host side of a load) a chunk that does not sit at its
  page's aligned start plus ``row * row_tokens`` (the last chunk: or whose page
  does not end ``page_size - 1`` tokens later) is not moved, and ``refused``
  becomes (1 device | 2 host, the page's first token), the device side first.
  An empty ``refused`` turns these checks off.
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

from sglang_mxfp8_hicache import scale_kernel
from sglang_mxfp8_hicache.scale_kernel import check_transfer_pages


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


class EmulatedKernels:
    """The hicache.py entry points our path and the base class use, on CPU."""

    def __init__(self, pointers: PointerMap) -> None:
        self.pointers = pointers
        self.calls: list[tuple[str, int]] = []

    @staticmethod
    def can_use_hicache_jit_kernel(
        *, element_size, unroll=None, block_quota=None, page_size=None
    ) -> bool:
        # The register kernel's rule; TMA is off unless SGLANG_HICACHE_TMA_TRANSFER.
        unroll = unroll or hicache_jit._default_unroll(element_size)
        return hicache_jit._tiles_across_lanes(element_size, unroll)

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
        element_size = (
            element_size or staging_k[0, 0].numel() * staging_k.element_size()
        )
        self.calls.append(("staged_write_back", element_size))
        assert element_size % 16 == 0, "element size must be 16-byte aligned"
        assert dst_indices.device.type == "cpu" and dst_indices.dtype == torch.int64
        assert src_indices.dtype in (torch.int32, torch.int64)
        layer_num = staging_k.shape[1]
        assert k_ptr_src.dtype == torch.uint64 and k_ptr_src.numel() == layer_num
        src_pages = src_indices[::page_size].tolist()
        capacity = staging_k.shape[0] // page_size
        for begin in range(0, len(src_pages), capacity):
            chunk = src_pages[begin : begin + capacity]
            tokens = len(chunk) * page_size
            chunk_dst = dst_indices[begin * page_size : begin * page_size + tokens]
            assert chunk_dst.numel() == tokens, "staging token count mismatch"
            for ptrs, staging, dst in (
                (k_ptr_src, staging_k, dst_k),
                (v_ptr_src, staging_v, dst_v),
            ):
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
        assert self.can_use_hicache_jit_kernel(element_size=element_size)
        tables = (k_ptr_dst, v_ptr_dst, k_ptr_src, v_ptr_src)
        assert all(t.dtype == torch.uint64 and t.dim() == 1 for t in tables)
        assert len({t.numel() for t in tables}) == 1, "pointer tables differ in layers"
        assert indices_src.dtype in (torch.int32, torch.int64)
        assert indices_dst.dtype in (torch.int32, torch.int64)
        assert indices_src.numel() == indices_dst.numel()
        for src_table, dst_table in ((k_ptr_src, k_ptr_dst), (v_ptr_src, v_ptr_dst)):
            self._copy_rows(
                src_table.tolist(),
                dst_table.tolist(),
                indices_src.long() * kv_cache_src_stride_bytes,
                indices_dst.long() * kv_cache_dst_stride_bytes,
                element_size,
            )

    def _copy_rows(self, src_bases, dst_bases, src_offsets, dst_offsets, row_bytes):
        """Per layer: row_bytes from src_bases[l] + src_offsets[i] to dst_bases[l] + dst_offsets[i]."""
        span = torch.arange(row_bytes)
        for src_address, dst_address in zip(src_bases, dst_bases, strict=True):
            src, src_base = self.pointers.locate(src_address)
            dst, dst_base = self.pointers.locate(dst_address)
            dst[dst_base + dst_offsets[:, None] + span] = src[
                src_base + src_offsets[:, None] + span
            ]

    def scale_rows_module(self, row_bytes: int):
        # walk_layers changes which worker moves a chunk, not the bytes moved.
        kernels = self

        def check(tables, host_indices, device_indices, row_tokens, page_size, what):
            assert tables.dtype == torch.uint64 and tables.is_contiguous()
            assert tables.dim() == 2 and tables.shape[0] == 4
            assert device_indices.dtype in (torch.int32, torch.int64)
            assert host_indices.dtype in (torch.int32, torch.int64)
            for indices in (host_indices, device_indices):
                assert indices.dim() == 1 and indices.is_contiguous()
            assert host_indices.numel() == device_indices.numel()
            if not (row_tokens > 0 and page_size > 0 and page_size % row_tokens == 0):
                raise RuntimeError(f"{what}: chunks must tile a page")
            return tuple(tables.tolist())

        def move(tables, host_rows, device_rows, host_stride, device_stride, to_host):
            host_k, host_v, device_k, device_v = tables
            host_offsets = host_rows * host_stride
            device_offsets = device_rows * device_stride
            for host_bases, device_bases in ((host_k, device_k), (host_v, device_v)):
                src, dst = (
                    (device_bases, host_bases)
                    if to_host
                    else (host_bases, device_bases)
                )
                offsets = (
                    (device_offsets, host_offsets)
                    if to_host
                    else (host_offsets, device_offsets)
                )
                kernels._copy_rows(src, dst, *offsets, row_bytes)

        def gpu_host_rows(host_indices, device_indices, row_tokens, what):
            # On a GPU both sit on one device; here everything is on the CPU.
            if host_indices.dtype != device_indices.dtype:
                raise RuntimeError(
                    f"{what}: host indices on the GPU must share the device "
                    "indices' device and dtype"
                )
            return host_indices.long()[::row_tokens]

        def aligned_chunks(indices, row_tokens, page_size):
            """Per chunk: it sits at its page's start plus its row, the page
            starts aligned, and (the last chunk only) ends page_size - 1 later;
            and each chunk's page start."""
            pages = indices.long().cpu().view(-1, page_size)
            starts = pages[:, :1]
            rows = page_size // row_tokens
            ok = pages[:, ::row_tokens] == starts + torch.arange(rows) * row_tokens
            ok &= (starts >= 0) & (starts % page_size == 0)
            ok[:, -1] &= pages[:, -1] == starts[:, 0] + page_size - 1
            return ok.reshape(-1), starts.expand(-1, rows).reshape(-1)

        def refuse_bad_chunks(refused, device_check, host_check=None):
            """The chunks to move; a bad one's page start goes to ``refused``
            (the device side first, as the kernel checks it first)."""
            device_ok, device_starts = device_check
            host_ok, host_starts = host_check or (torch.ones_like(device_ok), None)
            if refused.numel() == 0:  # no words: the kernel checks nothing
                return torch.ones_like(device_ok)
            keep = device_ok & host_ok
            if not bool(keep.all()):
                chunk = int((~keep).nonzero()[0])
                on_device = not bool(device_ok[chunk])
                starts = device_starts if on_device else host_starts
                refused[0], refused[1] = (1 if on_device else 2), int(starts[chunk])
            return keep

        class Module:
            @staticmethod
            def backup(
                tables,
                refused,
                host_indices,
                device_indices,
                host_stride,
                device_stride,
                row_tokens,
                page_size,
                walk_layers,
            ) -> None:
                what = "MXFP8 scale backup"
                bases = check(
                    tables, host_indices, device_indices, row_tokens, page_size, what
                )
                # Without a GPU, host indices are always on the CPU: the
                # page-start path. The GPU-index path runs on a GPU only.
                host_on_cpu = host_indices.device.type == "cpu"
                check_transfer_pages(
                    host_indices, device_indices, page_size, what, host_runs=host_on_cpu
                )
                if host_on_cpu:
                    # Each page's first token, from the CPU, in launch parameters.
                    if host_indices.dtype != torch.int64:
                        raise RuntimeError(
                            f"{what}: host indices on the CPU must be int64"
                        )
                    starts = host_indices.view(-1, page_size)[:, 0]
                    rows_per_page = page_size // row_tokens
                    host_rows = (
                        starts[:, None] + torch.arange(rows_per_page) * row_tokens
                    ).reshape(-1)
                    pages = starts.numel()
                    for _ in range(0, pages, scale_kernel.MAX_PAGES_PER_LAUNCH):
                        kernels.calls.append(("scale_rows_backup", row_bytes))
                    checks = [aligned_chunks(device_indices, row_tokens, page_size)]
                else:
                    host_rows = gpu_host_rows(
                        host_indices, device_indices, row_tokens, what
                    )
                    kernels.calls.append(("scale_rows_backup", row_bytes))
                    checks = [
                        aligned_chunks(device_indices, row_tokens, page_size),
                        aligned_chunks(host_indices, row_tokens, page_size),
                    ]
                keep = refuse_bad_chunks(refused, *checks)
                device_rows = device_indices.long()[::row_tokens].cpu()
                move(
                    bases,
                    host_rows[keep],
                    device_rows[keep],
                    host_stride,
                    device_stride,
                    True,
                )

            @staticmethod
            def load(
                tables,
                refused,
                host_indices,
                device_indices,
                host_stride,
                device_stride,
                row_tokens,
                page_size,
                walk_layers,
            ) -> None:
                what = "MXFP8 scale load"
                bases = check(
                    tables, host_indices, device_indices, row_tokens, page_size, what
                )
                check_transfer_pages(
                    host_indices, device_indices, page_size, what, host_runs=False
                )
                host_rows = gpu_host_rows(
                    host_indices, device_indices, row_tokens, what
                )
                kernels.calls.append(("scale_rows_load", row_bytes))
                keep = refuse_bad_chunks(
                    refused,
                    aligned_chunks(device_indices, row_tokens, page_size),
                    aligned_chunks(host_indices, row_tokens, page_size),
                )
                device_rows = device_indices.long()[::row_tokens]
                move(
                    bases,
                    host_rows[keep],
                    device_rows[keep],
                    host_stride,
                    device_stride,
                    False,
                )

        return Module()

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
        element_dim = element_dim or k_cache_dst.size(-1)
        self.calls.append(("one_layer", element_dim * k_cache_dst.element_size()))
        assert indices_dst.dtype in (torch.int32, torch.int64)
        assert indices_src.dtype in (torch.int32, torch.int64)
        assert indices_dst.numel() == indices_src.numel()
        for src, dst in ((k_cache_src, k_cache_dst), (v_cache_src, v_cache_dst)):
            src_rows = _bytes(src.view(-1, element_dim))
            dst_rows = _bytes(dst.view(-1, element_dim))
            dst_rows[indices_dst.long()] = src_rows[indices_src.long()]


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

    from sglang_mxfp8_hicache import host_pool

    kernels = EmulatedKernels(PointerMap())
    monkeypatch.setattr(scale_kernel, "scale_rows_module", kernels.scale_rows_module)
    for name in (
        "can_use_hicache_jit_kernel",
        "can_use_write_back_jit_kernel",
        "transfer_hicache_one_layer",
        "transfer_hicache_all_layer",
        "transfer_hicache_all_layer_staged_lf_pf",
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
    platform = SimpleNamespace(
        capabilities=SimpleNamespace(hicache_device_kernels=True)
    )
    monkeypatch.setattr(mha, "current_platform", platform)
    monkeypatch.setattr(mha, "_is_cuda", True)
    monkeypatch.setattr(host_pool, "current_platform", platform)
    return kernels


def install_stack_emulation(monkeypatch) -> EmulatedKernels:
    """``install_emulation`` for whole stacks that SGLang's assembler builds
    (``tools.e2e`` on the CPU): every block-scaled device pool and host pool
    registers its buffers with the pointer map as it is built, and pinned
    host memory is plain memory (no cudaHostRegister on a CPU-only torch)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.pool_host import base, common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from sglang_mxfp8_hicache import host_pool
    from sglang_mxfp8_hicache.tools.selfcheck import device_buffers

    kernels = install_emulation(monkeypatch)
    mamba_kernels = EmulatedMambaKernels(kernels.pointers)
    from sglang.kernels.ops.mamba import transfer_mamba
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.pool_host import mamba as mamba_host

    for name in ("transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf"):
        # mamba.py binds these at import, and only under CUDA/ROCm.
        monkeypatch.setattr(
            mamba_host, name, getattr(mamba_kernels, name), raising=False
        )
        monkeypatch.setattr(transfer_mamba, name, getattr(mamba_kernels, name))
    for module in (common, base, host_pool):
        for name in ("_cuda_host_register", "_cuda_host_unregister"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *args, **kwargs: None)

    def registering(init, buffers):
        def wrapped(self, *args, **kwargs):
            result = init(self, *args, **kwargs)
            kernels.pointers.register(buffers(self, result))
            return result

        return wrapped

    monkeypatch.setattr(
        MHATokenToKVPoolMXFP8,
        "__init__",
        registering(
            MHATokenToKVPoolMXFP8.__init__, lambda pool, _: device_buffers(pool)
        ),
    )
    # FP4 pools are SGLang's plain MHA pool with a quant method.
    monkeypatch.setattr(
        MHATokenToKVPool,
        "__init__",
        registering(
            MHATokenToKVPool.__init__,
            lambda pool, _: (
                device_buffers(pool)
                if type(pool) is MHATokenToKVPool and pool.k_scale_buffer is not None
                else []
            ),
        ),
    )
    monkeypatch.setattr(
        MambaPool,
        "__init__",
        registering(
            MambaPool.__init__,
            lambda pool, _: [pool.mamba_cache.temporal, *pool.mamba_cache.conv],
        ),
    )
    monkeypatch.setattr(
        mamba_host.MambaPoolHost,
        "init_kv_buffer",
        registering(
            mamba_host.MambaPoolHost.init_kv_buffer, lambda _, buffers: buffers
        ),
    )
    monkeypatch.setattr(
        MHATokenToKVPoolHost,
        "init_kv_buffer",
        registering(MHATokenToKVPoolHost.init_kv_buffer, lambda _, kv: [kv]),
    )
    monkeypatch.setattr(
        host_pool.MHATokenToKVPoolMXFP8Host,
        "init_kv_buffer",
        registering(
            host_pool.MHATokenToKVPoolMXFP8Host.init_kv_buffer,
            lambda pool, _: [pool.scale_host],
        ),
    )
    return kernels
