"""The server flags a block-scaled HiCache host pool refuses, as one table.

Each row is (flag, condition, reason): the flag an operator changes, when the
row applies to a :class:`HiCacheFlags`, and why it is refused, naming what to
set instead. Two callers read the table, both before anything is allocated:

- the plugin, right after SGLang resolves its server arguments
  (``ServerArgs.resolve_once``), so that ``launch_server`` with flags the pool
  cannot serve fails within seconds of its start, before a model loads;
- the pool's constructor (``host_pool``), with the flags of the running server
  and the device pool it is given; it then checks what only those buffers can
  tell (heads, scale layout, drafts, contiguity).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_mxfp8_hicache.geometry import FORMATS, INTERLEAVED_PAGE_SIZE
from sglang_mxfp8_hicache.storage import NO_STORAGE, storage_refusal

SERVED_LAYOUTS = ("page_first", "page_first_direct", "layer_first", "page_head")
"""Host layouts SGLang offers for MHA pools, all served: ``page_head`` by the
heads-major page (L3 head groups shared across TP sizes), the others by the
layer-major one; SGLang's controller places a transfer's indices by the name."""
HEADS_MAJOR_LAYOUT = "page_head"
SERVED_IO_BACKENDS = ("kernel", "direct")


@dataclass(frozen=True)
class HiCacheFlags:
    """The flags the table reads, as the server resolved them.

    ``symmetric``: K and V heads of one size, known once the model is (the
    pool knows it; the server-args check passes True and leaves it to the
    pool)."""

    kv_cache_dtype: str
    page_size: int
    mem_layout: str
    io_backend: str = "kernel"
    storage_backend: str | None = None
    """``--hicache-storage-backend``, or None (also SGLang's "default")."""
    storage_extra_config: dict[str, Any] | None = None
    decode_host_receive: bool = False
    symmetric: bool = True

    @classmethod
    def from_server_args(cls, args: Any) -> HiCacheFlags:
        """From a resolved ``ServerArgs`` (or its resolving view)."""
        extra_config = args.hicache_storage_backend_extra_config
        if not isinstance(extra_config, dict):
            try:
                extra_config = json.loads(extra_config) if extra_config else {}
            except (TypeError, ValueError):
                extra_config = None  # SGLang's own parser reports it
        threshold = args.disaggregation_decode_host_receive_threshold
        return cls(
            kv_cache_dtype=args.kv_cache_dtype,
            page_size=args.page_size,
            mem_layout=args.hicache_mem_layout,
            io_backend=args.hicache_io_backend or "kernel",
            storage_backend=args.hicache_storage_backend,
            storage_extra_config=extra_config,
            decode_host_receive=threshold is not None and threshold < 1,
        )


@dataclass(frozen=True)
class Refusal:
    flag: str
    applies: Callable[[HiCacheFlags], bool]
    reason: Callable[[HiCacheFlags], str]


def _storage_reason(flags: HiCacheFlags) -> str | None:
    return storage_refusal(
        flags.storage_backend or NO_STORAGE,
        flags.kv_cache_dtype,
        sealed=flags.mem_layout != HEADS_MAJOR_LAYOUT,
        symmetric=flags.symmetric,
        extra_config=flags.storage_extra_config,
    )


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "--page-size",
        lambda f: (
            FORMATS[f.kv_cache_dtype].interleaved
            and f.page_size != INTERLEAVED_PAGE_SIZE
        ),
        lambda f: (
            f"--kv-cache-dtype {f.kv_cache_dtype} at --page-size "
            f"{f.page_size}: SGLang 0.5.23 builds such pools with per-token scales, "
            "but none of its write paths writes them (set_kv_buffer needs the "
            f"page-interleaved scales of page_size {INTERLEAVED_PAGE_SIZE}), so "
            f"there is nothing to serve; set --page-size {INTERLEAVED_PAGE_SIZE}."
        ),
    ),
    Refusal(
        "--hicache-mem-layout",
        lambda f: f.mem_layout not in SERVED_LAYOUTS,
        lambda f: (
            f"--hicache-mem-layout {f.mem_layout} is not served: SGLang "
            "offers it for no MHA host pool. Use --hicache-mem-layout "
            f"{', '.join(SERVED_LAYOUTS)}."
        ),
    ),
    Refusal(
        "--hicache-io-backend",
        lambda f: f.io_backend not in SERVED_IO_BACKENDS,
        lambda f: (
            f"--hicache-io-backend {f.io_backend} is not served (it is a "
            "vendor path with its own page layout); use --hicache-io-backend "
            f"{' or '.join(SERVED_IO_BACKENDS)}."
        ),
    ),
    Refusal(
        "--disaggregation-decode-host-receive-threshold",
        lambda f: f.decode_host_receive,
        lambda f: (
            "--disaggregation-decode-host-receive-threshold < 1 receives "
            "KV into the host pool, and SGLang's decode side rejects block-scaled "
            f"({f.kv_cache_dtype}) KV state there whatever the host pool "
            "(StateType.BLOCK_SCALE); leave the threshold at 1."
        ),
    ),
    Refusal(
        "--hicache-storage-backend",
        lambda f: _storage_reason(f) is not None,
        lambda f: _storage_reason(f) or "",
    ),
)


def refusal(flags: HiCacheFlags) -> str | None:
    """Why the first row of the table that applies to ``flags`` refuses them,
    or None if none does."""
    for row in REFUSALS:
        if row.applies(flags):
            return row.reason(flags)
    return None
