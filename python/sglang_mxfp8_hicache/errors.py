"""The error every refusal raises, shared by the pool, the plugin and the L3 guard."""

from __future__ import annotations


class BlockScaledHiCacheConfigError(ValueError):
    """A configuration the block-scaled (MXFP8, FP4) host pool cannot serve; the
    message names the flag to change."""


def refusal_error(
    reason: str, fmt_name: str, pool_label: str | None = None
) -> BlockScaledHiCacheConfigError:
    """The one form of a refusal: ``[pool: ]FORMAT HiCache: reason``."""
    where = f"{pool_label}: " if pool_label else ""
    return BlockScaledHiCacheConfigError(f"{where}{fmt_name} HiCache: {reason}")
