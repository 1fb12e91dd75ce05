"""The error every refusal raises, shared by the pool and the L3 guard."""


class MXFP8HiCacheConfigError(ValueError):
    """A configuration this pool cannot serve; the message names the flag to change."""
