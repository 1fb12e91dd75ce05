"""L3 storage of block-scaled pages: which SGLang backends may carry them, and
the guard each gets (``guards.py``).

The stored page is the host page itself (``page.HostPage``: one span, K part
then V part; ``get_page_buffer_meta`` gives one pointer and size per part, the
flat page is a view of the span; ``docs/storage.md``). This module hooks
``StorageBackendFactory.create_backend`` (AROUND), which every backend SGLang
builds passes, at startup and through ``attach_storage_backend`` alike. For a
pool of ours it refuses, by name and before it is built, a backend that would
not carry the page whole (``storage_refusal``), and puts the backend SGLang
built behind the guard :data:`BACKENDS` names: a stored page of the wrong
size, a missing part or a wrong seal is then a miss, never a load. Every
other pool's backend is left to SGLang unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_mxfp8_hicache import guards, releases, settings
from sglang_mxfp8_hicache.page import HostPage

logger = logging.getLogger(__name__)

FACTORY_HOOK_TARGET = (
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend"
)

NO_STORAGE = "default"
"""``get_allocator_type()`` without ``--hicache-storage-backend``."""

_EXISTS_THROUGH_BATCH = (
    "its batch_exists_v2 finds KV pages through batch_exists: their keys take "
    "the prefix, the sidecar pools' keys it derives from the keys it was given "
    "do not"
)


@dataclass(frozen=True)
class Backend:
    """How a served backend carries a page of ours, and its guard."""

    why: str
    """What the backend does with a page that makes its guard what it is."""
    guard: type[guards.Guard] | None = None
    """None: the backend is left as SGLang built it."""
    sealed: bool = False
    """Reads are checked by the pages' seals (``seal.py``)."""
    key_prefixed: bool = False
    """Keys get the pool's format tag (the backend keys no model name)."""
    zero_copy: bool = False
    """Driven through ``batch_*_v1``; ``dynamic`` too with ``interface_v1``."""
    inner_calls: dict[str, str] | None = None
    """Calls between the backend's own methods the guard sits in, with why."""


BACKENDS: dict[str, Backend] = {
    "file": Backend(
        "it writes flat pages; a read of a longer file fills the page without "
        "a word, a shorter one raises and costs the whole batch",
        guards.FileGuard,
    ),
    "mooncake": Backend(
        "it registers get_hybrid_pool_buffer() and moves get_page_buffer_meta "
        "parts; it reads a shorter object and reports the bytes, which SGLang "
        "takes as read",
        guards.MooncakeGuard,
        zero_copy=True,
        inner_calls={
            "_get_batch_zero_copy_impl": (
                "batch_get_v1 reads through it and keeps only whether each count "
                "is above 0: the byte counts are seen here alone"
            )
        },
    ),
    "hf3fs": Backend(
        "it reads and writes the parts of get_data_page(flat=False) in fixed "
        "slots of a shared file, whatever was last written there",
        guards.SealedGuard,
        sealed=True,
        key_prefixed=True,
        zero_copy=True,
        inner_calls={"batch_exists": _EXISTS_THROUGH_BATCH},
    ),
    "nixl": Backend(
        "it registers kv_buffer and moves the parts (page_first) or copies flat "
        "pages through its bounce buffers; it reads a longer file's first "
        "bytes, rewrites files in place and fails a batch on one short file",
        guards.NixlGuard,
        sealed=True,
        zero_copy=True,
    ),
    "seaweedfs": Backend(
        "it copies the get_page_buffer_meta parts into one object per page and "
        "reads only an object of their total size",
        zero_copy=True,
    ),
    "dynamic": Backend(
        "a class SGLang loads by module path, which reports no object sizes",
        guards.SealedGuard,
        sealed=True,
        key_prefixed=True,
        inner_calls={"batch_exists": _EXISTS_THROUGH_BATCH},
    ),
}
"""Every served backend, tested end to end (``test/storage``)."""

REFUSED_STORAGE_BACKENDS: dict[str, str] = {
    "aibrix": (
        "it checks every page against a block spec of payload dtype, heads, "
        "layers and head dim; a page with scales and a seal has none of those "
        "shapes, and a spec made to match its bytes would name layers and heads "
        "the page does not have"
    ),
    "sim": "it stores no bytes, so every page it 'serves' is garbage",
    "shm": "it is a no-op store paired with a shared-memory allocator",
    "eic": "it needs Volcengine's EIC SDK and cluster, not available to prove it",
    "simm": "it needs a SiMM RDMA cluster (built from source), not available to prove it",
    "mori": "it runs on ROCm only (amd-mori), not available to prove it",
    "npu_memcache": "it needs an Ascend NPU driver, not available to prove it",
    "tensorcast": (
        "it needs tensorcast's own CUDA 13 / torch 2.13 build, not available to prove it"
    ),
}
"""Every other backend SGLang offers, with the reason it is refused."""

SGLANG_PRIVATE_NAMES: dict[str, str] = {
    "HiCacheFile._get_suffixed_key": "where a page's file is (no public name gives it)",
    "HiCacheNixl._get_suffixed_key": "where a flat page's file is",
    "HiCacheNixl._get_key_list_from_meta": "where a zero-copy page's part files are",
    "MooncakeStore._get_batch_zero_copy_impl": "every zero-copy read, its byte counts",
    "MooncakeStore._tag_keys": "the keys as Mooncake stores them (bench --l3 removes)",
    "MooncakeStore._batch_preprocess": "a page's object keys (bench --l3 removes)",
    "HiCacheStorageFailureInjector._backend": "the backend SGLang's test injector wraps",
    "HiCacheStorageFailureInjector._random_delay_limit": "its delay, for its rebuild",
    "HiCacheStorageFailureInjector._failure_prob": "its failure rate, for its rebuild",
    "HookRegistry._hooks": "the hooks registered per target (which are ours)",
    "HookRegistry._patched": "the targets the registry applied (hooks in force)",
}
"""Every private name of SGLang the guards, the hook account and the tools
read, with why: a release that renames one fails ``test_storage_policy``'s
check of this table, naming it."""


def storage_refusal(
    backend: str,
    fmt_name: str = "mxfp8",
    *,
    sealed: bool = True,
    symmetric: bool = True,
) -> str | None:
    """Why ``backend`` cannot carry ``fmt_name`` pages (with seals if
    ``sealed``; K and V parts of one size if ``symmetric``), or None if it can."""
    if backend == "hf3fs" and not symmetric:
        return (
            f"--hicache-storage-backend hf3fs cannot store {fmt_name} pages whose K "
            "and V head dims differ: it reads and writes both parts in slots of the "
            "K part's size. Use file or mooncake."
        )
    served = BACKENDS.get(backend)
    if served is not None and served.sealed and not sealed:
        return (
            f"--hicache-storage-backend {backend} cannot store {fmt_name} pages "
            "with --hicache-mem-layout page_head: its reads are checked by a seal "
            "on each page, and a heads-major page has none (its head groups are "
            "shared with ranks of other head counts). Use mooncake, or another "
            "--hicache-mem-layout."
        )
    if backend == NO_STORAGE or served is not None:
        return None
    reason = REFUSED_STORAGE_BACKENDS.get(
        backend, f"it is not one SGLang {releases.NEWEST} offers"
    )
    return (
        f"--hicache-storage-backend {backend} cannot store {fmt_name} pages: {reason}. "
        f"Use one of {', '.join(BACKENDS)}, or run without "
        "--hicache-storage-backend."
    )


def guard_storage_backend(
    original: Callable[..., Any],
    factory: type,
    backend_name: str,
    storage_config: Any,
    mem_pool_host: Any,
    **kwargs: Any,
) -> Any:
    """AROUND hook on ``StorageBackendFactory.create_backend``: a backend is
    ours to guard when the anchor pool SGLang hands the factory is ours.
    SGLang's test failure injector is built again around the guard, so its
    failures reach the guard as a backend's."""
    if not isinstance(getattr(mem_pool_host, "host_page", None), HostPage):
        return original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    pool = mem_pool_host
    refused = pool.refusal_with_storage(backend_name)
    if refused is not None:
        raise refused.error(pool.host_page.fmt.name, pool.pool_label)
    served = BACKENDS[backend_name]
    current = settings.current()
    storage_config = releases.storage_config_with_tag(
        storage_config, pool.storage_format_tag
    )
    built = original(factory, backend_name, storage_config, pool, **kwargs)
    injector_type = releases.failure_injector_type()
    injector = built if injector_type and isinstance(built, injector_type) else None
    backend = injector._backend if injector is not None else built
    if isinstance(backend, guards.Guard):  # the hook ran twice around one build
        return built
    logger.info(
        "%s: %s pages go to L3 backend %r as %s, key tag %r; a stored page of "
        "another size%s is a miss.",
        pool.pool_label,
        pool.host_page.fmt.name,
        backend_name,
        pool.host_page.describe(),
        pool.storage_format_tag,
        f" or seal (seal_threads={current.seal_threads}, "
        f"l3_chunk_pages={current.l3_chunk_pages})"
        if served.sealed
        else "",
    )
    if served.guard is None:
        return built
    prefix = {"prefix": f"{pool.storage_format_tag}_"} if served.key_prefixed else {}
    inner_calls = tuple(served.inner_calls or ())
    guarded = served.guard(backend, pool, current, inner_calls, **prefix)
    if injector is None:
        return guarded
    return type(injector)(guarded, injector._random_delay_limit, injector._failure_prob)
