"""The package's counters as the process's registry holds them, for tests to
take before and after what they drive (counters only grow, and every pool of
a test process counts under the same labels)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sglang_mxfp8_hicache import metrics


def missed(pool: str) -> dict[str, float]:
    """L3 pages treated as a miss so far, by reason, of pool ``pool``."""
    return {
        reason: _sample("l3_missed_pages_total", tp_rank="0", pool=pool, reason=reason)
        for reason in metrics.MISS_REASONS
    }


def moved(pool: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(pages, bytes) moved so far by (path, direction), of pool ``pool``."""
    return {
        (path, direction): tuple(
            _sample(
                f"moved_{what}_total",
                tp_rank="0",
                pool=pool,
                path=path,
                direction=direction,
            )
            for what in ("pages", "bytes")
        )
        for path in metrics.PATHS
        for direction in ("load", "backup")
    }


def staging_reserved() -> float:
    return _sample("staging_reserved_bytes", tp_rank="0")


def grown(before: dict, after: dict) -> dict:
    """The entries that grew, by how much."""
    deltas = {
        key: tuple(a - b for a, b in zip(after[key], before[key], strict=True))
        if isinstance(before[key], tuple)
        else after[key] - before[key]
        for key in before
    }
    return {
        key: d for key, d in deltas.items() if any(d if isinstance(d, tuple) else [d])
    }


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metrics.PREFIX + name, labels) or 0.0
