"""L3 storage of MXFP8 pages: which SGLang backends may carry them, and two hooks.

The page format itself is the host pool's (``get_page_buffer_meta``,
``get_data_page``, ``storage_format_tag``; docs/design.md). This module decides
which ``--hicache-storage-backend`` may see such a pool, and guards the one
backend that cannot tell a wrong-sized page from a good one:

* ``StorageBackendFactory.create_backend`` (AROUND): every backend SGLang
  builds, at startup and through ``attach_storage_backend``, passes here. A
  backend that would move the payload without the scales is refused by name
  before it is built.
* ``HiCacheFile.batch_get`` (AROUND): ``HiCacheFile.get`` reads a longer file
  into the page without a word and raises on a shorter one, which costs the
  whole batch. For an MXFP8 pool a file whose size is not the page's is a
  miss, logged once per batch, and nothing of it is read.

Both hooks leave every pool that is not ours to SGLang unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

logger = logging.getLogger(__name__)

FACTORY_HOOK_TARGET = (
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend"
)
FILE_GET_HOOK_TARGET = "sglang.srt.mem_cache.hicache_storage.HiCacheFile.batch_get"

NO_STORAGE = "default"
"""``get_allocator_type()`` without ``--hicache-storage-backend``."""

SUPPORTED_STORAGE_BACKENDS = ("file", "mooncake")
"""Backends whose every byte path goes through the pool's page methods, tested
end to end: ``file`` reads and writes flat pages, ``mooncake`` registers
``get_hybrid_pool_buffer()`` and moves ``get_page_buffer_meta`` parts."""

REFUSED_STORAGE_BACKENDS: dict[str, str] = {
    "hf3fs": "it stores get_data_page(flat=False)'s K and V halves, which hold no scales",
    "nixl": "it registers only kv_buffer and reads flat pointers per page",
    "aibrix": "it checks every page against a bf16/fp8 block spec without scales",
    "eic": "it registers kv_buffer only and reads the page's non-flat shape",
    "simm": "it expects one flat pointer and size per K and V page",
    "seaweedfs": "it expects one flat pointer and size per K and V page",
    "mori": "it sizes its pages from flat pointers at construction",
    "npu_memcache": "it is an Ascend NPU backend with flat per-page pointers",
    "tensorcast": "it serves the exact MHATokenToKVPoolHost class only",
    "sim": "it stores no bytes, so every page it 'serves' is garbage",
    "shm": "it is a no-op store paired with a shared-memory allocator",
    "dynamic": "a backend loaded by module path is unknown code; it may move the "
    "payload without the scales",
}
"""Every other backend SGLang 0.5.23 offers, with the reason it is refused."""


def storage_refusal(backend: str) -> str | None:
    """Why ``backend`` cannot carry MXFP8 pages, or None if it can."""
    if backend in (NO_STORAGE, *SUPPORTED_STORAGE_BACKENDS):
        return None
    reason = REFUSED_STORAGE_BACKENDS.get(backend, "it is not one SGLang 0.5.23 offers")
    return (
        f"--hicache-storage-backend {backend} cannot store MXFP8 pages: {reason}. "
        f"Use one of {', '.join(SUPPORTED_STORAGE_BACKENDS)}, or run without "
        "--hicache-storage-backend."
    )


def mxfp8_host_pools(host_pool: Any) -> list[MHATokenToKVPoolMXFP8Host]:
    """Our pools in what SGLang hands a backend: the pool, or a group's entries."""
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

    entries = getattr(host_pool, "entries", None) or ()
    pools = [host_pool, *(getattr(e, "host_pool", None) for e in entries)]
    return [p for p in pools if isinstance(p, MHATokenToKVPoolMXFP8Host)]


def refuse_unsupported_backend(
    original: Callable[..., Any],
    factory: type,
    backend_name: str,
    storage_config: Any,
    mem_pool_host: Any,
    **kwargs: Any,
) -> Any:
    """AROUND hook on ``StorageBackendFactory.create_backend``."""
    pools = mxfp8_host_pools(mem_pool_host)
    reason = storage_refusal(backend_name) if pools else None
    if reason is not None:
        from sglang_mxfp8_hicache.host_pool import MXFP8HiCacheConfigError

        raise MXFP8HiCacheConfigError(f"{pools[0].pool_label}: MXFP8 HiCache: {reason}")
    backend = original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    for pool in pools:
        logger.info(
            "%s: MXFP8 pages go to L3 backend %r as %r (key tag %r).",
            pool.pool_label,
            backend_name,
            pool.describe_storage_page(),
            pool.storage_format_tag,
        )
    return backend


def file_batch_get_checked(
    original: Callable[..., Any],
    backend: Any,
    keys: Sequence[str],
    target_locations: Sequence[torch.Tensor] | None,
    target_sizes: Any = None,
) -> list[torch.Tensor | None]:
    """AROUND hook on ``HiCacheFile.batch_get``: a file that is not exactly one
    page of the pool's format is a miss (None), and the batch logs one line."""
    if not mxfp8_host_pools(getattr(backend, "mem_pool_host", None)) or not keys:
        return original(backend, keys, target_locations, target_sizes)
    wrong: list[tuple[str, int, int]] = []
    results: list[torch.Tensor | None] = []
    for key, target in zip(keys, target_locations, strict=True):
        expected = target.numel() * target.element_size()
        path = os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")
        try:
            found = os.path.getsize(path)
        except OSError:
            found = expected  # missing: HiCacheFile.get logs and misses itself
        if found != expected:
            wrong.append((key, found, expected))
            results.append(None)
        else:
            results.append(backend.get(key, target))
    if wrong:
        key, found, expected = wrong[0]
        logger.warning(
            "HiCacheFile: %d of %d MXFP8 pages in this batch have the wrong size and "
            "are treated as not in L3 (first: %s, %d bytes, expected %d).",
            len(wrong),
            len(keys),
            key,
            found,
            expected,
        )
    return results
