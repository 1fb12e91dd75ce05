"""The seal at the end of each part of a host page (``page.PagePart``).

Some L3 backends cannot say what they stored before its bytes land in the
page: a class loaded with ``--hicache-storage-backend dynamic`` answers hit or
miss, and may have copied a shorter, longer, stale or foreign object into the
page. For those, each part's seal is written when a page goes to L3 and
checked when it comes back, and a part whose seal does not match is a miss.

A seal is 24 bytes at the start of the part's last ``page.seal_bytes``:

    magic b"MXHCSEAL" | seed (8 B, little endian) | digest (8 B, little endian)

``seed`` is xxh3-64 of the pool's format tag and the page's key, so an object
stored under another key, or by a pool of another format, does not match;
``digest`` is xxh3-64 of every byte of the part before its seal, with that
seed. SGLang already depends on ``xxhash``.

A digest is a pass over the page in host memory, several GB/s per core, on
the L3 path of these backends only. ``map_pages`` runs it for a batch's pages
on up to ``DIGEST_THREADS`` threads: the digest is python-xxhash's own
``XXH3_64bits_withSeed`` called through ctypes, which releases the GIL (the
Python binding holds it); where that symbol cannot be found, pages are
digested one after another by the binding, with the same result.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import xxhash

from sglang_mxfp8_hicache.page import SEAL_CONTENT_BYTES

MAGIC = b"MXHCSEAL"


DIGEST_THREADS = min(8, os.cpu_count() or 1)

T = TypeVar("T")
R = TypeVar("R")


def _native_xxh3() -> Callable[[int, int, int], int] | None:
    """``XXH3_64bits_withSeed(pointer, length, seed)`` of python-xxhash's
    extension, or None if it does not export it."""
    try:
        function = ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits_withSeed
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    return function


_XXH3 = _native_xxh3()
_threads: ThreadPoolExecutor | None = None


def digest(data: np.ndarray, seed: int) -> int:
    """xxh3-64 of ``data`` (uint8) under ``seed``."""
    if _XXH3 is not None and data.flags.c_contiguous:
        return _XXH3(data.ctypes.data, data.nbytes, seed)
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def map_pages(function: Callable[[T], R], pages: Sequence[T]) -> list[R]:
    """``function`` over ``pages``, on threads where digests leave the GIL."""
    global _threads
    if _XXH3 is None or DIGEST_THREADS < 2 or len(pages) < 2:
        return [function(page) for page in pages]
    if _threads is None:
        _threads = ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="l3-seal")
    return list(_threads.map(function, pages))


def key_seed(tag: str, key: str) -> int:
    """The seed of a page stored under ``key`` by a pool of format ``tag``."""
    return xxhash.xxh3_64_intdigest(f"{tag}/{key}".encode())


def _content(seed: int, part: np.ndarray, seal_bytes: int) -> bytes:
    value = digest(part[:-seal_bytes], seed)
    return MAGIC + seed.to_bytes(8, "little") + value.to_bytes(8, "little")


def write(part: np.ndarray, seal_bytes: int, seed: int) -> None:
    """Seals ``part`` (one K or V part of a page, uint8, its seal last)."""
    end = len(part) - seal_bytes + SEAL_CONTENT_BYTES
    part[-seal_bytes:end] = np.frombuffer(_content(seed, part, seal_bytes), np.uint8)


def holds(part: np.ndarray, seal_bytes: int, seed: int) -> bool:
    """Whether ``part`` carries the seal its bytes and ``seed`` make."""
    end = len(part) - seal_bytes + SEAL_CONTENT_BYTES
    return part[-seal_bytes:end].tobytes() == _content(seed, part, seal_bytes)
