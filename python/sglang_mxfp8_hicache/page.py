"""The host page: one span per page, K part then V part, payload and scales inside.

For L layers (packed draft layers last), a host page is one contiguous span of
``span_bytes`` bytes, and the same bytes are the L3 page:

    page p, at byte p * span_bytes of the pool's one host allocation
    +-- K part ----------------------------------------------------------+
    | layer 0: K payload run | K scale run | layer 1: ... | layer L-1: ... |
    +-- V part ----------------------------------------------------------+
    | layer 0: V payload run | V scale run | layer 1: ... | layer L-1: ... |
    +--------------------------------------------------------------------+

A run is the device page's bytes as the device pool holds them: in SGLang's
pools one page of one layer is one contiguous run of payload (P x H x D bytes
of fp8, or half of that for FP4) and one of scales (the FA4 interleaved atom
for MXFP8, P per-token rows for FP4). So every (page, layer, part) moves as one
chunk between a device page number times the run's bytes and a host page
number times ``span_bytes``, whatever the format: the host page never needs to
know what a scale byte means, and neither does an L3 backend.

This module imports no CUDA code.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_mxfp8_hicache.geometry import ScaleFormat, ScaleGeometry

STORAGE_FORMAT_VERSION = 2
"""Bumped whenever the bytes of a stored page change meaning; it is in the keys.
Version 1 kept the scales of a page apart from its payload."""

PARTS = ("k_payload", "k_scales", "v_payload", "v_scales")
"""The four runs of one page and layer, in the order kernels and tables use."""


@dataclass(frozen=True)
class PagePart:
    """One side (K or V) of a host page: per layer, a payload run then a scale run."""

    payload_bytes: int
    scale_bytes: int
    layer_num: int

    @property
    def layer_bytes(self) -> int:
        return self.payload_bytes + self.scale_bytes

    @property
    def span_bytes(self) -> int:
        return self.layer_num * self.layer_bytes

    def payload_offset(self, layer: int) -> int:
        return layer * self.layer_bytes

    def scale_offset(self, layer: int) -> int:
        return layer * self.layer_bytes + self.payload_bytes


@dataclass(frozen=True)
class HostPage:
    """The byte order of one host page (module docstring) for one pool."""

    k: ScaleGeometry
    v: ScaleGeometry
    layer_num: int

    def __post_init__(self) -> None:
        if (self.k.fmt, self.k.page_size, self.k.head_num) != (
            self.v.fmt,
            self.v.page_size,
            self.v.head_num,
        ):
            raise ValueError("K and V must share format, page size and heads")

    @property
    def fmt(self) -> ScaleFormat:
        return self.k.fmt

    @property
    def page_size(self) -> int:
        return self.k.page_size

    @property
    def k_part(self) -> PagePart:
        return PagePart(self.k.payload_page_bytes, self.k.page_bytes, self.layer_num)

    @property
    def v_part(self) -> PagePart:
        return PagePart(self.v.payload_page_bytes, self.v.page_bytes, self.layer_num)

    @property
    def span_bytes(self) -> int:
        """Bytes of one host page, K part then V part."""
        return self.k_part.span_bytes + self.v_part.span_bytes

    @property
    def bytes_per_token(self) -> int:
        """Host bytes per token, payload and scales: ``get_size_per_token``."""
        return self.span_bytes // self.page_size

    @property
    def scale_bytes_per_token(self) -> int:
        return (self.k.bytes_per_token + self.v.bytes_per_token) * self.layer_num

    def run_bytes(self) -> tuple[int, int, int, int]:
        """Bytes of each part (``PARTS``) of one page and layer."""
        k, v = self.k_part, self.v_part
        return k.payload_bytes, k.scale_bytes, v.payload_bytes, v.scale_bytes

    def run_offsets(self, layer: int) -> tuple[int, int, int, int]:
        """Where each part (``PARTS``) of ``layer`` starts in a host page."""
        k, v = self.k_part, self.v_part
        return (
            k.payload_offset(layer),
            k.scale_offset(layer),
            k.span_bytes + v.payload_offset(layer),
            k.span_bytes + v.scale_offset(layer),
        )

    def describe(self) -> str:
        k, v = self.k_part, self.v_part
        return (
            f"{self.span_bytes} B per page: K {k.span_bytes} B then V {v.span_bytes} B, "
            f"each {self.layer_num} layers of [payload {k.payload_bytes} B | scales "
            f"{k.scale_bytes} B]"
            + (
                ""
                if k == v
                else f" for K, [payload {v.payload_bytes} B | scales {v.scale_bytes} B] for V"
            )
        )

    def storage_format_tag(self) -> str:
        """SGLang's L3 key tag for pages of this byte order.

        Names the format, the page format version and every number that fixes
        a page's bytes (layers, heads, head dims, page size), so that a page of
        another format, version or geometry never shares a key with one of ours.
        """
        dims = f"d{self.k.head_dim}"
        if self.v.head_dim != self.k.head_dim:
            dims += f"v{self.v.head_dim}"
        return (
            f"{self.fmt.name}v{STORAGE_FORMAT_VERSION}-l{self.layer_num}"
            f"h{self.k.head_num}{dims}p{self.page_size}"
        )
