"""A sealed L3 batch moved in chunks, so that the seal pass hides behind the
backend's own I/O.

A sealed page (``seal.py``) costs one xxh3 pass over its bytes: before a put,
after a get. Made over the whole batch before or after the backend's one call,
the pass adds its whole time to the batch's (half to two thirds of a local
backend's read on the GPU hosts here). Split into chunks, the backend moves
one chunk on a thread of its own while the caller seals the next (puts) or
checks the one before (gets): the batch then costs the backend's time, one
call more per chunk, and the pass over one chunk, its last (gets) or first
(puts). That chunk is the smallest: a get's chunks shrink by half down to
``SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES`` pages, a put's grow from it the same
way, so a batch of ``n`` pages makes about ``log2(n / smallest)`` calls, and
the pass keeps up with the backend while it is at least twice as fast (an
xxh3 pass on one core, about 7 GB/s on the GPU hosts here, against 2-4 GB/s
of file I/O).

It is off by default (0: a batch is one call): each call more costs the
backend its own setup (NIXL about 0.4 ms on the H100 host, 1.2 ms on the CI
machine), and the overlap needs a core to spare beside the backend's
threads. On the 2-core CI machine chunks did not make NIXL or hf3fs faster
(``docs/benchmarks.md``); a host of many cores is where to try it.

The backend's calls of one direction run in order on one thread per guarded
backend, as SGLang runs them on its one prefetch or backup thread, and never
two at once; a batch returns only once none of its calls is left running
(a read past a bad page writes the prefetch's own host pages, which SGLang
frees when the batch returns).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

CHUNK_PAGES_ENV = "SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES"
DEFAULT_CHUNK_PAGES = 0

_Reply = TypeVar("_Reply")


def smallest_chunk_pages() -> int:
    """Pages of a sealed batch's smallest chunk
    (``SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES``; 0, the default: one call)."""
    text = os.environ.get(CHUNK_PAGES_ENV, "").strip()
    if not text:
        return DEFAULT_CHUNK_PAGES
    if not text.isdigit():
        raise BlockScaledHiCacheConfigError(
            f"{CHUNK_PAGES_ENV}={text!r}: give the pages of a sealed L3 batch's "
            "smallest chunk as a whole number (0, the default, moves a batch in "
            "one call)."
        )
    return int(text)


def chunk_bounds(pages: int, smallest: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of a batch of ``pages``: each the larger
    half of what is left, while what is left is at least twice ``smallest``;
    then the rest. A ``smallest`` of 0 makes the batch one chunk."""
    sizes: list[int] = []
    left = pages
    while smallest and left >= 2 * smallest:
        sizes.append(left - left // 2)
        left //= 2
    sizes.append(left)
    return _bounds(sizes)


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def growing_chunk_bounds(pages: int, smallest: int) -> list[tuple[int, int]]:
    """The chunks of :func:`chunk_bounds` in reverse order of size: the
    smallest first."""
    sizes = [end - start for start, end in chunk_bounds(pages, smallest)]
    return _bounds(sizes[::-1])


class ChunkedCalls:
    """One direction of a guarded backend's sealed batches (``"l3-read"``,
    ``"l3-write"``), in chunks of at least ``smallest`` pages (0: a batch is
    one call, on the caller's thread): the backend's calls run in order on
    this object's thread, the seal passes on the caller's."""

    def __init__(self, name: str, smallest: int) -> None:
        self.smallest = smallest
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    def read_checked(
        self,
        pages: int,
        read: Callable[[int, int], _Reply],
        check: Callable[[int, int, _Reply], int],
    ) -> tuple[int, list[_Reply]]:
        """Reads a batch of ``pages`` chunk by chunk (``read(start, end)``),
        each chunk's read issued behind the one before, and checks each
        chunk's reply while the next is read (``check(start, end, reply)``:
        the chunk's leading good pages, logging what it finds bad).

        Returns the batch's leading good pages and the replies of the chunks
        read up to the first with a bad page; the chunks after it are not
        read, or their reads are awaited and dropped."""
        bounds = chunk_bounds(pages, self.smallest)
        if len(bounds) == 1:
            reply = read(0, pages)
            return check(0, pages, reply), [reply]
        reads: list[Future[_Reply]] = [
            self._thread.submit(read, start, end) for start, end in bounds
        ]
        good, replies = 0, []
        try:
            for (start, end), chunk_read in zip(bounds, reads, strict=True):
                reply = chunk_read.result()
                replies.append(reply)
                chunk_good = check(start, end, reply)
                good = start + chunk_good
                if chunk_good < end - start:
                    break
        finally:
            for chunk_read in reads:
                chunk_read.cancel()
            wait(reads)
        return good, replies

    def sealed_write(
        self,
        pages: int,
        seal: Callable[[int, int], None],
        write: Callable[[int, int], _Reply],
    ) -> list[_Reply]:
        """Writes a batch of ``pages`` chunk by chunk, the smallest first
        (:func:`growing_chunk_bounds`): ``seal(start, end)`` on the caller's
        thread, then ``write(start, end)`` issued behind the chunk before,
        while the caller seals the next. Returns each chunk's reply, once
        every write is done; the first write that raised raises."""
        bounds = growing_chunk_bounds(pages, self.smallest)
        if len(bounds) == 1:
            seal(0, pages)
            return [write(0, pages)]
        writes: list[Future[_Reply]] = []
        try:
            for start, end in bounds:
                seal(start, end)
                writes.append(self._thread.submit(write, start, end))
        finally:
            wait(writes)
        return [chunk_write.result() for chunk_write in writes]
