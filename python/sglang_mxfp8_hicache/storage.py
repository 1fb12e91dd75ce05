"""L3 storage of block-scaled pages (MXFP8, FP4): which SGLang backends may carry
them, and a size check.

The stored page is the host page itself (``page.HostPage``: one span, K part
then V part; ``get_page_buffer_meta`` gives one pointer and size per part, the
flat page is a view of the span; docs/design.md). This module hooks
``StorageBackendFactory.create_backend`` (AROUND), which every backend SGLang
builds passes, at startup and through ``attach_storage_backend`` alike. For a
pool of ours it

* refuses, by name and before it is built, a backend that would move the
  payload without the scales;
* guards the read of the backend it builds: a stored page whose size is not
  this format's, or that misses a part, is a miss, logged once per batch, and
  none of its bytes, nor those of the pages after it in the batch, reach the
  host pool. Neither backend does that alone: ``HiCacheFile.get`` reads a
  longer file into the page without a word and raises on a shorter one (which
  costs the whole batch), and Mooncake writes the parts of a page that are
  fine into host memory before it fails the part that is not;
* for ``dynamic``, a class SGLang loads by module path, prefixes every key with
  the pool's format tag (the class may leave the model name out of its keys)
  and checks each read as far as a class's reply tells: an error, a page of
  another size, or a page whose last 16 bytes the class did not write is a
  miss. What the reply cannot tell is not caught: a longer object cut to the
  page, or one short by under 16 bytes, copied into the page by a class that
  reports a hit. A zero-copy class writes into the prefetch's own host pages,
  which SGLang frees past the last page that arrived.

Every other pool's backend is left to SGLang unchanged.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FACTORY_HOOK_TARGET = (
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend"
)

NO_STORAGE = "default"
"""``get_allocator_type()`` without ``--hicache-storage-backend``."""

SUPPORTED_STORAGE_BACKENDS = ("file", "mooncake", "dynamic")
"""Backends whose every byte path goes through the pool's page methods, tested
end to end: ``file`` reads and writes flat pages, ``mooncake`` registers
``get_hybrid_pool_buffer()`` and moves ``get_page_buffer_meta`` parts, and
``dynamic`` classes do either (``interface_v1`` in the extra config picks
SGLang's zero-copy page functions)."""

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
}
"""Every other backend SGLang 0.5.23 offers, with the reason it is refused."""

TESTED_MOONCAKE = "0.3.13.post1"


def storage_refusal(backend: str, fmt_name: str = "mxfp8") -> str | None:
    """Why ``backend`` cannot carry ``fmt_name`` pages, or None if it can."""
    if backend in (NO_STORAGE, *SUPPORTED_STORAGE_BACKENDS):
        return None
    reason = REFUSED_STORAGE_BACKENDS.get(backend, "it is not one SGLang 0.5.23 offers")
    return (
        f"--hicache-storage-backend {backend} cannot store {fmt_name} pages: {reason}. "
        f"Use one of {', '.join(SUPPORTED_STORAGE_BACKENDS)}, or run without "
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
    """AROUND hook on ``StorageBackendFactory.create_backend``.

    SGLang hands the factory the controller's ``storage_host_pool``, the anchor
    pool itself (never a group): a backend is ours to guard when that is ours.
    """
    from sglang_mxfp8_hicache.host_pool import (
        MHATokenToKVPoolMXFP8Host,
        MXFP8HiCacheConfigError,
    )

    if not isinstance(mem_pool_host, MHATokenToKVPoolMXFP8Host):
        return original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    pool = mem_pool_host
    name = pool.host_page.fmt.name
    reason = storage_refusal(backend_name, name)
    if reason is not None:
        raise MXFP8HiCacheConfigError(f"{pool.pool_label}: {name} HiCache: {reason}")
    backend = original(factory, backend_name, storage_config, pool, **kwargs)
    if backend_name == "dynamic":
        _guard_dynamic(backend, pool, storage_config)
    else:
        _guard_reads(backend, backend_name)
    logger.info(
        "%s: %s pages go to L3 backend %r as %s, key tag %r; a stored page of "
        "another size is a miss.",
        pool.pool_label,
        name,
        backend_name,
        pool.describe_storage_page(),
        pool.storage_format_tag,
    )
    return backend


def _guard_reads(backend: Any, backend_name: str) -> None:
    """Wrap the read the controller calls on this backend instance (the inner
    one under SGLang's test failure injector) with its size check."""
    method, check = {
        "file": ("batch_get", _file_batch_get_checked),
        "mooncake": ("batch_get_v1", _mooncake_batch_get_checked),
    }[backend_name]
    inner = getattr(backend, "_backend", backend)
    if backend_name == "mooncake" and not hasattr(
        inner.store, "batch_get_replica_desc"
    ):
        from sglang_mxfp8_hicache.host_pool import MXFP8HiCacheConfigError

        raise MXFP8HiCacheConfigError(
            "the installed Mooncake has no batch_get_replica_desc, which the MXFP8 "
            f"size check needs; install mooncake-transfer-engine>={TESTED_MOONCAKE}."
        )
    read = getattr(inner, method)

    @functools.wraps(read)
    def checked(*args: Any, **kwargs: Any) -> Any:
        return check(read, inner, *args, **kwargs)

    setattr(inner, method, checked)


KEYED_METHODS = (
    "batch_exists",
    "batch_get",
    "batch_set",
    "batch_get_v1",
    "batch_set_v1",
)
"""The methods of SGLang's ``HiCacheStorage`` that its cache controller calls
with page keys. Only these take the prefix: a class's own ``exists``, ``get``
and ``set`` are what its batch methods may call with the keys they were given."""

UNWRITTEN_TAIL_BYTES = 16
"""Bytes at the end of each target of a dynamic read that are set to a random
mark first: a class that leaves them is a class that wrote less than a page."""


def _guard_dynamic(backend: Any, pool: Any, storage_config: Any) -> None:
    """A dynamic class's keys carry the pool's format tag as a prefix, and its
    reads are checked (``_dynamic_get_checked``, ``_dynamic_get_v1_checked``)."""
    inner = getattr(backend, "_backend", backend)
    prefix = f"{pool.storage_format_tag}_"
    for name in KEYED_METHODS:
        method = getattr(inner, name, None)
        if method is not None:
            setattr(inner, name, _with_key_prefix(method, prefix))
    v1 = bool((storage_config.extra_config or {}).get("interface_v1", 0))
    name, check = (
        ("batch_get_v1", _dynamic_get_v1_checked)
        if v1
        else ("batch_get", _dynamic_get_checked)
    )
    read = getattr(inner, name)

    @functools.wraps(read)
    def checked(*args: Any, **kwargs: Any) -> Any:
        return check(read, pool, *args, **kwargs)

    setattr(inner, name, checked)


def _with_key_prefix(method: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def prefixed(keys: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        return method([prefix + key for key in keys], *args, **kwargs)

    return prefixed


def _read_or_log(read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``read``'s reply, or None (logged) if the class raised: a miss."""
    try:
        return read(*args, **kwargs)
    except Exception as exc:
        logger.warning(
            "L3: the dynamic backend raised %r on a read; its pages are treated as "
            "not in L3.",
            exc,
        )
        return None


def _dynamic_get_checked(
    read: Callable[..., Any],
    pool: Any,
    keys: Sequence[str],
    target_locations: Sequence[torch.Tensor],
    target_sizes: Any = None,
) -> list[torch.Tensor | None]:
    """A generic dynamic ``batch_get``: the leading pages the class returned
    whole, each exactly one flat page. The targets are the controller's
    staging pages, so nothing of a page reaches the host pool before this."""
    import torch

    mark = torch.frombuffer(
        bytearray(os.urandom(UNWRITTEN_TAIL_BYTES)), dtype=torch.uint8
    )
    for target in target_locations:
        target.view(torch.uint8)[-UNWRITTEN_TAIL_BYTES:] = mark
    results = _read_or_log(read, keys, target_locations, target_sizes)
    if results is None:
        return [None] * len(keys)
    expected = pool.host_page.span_bytes
    wrong: list[WrongPage] = []
    returned = len(keys)
    for page, (key, result, target) in enumerate(
        zip(keys, results, target_locations, strict=True)
    ):
        if result is None:
            returned = min(returned, page)
            continue
        found = result.numel() * result.element_size()
        if found != expected:
            wrong.append((page, key, found, expected))
        elif result.data_ptr() == target.data_ptr() and torch.equal(
            result.view(torch.uint8)[-UNWRITTEN_TAIL_BYTES:], mark
        ):
            wrong.append((page, key, FEWER, expected))
    good = min(returned, _leading_good_pages(wrong, len(keys)))
    return [*results[:good], *[None] * (len(keys) - good)]


def _dynamic_get_v1_checked(
    read: Callable[..., Any],
    pool: Any,
    keys: Sequence[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """A zero-copy dynamic ``batch_get_v1``: the leading pages the class says
    it read and whose K and V parts it wrote to their last bytes. The class
    writes into the prefetch's own host pages, which the controller frees
    past the last page that arrived: a page it reports missing gets back the
    bytes the mark replaced."""
    import ctypes

    pointers, sizes = pool.get_page_buffer_meta(host_indices)
    tails = [p + n - UNWRITTEN_TAIL_BYTES for p, n in zip(pointers, sizes, strict=True)]
    kept = [ctypes.string_at(t, UNWRITTEN_TAIL_BYTES) for t in tails]
    mark = os.urandom(UNWRITTEN_TAIL_BYTES)
    for tail in tails:
        ctypes.memmove(tail, mark, UNWRITTEN_TAIL_BYTES)
    results = _read_or_log(read, keys, host_indices, extra_info)
    hits = [False] * len(keys) if results is None else list(results)
    parts = len(tails) // len(keys)
    wrong: list[WrongPage] = []
    returned = len(keys)
    for page, (key, hit) in enumerate(zip(keys, hits, strict=True)):
        page_parts = range(page * parts, (page + 1) * parts)
        if not hit:
            returned = min(returned, page)
            for part in page_parts:
                ctypes.memmove(tails[part], kept[part], UNWRITTEN_TAIL_BYTES)
        elif any(
            ctypes.string_at(tails[i], UNWRITTEN_TAIL_BYTES) == mark for i in page_parts
        ):
            wrong.append((page, key, FEWER, pool.host_page.span_bytes))
    good = min(returned, _leading_good_pages(wrong, len(keys)))
    return [*[True] * good, *[False] * (len(keys) - good)]


WrongPage = tuple[int, str, int, int]
"""(page in the batch, its first wrong object or file, size found, size expected)."""

FEWER = -2
"""Size found for a page whose last bytes the backend did not write."""


def _leading_good_pages(wrong: list[WrongPage], pages: int) -> int:
    """Logs the batch's wrong pages once; the number of pages before the first."""
    if not wrong:
        return pages
    first, key, found, expected = wrong[0]
    logger.warning(
        "L3: %d of %d pages in this batch are missing a part or have the "
        "wrong size; they and the pages after the first of them are treated as "
        "not in L3 (first: %s, %s bytes, expected %d).",
        len(wrong),
        pages,
        key,
        "fewer" if found == FEWER else found,
        expected,
    )
    return first


def _file_batch_get_checked(
    read: Callable[..., Any],
    backend: Any,
    keys: Sequence[str],
    target_locations: Sequence[torch.Tensor],
    target_sizes: Any = None,
) -> list[torch.Tensor | None]:
    """``HiCacheFile.batch_get``, reading only the leading files of exactly one page."""
    wrong: list[WrongPage] = []
    for page, (key, target) in enumerate(zip(keys, target_locations, strict=True)):
        expected = target.numel() * target.element_size()
        path = os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")
        try:
            found = os.path.getsize(path)
        except OSError:
            continue  # missing: HiCacheFile.get logs it and misses
        if found != expected:
            wrong.append((page, key, found, expected))
    good = _leading_good_pages(wrong, len(keys))
    return [*read(keys[:good], target_locations[:good]), *[None] * (len(keys) - good)]


def _mooncake_batch_get_checked(
    read: Callable[..., Any],
    store: Any,
    keys: list[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """``MooncakeStore.batch_get_v1``, reading only the leading pages whose
    objects all exist with exactly the sizes the pool asks for (one master
    query): Mooncake would write the K part of a page whose V part is missing."""
    if not keys:
        return read(keys, host_indices, extra_info)
    # One object per page part (K part, V part), one size each.
    object_keys, _, part_sizes = store._batch_preprocess(
        store._tag_keys(keys), host_indices
    )
    found = _mooncake_object_sizes(store.store, object_keys)
    per_page = len(object_keys) // len(keys)
    wrong: list[WrongPage] = []
    for n, (key, expected) in enumerate(zip(object_keys, part_sizes, strict=True)):
        page, size = n // per_page, found.get(key)
        if (
            size is not None
            and size != expected
            and (not wrong or wrong[-1][0] != page)
        ):
            wrong.append((page, key, size, expected))
    good = _leading_good_pages(wrong, len(keys))
    page_size = len(host_indices) // len(keys)
    results = (
        read(keys[:good], host_indices[: good * page_size], extra_info) if good else []
    )
    return [*results, *[False] * (len(keys) - good)]


MISSING = -1
"""Size reported for an object the master does not know."""


def _mooncake_object_sizes(client: Any, object_keys: list[str]) -> dict[str, int]:
    """Each object's size, from its first memory replica; MISSING for an object
    the master does not know. An object held only on disk (SSD offload) names
    no size here and is left out: Mooncake's own read checks it."""
    sizes = dict.fromkeys(object_keys, MISSING)
    for key, replicas in client.batch_get_replica_desc(object_keys).items():
        memory = [r for r in replicas if r.is_memory_replica()]
        if memory:
            sizes[key] = memory[0].get_memory_descriptor().buffer_descriptor.size
        elif replicas:
            del sizes[key]
    return sizes
