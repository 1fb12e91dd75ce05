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
"""

from __future__ import annotations

import numpy as np
import xxhash

from sglang_mxfp8_hicache.page import SEAL_CONTENT_BYTES

MAGIC = b"MXHCSEAL"


def key_seed(tag: str, key: str) -> int:
    """The seed of a page stored under ``key`` by a pool of format ``tag``."""
    return xxhash.xxh3_64_intdigest(f"{tag}/{key}".encode())


def _content(seed: int, part: np.ndarray, seal_bytes: int) -> bytes:
    digest = xxhash.xxh3_64_intdigest(part[:-seal_bytes], seed=seed)
    return MAGIC + seed.to_bytes(8, "little") + digest.to_bytes(8, "little")


def write(part: np.ndarray, seal_bytes: int, seed: int) -> None:
    """Seals ``part`` (one K or V part of a page, uint8, its seal last)."""
    end = len(part) - seal_bytes + SEAL_CONTENT_BYTES
    part[-seal_bytes:end] = np.frombuffer(_content(seed, part, seal_bytes), np.uint8)


def holds(part: np.ndarray, seal_bytes: int, seed: int) -> bool:
    """Whether ``part`` carries the seal its bytes and ``seed`` make."""
    end = len(part) - seal_bytes + SEAL_CONTENT_BYTES
    return part[-seal_bytes:end].tobytes() == _content(seed, part, seal_bytes)
