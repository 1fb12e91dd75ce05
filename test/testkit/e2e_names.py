"""What ``test/e2e.py`` and ``test/e2e_cpu.py`` accept, by name, without
importing torch or SGLang: their flags are checked before either loads
(``e2e.py`` checks that its builders are these setups)."""

from __future__ import annotations

from sglang_mxfp8_hicache.geometry import FP4_FORMAT_NAMES

MODES = ("ours", "sglang", "plain")
SETUPS = (
    "kv",
    "draft",
    "sidecar_draft",
    "layer_first",
    "hybrid_swa",
    "mamba",
    *FP4_FORMAT_NAMES,
    "mamba_fp4_mx_block16",
)
L3_BACKENDS = ("file", "hf3fs", "nixl", "mooncake", "seaweedfs", "dynamic")
