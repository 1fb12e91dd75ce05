"""Host-tier sizing per rank, with and without the scale bytes of a block-scaled format.

Follows ``HostKVCache.__init__`` in SGLang 0.5.23: ``--hicache-size`` (decimal GB)
divided by the bytes per token, else the device token count times
``--hicache-ratio``; rounded down to whole pages plus one padding page. The CPU
tests check these figures against the real host pool's ``size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_mxfp8_hicache.geometry import FORMATS, MXFP8, ScaleFormat, ScaleGeometry
from sglang_mxfp8_hicache.page import seal_bytes

PAGE_SIZE = 128
"""MXFP8's page size, and the default for the others."""
SMALLEST_SCALE_BLOCK = min(f.sf_block for f in FORMATS.values())
SCALED_HEAD_DIMS = "a multiple of the scale block: " + ", ".join(
    f"{f.sf_block} for {f.name}" for f in FORMATS.values()
)
MLA_CONFIG_KEYS = ("kv_lora_rank", "qk_rope_head_dim")
"""Keys of a latent-attention config (DeepSeek-V2/V3, Kimi K2): SGLang gives such
models an MLA KV pool, which MXFP8 HiCache does not serve."""


class SizingError(ValueError):
    """A model or TP size that cannot be sized: an unreadable or non-MHA config.json,
    or a count SGLang's MXFP8 KV pool would refuse.

    The CLI prints it as a one-line usage error, so every message names the value,
    where it came from and what is allowed.
    """


def _positive_int(value: object, name: str) -> int:
    # bool is an int subclass, but `true` in a config.json is no count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SizingError(
            f"{name} must be a positive integer, got {value!r} ({type(value).__name__})"
        )
    if value <= 0:
        raise SizingError(f"{name} must be a positive integer, got {value}")
    return value


def _scaled_head_dim(value: object, name: str) -> int:
    """A head_dim some block-scaled format can hold: whole scale blocks of the
    smallest block; the format's own block is checked by :func:`host_plan`."""
    head_dim = _positive_int(value, name)
    if head_dim % SMALLEST_SCALE_BLOCK:
        raise SizingError(f"{name} must be {SCALED_HEAD_DIMS}, got {head_dim}")
    return head_dim


def _config_count(config: dict, key: str) -> int:
    if config.get(key) is None:
        raise SizingError(f"{key} is missing")
    return _positive_int(config[key], key)


@dataclass(frozen=True)
class ModelGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _positive_int(self.layers, "layers")
        _positive_int(self.kv_heads, "kv_heads")
        _scaled_head_dim(self.head_dim, "head_dim")

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelGeometry:
        """Read a Hugging Face ``config.json`` (or its ``text_config``).

        Raises :class:`SizingError` naming the path and the key: the file is read
        from the user's command line, where a wrong file or an MLA model is a
        usage error, not a crash.
        """
        path = Path(path)
        if path.is_dir():
            raise SizingError(f"{path} is a directory, expected the config.json in it")
        try:
            config = json.loads(path.read_bytes())
        except OSError as exc:
            raise SizingError(f"{path}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise SizingError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls._from_config_dict(config)
        except SizingError as exc:
            raise SizingError(f"{path}: {exc}") from None

    @classmethod
    def _from_config_dict(cls, config: object) -> ModelGeometry:
        if not isinstance(config, dict):
            raise SizingError(f"expected a JSON object, got a {type(config).__name__}")
        if config.get("text_config") is not None:
            config = config["text_config"]
            if not isinstance(config, dict):
                raise SizingError(f"text_config must be a JSON object, got {config!r}")
        for key in MLA_CONFIG_KEYS:
            if config.get(key) is not None:
                raise SizingError(
                    f"{key} {config[key]!r} marks an MLA model (latent KV, as "
                    "DeepSeek-V3); block-scaled HiCache serves MHA KV pools only"
                )
        layers = _config_count(config, "num_hidden_layers")
        heads = _config_count(config, "num_attention_heads")
        kv_heads = heads
        if config.get("num_key_value_heads") is not None:
            kv_heads = _config_count(config, "num_key_value_heads")
        if config.get("head_dim") is not None:
            head_dim = _scaled_head_dim(config["head_dim"], "head_dim")
        elif config.get("hidden_size") is not None:
            hidden = _config_count(config, "hidden_size")
            head_dim = _scaled_head_dim(
                hidden // heads,
                f"head_dim (hidden_size {hidden} // num_attention_heads {heads})",
            )
        else:
            raise SizingError(
                "neither head_dim nor hidden_size (to derive head_dim) is given"
            )
        return cls(layers=layers, kv_heads=kv_heads, head_dim=head_dim)

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """SGLang splits KV heads over TP ranks, or replicates them when TP is larger."""
        _positive_int(tp_size, "--tp-size")
        if self.kv_heads % tp_size and tp_size % self.kv_heads:
            raise SizingError(
                f"--tp-size {tp_size} must divide the {self.kv_heads} KV heads "
                f"or be a multiple of {self.kv_heads}"
            )
        return max(1, self.kv_heads // tp_size)


@dataclass(frozen=True)
class HostPlan:
    kv_heads_per_rank: int
    payload_bytes_per_token: int
    scale_bytes_per_token: int
    seal_bytes_per_token: int
    host_tokens: int
    host_tokens_without_scales: int

    @property
    def bytes_per_token(self) -> int:
        """The host pool's ``get_size_per_token()``: payload, scales and the
        seals at the end of each part of a page (``page.seal_bytes``)."""
        return (
            self.payload_bytes_per_token
            + self.scale_bytes_per_token
            + self.seal_bytes_per_token
        )

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
    fmt: ScaleFormat = MXFP8,
    page_size: int = PAGE_SIZE,
) -> HostPlan:
    """``fmt``'s host tier for ``model``: payload and scale bytes from the
    same geometry the host pool uses."""
    heads = model.kv_heads_per_rank(tp_size)
    if model.head_dim % fmt.sf_block:
        raise SizingError(
            f"head_dim must be a multiple of {fmt.sf_block} ({fmt.name} keeps one "
            f"scale byte per {fmt.sf_block} elements), got {model.head_dim}"
        )
    if fmt.interleaved and page_size != PAGE_SIZE:
        raise SizingError(
            f"{fmt.name} HiCache needs --page-size {PAGE_SIZE}, got {page_size}"
        )
    scales = ScaleGeometry(
        head_num=heads, head_dim=model.head_dim, page_size=page_size, fmt=fmt
    )
    payload = 2 * scales.payload_bytes_per_token * model.layers
    scale = 2 * scales.bytes_per_token * model.layers
    seal = 2 * seal_bytes(page_size) // page_size

    def tokens(bytes_per_token: int) -> int:
        return host_tokens(
            bytes_per_token,
            device_tokens=device_tokens,
            hicache_ratio=hicache_ratio,
            hicache_size_gb=hicache_size_gb,
            page_size=page_size,
        )

    return HostPlan(
        kv_heads_per_rank=heads,
        payload_bytes_per_token=payload,
        scale_bytes_per_token=scale,
        seal_bytes_per_token=seal,
        host_tokens=tokens(payload + scale + seal),
        host_tokens_without_scales=tokens(payload),
    )
