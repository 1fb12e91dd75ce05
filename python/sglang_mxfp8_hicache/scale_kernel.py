"""The JIT kernel that moves MXFP8 scale rows: every layer, K and V, in one launch.

Built with SGLang's own JIT loader from ``csrc/scale_rows.cuh``, which reuses
the byte copy of SGLang's all-layer HiCache kernel. What it adds is index
handling: indices are read with a step (every ``row_tokens``-th token), and a
backup's host page starts travel in the launch parameters. SGLang's kernel
needs packed GPU index tensors instead, whose preparation (a pinned upload and
a gather) cost a one-page backup more CPU time than its whole budget
(``docs/benchmarks.md``, tables E and F).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sglang.kernels.jit.utils import KERNEL_PATH, cache_once, load_jit, make_cpp_args
from sglang.kernels.ops.kvcache.hicache import DEFAULT_BLOCK_QUOTA, _default_unroll

if TYPE_CHECKING:
    from tvm_ffi.module import Module

SOURCE = Path(__file__).with_name("csrc") / "scale_rows.cuh"
# Block size of SGLang's register HiCache kernels.
BLOCK_SIZE = 1024
# Pages one backup launch takes (kMaxPagesPerLaunch in the source).
MAX_PAGES_PER_LAUNCH = 256


@cache_once
def scale_rows_module(row_bytes: int, *, walk_layers: bool) -> Module:
    """``backup`` and ``load`` entry points for rows of ``row_bytes`` bytes.

    ``walk_layers``: a worker takes one row through every layer, as SGLang's
    all-layer kernel does, rather than one (row, layer).

    backup(tables, host_indices, device_indices, host_stride, device_stride,
    row_tokens, page_size) and load(tables, host_indices, device_indices,
    host_stride, device_stride, row_tokens): ``tables`` is a [4, layers] uint64
    GPU tensor of layer base addresses (host K, host V, device K, device V).
    """
    args = make_cpp_args(
        row_bytes,
        _default_unroll(row_bytes),
        DEFAULT_BLOCK_QUOTA,
        BLOCK_SIZE,
        walk_layers,
    )
    kernel = f"&sglang_mxfp8_hicache::ScaleRowKernel<{args}>"
    return load_jit(
        "mxfp8_hicache_scale_rows",
        *args,
        cuda_files=[str(SOURCE)],
        cuda_wrappers=[("backup", f"{kernel}::backup"), ("load", f"{kernel}::load")],
        extra_include_paths=[str(KERNEL_PATH / "csrc")],
    )
