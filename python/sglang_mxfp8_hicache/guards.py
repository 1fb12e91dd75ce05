"""The guards in front of the L3 backends SGLang builds for a pool of ours
(which backend gets which, and why: ``storage.BACKENDS``).

A guard's class body lists every method it changes, each a call to the
backend and then a check (or a seal before it); every other attribute is the
backend's. A call between a backend's own methods that a guard must sit in is
named in its row's ``inner_calls``: the guard sets its ``inner_<name>`` in
front of the backend's method, on that backend instance only.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sglang_mxfp8_hicache.sealed import (
    MOONCAKE_OBJECT_NOT_FOUND,
    FlatPages,
    HostPages,
    SealedBatches,
    WrongPage,
    leading_good_pages,
    with_prefix_keys,
)

if TYPE_CHECKING:
    import torch

    from sglang_mxfp8_hicache.settings import Settings


class Guard:
    """A backend, with the calls named in ``inner_calls`` guarded (module
    docstring); subclasses list the methods they change."""

    def __init__(
        self,
        backend: Any,
        pool: Any,
        settings: Settings,
        inner_calls: Sequence[str] = (),
    ) -> None:
        self._backend = backend
        self._pool = pool
        self._settings = settings
        for name in inner_calls:
            own = getattr(backend, name)
            setattr(
                backend, name, functools.partial(getattr(self, f"inner_{name}"), own)
            )

    def __getattr__(self, name: str) -> Any:
        if name == "_backend":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._backend, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._backend!r})"


def file_page_path(backend: Any, key: str) -> str:
    """Where ``HiCacheFile`` keeps the page of ``key``."""
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin")


class FileGuard(Guard):
    """``HiCacheFile`` reads a longer file into the page without a word and
    raises on a shorter one, which costs the whole batch."""

    def batch_get(
        self,
        keys: Sequence[str],
        target_locations: Sequence[torch.Tensor],
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """The leading files of exactly one page; a missing one is the
        backend's own miss."""
        wrong = []
        for page, (key, target) in enumerate(zip(keys, target_locations, strict=True)):
            expected = target.numel() * target.element_size()
            try:
                found = os.path.getsize(file_page_path(self._backend, key))
            except OSError:
                continue
            if found != expected:
                wrong.append(WrongPage(page, key, found, expected))
        good = leading_good_pages(wrong, len(keys), self._pool.metrics)
        read = self._backend.batch_get(keys[:good], target_locations[:good])
        return [*read, *[None] * (len(keys) - good)]


WRONG_LENGTH = -2000
"""What the guard reports, in place of the bytes read, for an object that
arrived with another length than its buffer's (Mooncake's own errors are
small negative codes; SGLang counts any result above 0 as read)."""


class MooncakeGuard(Guard):
    """Mooncake refuses a longer object before writing a byte, but reads a
    shorter one and reports the bytes it read, which SGLang takes as read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch = threading.local()
        """The objects of this thread's guarded batch read not read whole."""

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """The pages before the first with an object not read whole. A page
        with none of its objects is a plain miss, which SGLang logs."""
        self._batch.wrong = wrong_objects = []
        try:
            results = self._backend.batch_get_v1(keys, host_indices, extra_info)
        finally:
            self._batch.wrong = None
        if not wrong_objects:
            return results
        per_page = wrong_objects[0][-1] // len(keys)
        by_page: dict[int, list[tuple[int, str, int, int, int]]] = {}
        for found in wrong_objects:
            by_page.setdefault(found[0] // per_page, []).append(found)
        wrong = [
            WrongPage(page, objects[0][1], objects[0][2], objects[0][3])
            for page, objects in by_page.items()
            if [o[2] for o in objects] != [MOONCAKE_OBJECT_NOT_FOUND] * per_page
        ]
        good = leading_good_pages(wrong, len(keys), self._pool.metrics)
        return [*results[:good], *[False] * (len(keys) - good)]

    def inner__get_batch_zero_copy_impl(
        self,
        own: Callable[..., Any],
        key_strs: list[str],
        buffer_ptrs: list[Any],
        buffer_sizes: list[Any],
    ) -> list[int]:
        """Every zero-copy read of the store: an object of another length
        than its buffer is reported as :data:`WRONG_LENGTH`, and noted for
        :meth:`batch_get_v1`'s log."""
        counts = own(key_strs, buffer_ptrs, buffer_sizes)
        if list(counts) == buffer_sizes:  # every object whole
            return counts
        expected = np.array(
            [sum(s) if isinstance(s, list | tuple) else s for s in buffer_sizes]
        )
        found = np.asarray(counts, dtype=np.int64)
        wrong_objects = getattr(self._batch, "wrong", None)
        if wrong_objects is not None:
            wrong_objects += [
                (int(n), key_strs[n], int(found[n]), int(expected[n]), len(counts))
                for n in np.flatnonzero(found != expected)
            ]
        counts = list(counts)
        for n in np.flatnonzero((found > 0) & (found != expected)):
            counts[n] = WRONG_LENGTH
        return counts


class SealedGuard(Guard):
    """Every page sealed on its way to L3 and checked on its way back
    (``sealed.py``); with a ``prefix``, every key the backend is given takes it."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sealed = SealedBatches(self._pool, self._settings)
        self._prefix = prefix

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self._prefix + key for key in keys]

    def _info(self, extra_info: Any) -> Any:
        prefix_keys = getattr(extra_info, "prefix_keys", None)
        if not self._prefix or prefix_keys is None:
            return extra_info
        return with_prefix_keys(extra_info, self._keys(prefix_keys))

    def inner_batch_exists(self, own: Callable[..., Any], keys, extra_info=None):
        """Every page lookup, the controller's and ``batch_exists_v2``'s."""
        return own(self._keys(keys), self._info(extra_info))

    def batch_set(self, keys, values, *args: Any, **kwargs: Any) -> bool:
        batch = FlatPages(self._pool, keys, values, prefix=self._prefix)
        if args or kwargs:  # not the controller's call: one chunk
            self._sealed.seal(batch, 0, len(keys))
            return self._backend.batch_set(batch.stored_keys, values, *args, **kwargs)
        return all(self._sealed.put(self._backend.batch_set, batch))

    def batch_get(self, keys, target_locations, target_sizes=None):
        batch = FlatPages(
            self._pool, keys, target_locations, target_sizes, prefix=self._prefix
        )
        return self._sealed.get(self._backend.batch_get, batch)

    def _host_pages(self, keys, host_indices, extra_info) -> HostPages:
        info = self._info(extra_info)
        return HostPages(self._pool, keys, host_indices, info, prefix=self._prefix)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        replies = self._sealed.put(
            self._write_v1, self._host_pages(keys, host_indices, extra_info)
        )
        return [written for reply in replies for written in reply]

    def _write_v1(self, keys, host_indices, extra_info) -> list[bool]:
        """A chunk's replies; pages a short reply leaves out are not written."""
        reply = self._backend.batch_set_v1(keys, host_indices, extra_info)
        return [*reply[: len(keys)], *[False] * (len(keys) - len(reply))]

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        batch = self._host_pages(keys, host_indices, extra_info)
        return self._sealed.get(self._read_v1, batch)

    def _read_v1(self, keys, host_indices, extra_info) -> list[bool]:
        return self._backend.batch_get_v1(keys, host_indices, extra_info)


def nixl_page_paths(backend: Any, keys: Sequence[str]) -> list[str]:
    """Where ``HiCacheNixl`` (file plugins) keeps the pages of ``keys``: a
    file per K and V part in zero-copy mode, one per flat page otherwise."""
    names = (
        backend._get_key_list_from_meta(keys)
        if backend.is_zero_copy
        else [backend._get_suffixed_key(key) for key in keys]
    )
    return [backend.file_manager.get_file_path(name) for name in names]


class NixlGuard(SealedGuard):
    """Sealed; a failed read (NIXL fails a batch on one missing or short file)
    is read again up to its first file of the wrong size."""

    def _read_v1(self, keys, host_indices, extra_info) -> list[bool]:
        backend = self._backend
        results = backend.batch_get_v1(keys, host_indices, extra_info)
        if backend.file_manager is None or (
            len(results) >= len(keys) and all(results[: len(keys)])
        ):
            return results  # an object plugin, or all read: the seals judge
        page = self._pool.host_page
        paths = nixl_page_paths(backend, keys)
        sizes = [page.span_bytes]
        if backend.is_zero_copy:
            sizes = [page.k_part.span_bytes, page.v_part.span_bytes]
        wrong: list[WrongPage] = []
        present = len(keys)
        for n, path in enumerate(paths):
            expected = sizes[n % len(sizes)]
            try:
                found = os.path.getsize(path)
            except OSError:
                present = n // len(sizes)
                break
            if found != expected and (not wrong or wrong[-1].page != n // len(sizes)):
                name = os.path.basename(path)
                wrong.append(WrongPage(n // len(sizes), name, found, expected))
        good = leading_good_pages(wrong, len(keys), self._pool.metrics)
        good = min(present, good)
        if not good:
            return [False] * len(keys)
        page_tokens = len(host_indices) // len(keys)
        read = backend.batch_get_v1(
            keys[:good], host_indices[: good * page_tokens], extra_info
        )
        return [*read, *[False] * (len(keys) - good)]
