"""The seal of a page part, written and checked a batch at a time on threads:
the same bytes as one at a time, and a flipped byte anywhere is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_mxfp8_hicache import seal
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError


def _parts(count: int, size: int = 64 << 10) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_batch_seals_as_one_at_a_time(threads):
    parts, alone = _parts(7), _parts(7)
    seeds = [seal.key_seed("mxfp8v4", f"key{n}") for n in range(len(parts))]
    seal.write_all(parts, seeds, threads)
    for part, seed in zip(alone, seeds, strict=True):
        seal.write(part, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, alone, strict=True))
    assert seal.hold_all(parts, seeds, threads) == [True] * len(parts)
    # One byte flipped in one part (its payload, the padding before its seal,
    # its digest): that part alone.
    for where in (1000, len(parts[4]) - 30, len(parts[4]) - 4):
        parts[4][where] ^= 0x01
        held = seal.hold_all(parts, seeds, threads)
        assert held == [n != 4 for n in range(len(parts))], where
        parts[4][where] ^= 0x01
    # Another key's seed does not match.
    assert seal.hold_all(parts[:1], seeds[1:2], threads) == [False]


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_seal_threads_refuses_a_bad_value(monkeypatch, value):
    monkeypatch.setenv(seal.THREADS_ENV, value)
    with pytest.raises(BlockScaledHiCacheConfigError, match=seal.THREADS_ENV):
        seal.threads()


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (16, 4)])
def test_seal_threads_default_to_four_or_the_cores(monkeypatch, cores, expected):
    """Unset, the variable gives 4 threads, or as many as the process's cores
    if fewer; set, it is taken as given."""
    monkeypatch.delenv(seal.THREADS_ENV, raising=False)
    monkeypatch.setattr(seal.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert seal.threads() == expected
    monkeypatch.setenv(seal.THREADS_ENV, "8")
    assert seal.threads() == 8
