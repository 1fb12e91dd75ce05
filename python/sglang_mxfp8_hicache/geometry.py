"""Byte geometry of block-scaled KV caches: formats, and the bytes of one side
(K or V) of one layer, shared by the host page, sizing and the CLI.

SGLang keeps a block-scaled KV cache as a packed payload plus one scale byte
per block of elements, in scale tensors beside the payload:

    format          payload            scale byte per   device scales per layer
    mxfp8           fp8 e4m3, 1 B      32 elements      (pages, H, 32, P // 32, D // 32)  FA4 interleaved
    fp4_mx_block16  2 x e2m1, 1/2 B    16 elements      (tokens, H * D // 16)             one row per token
    nvfp4           2 x e2m1, 1/2 B    16 elements      (tokens, H, D // 16)              one row per token

Each layout holds the payload of one page and layer in one contiguous run of
``payload_page_bytes`` and its scales in one of ``page_bytes``, so one
mechanism moves all three (``page.py``). A format is a small
:class:`ScaleFormat`; nothing else knows one from another. No CUDA imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.device_pool_info import MHABufferInfo


@dataclass(frozen=True)
class ScaleFormat:
    """What fixes a block-scaled KV format's bytes.

    ``interleaved``: the device keeps one page of scales per leading index (the
    FA4 atom), else one token. ``name`` is the ``--kv-cache-dtype`` value, and
    it leads the L3 key tag, so pages of one recipe never load into another.
    """

    name: str
    sf_block: int
    payload_bits: int
    interleaved: bool

    def payload_bytes(self, elements: int) -> int:
        return elements * self.payload_bits // 8


MXFP8 = ScaleFormat("mxfp8", sf_block=32, payload_bits=8, interleaved=True)
FP4_MX_BLOCK16 = ScaleFormat(
    "fp4_mx_block16", sf_block=16, payload_bits=4, interleaved=False
)
NVFP4 = ScaleFormat("nvfp4", sf_block=16, payload_bits=4, interleaved=False)
INTERLEAVED_PAGE_SIZE = 128
"""The page size at which SGLang 0.5.23 keeps MXFP8 scales interleaved (the FA4
atom), the only MXFP8 scale layout its write paths write."""
FORMATS = {f.name: f for f in (MXFP8, FP4_MX_BLOCK16, NVFP4)}
"""Every format this package serves, by ``--kv-cache-dtype``."""
FP4_FORMAT_NAMES = tuple(f.name for f in FORMATS.values() if f.payload_bits == 4)
MXFP8_SCALE_BLOCK = MXFP8.sf_block


def is_packed_fp4(buffer_info: MHABufferInfo) -> bool:
    """A uint8 payload of half a byte per element: SGLang's FP4 KV pools report
    the store dtype and the logical head_dim (``MHABufferInfo`` says 2x)."""
    import torch

    k = buffer_info.buffers.k
    return (
        buffer_info.dtype == torch.uint8
        and bool(k)
        and 2 * k[0].shape[-1] == buffer_info.head_dim
    )


def buffer_scale_format(buffer_info: MHABufferInfo) -> ScaleFormat | None:
    """The block-scaled format of a device pool, read from its tensors (nothing
    in ``MHABufferInfo`` names the recipe), or None for an unscaled pool.

    Recognised in any layout, page size and scale count, so that a pool we
    cannot serve gets our error naming the flag rather than a generic one: an
    fp8 payload with UE8M0 scales of one byte per 32 elements is MXFP8; a
    packed FP4 payload with uint8 scale rows of one byte per 16 elements is
    nvfp4 (per head, 3-D) or fp4_mx_block16 (heads flattened, 2-D).
    """
    import torch

    scales = buffer_info.scales
    if scales is None or not scales.k:
        return None
    scale = scales.k[0]
    if buffer_info.dtype == torch.float8_e4m3fn:
        if (
            scale.dtype == torch.float8_e8m0fnu
            and scale.shape[-1] == buffer_info.head_dim // MXFP8.sf_block
        ):
            return MXFP8
        return None
    if not is_packed_fp4(buffer_info) or scale.dtype != torch.uint8:
        return None
    head_num, head_dim = buffer_info.head_num, buffer_info.head_dim
    if scale.dim() == 3 and tuple(scale.shape[1:]) == (
        head_num,
        head_dim // NVFP4.sf_block,
    ):
        return NVFP4
    if (
        scale.dim() == 2
        and scale.shape[1] == head_num * head_dim // FP4_MX_BLOCK16.sf_block
    ):
        return FP4_MX_BLOCK16
    return None


@dataclass(frozen=True)
class ScaleGeometry:
    """Bytes of one KV side (K or V) of one layer: its payload and its scales,
    per token and per page. K and V each have one (asymmetric heads differ)."""

    head_num: int
    head_dim: int
    page_size: int
    fmt: ScaleFormat = MXFP8

    def __post_init__(self) -> None:
        for name in ("head_num", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % self.fmt.sf_block:
            raise ValueError(
                f"{self.fmt.name} needs head_dim divisible by {self.fmt.sf_block}, "
                f"got {self.head_dim}"
            )

    @property
    def sf_dim(self) -> int:
        """Scale bytes per head and token."""
        return self.head_dim // self.fmt.sf_block

    @property
    def payload_head_bytes(self) -> int:
        """Payload bytes of one head and token: the device rows' real width
        (half a byte per element for FP4, where ``MHABufferInfo`` counts one)."""
        return self.fmt.payload_bytes(self.head_dim)

    # Per token and per page (one contiguous device run each): scales, payload.
    bytes_per_token = property(lambda self: self.head_num * self.sf_dim)
    page_bytes = property(lambda self: self.bytes_per_token * self.page_size)
    payload_bytes_per_token = property(
        lambda self: self.head_num * self.payload_head_bytes
    )
    payload_page_bytes = property(
        lambda self: self.payload_bytes_per_token * self.page_size
    )

    @classmethod
    def from_device_scales(
        cls,
        scale: torch.Tensor,
        *,
        fmt: ScaleFormat,
        head_num: int,
        head_dim: int,
        page_size: int,
        side: str = "k",
    ) -> ScaleGeometry:
        """Geometry from the format, cross-checked against one layer's device
        scale tensor of this side: one contiguous byte per scale, and whole
        pages of the layout the format keeps (one page or one token per
        leading index)."""
        geometry = cls(
            head_num=head_num, head_dim=head_dim, page_size=page_size, fmt=fmt
        )
        unit, unit_name = (
            (geometry.page_bytes, f"one page of {geometry.page_bytes} bytes")
            if fmt.interleaved
            else (
                geometry.bytes_per_token,
                f"one token of {geometry.bytes_per_token} bytes",
            )
        )
        if scale.element_size() != 1 or not scale.is_contiguous():
            raise ValueError(
                f"{side} scale buffer must be contiguous 1-byte scales, got "
                f"dtype={scale.dtype} strides={tuple(scale.stride())}"
            )
        if math.prod(scale.shape[1:]) != unit or scale.numel() % geometry.page_bytes:
            raise ValueError(
                f"{side} scale buffer shape {tuple(scale.shape)} does not hold "
                f"{unit_name} per leading index in whole pages, as "
                f"{fmt.name} with {head_num} heads of {head_dim} keeps them"
            )
        return geometry
