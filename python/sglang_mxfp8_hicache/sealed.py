"""Sealed L3 batches: a put seals its pages' parts, then writes them; a get
reads, then takes the leading pages whose parts carry their seal.

A batch is :class:`FlatPages` (``batch_get`` / ``batch_set``: a flat page
tensor per key) or :class:`HostPages` (``batch_*_v1``: the pool's host pages,
read and written in place); each gives :class:`SealedBatches` a chunk's
backend call, its pages' parts, and what a get's reply says arrived. SGLang
takes no page after a miss, so a get keeps the pages before the first that
is missing, of the wrong size or unsealed; what a read wrote past it lies in
pages SGLang frees or reads again.
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sglang_mxfp8_hicache import seal
from sglang_mxfp8_hicache.chunked import ChunkedCalls

if TYPE_CHECKING:
    import torch

    from sglang_mxfp8_hicache.metrics import PoolMetrics
    from sglang_mxfp8_hicache.settings import Settings

logger = logging.getLogger(__name__)

PageParts = tuple[np.ndarray, np.ndarray]
"""The K and V parts of one stored page, as uint8 arrays."""

UNSEALED = -2
"""The size reported for a page of the right size whose seal does not match."""


MOONCAKE_OBJECT_NOT_FOUND = -704
"""Mooncake's ``OBJECT_NOT_FOUND`` (``ErrorCode``), a read's result for an
object it does not hold: a page with another of its objects lacks a part."""


class WrongPage(NamedTuple):
    """A page of a batch that did not arrive whole: its place in the batch,
    its key (or its first wrong object or file), the bytes found (or a
    backend's negative error, or :data:`UNSEALED`) and the bytes expected."""

    page: int
    name: str
    found: int
    expected: int

    @property
    def reason(self) -> str:
        """Why it is a miss, as ``metrics.MISS_REASONS`` names it."""
        if self.found == UNSEALED:
            return "seal_mismatch"
        if self.found == MOONCAKE_OBJECT_NOT_FOUND:
            return "part_missing"
        return "read_error" if self.found < 0 else "wrong_size"


def leading_good_pages(
    wrong: Sequence[WrongPage], pages: int, counts: PoolMetrics
) -> int:
    """The pages of a batch of ``pages`` before the first wrong one; the
    wrong ones are logged once, and counted with the pages behind them."""
    if not wrong:
        return pages
    first = wrong[0]
    for reason, missed in collections.Counter(p.reason for p in wrong).items():
        counts.l3_missed(reason, missed)
    counts.l3_missed("behind_a_miss", pages - first.page - len(wrong))
    found = (
        "unsealed"
        if first.found == UNSEALED
        else f"read error {first.found}"
        if first.found < 0
        else f"{first.found} bytes"
    )
    logger.warning(
        "L3: %d of %d pages in this batch are missing a part or have the "
        "wrong size or seal; they and the pages after the first of them are "
        "treated as not in L3 (first: %s, %s, expected %d bytes).",
        len(wrong),
        pages,
        first.name,
        found,
        first.expected,
    )
    return first.page


def leading_replies(replies: Sequence[Any], pages: int, missed: Callable) -> int:
    """The pages of a chunk that ``replies`` gives before its first miss."""
    replied = min(pages, len(replies))
    return next((n for n, r in enumerate(replies[:replied]) if missed(r)), replied)


def read_or_log(read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, or None (logged) if the backend raised: a miss."""
    try:
        return read(*args)
    except Exception as exc:
        logger.warning(
            "L3: the backend raised %r on a read; its pages are treated as not in L3.",
            exc,
        )
        return None


def with_prefix_keys(extra_info: Any, prefix_keys: list[str]) -> Any:
    """A copy of SGLang's ``HiCacheStorageExtraInfo`` with other ``prefix_keys``."""
    info = copy.copy(extra_info)
    info.prefix_keys = prefix_keys
    return info


def chunk_extra_info(extra_info: Any, keys: Sequence[str], start: int) -> Any:
    """``extra_info`` for the chunk from page ``start``: ``prefix_keys`` with
    the keys before it, as SGLang's hybrid controller splits its calls."""
    prefix = getattr(extra_info, "prefix_keys", None)
    if start == 0 or prefix is None:
        return extra_info
    return with_prefix_keys(extra_info, [*prefix, *keys[:start]])


class FlatPages:
    """A ``batch_get`` / ``batch_set`` batch: a flat page per key. Seals are
    made under ``keys``, the controller's; the backend gets them ``prefix``ed."""

    def __init__(
        self,
        pool: Any,
        keys: Sequence[str],
        pages: Sequence[torch.Tensor],
        sizes=None,
        prefix: str = "",
    ) -> None:
        self.pool, self.keys, self.pages, self.sizes = pool, keys, pages, sizes
        self.stored_keys = [prefix + key for key in keys]

    def call(self, method: Callable[..., Any], start: int, end: int) -> Any:
        args = [self.stored_keys[start:end], self.pages[start:end]]
        if self.sizes is not None:
            args.append(self.sizes[start:end])
        return method(*args)

    def parts(self, start: int, end: int) -> list[PageParts]:
        return [self._parts(page) for page in self.pages[start:end]]

    def _parts(self, page: torch.Tensor) -> PageParts:
        """A view of a contiguous CPU page (a put seals host pages in place);
        raises on any other tensor."""
        import torch

        data = page.reshape(-1).view(torch.uint8).numpy()
        k_span = self.pool.host_page.k_part.span_bytes
        return data[:k_span], data[k_span:]

    def arrived(self, start: int, end: int, reply: Sequence[Any]) -> list[Any]:
        """Per leading page the backend returned, its parts, or the bytes
        found where they are not one whole page."""
        expected = self.pool.host_page.span_bytes
        arrived: list[Any] = []
        for page in reply[: leading_replies(reply, end - start, lambda r: r is None)]:
            found = page.numel() * page.element_size()
            try:
                arrived.append(self._parts(page) if found == expected else found)
            except (RuntimeError, TypeError):  # not a contiguous CPU tensor
                arrived.append(UNSEALED)
        return arrived

    def get_result(self, replies: Sequence[Any], good: int) -> list[Any]:
        results = [page for reply in replies if reply is not None for page in reply]
        return [*results[:good], *[None] * (len(self.keys) - good)]


class HostPages:
    """A ``batch_*_v1`` batch: host indices of the pool's pages, which the
    backend reads and writes in place; ``keys`` as :class:`FlatPages`'."""

    def __init__(
        self,
        pool: Any,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info=None,
        prefix: str = "",
    ) -> None:
        self.pool, self.keys, self.extra_info = pool, keys, extra_info
        self.host_indices = host_indices
        self.stored_keys = [prefix + key for key in keys]

    def _indices(self, start: int, end: int) -> torch.Tensor:
        page_size = self.pool.page_size
        return self.host_indices[start * page_size : end * page_size]

    def call(self, method: Callable[..., Any], start: int, end: int) -> Any:
        extra_info = chunk_extra_info(self.extra_info, self.stored_keys, start)
        return method(
            self.stored_keys[start:end], self._indices(start, end), extra_info
        )

    def parts(self, start: int, end: int) -> list[PageParts]:
        """Slices of one uint8 view of the pool's pages: no tensor per page."""
        import torch

        rows = self.pool.kv_buffer.view(torch.uint8).numpy()
        k_span = self.pool.host_page.k_part.span_bytes
        pages = self.pool.page_numbers(self._indices(start, end)).tolist()
        return [(rows[page, :k_span], rows[page, k_span:]) for page in pages]

    def arrived(self, start: int, end: int, reply: Sequence[bool]) -> list[Any]:
        returned = leading_replies(reply, end - start, lambda hit: not hit)
        return self.parts(start, start + returned)

    def get_result(self, replies: Sequence[Any], good: int) -> list[bool]:
        return [*[True] * good, *[False] * (len(self.keys) - good)]


Batch = FlatPages | HostPages


class SealedBatches:
    """A sealed backend's puts and gets (module docstring): its pool, its
    :class:`~sglang_mxfp8_hicache.seal.Sealer`, and the chunked calls of each
    direction."""

    def __init__(self, pool: Any, settings: Settings) -> None:
        self.pool = pool
        self.sealer = seal.Sealer(settings.seal_threads)
        self.reads = ChunkedCalls("l3-read", settings.l3_chunk_pages)
        self.writes = ChunkedCalls("l3-write", settings.l3_chunk_pages)

    def _seeds(self, keys: Sequence[str]) -> list[int]:
        """Both parts of a page are sealed under its key."""
        tag = self.pool.storage_format_tag
        return [seed for key in keys for seed in [seal.key_seed(tag, key)] * 2]

    def seal(self, batch: Batch, start: int, end: int) -> None:
        parts = [part for page in batch.parts(start, end) for part in page]
        self.sealer.write_all(parts, self._seeds(batch.keys[start:end]))

    def put(self, write: Callable[..., Any], batch: Batch) -> list[Any]:
        """Each chunk sealed, then written (the next sealed meanwhile); the
        chunks' replies."""
        return self.writes.sealed_write(
            len(batch.keys),
            lambda start, end: self.seal(batch, start, end),
            lambda start, end: batch.call(write, start, end),
        )

    def get(self, read: Callable[..., Any], batch: Batch) -> list[Any]:
        """Each chunk read, then checked (the next read meanwhile); the
        batch's result up to its first missing, wrong or unsealed page."""
        keys = batch.keys

        def check(start: int, end: int, reply: Any) -> int:
            if reply is None:  # the backend raised: logged by read_or_log
                self.pool.metrics.l3_missed("backend_raised", end - start)
                self.pool.metrics.l3_missed("behind_a_miss", len(keys) - end)
                return 0
            arrived = batch.arrived(start, end, reply)
            sized = [n for n, got in enumerate(arrived) if not isinstance(got, int)]
            parts = [part for n in sized for part in arrived[n]]
            held = self.sealer.hold_all(
                parts, self._seeds([keys[start + n] for n in sized])
            )
            for n, k_ok, v_ok in zip(sized, held[::2], held[1::2], strict=True):
                arrived[n] = k_ok and v_ok or UNSEALED
            expected = self.pool.host_page.span_bytes
            wrong = [
                WrongPage(start + n, keys[start + n], got, expected)
                for n, got in enumerate(arrived)
                if got is not True
            ]
            good = leading_good_pages(wrong, len(keys), self.pool.metrics)
            return min(len(arrived), good - start)

        good, replies = self.reads.read_checked(
            len(keys),
            lambda start, end: read_or_log(batch.call, read, start, end),
            check,
        )
        return batch.get_result(replies, good)
