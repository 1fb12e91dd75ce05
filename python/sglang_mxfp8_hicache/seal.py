"""The seal at the end of each part of a host page (``page.PagePart``).

Some L3 backends cannot say what they stored before its bytes land in the
page (``storage.BACKENDS``: the sealed ones). For those, each part's seal is
written when a page goes to L3 and checked when it comes back, and a part
whose seal does not match is a miss.

A seal is the last 24 bytes of the part (its seal area, ``page.seal_bytes``,
ends in it):

    magic b"MXHCSEAL" | seed (8 B, little endian) | digest (8 B, little endian)

``seed`` is xxh3-64 of the pool's format tag and the page's key, so an object
stored under another key, or by a pool of another format, does not match;
``digest`` is xxh3-64 of every byte of the part before its seal, with that
seed: the layers and the rest of the seal area, which no device transfer
touches but which travels with the page.

An xxh3 pass is bound by what one core reads from memory and releases the
GIL, so a :class:`Sealer` spreads a batch's parts over threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import xxhash

from sglang_mxfp8_hicache.page import SEAL_CONTENT_BYTES

MAGIC = b"MXHCSEAL"
_T = TypeVar("_T")


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


class Sealer:
    """Seals and checks a batch's parts on ``threads`` threads (the
    ``seal_threads`` setting), each thread given one run of consecutive
    parts: a task per part would cost more in Python than the pass over a
    small part. One thread seals on the caller's."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="seal")

    def write_all(self, parts: Sequence[np.ndarray], seeds: Sequence[int]) -> None:
        """Seals every part with its seed (``write``)."""
        self._each(write, parts, seeds)

    def hold_all(self, parts: Sequence[np.ndarray], seeds: Sequence[int]) -> list[bool]:
        """Whether each part carries its seal (``holds``)."""
        return self._each(holds, parts, seeds)

    def _each(
        self,
        work: Callable[[np.ndarray, int], _T],
        parts: Sequence[np.ndarray],
        seeds: Sequence[int],
    ) -> list[_T]:
        count = min(self.threads, len(parts))
        if count <= 1:
            return [work(part, seed) for part, seed in zip(parts, seeds, strict=True)]
        cuts = [len(parts) * n // count for n in range(count + 1)]

        def run(lo: int, hi: int) -> list[_T]:
            return [work(parts[n], seeds[n]) for n in range(lo, hi)]

        runs = self._executor.map(run, cuts[:-1], cuts[1:])
        return [done for run_done in runs for done in run_done]
