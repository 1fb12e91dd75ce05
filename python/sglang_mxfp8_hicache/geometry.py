"""Byte geometry of MXFP8 KV scales, shared by both transfer directions and sizing.

SGLang's MXFP8 device pool (``MHATokenToKVPoolMXFP8``) keeps one UE8M0 scale
byte per 32 fp8 elements. With page_size 128 the scales of one page and layer
are stored in the FA4 interleaved atom ``(page, head, 32, page_size // 32,
head_dim // 32)``, so they form one contiguous run of ``page_bytes`` bytes. A
transfer moves whole pages of scales, cut into page chunks of ``row_bytes``:
chunk j of a page starts ``j * row_tokens`` tokens' worth of scale bytes into
it, so a token index times a stride addresses it, but its bytes are not those
tokens' scales (the first 512 B of an 8x128 page are head 0's scales for all
128 tokens).

This module imports no CUDA code, so the CLI's ``size`` command and the CPU tests
can use it anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MXFP8_SCALE_BLOCK = 32
"""fp8 elements that share one UE8M0 scale byte."""

FP8_ITEMSIZE = 1

SCALE_ROW_BYTES = 512
"""Narrowest page chunk, one kernel worker's unit: narrow chunks keep more
workers busy for few pages, wide ones read fewer indices per byte. On an H100,
512 B chunks beat 128 B chunks on large loads and lost to them only on one-page
loads (docs/benchmarks.md). A multiple of 128 B, as the kernel needs on CUDA."""


@dataclass(frozen=True)
class MXFP8ScaleGeometry:
    """Scale bytes of one KV side (K or V) per page and per token, for one layer.

    K and V must agree because SGLang's MHA host pool keeps one head_dim for
    both; the asymmetric case has a host class of its own that we do not extend.
    """

    head_num: int
    head_dim: int
    page_size: int
    sf_block: int = MXFP8_SCALE_BLOCK
    min_row_bytes: int = SCALE_ROW_BYTES

    def __post_init__(self) -> None:
        for name in ("head_num", "head_dim", "page_size", "sf_block", "min_row_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % self.sf_block:
            raise ValueError(
                f"MXFP8 needs head_dim divisible by {self.sf_block}, got {self.head_dim}"
            )
        if self.page_size % self.row_tokens:
            raise ValueError(
                f"page_size {self.page_size} is not a multiple of the {self.row_tokens} "
                "tokens of one scale row"
            )

    @property
    def sf_dim(self) -> int:
        """Scale bytes per head and token."""
        return self.head_dim // self.sf_block

    @property
    def bytes_per_token(self) -> int:
        """Scale bytes of one side (K or V) per token and layer."""
        return self.head_num * self.sf_dim

    @property
    def page_bytes(self) -> int:
        """Scale bytes of one side per page and layer: one contiguous device run."""
        return self.bytes_per_token * self.page_size

    @property
    def payload_bytes_per_token(self) -> int:
        """fp8 payload bytes of one side per token and layer."""
        return self.head_num * self.head_dim * FP8_ITEMSIZE

    @property
    def row_tokens(self) -> int:
        """The size of a page chunk in tokens' worth of scale bytes: the fewest
        tokens whose scale bytes are a multiple of ``min_row_bytes``. A chunk
        starts at a token index (times the stride) but holds a slice of the
        page's interleaved scales, not these tokens' own."""
        tokens = self.min_row_bytes // math.gcd(
            self.bytes_per_token, self.min_row_bytes
        )
        return min(tokens, self.page_size)

    @property
    def row_bytes(self) -> int:
        """Bytes of one page chunk: one kernel worker's copy, per layer and side."""
        return self.row_tokens * self.bytes_per_token

    @property
    def rows_per_page(self) -> int:
        return self.page_size // self.row_tokens

    def host_page_layer(self, host_pages: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's pages, in device byte order, from host pages of one side.

        The host keeps a page as ``(rows_per_page, layers, row_bytes)``, so that
        the kernel reaches chunk ``j`` of layer ``l`` from a token index times
        one fixed stride (see ``host_pool``).
        """
        return host_pages[..., layer, :].flatten(-2)

    def storage_format_tag(self, *, layer_num: int, version: int) -> str:
        """SGLang's L3 key tag for pages of this geometry.

        Names the format, its version and every number that fixes a page's
        bytes (layers, heads, head_dim, page size, and the chunk the host
        scales are cut in), so that a page of another format, version or
        geometry never shares a key with one of ours.
        """
        return (
            f"mxfp8v{version}-l{layer_num}h{self.head_num}d{self.head_dim}"
            f"p{self.page_size}r{self.row_tokens}"
        )

    def host_bytes(self, *, page_num: int, layer_num: int) -> int:
        """Host bytes of the K and V scale mirrors for ``page_num`` pages."""
        return 2 * page_num * layer_num * self.page_bytes

    @classmethod
    def from_device_scales(
        cls,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        *,
        head_num: int,
        head_dim: int,
        page_size: int,
        min_row_bytes: int = SCALE_ROW_BYTES,
    ) -> MXFP8ScaleGeometry:
        """Geometry from the formula, cross-checked against one layer's device tensors."""
        geometry = cls(
            head_num=head_num,
            head_dim=head_dim,
            page_size=page_size,
            min_row_bytes=min_row_bytes,
        )
        for side, scale in (("k", k_scale), ("v", v_scale)):
            if scale.element_size() != 1 or not scale.is_contiguous():
                raise ValueError(
                    f"{side} scale buffer must be contiguous 1-byte UE8M0, got "
                    f"dtype={scale.dtype} strides={tuple(scale.stride())}"
                )
            if math.prod(scale.shape[1:]) != geometry.page_bytes:
                raise ValueError(
                    f"{side} scale buffer shape {tuple(scale.shape)} does not hold one "
                    f"page of {geometry.page_bytes} bytes per leading index; expected "
                    f"the interleaved layout (pages, {head_num}, 32, "
                    f"{page_size // 32}, {geometry.sf_dim})"
                )
        return geometry
