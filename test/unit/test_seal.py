"""The seal of a page part, written and checked a batch at a time on threads:
the same bytes as one at a time, and a flipped byte anywhere is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_mxfp8_hicache import seal


def _parts(count: int, size: int = 64 << 10) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_batch_seals_as_one_at_a_time(threads):
    parts, alone = _parts(7), _parts(7)
    seeds = [seal.key_seed("mxfp8v4", f"key{n}") for n in range(len(parts))]
    sealer = seal.Sealer(threads)
    sealer.write_all(parts, seeds)
    for part, seed in zip(alone, seeds, strict=True):
        seal.write(part, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, alone, strict=True))
    assert sealer.hold_all(parts, seeds) == [True] * len(parts)
    # One byte flipped in one part (its payload, the padding before its seal,
    # its digest): that part alone.
    for where in (1000, len(parts[4]) - 30, len(parts[4]) - 4):
        parts[4][where] ^= 0x01
        held = sealer.hold_all(parts, seeds)
        assert held == [n != 4 for n in range(len(parts))], where
        parts[4][where] ^= 0x01
    # Another key's seed does not match.
    assert sealer.hold_all(parts[:1], seeds[1:2]) == [False]
