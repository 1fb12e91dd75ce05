"""The seal at the end of each part of a host page (``page.PagePart``).

Some L3 backends cannot say what they stored before its bytes land in the
page: a class loaded with ``--hicache-storage-backend dynamic`` answers hit or
miss, and may have copied a shorter, longer, stale or foreign object into the
page. For those, each part's seal is written when a page goes to L3 and
checked when it comes back, and a part whose seal does not match is a miss.

A seal is the last 24 bytes of the part (its seal area, ``page.seal_bytes``,
ends in it):

    magic b"MXHCSEAL" | seed (8 B, little endian) | digest (8 B, little endian)

``seed`` is xxh3-64 of the pool's format tag and the page's key, so an object
stored under another key, or by a pool of another format, does not match;
``digest`` is xxh3-64 of every byte of the part before its seal, with that
seed: the layers and the rest of the seal area, which no device transfer
touches but which travels with the page. SGLang already depends on ``xxhash``.

The storage guard seals and checks a batch chunk by chunk, beside the
backend's own I/O (``chunked.py``); a chunk's parts go to
``SGLANG_MXFP8_HICACHE_SEAL_THREADS`` threads (read once per pool, when its
guard is built). One xxh3 pass is bound by what one core reads from memory
(about 7 GB/s on the GPU hosts here) and runs outside the GIL, so threads
digest faster, and end to end too (``docs/benchmarks.md``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import xxhash

from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError
from sglang_mxfp8_hicache.page import SEAL_CONTENT_BYTES

MAGIC = b"MXHCSEAL"
THREADS_ENV = "SGLANG_MXFP8_HICACHE_SEAL_THREADS"
DEFAULT_THREADS = 4
"""Threads when the variable is unset, or the cores this process may run on
if fewer: on the H100 host 4 took a 64-page batch's check from 8.7 to 2.9 ms
and NIXL's gets from 1.58x to 1.24x payload-only's time; 8 digest only 1.3-1.4x
faster than 4 (each reads memory)."""


def key_seed(tag: str, key: str) -> int:
    """The seed of a page stored under ``key`` by a pool of format ``tag``."""
    return xxhash.xxh3_64_intdigest(f"{tag}/{key}".encode())


def _content(seed: int, part: np.ndarray) -> bytes:
    digest = xxhash.xxh3_64_intdigest(part[:-SEAL_CONTENT_BYTES], seed=seed)
    return MAGIC + seed.to_bytes(8, "little") + digest.to_bytes(8, "little")


def write(part: np.ndarray, seed: int) -> None:
    """Seals ``part`` (one K or V part of a page, uint8, its seal last)."""
    part[-SEAL_CONTENT_BYTES:] = np.frombuffer(_content(seed, part), np.uint8)


def holds(part: np.ndarray, seed: int) -> bool:
    """Whether ``part`` carries the seal its bytes and ``seed`` make."""
    return part[-SEAL_CONTENT_BYTES:].tobytes() == _content(seed, part)


def threads() -> int:
    """Threads a batch's parts are sealed and checked on
    (``SGLANG_MXFP8_HICACHE_SEAL_THREADS``; 1 seals on the caller's thread)."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return min(DEFAULT_THREADS, len(os.sched_getaffinity(0)))
    if not text.isdigit() or int(text) < 1:
        raise BlockScaledHiCacheConfigError(
            f"{THREADS_ENV}={text!r}: give the threads that seal and check L3 "
            f"pages as a whole number, 1 or more (default {DEFAULT_THREADS})."
        )
    return int(text)


_executors: dict[int, ThreadPoolExecutor] = {}
_executors_lock = threading.Lock()
_T = TypeVar("_T")


def _each(
    work: Callable[[np.ndarray, int], _T], parts, seeds, pool_threads: int
) -> list[_T]:
    """``work(part, seed)`` for every part, on ``pool_threads`` threads (one
    pool of them per process, whatever the batch's size), each given one
    run of consecutive parts: a task per part would cost more in Python than
    the xxh3 pass over a small part."""
    count = min(pool_threads, len(parts))
    if count <= 1:
        return [work(part, seed) for part, seed in zip(parts, seeds, strict=True)]
    with _executors_lock:  # storage threads of several pools may be here at once
        if pool_threads not in _executors:
            _executors[pool_threads] = ThreadPoolExecutor(
                pool_threads, thread_name_prefix="seal"
            )
        executor = _executors[pool_threads]
    cuts = [len(parts) * n // count for n in range(count + 1)]

    def run(lo: int, hi: int) -> list[_T]:
        return [work(parts[n], seeds[n]) for n in range(lo, hi)]

    runs = executor.map(run, cuts[:-1], cuts[1:])
    return [done for run_done in runs for done in run_done]


def write_all(
    parts: Sequence[np.ndarray],
    seeds: Sequence[int],
    pool_threads: int = DEFAULT_THREADS,
) -> None:
    """Seals every part with its seed (``write``), on ``pool_threads``
    threads (a pool's ``threads()``, read once when its guard is built)."""
    _each(write, parts, seeds, pool_threads)


def hold_all(
    parts: Sequence[np.ndarray],
    seeds: Sequence[int],
    pool_threads: int = DEFAULT_THREADS,
) -> list[bool]:
    """Whether each part carries its seal (``holds``), on ``pool_threads``."""
    return _each(holds, parts, seeds, pool_threads)
