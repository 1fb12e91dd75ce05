"""Host-tier sizing per rank, with and without the MXFP8 scale bytes.

Follows ``HostKVCache.__init__`` in SGLang 0.5.23: ``--hicache-size`` (decimal GB)
divided by the bytes per token, else the device token count times
``--hicache-ratio``; rounded down to whole pages plus one padding page. The CPU
tests check these figures against the real host pool's ``size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_mxfp8_hicache.geometry import MXFP8ScaleGeometry

PAGE_SIZE = 128


@dataclass(frozen=True)
class ModelGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelGeometry:
        """Read a Hugging Face ``config.json`` (or its ``text_config``)."""
        config = json.loads(Path(path).read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        )

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """SGLang splits KV heads over TP ranks, or replicates them when TP is larger."""
        if tp_size <= self.kv_heads:
            if self.kv_heads % tp_size:
                raise ValueError(
                    f"tp_size {tp_size} does not divide {self.kv_heads} KV heads"
                )
            return self.kv_heads // tp_size
        if tp_size % self.kv_heads:
            raise ValueError(
                f"tp_size {tp_size} is not a multiple of {self.kv_heads} KV heads"
            )
        return 1


@dataclass(frozen=True)
class HostPlan:
    kv_heads_per_rank: int
    payload_bytes_per_token: int
    scale_bytes_per_token: int
    host_tokens: int
    host_tokens_without_scales: int

    @property
    def bytes_per_token(self) -> int:
        return self.payload_bytes_per_token + self.scale_bytes_per_token

    @property
    def host_bytes(self) -> int:
        return self.host_tokens * self.bytes_per_token

    @property
    def host_bytes_without_scales(self) -> int:
        """What a payload-only host pool would have allocated."""
        return self.host_tokens_without_scales * self.payload_bytes_per_token


def host_tokens(
    bytes_per_token: int,
    *,
    device_tokens: int,
    hicache_ratio: float,
    hicache_size_gb: float,
    page_size: int = PAGE_SIZE,
) -> int:
    """``HostKVCache``'s token count: whole pages plus one padding page."""
    if hicache_size_gb > 0:
        tokens = int(hicache_size_gb * 1e9 // bytes_per_token)
    else:
        tokens = int(device_tokens * hicache_ratio)
    return (tokens // page_size + 1) * page_size


def host_plan(
    model: ModelGeometry,
    *,
    tp_size: int,
    device_tokens: int,
    hicache_ratio: float = 2.0,
    hicache_size_gb: float = 0.0,
) -> HostPlan:
    heads = model.kv_heads_per_rank(tp_size)
    scales = MXFP8ScaleGeometry(
        head_num=heads, head_dim=model.head_dim, page_size=PAGE_SIZE
    )
    payload = 2 * scales.payload_bytes_per_token * model.layers
    scale = 2 * scales.bytes_per_token * model.layers

    def tokens(bytes_per_token: int) -> int:
        return host_tokens(
            bytes_per_token,
            device_tokens=device_tokens,
            hicache_ratio=hicache_ratio,
            hicache_size_gb=hicache_size_gb,
        )

    return HostPlan(
        kv_heads_per_rank=heads,
        payload_bytes_per_token=payload,
        scale_bytes_per_token=scale,
        host_tokens=tokens(payload + scale),
        host_tokens_without_scales=tokens(payload),
    )
