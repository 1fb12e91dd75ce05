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
* returns the backend SGLang built inside a :class:`GuardedStorage`, which
  guards its reads and writes and sets nothing on it: a stored page whose size is not
  this format's, or that misses a part, is a miss, logged once per batch, and
  neither it nor the pages after it in the batch are taken into the host
  pool (what a zero-copy read wrote past it lies in the prefetch's own host
  pages, which SGLang frees). These backends do not do that alone:
  ``HiCacheFile.get`` reads a longer file into the page without a word and
  raises on a shorter one (which costs the whole batch), Mooncake reads a
  shorter object and reports the bytes it read, which SGLang takes as read
  whatever their number, and NIXL fails the whole batch on one short file and
  reads a longer one's first bytes (``seaweedfs`` checks sizes itself);
* for ``dynamic`` (a class SGLang loads by module path, which reports no
  object sizes), ``hf3fs`` (fixed slots of a shared file, read whatever was
  last written there) and ``nixl`` (files rewritten in place, a longer old
  one's tail kept), seals each page on its way to L3 (``seal.py``): a read
  that raises, returns a page of another size, or brings a page whose seal
  does not match its bytes and key is a miss; ``dynamic`` and ``hf3fs`` keys
  also get the pool's format tag as a prefix (neither puts the model name in
  every key). With ``SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES``, a batch moves
  in chunks, each sealed or checked while the backend moves the one beside
  (``chunked.py``). A zero-copy backend writes
  the prefetch's own host pages, which SGLang frees past the last page that
  arrived.

Every other pool's backend is left to SGLang unchanged.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
import threading
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sglang_mxfp8_hicache import chunked, releases, seal
from sglang_mxfp8_hicache.page import HostPage

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FACTORY_HOOK_TARGET = (
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory.create_backend"
)

NO_STORAGE = "default"
"""``get_allocator_type()`` without ``--hicache-storage-backend``."""

SUPPORTED_STORAGE_BACKENDS = (
    "file",
    "mooncake",
    "dynamic",
    "hf3fs",
    "nixl",
    "seaweedfs",
)
"""Backends whose every byte path goes through the pool's page methods, tested
end to end: ``file`` reads and writes flat pages, ``mooncake`` registers
``get_hybrid_pool_buffer()`` and moves ``get_page_buffer_meta`` parts,
``hf3fs`` reads and writes the parts of ``get_data_page(flat=False)``,
``nixl`` registers ``kv_buffer`` and moves the parts (page_first) or copies
flat pages through its bounce buffers (layer_first), ``seaweedfs`` copies
the ``get_page_buffer_meta`` parts into and out of one object per page (and
reads only an object of their total size), and ``dynamic`` classes do
either (``interface_v1`` in the extra config picks SGLang's zero-copy page
functions)."""

ZERO_COPY_BACKENDS = ("mooncake", "hf3fs", "nixl", "seaweedfs")
"""The served backends SGLang's cache controller drives through its zero-copy
page functions (``batch_*_v1``), besides ``dynamic`` with ``interface_v1``
(``cache_controller.py:645-661``)."""

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
"""Every other backend SGLang 0.5.23 offers, with the reason it is refused."""

SEALED_BACKENDS = ("dynamic", "hf3fs", "nixl")
"""Served backends whose reads are checked by the pages' seals (``seal.py``):
they report no object sizes (``dynamic``), read fixed slots whatever was
written there (``hf3fs``), or read a longer file's first bytes and rewrite a
file in place, leaving a longer one's tail (``nixl``)."""

KEY_PREFIXED_BACKENDS = ("dynamic", "hf3fs")
"""Sealed backends whose keys get the format tag as a prefix: neither puts
SGLang's model name, which carries the tag, in every key."""


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
    if backend in SEALED_BACKENDS and not sealed:
        return (
            f"--hicache-storage-backend {backend} cannot store {fmt_name} pages "
            "with --hicache-mem-layout page_head: its reads are checked by a seal "
            "on each page, and a heads-major page has none (its head groups are "
            "shared with ranks of other head counts). Use mooncake, or another "
            "--hicache-mem-layout."
        )
    if backend in (NO_STORAGE, *SUPPORTED_STORAGE_BACKENDS):
        return None
    reason = REFUSED_STORAGE_BACKENDS.get(backend, "it is not one SGLang 0.5.23 offers")
    return (
        f"--hicache-storage-backend {backend} cannot store {fmt_name} pages: {reason}. "
        f"Use one of {', '.join(SUPPORTED_STORAGE_BACKENDS)}, or run without "
        "--hicache-storage-backend."
    )


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
}
"""Every private name of SGLang the guards and tools read, with why: a release that
renames one fails ``test_storage``'s check of this table, naming it."""


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
    The backend SGLang built is returned inside a :class:`GuardedStorage`;
    SGLang's test failure injector, when its variables are set, is built again
    around the guard, so its failures reach the guard as a backend's would.
    """
    if not isinstance(getattr(mem_pool_host, "host_page", None), HostPage):
        return original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    pool = mem_pool_host
    name = pool.host_page.fmt.name
    refused = pool.refusal_with_storage(backend_name)
    if refused is not None:
        raise refused.error(name, pool.pool_label)
    sealed = backend_name in SEALED_BACKENDS
    # Read once, a bad value refused now.
    chunk_pages = chunked.smallest_chunk_pages() if sealed else 0
    seal_threads = seal.threads() if sealed else seal.DEFAULT_THREADS
    storage_config = releases.storage_config_with_tag(
        storage_config, pool.storage_format_tag
    )
    built = original(factory, backend_name, storage_config, pool, **kwargs)
    injector_type = releases.failure_injector_type()
    injector = built if injector_type and isinstance(built, injector_type) else None
    backend = injector._backend if injector is not None else built
    if isinstance(backend, GuardedStorage):  # the hook ran twice around one build
        return built
    guarded = GuardedStorage(
        backend, pool, backend_name, storage_config, chunk_pages, seal_threads
    )
    logger.info(
        "%s: %s pages go to L3 backend %r as %s, key tag %r; a stored page of "
        "another size%s is a miss.",
        pool.pool_label,
        name,
        backend_name,
        pool.describe_storage_page(),
        pool.storage_format_tag,
        f" or seal ({seal.THREADS_ENV}={seal_threads}, "
        f"{chunked.CHUNK_PAGES_ENV}={chunk_pages})"
        if sealed
        else "",
    )
    if injector is None:
        return guarded
    return type(injector)(guarded, injector._random_delay_limit, injector._failure_prob)


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


class GuardedStorage:
    """SGLang's L3 backend for a pool of ours, as its cache controller calls it:
    the reads and writes of :data:`KEYED_METHODS` go through this pool's
    guards (key prefix, size check, seals), the backend itself is left as
    SGLang built it.

    Every other method is the backend's own, run with the guard as its
    instance, so a backend method that calls a guarded one (``batch_exists_v2``
    calls ``batch_exists``) calls it guarded, as the controller would; every
    other attribute, read or written, is the backend's. ``__class__`` is the
    backend's, for SGLang's ``isinstance(..., MooncakeStore)``.

    A backend reads its own attributes in its page loops (``HiCacheNixl``
    about ten per page), so the guard's instance dictionary is the backend's
    own: those reads cost what they cost the backend. The guard's own state
    is in slots, and every method it may guard is a :class:`_GuardedMethod`,
    found before an instance attribute of that name. ``chunk_pages`` is the
    smallest chunk of a sealed batch (``chunked.py``; 0: one call a batch),
    ``seal_threads`` the threads that seal and check it.
    """

    __slots__ = ("_backend", "_guards", "_methods", "__dict__")

    def __init__(
        self,
        backend: Any,
        pool: Any,
        backend_name: str,
        storage_config: Any,
        chunk_pages: int = 0,
        seal_threads: int = seal.DEFAULT_THREADS,
    ) -> None:
        guards: dict[str, Callable[..., Any]] = {}

        def current(name: str) -> Callable[..., Any]:
            return guards.get(name) or self._own(name)

        def guard(name: str, check: Callable[..., Any], context: Any) -> None:
            guards[name] = _bind(check, current(name), context)

        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_guards", guards)
        object.__setattr__(self, "_methods", {})
        if isinstance(getattr(backend, "__dict__", None), dict):
            object.__setattr__(self, "__dict__", backend.__dict__)
        for method, check in SIZE_CHECKS.get(backend_name, ()):
            guard(method, check, backend)
        if backend_name in KEY_PREFIXED_BACKENDS:
            prefix = f"{pool.storage_format_tag}_"
            for name in KEYED_METHODS:
                if hasattr(backend, name):
                    guards[name] = _with_key_prefix(current(name), prefix)
        if backend_name in SEALED_BACKENDS:
            v1 = backend_name in ZERO_COPY_BACKENDS or bool(
                (storage_config.extra_config or {}).get("interface_v1", 0)
            )
            sealed = SealedBatches(
                pool,
                chunked.ChunkedCalls("l3-read", chunk_pages),
                chunked.ChunkedCalls("l3-write", chunk_pages),
                seal_threads,
            )
            if v1:
                guard("batch_set_v1", _sealed_set_v1, sealed)
                guard("batch_get_v1", _checked_get_v1, sealed)
            else:
                guard("batch_set", _sealed_set, sealed)
                guard("batch_get", _checked_get, sealed)

    def _own(self, name: str) -> Any:
        """The backend's ``name``; a method of its class bound to the guard.

        A class method (or static method) is looked up once and kept, bound
        to the guard: a class's functions do not change, and an instance
        attribute of that name still wins.
        """
        backend = object.__getattribute__(self, "_backend")
        own_attrs = getattr(backend, "__dict__", None) or {}
        if name in own_attrs:
            return own_attrs[name]
        methods = object.__getattribute__(self, "_methods")
        if name in methods:
            return methods[name]
        attr = inspect.getattr_static(type(backend), name, None)
        if isinstance(attr, types.FunctionType):
            methods[name] = types.MethodType(attr, self)
            return methods[name]
        if isinstance(attr, staticmethod):
            methods[name] = attr.__func__
            return methods[name]
        return getattr(backend, name)

    def __getattr__(self, name: str) -> Any:
        guards = object.__getattribute__(self, "_guards")
        return guards[name] if name in guards else self._own(name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._backend)

    def __repr__(self) -> str:
        return f"GuardedStorage({self._backend!r})"


def sglang_backend(storage_backend: Any) -> Any:
    """The backend SGLang built, under our guard and SGLang's test injector."""
    injector_type = releases.failure_injector_type() or GuardedStorage
    while type(storage_backend) is GuardedStorage or isinstance(
        storage_backend, injector_type
    ):
        storage_backend = storage_backend._backend
    return storage_backend


def _bind(check: Callable[..., Any], method: Callable[..., Any], context: Any):
    """``method`` run through ``check(method, context, ...)``."""

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        return check(method, context, *args, **kwargs)

    return checked


def _with_key_prefix(method: Callable[..., Any], prefix: str) -> Callable[..., Any]:
    """``method`` given the keys with ``prefix``, and the ``prefix_keys`` of
    its extra info too: ``prefix_keys + keys`` stays one chain of keys."""

    def prefixed_info(value: Any) -> Any:
        prefix_keys = getattr(value, "prefix_keys", None)
        if prefix_keys is None:
            return value
        return _with_prefix_keys(value, [prefix + key for key in prefix_keys])

    @functools.wraps(method)
    def prefixed(keys: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        args = tuple(prefixed_info(arg) for arg in args)
        kwargs = {name: prefixed_info(arg) for name, arg in kwargs.items()}
        return method([prefix + key for key in keys], *args, **kwargs)

    return prefixed


PageParts = tuple[np.ndarray, np.ndarray]
"""The K and V parts of one stored page, as uint8 arrays."""


def _flat_page_parts(pool: Any, flat: torch.Tensor) -> PageParts:
    """The K and V parts of one flat page (CPU): a view of a contiguous page
    (seals are written into host pages in place), a copy of any other reply,
    which is only read."""
    import torch

    data = flat.reshape(-1).view(torch.uint8).numpy()
    k_span = pool.host_page.k_part.span_bytes
    return data[:k_span], data[k_span:]


def _host_page_parts(pool: Any, host_indices: torch.Tensor) -> list[PageParts]:
    """The K and V parts of each host page of ``host_indices``: slices of one
    uint8 view of the pool's buffer, no tensor made per page."""
    import torch

    rows = pool.kv_buffer.view(torch.uint8).numpy()
    k_span = pool.host_page.k_part.span_bytes
    pages = pool.page_numbers(host_indices).tolist()
    return [(rows[page, :k_span], rows[page, k_span:]) for page in pages]


def _seal_arguments(
    sealed: SealedBatches, pages: Sequence[PageParts], keys: Sequence[str]
) -> tuple[list[np.ndarray], list[int], int]:
    """``seal.write_all``'s and ``hold_all``'s arguments for a batch's pages:
    both parts of a page are sealed under its key."""
    pool = sealed.pool
    tag = pool.storage_format_tag
    parts = [part for page in pages for part in page]
    seeds = [seed for key in keys for seed in [seal.key_seed(tag, key)] * 2]
    return parts, seeds, sealed.threads


def _seal_pages(
    sealed: SealedBatches, pages: Sequence[PageParts], keys: Sequence[str]
) -> None:
    """Seals both parts of every page of a batch (``seal.write_all``)."""
    seal.write_all(*_seal_arguments(sealed, pages, keys))


def _pages_sealed(
    sealed: SealedBatches, pages: Sequence[PageParts], keys: Sequence[str]
) -> list[bool]:
    """Whether both parts of each page carry the seal of their bytes under
    its key."""
    held = seal.hold_all(*_seal_arguments(sealed, pages, keys))
    return [k and v for k, v in zip(held[::2], held[1::2], strict=True)]


def _read_or_log(read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``read``'s reply, or None (logged) if the class raised: a miss."""
    try:
        return read(*args, **kwargs)
    except Exception as exc:
        logger.warning(
            "L3: the backend raised %r on a read; its pages are treated as not in L3.",
            exc,
        )
        return None


class SealedBatches(NamedTuple):
    """What a sealed backend's guards share: the pool, the threads its reads
    and writes run on, chunk by chunk (``chunked.py``), and how many threads
    seal and check a chunk (``seal.threads()``)."""

    pool: Any
    reads: chunked.ChunkedCalls
    writes: chunked.ChunkedCalls
    threads: int


def _chunk_extra_info(extra_info: Any, keys: Sequence[str], start: int) -> Any:
    """``extra_info`` for the chunk of a batch that starts at page ``start``:
    its ``prefix_keys`` (the hashes before the call's keys, when SGLang
    passes them) extended by the batch's keys before the chunk, as SGLang's
    hybrid controller does for the calls it splits."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if start == 0 or prefix is None:
        return extra_info
    return _with_prefix_keys(extra_info, [*prefix, *keys[:start]])


def _with_prefix_keys(extra_info: Any, prefix_keys: list[str]) -> Any:
    """A copy of SGLang's ``HiCacheStorageExtraInfo`` with other
    ``prefix_keys``; the caller's is left as it was."""
    info = copy.copy(extra_info)
    info.prefix_keys = prefix_keys
    return info


def _sealed_set(
    write: Callable[..., Any],
    sealed: SealedBatches,
    keys: Sequence[str],
    values: Sequence[torch.Tensor],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A generic ``batch_set`` of flat pages (views of host pages), each
    chunk sealed while the one before is written; true if every chunk was."""
    pool = sealed.pool
    if args or kwargs:  # not the controller's call: one chunk
        _seal_pages(sealed, [_flat_page_parts(pool, v) for v in values], keys)
        return write(keys, values, *args, **kwargs)

    def seal_chunk(start: int, end: int) -> None:
        parts = [_flat_page_parts(pool, value) for value in values[start:end]]
        _seal_pages(sealed, parts, keys[start:end])

    replies = sealed.writes.sealed_write(
        len(keys),
        seal_chunk,
        lambda start, end: write(keys[start:end], values[start:end]),
    )
    return all(replies)


def _sealed_set_v1(
    write: Callable[..., Any],
    sealed: SealedBatches,
    keys: Sequence[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """A zero-copy ``batch_set_v1``, each chunk's host pages sealed while the
    chunk before is written."""
    pool = sealed.pool
    page_size = pool.page_size

    def seal_chunk(start: int, end: int) -> None:
        pages = host_indices[start * page_size : end * page_size]
        _seal_pages(sealed, _host_page_parts(pool, pages), keys[start:end])

    def write_chunk(start: int, end: int) -> list[bool]:
        pages = host_indices[start * page_size : end * page_size]
        reply = write(
            keys[start:end], pages, _chunk_extra_info(extra_info, keys, start)
        )
        return [*reply[: end - start], *[False] * (end - start - len(reply))]

    replies = sealed.writes.sealed_write(len(keys), seal_chunk, write_chunk)
    return [written for reply in replies for written in reply]


def _checked_get(
    read: Callable[..., Any],
    sealed: SealedBatches,
    keys: Sequence[str],
    target_locations: Sequence[torch.Tensor],
    target_sizes: Any = None,
) -> list[torch.Tensor | None]:
    """A generic ``batch_get``: the leading pages the class returned as one
    whole flat page each, sealed under their key, each chunk checked while
    the next is read. The targets are the controller's staging pages:
    nothing reaches a host page before this."""
    pool = sealed.pool
    expected = pool.host_page.span_bytes

    def read_chunk(start: int, end: int) -> list[torch.Tensor | None] | None:
        sizes = None if target_sizes is None else target_sizes[start:end]
        return _read_or_log(read, keys[start:end], target_locations[start:end], sizes)

    def check_chunk(start: int, end: int, results: Any) -> int:
        if results is None:
            return 0
        returned = _replied_before_a_miss(results, end - start, lambda r: r is None)
        found = [r.numel() * r.element_size() for r in results[:returned]]
        whole = [n for n, size in enumerate(found) if size == expected]
        readable, parts = [], []
        for n in whole:
            try:
                parts.append(_flat_page_parts(pool, results[n]))
                readable.append(n)
            except (RuntimeError, TypeError):  # not a contiguous CPU tensor
                pass
        ok = _pages_sealed(sealed, parts, [keys[start + n] for n in readable])
        unsealed = set(whole) - {n for n, o in zip(readable, ok, strict=True) if o}
        wrong: list[WrongPage] = [
            (start + n, keys[start + n], UNSEALED if n in unsealed else size, expected)
            for n, size in enumerate(found)
            if size != expected or n in unsealed
        ]
        return min(returned, _leading_good_pages(wrong, len(keys)) - start)

    good, replies = sealed.reads.read_checked(len(keys), read_chunk, check_chunk)
    results = [result for reply in replies if reply is not None for result in reply]
    return [*results[:good], *[None] * (len(keys) - good)]


def _checked_get_v1(
    read: Callable[..., Any],
    sealed: SealedBatches,
    keys: Sequence[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """A zero-copy ``batch_get_v1``: the leading pages the backend says it
    read whose bytes carry their seal, each chunk checked while the next is
    read. It writes the prefetch's own host pages, which SGLang frees past
    the last page that arrived, and takes no page after a miss, so none is
    judged (hf3fs reads the pages found after a missing one into the targets
    of the pages before them)."""
    pool = sealed.pool
    page_size = pool.page_size
    expected = pool.host_page.span_bytes

    def read_chunk(start: int, end: int) -> list[bool] | None:
        pages = host_indices[start * page_size : end * page_size]
        chunk_info = _chunk_extra_info(extra_info, keys, start)
        return _read_or_log(read, keys[start:end], pages, chunk_info)

    def check_chunk(start: int, end: int, results: list[bool] | None) -> int:
        if results is None:
            return 0
        returned = _replied_before_a_miss(results, end - start, lambda hit: not hit)
        pages = host_indices[start * page_size : (start + returned) * page_size]
        ok = _pages_sealed(
            sealed, _host_page_parts(pool, pages), keys[start : start + returned]
        )
        wrong: list[WrongPage] = [
            (start + n, keys[start + n], UNSEALED, expected)
            for n, held in enumerate(ok)
            if not held
        ]
        return min(returned, _leading_good_pages(wrong, len(keys)) - start)

    good, _ = sealed.reads.read_checked(len(keys), read_chunk, check_chunk)
    return [*[True] * good, *[False] * (len(keys) - good)]


def _replied_before_a_miss(
    results: Sequence[Any], pages: int, missed: Callable[[Any], bool]
) -> int:
    """The pages of a chunk of ``pages`` that ``results`` gives before its
    first miss: SGLang takes no page after a miss, or past a short reply."""
    replied = min(pages, len(results))
    return next((n for n, r in enumerate(results[:replied]) if missed(r)), replied)


WrongPage = tuple[int, str, int, int]
"""(page in the batch, its first wrong object or file, size found, size expected)."""

UNSEALED = -2
"""Size found for a page of the right size whose seal does not match."""


def _leading_good_pages(wrong: list[WrongPage], pages: int) -> int:
    """Logs the batch's wrong pages once; the number of pages before the first."""
    if not wrong:
        return pages
    first, key, found, expected = wrong[0]
    logger.warning(
        "L3: %d of %d pages in this batch are missing a part or have the "
        "wrong size or seal; they and the pages after the first of them are "
        "treated as not in L3 (first: %s, %s, expected %d bytes).",
        len(wrong),
        pages,
        key,
        _describe_found(found),
        expected,
    )
    return first


def _describe_found(found: int) -> str:
    if found == UNSEALED:
        return "unsealed"
    return f"read error {found}" if found < 0 else f"{found} bytes"


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
        try:
            found = os.path.getsize(file_page_path(backend, key))
        except OSError:
            continue  # missing: HiCacheFile.get logs it and misses
        if found != expected:
            wrong.append((page, key, found, expected))
    good = _leading_good_pages(wrong, len(keys))
    return [*read(keys[:good], target_locations[:good]), *[None] * (len(keys) - good)]


class WrongObject(NamedTuple):
    """An object of a Mooncake read that did not arrive whole."""

    index: int
    """Its place among the read's objects."""
    key: str
    found: int
    """Bytes read, or Mooncake's (negative) error."""
    expected: int
    objects: int
    """Objects in the read."""


class _ObjectLengths(threading.local):
    """The objects of the current thread's guarded Mooncake batch read that
    did not arrive whole; None outside one."""

    wrong: list[WrongObject] | None = None


_mooncake_reads = _ObjectLengths()

WRONG_LENGTH = -2000
"""What the guard reports, in place of the bytes read, for an object that
arrived with another length than its buffer's (Mooncake's own errors are
small negative codes; SGLang counts any result above 0 as read)."""

MOONCAKE_OBJECT_NOT_FOUND = -704
"""Mooncake's ``OBJECT_NOT_FOUND`` (``ErrorCode``), a read's result for an
object it does not hold."""


def _mooncake_batch_get_checked(
    read: Callable[..., Any],
    store: Any,
    keys: list[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """``MooncakeStore.batch_get_v1``, its objects' lengths checked on arrival
    (:func:`_mooncake_lengths_checked`, run by the read itself): the pages
    before the first bad one, logged once. Mooncake refuses a longer object
    before writing a byte; a shorter one it reads, and SGLang would take it.
    A page with some parts and not others is bad too; a page with none is a
    plain miss, which SGLang logs. What the read wrote past a bad page lies in
    the prefetch's own host pages, which SGLang frees past the last that
    arrived."""
    _mooncake_reads.wrong = []
    try:
        results = read(keys, host_indices, extra_info)
        objects = _mooncake_reads.wrong
    finally:
        _mooncake_reads.wrong = None
    if not objects:
        return results
    per_page = objects[0].objects // len(keys)
    by_page: dict[int, list[WrongObject]] = {}
    for wrong_object in objects:
        by_page.setdefault(wrong_object.index // per_page, []).append(wrong_object)
    wrong: list[WrongPage] = []
    for page, page_objects in by_page.items():
        found = [wrong_object.found for wrong_object in page_objects]
        if found != [MOONCAKE_OBJECT_NOT_FOUND] * per_page:  # not a plain miss
            first = page_objects[0]
            wrong.append((page, first.key, first.found, first.expected))
    good = _leading_good_pages(wrong, len(keys))
    return [*results[:good], *[False] * (len(keys) - good)]


def _mooncake_lengths_checked(
    read_into: Callable[..., Any],
    store: Any,
    key_strs: list[str],
    buffer_ptrs: list[Any],
    buffer_sizes: list[Any],
) -> list[int]:
    """``MooncakeStore._get_batch_zero_copy_impl``, through which every
    zero-copy read of the store goes (``batch_get_v1``, its pool-transfer
    reads, ``get``): Mooncake returns the bytes it read per object, and an
    object of another length than its buffer is reported as
    :data:`WRONG_LENGTH`, so SGLang takes it as not read. Inside a guarded
    ``batch_get_v1``, every object not read whole is noted for its log."""
    counts = read_into(key_strs, buffer_ptrs, buffer_sizes)
    if list(counts) == buffer_sizes:  # every object whole (sizes of one buffer each)
        return counts
    expected = np.array(
        [sum(size) if isinstance(size, list | tuple) else size for size in buffer_sizes]
    )
    found = np.asarray(counts, dtype=np.int64)
    if _mooncake_reads.wrong is not None:
        _mooncake_reads.wrong += [
            WrongObject(
                int(n), key_strs[n], int(found[n]), int(expected[n]), len(counts)
            )
            for n in np.flatnonzero(found != expected)
        ]
    short = np.flatnonzero((found > 0) & (found != expected))
    if not len(short):
        return counts
    counts = list(counts)
    for n in short:
        counts[n] = WRONG_LENGTH
    return counts


def _read_leading(
    read: Callable[..., Any],
    keys: list[str],
    host_indices: torch.Tensor,
    extra_info: Any,
    good: int,
) -> list[bool]:
    """A zero-copy read of the first ``good`` pages; the rest are misses."""
    page_size = len(host_indices) // len(keys)
    results = (
        read(keys[:good], host_indices[: good * page_size], extra_info) if good else []
    )
    return [*results, *[False] * (len(keys) - good)]


def file_page_path(backend: Any, key: str) -> str:
    """Where ``HiCacheFile`` keeps the page of ``key``."""
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")


def nixl_page_paths(backend: Any, keys: Sequence[str]) -> list[str]:
    """Where ``HiCacheNixl`` (file plugins) keeps the pages of ``keys``: a
    file per K and V part in zero-copy mode, one per flat page otherwise."""
    names = (
        backend._get_key_list_from_meta(keys)
        if backend.is_zero_copy
        else [backend._get_suffixed_key(key) for key in keys]
    )
    return [backend.file_manager.get_file_path(name) for name in names]


def _nixl_batch_get_checked(
    read: Callable[..., Any],
    backend: Any,
    keys: list[str],
    host_indices: torch.Tensor,
    extra_info: Any = None,
) -> list[bool]:
    """``HiCacheNixl.batch_get_v1`` on files, reading the leading pages whose
    files all exist with exactly the sizes the pool asks for: NIXL fails the
    whole batch on one missing or short file, and reads a longer one's first
    bytes. The batch is read first as it is, and the files' sizes are asked
    only if that read fails: NIXL is sealed, so a longer file's first bytes
    are checked by the seal anyway, and what a failed read wrote lies in the
    prefetch's own host pages, read again or freed. Object plugins (no
    files) are left to the seals."""
    if not keys or backend.file_manager is None:
        return read(keys, host_indices, extra_info)
    results = read(keys, host_indices, extra_info)
    if all(results[: len(keys)]) and len(results) >= len(keys):
        return results
    page = backend.mem_pool_host.host_page
    paths = nixl_page_paths(backend, keys)
    if backend.is_zero_copy:
        sizes = [page.k_part.span_bytes, page.v_part.span_bytes] * len(keys)
    else:
        sizes = [page.span_bytes] * len(keys)
    per_page = len(paths) // len(keys)
    wrong: list[WrongPage] = []
    present = len(keys)
    for n, (path, expected) in enumerate(zip(paths, sizes, strict=True)):
        try:
            found = os.path.getsize(path)
        except OSError:
            present = n // per_page
            break
        if found != expected and (not wrong or wrong[-1][0] != n // per_page):
            wrong.append((n // per_page, os.path.basename(path), found, expected))
    good = min(present, _leading_good_pages(wrong, len(keys)))
    return _read_leading(read, keys, host_indices, extra_info, good)


SIZE_CHECKS: dict[str, tuple[tuple[str, Callable[..., Any]], ...]] = {
    "file": (("batch_get", _file_batch_get_checked),),
    "mooncake": (
        ("batch_get_v1", _mooncake_batch_get_checked),
        ("_get_batch_zero_copy_impl", _mooncake_lengths_checked),
    ),
    "nixl": (("batch_get_v1", _nixl_batch_get_checked),),
}
"""Per backend whose stored objects have a size or length to check: the
methods of its reads, and the checks that let through only the leading pages
of the pool's exact size."""


class _GuardedMethod:
    """A name :class:`GuardedStorage` may guard: its guard when it has one,
    else the backend's own. A data descriptor, so an instance attribute of the
    backend (whose dictionary the guard shares) never goes around a guard."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, guard: Any, owner: type | None = None) -> Any:
        if guard is None:
            return self
        guards = object.__getattribute__(guard, "_guards")
        return guards[self.name] if self.name in guards else guard._own(self.name)

    def __set__(self, guard: Any, value: Any) -> None:
        setattr(object.__getattribute__(guard, "_backend"), self.name, value)


for _name in {
    *KEYED_METHODS,
    *(m for checks in SIZE_CHECKS.values() for m, _ in checks),
}:
    setattr(GuardedStorage, _name, _GuardedMethod(_name))
