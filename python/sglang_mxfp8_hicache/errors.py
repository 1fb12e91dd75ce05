"""The error every refusal raises, shared by the pool, the plugin and the L3 guard."""


class BlockScaledHiCacheConfigError(ValueError):
    """A configuration the block-scaled (MXFP8, FP4) host pool cannot serve; the
    message names the flag to change."""


MXFP8HiCacheConfigError = BlockScaledHiCacheConfigError
"""The name the error was introduced with, kept for code that catches it."""
