"""The kernels that move MXFP8 scale chunks: ours, and SGLang's as the fallback.

Both move, for the layers of one ``[4, layers]`` uint64 pointer table (host K,
host V, device K, device V), the chunks of every page of a transfer: chunk ``i``
of ``row_bytes`` bytes sits at token index ``indices[i * row_tokens]`` times a
fixed stride on each side (see ``host_pool``).

- :class:`ScaleRowKernel` is ours (``csrc/scale_rows.cuh``, built by SGLang's JIT
  loader): SGLang's all-layer copy reading every ``row_tokens``-th index of the
  transfer's own index tensors, with a backup's CPU host page starts passed in
  the launch parameters. A transfer costs one FFI call and one launch.
- :class:`SGLangAllLayerKernel` is SGLang's own all-layer JIT kernel, which
  needs packed GPU index tensors: they are gathered (and, for CPU host indices,
  uploaded through pinned memory) on every transfer. It moves the same bytes a
  little slower on small transfers (``docs/benchmarks.md``), and it is what a
  pool uses when ours does not build: another CUDA toolchain, or a change in
  the SGLang headers ours includes.

Both refuse, before anything moves, a transfer whose index count is not whole
pages, and a backup whose CPU host indices are not whole aligned pages. Index
values that live on the GPU are not read on the CPU: that would synchronise the
transfer stream on every call. Ours checks them in the kernel instead: a chunk
whose page is not one aligned run stays where it is, the kernel notes the
page's first token in a pinned word, and the pool's next transfer raises
:class:`MXFP8ScaleIndexError` (the payload of that transfer has moved by then).
SGLang's kernel does not check them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from sglang.kernels.jit.utils import KERNEL_PATH, cache_once, load_jit, make_cpp_args
from sglang.kernels.ops.kvcache import hicache

if TYPE_CHECKING:
    from tvm_ffi.module import Module

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "scale_rows.cuh"
# Block size of SGLang's register HiCache kernels.
BLOCK_SIZE = 1024
# Pages one backup launch takes with CPU host indices (kMaxPagesPerLaunch).
MAX_PAGES_PER_LAUNCH = 256


@dataclass(frozen=True)
class ScaleRowStrides:
    """Where chunk ``i`` of a transfer lives: a token index times a stride per side."""

    host_stride: int
    device_stride: int
    row_tokens: int
    page_size: int


class MXFP8ScaleIndexError(RuntimeError):
    """A transfer named GPU token indices that are not whole aligned pages."""


class ScaleKernel(Protocol):
    name: str

    def raise_if_refused(self) -> None:
        """Raise if an earlier launch refused a page (see the module docstring)."""

    def backup(
        self,
        tables: torch.Tensor,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        strides: ScaleRowStrides,
        *,
        walk_layers: bool,
    ) -> None: ...

    def load(
        self,
        tables: torch.Tensor,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        strides: ScaleRowStrides,
        *,
        walk_layers: bool,
    ) -> None: ...


@cache_once
def scale_rows_module(row_bytes: int) -> Module:
    """``backup`` and ``load`` entry points for chunks of ``row_bytes`` bytes.

    Both take (tables, refused, host_indices, device_indices, host_stride,
    device_stride, row_tokens, page_size, walk_layers); ``refused``: two pinned
    int64 words the kernel sets to (1 device | 2 host, first token) for a page
    it did not move; ``walk_layers``: a worker takes one chunk through every
    layer, as SGLang's all-layer kernel does, rather than one (chunk, layer).
    """
    args = make_cpp_args(
        row_bytes,
        hicache._default_unroll(row_bytes),
        hicache.DEFAULT_BLOCK_QUOTA,
        BLOCK_SIZE,
    )
    kernel = f"&sglang_mxfp8_hicache::ScaleRowKernel<{args}>"
    return load_jit(
        "mxfp8_hicache_scale_rows",
        *args,
        cuda_files=[str(SOURCE)],
        cuda_wrappers=[("backup", f"{kernel}::backup"), ("load", f"{kernel}::load")],
        extra_include_paths=[str(KERNEL_PATH / "csrc")],
    )


class ScaleRowKernel:
    """Ours: one FFI call and one launch per transfer (per 256 pages of a CPU-indexed backup)."""

    name = "sglang-mxfp8-hicache scale_rows"

    def __init__(self, row_bytes: int, *, check_gpu_indices: bool = True) -> None:
        self._module = scale_rows_module(row_bytes)
        # Pinned, so the kernel can write it and the CPU read it, no copy; no
        # words: the kernel checks nothing (a bench ablation).
        words = 2 if check_gpu_indices else 0
        pinned = torch.cuda.is_available()
        self._refused = torch.zeros(words, dtype=torch.int64, pin_memory=pinned)
        self._refused_words = self._refused.numpy()  # read without a torch op

    def raise_if_refused(self) -> None:
        side, first_token = self._refused_words.tolist() or (0, 0)
        if not side:
            return
        self._refused.zero_()
        raise MXFP8ScaleIndexError(
            f"an earlier MXFP8 scale transfer named a {('device', 'host')[side - 1]} "
            f"page starting at token {first_token} that is not one aligned run of "
            "whole-page token indices: its scales were not moved, its payload was. "
            "HiCache hands a host pool whole pages; whatever sent these did not."
        )

    def backup(self, tables, host_indices, device_indices, strides, *, walk_layers):
        self._module.backup(
            tables,
            self._refused,
            host_indices,
            device_indices,
            strides.host_stride,
            strides.device_stride,
            strides.row_tokens,
            strides.page_size,
            walk_layers,
        )

    def load(self, tables, host_indices, device_indices, strides, *, walk_layers):
        self._module.load(
            tables,
            self._refused,
            host_indices,
            device_indices,
            strides.host_stride,
            strides.device_stride,
            strides.row_tokens,
            strides.page_size,
            walk_layers,
        )


def check_transfer_pages(
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    what: str,
    *,
    host_runs: bool,
) -> None:
    """The checks ``csrc/scale_rows.cuh`` makes on the CPU, with its messages.

    ``host_runs``: also check that each host page is one aligned run of
    ``page_size`` tokens, as a backup does with CPU host indices.
    """
    count = device_indices.numel()
    if host_indices.numel() != count:
        raise RuntimeError(
            f"{what}: {host_indices.numel()} host and {count} device token indices"
        )
    if count % page_size:
        raise RuntimeError(
            f"{what}: {count} token indices are not whole pages of {page_size} tokens"
        )
    if not host_runs:
        return
    pages = host_indices.view(-1, page_size)
    starts = pages[:, 0]
    runs = (starts >= 0) & (starts % page_size == 0)
    runs &= pages[:, -1] == starts + page_size - 1
    bad = (~runs).nonzero()
    if bad.numel():
        page = int(bad[0])
        raise RuntimeError(
            f"{what}: host page {page} is not one aligned run of {page_size} "
            f"tokens (it starts at token {int(starts[page])})"
        )


class SGLangAllLayerKernel:
    """SGLang's all-layer JIT kernel with chunk indices prepared per transfer."""

    name = "SGLang's transfer_hicache_all_layer"

    def __init__(self, row_bytes: int) -> None:
        self._launch_all = hicache._jit_hicache_module(
            element_size=row_bytes,
            unroll=hicache._default_unroll(row_bytes),
            block_quota=hicache.DEFAULT_BLOCK_QUOTA,
        ).launch_all

    def raise_if_refused(self) -> None:
        """SGLang's kernel checks no index values; nothing is ever refused."""

    @staticmethod
    def _chunk_indices(
        host_indices: torch.Tensor, device_indices: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every ``step``-th index of both sides, packed, on the GPU, one dtype."""
        device_rows = device_indices[::step]
        if host_indices.device != device_indices.device:
            host_rows = host_indices[::step].pin_memory()
            host_rows = host_rows.to(device_indices.device, non_blocking=True)
            return host_rows.to(device_rows.dtype), device_rows.contiguous()
        if step == 1 and host_indices.dtype == device_indices.dtype:
            return host_indices, device_indices
        host_rows = host_indices[::step].to(device_rows.dtype)
        host_rows, device_rows = torch.stack((host_rows, device_rows))
        return host_rows, device_rows

    def _move(self, tables, host_indices, device_indices, strides, *, to_host):
        host_k, host_v, device_k, device_v = tables
        host_rows, device_rows = self._chunk_indices(
            host_indices, device_indices, strides.row_tokens
        )
        # (K dst, V dst, rows dst, K src, V src, rows src, src stride, dst stride)
        host = (host_k, host_v, host_rows)
        device = (device_k, device_v, device_rows)
        if to_host:
            self._launch_all(*host, *device, strides.device_stride, strides.host_stride)
        else:
            self._launch_all(*device, *host, strides.host_stride, strides.device_stride)

    def backup(self, tables, host_indices, device_indices, strides, *, walk_layers):
        # SGLang's kernel always walks the layers of a chunk.
        check_transfer_pages(
            host_indices,
            device_indices,
            strides.page_size,
            "MXFP8 scale backup",
            host_runs=host_indices.device.type == "cpu",
        )
        self._move(tables, host_indices, device_indices, strides, to_host=True)

    def load(self, tables, host_indices, device_indices, strides, *, walk_layers):
        check_transfer_pages(
            host_indices,
            device_indices,
            strides.page_size,
            "MXFP8 scale load",
            host_runs=False,
        )
        self._move(tables, host_indices, device_indices, strides, to_host=False)


class ScaleKernelUnavailable(RuntimeError):
    """Neither our kernel nor SGLang's builds for this chunk size."""


def build_scale_kernel(
    row_bytes: int, *, pool_label: str, prefer_ours: bool = True
) -> ScaleKernel:
    """Ours if it builds, else SGLang's all-layer kernel, with one warning."""
    ours_error = None
    if prefer_ours:
        try:
            return ScaleRowKernel(row_bytes)
        except Exception as exc:
            ours_error = exc
    try:
        kernel = SGLangAllLayerKernel(row_bytes)
    except Exception as exc:
        reason = f"ours: {ours_error}; " if ours_error else ""
        raise ScaleKernelUnavailable(
            f"no kernel for scale chunks of {row_bytes} B builds ({reason}"
            f"SGLang's all-layer kernel: {exc})"
        ) from exc
    if ours_error is not None:
        logger.warning(
            "%s: the MXFP8 scale-chunk kernel (%s) failed to build: %s. Scales move "
            "through %s instead: the same bytes, slower on small transfers.",
            pool_label,
            SOURCE.name,
            ours_error,
            kernel.name,
        )
    return kernel
