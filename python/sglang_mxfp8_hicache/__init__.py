"""Block-scaled KV caches (MXFP8, FP4) in SGLang's hierarchical KV cache (HiCache),
as an SGLang plugin.

The host pool class lives in :mod:`sglang_mxfp8_hicache.host_pool` and imports
SGLang; it is imported lazily so that the geometry, the CLI and the plugin entry
point stay cheap to import.
"""

from sglang_mxfp8_hicache.geometry import FORMATS, ScaleFormat, ScaleGeometry

__version__ = "0.1.0"

__all__ = ["FORMATS", "ScaleFormat", "ScaleGeometry", "__version__"]
