"""A sealed L3 batch moved in chunks, so that the seal passes (``seal.py``)
run beside the backend's own I/O: the backend moves one chunk while a thread
of ours seals the next (puts) or checks the one before (gets). A get's chunks
shrink by half down to the ``l3_chunk_pages`` setting, a put's grow from it,
so a batch of ``n`` pages makes about ``log2(n / smallest)`` calls; 0, the
default, makes a batch one call (``docs/benchmarks.md`` says why).

The backend's calls stay on the caller's thread (SGLang's prefetch or backup
thread), one after another: a backend never meets a thread it did not come
from. A batch returns only once none of its passes is left running.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

_Reply = TypeVar("_Reply")


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
    one call): the backend's calls run in order on the caller's thread, the
    seal passes beside them on this object's thread."""

    def __init__(self, name: str, smallest: int) -> None:
        self.smallest = smallest
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)

    def read_checked(
        self,
        pages: int,
        read: Callable[[int, int], _Reply],
        check: Callable[[int, int, _Reply], int],
    ) -> tuple[int, list[_Reply]]:
        """Reads a batch chunk by chunk (``read(start, end)``), each checked
        while the next is read (``check(start, end, reply)``: its leading good
        pages). Returns the batch's leading good pages and the replies up to
        the first chunk with a bad page; none is read after it."""
        bounds = chunk_bounds(pages, self.smallest)
        if len(bounds) == 1:
            reply = read(0, pages)
            return check(0, pages, reply), [reply]
        replies: list[_Reply] = []
        pending: tuple[int, int, Future[int]] | None = None  # the chunk in check
        try:
            for start, end in bounds:
                reply = read(start, end)
                if pending is not None:
                    checked_start, checked_end, checked = pending
                    pending = None
                    good = checked_start + checked.result()
                    if good < checked_end:
                        return good, replies
                replies.append(reply)
                pending = (start, end, self._thread.submit(check, start, end, reply))
            checked_start, _, checked = pending
            pending = None
            return checked_start + checked.result(), replies
        finally:
            if pending is not None:
                wait([pending[2]])

    def sealed_write(
        self,
        pages: int,
        seal: Callable[[int, int], None],
        write: Callable[[int, int], _Reply],
    ) -> list[_Reply]:
        """Writes a batch of ``pages`` chunk by chunk, the smallest first
        (:func:`growing_chunk_bounds`): each chunk sealed (``seal(start,
        end)``) before it is written (``write(start, end)``), the next sealed
        while it is written. Returns each chunk's reply; a write or seal that
        raises ends the batch with its exception once no pass is running."""
        bounds = growing_chunk_bounds(pages, self.smallest)
        if len(bounds) == 1:
            seal(0, pages)
            return [write(0, pages)]
        replies: list[_Reply] = []
        sealed = self._thread.submit(seal, *bounds[0])
        try:
            for n, (start, end) in enumerate(bounds):
                sealed.result()
                if n + 1 < len(bounds):
                    sealed = self._thread.submit(seal, *bounds[n + 1])
                replies.append(write(start, end))
        finally:
            wait([sealed])
        return replies
