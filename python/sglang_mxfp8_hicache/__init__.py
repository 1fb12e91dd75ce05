"""Block-scaled KV caches (MXFP8, FP4) in SGLang's hierarchical KV cache (HiCache),
as an SGLang plugin. The host pool (:mod:`sglang_mxfp8_hicache.host_pool`)
imports SGLang, so it is imported only where it is used.
"""

from sglang_mxfp8_hicache.geometry import FORMATS, ScaleFormat, ScaleGeometry

__version__ = "0.1.0"

__all__ = ["FORMATS", "ScaleFormat", "ScaleGeometry", "__version__"]
