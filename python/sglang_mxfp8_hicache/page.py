"""The host page: one span per page, K part then V part, payload and scales inside.

For L layers (packed draft layers last), a host page is one contiguous span of
``span_bytes`` bytes, and the same bytes are the L3 page:

    page p, at byte p * span_bytes of the pool's one host allocation
    +-- K part -----------------------------------------------------------------+
    | layer 0: K payload run | K scale run | layer 1: ... | layer L-1: ... | seal |
    +-- V part -----------------------------------------------------------------+
    | layer 0: V payload run | V scale run | layer 1: ... | layer L-1: ... | seal |
    +---------------------------------------------------------------------------+

A run is the device page's bytes as the device pool holds them: one page of
one layer is one contiguous run of payload and one of scales in SGLang's
pools, whatever the format. So every (page, layer, part) moves as one chunk
between a device page number times the run's bytes and a host page number
times ``span_bytes``: neither the host page nor an L3 backend needs to know
what a scale byte means.

Each part of a layer-major page ends in its seal area (``seal_bytes``): the
bytes that make the part whole ``PART_ALIGN`` (4 KiB) blocks, so that O_DIRECT
moves it in place, at least ``SEAL_CONTENT_BYTES`` of them, the seal last
(``seal.py``). No device transfer touches it. A heads-major page has none.

``--hicache-mem-layout page_head`` asks for a heads-major page, so that ranks
of another TP size can share an L3 object of a head group (mooncake's split
heads): each part is, head by head, every layer's chunk of that head (its
payload rows and scales, strided on the device). A head group's bytes are
then the same whatever the rank's head count; a seal would break that:

    heads-major K part:  head 0: [layer 0: payload | scales] ... [layer L-1: ...]
                         head 1: ...

This module imports no CUDA code.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

from sglang_mxfp8_hicache.geometry import ScaleFormat, ScaleGeometry

STORAGE_FORMAT_VERSION = 4
"""Bumped whenever the bytes of a stored page change meaning; it is in the keys,
so a page of another version is a miss."""

SEAL_CONTENT_BYTES = 24
"""What a seal holds (``seal.py``): a magic word, the key's seed, the digest."""

PART_ALIGN = 4096
"""A layer-major part is a whole number of these: O_DIRECT's unit (an OS
page), which NIXL's file plugin needs of every buffer and length it moves."""


def seal_bytes(body_bytes: int, page_size: int) -> int:
    """Bytes of the seal area after a part's ``body_bytes`` of layers: room
    for a seal, up to the next whole ``PART_ALIGN`` block that is also a
    multiple of ``page_size`` (so a page stays whole bytes per token)."""
    unit = math.lcm(PART_ALIGN, page_size)
    return -(-(body_bytes + SEAL_CONTENT_BYTES) // unit) * unit - body_bytes


PARTS = ("k_payload", "k_scales", "v_payload", "v_scales")
"""The four runs of one page and layer, in the order kernels and tables use."""


@dataclass(frozen=True)
class PagePart:
    """One side (K or V) of a host page: per layer, a payload run then a scale
    run, then the part's seal (none for one head's chunks)."""

    payload_bytes: int
    scale_bytes: int
    layer_num: int
    seal_bytes: int = 0

    layer_bytes = property(lambda self: self.payload_bytes + self.scale_bytes)
    span_bytes = property(
        lambda self: self.layer_num * self.layer_bytes + self.seal_bytes
    )

    def payload_offset(self, layer: int) -> int:
        return layer * self.layer_bytes

    def scale_offset(self, layer: int) -> int:
        return layer * self.layer_bytes + self.payload_bytes


@dataclass(frozen=True)
class ChunkShape:
    """How one part of one (page, layer) moves (``csrc/page_chunks.cuh``):
    ``HostPage.heads`` chunks of ``bytes``, each ``bytes // row_bytes`` device
    rows ``device_row_stride`` apart, contiguous on the host."""

    bytes: int
    row_bytes: int
    device_page_stride: int
    device_head_stride: int
    device_row_stride: int
    host_head_stride: int

    def fields(self) -> tuple[int, ...]:
        """In the kernel's order: the order above."""
        return dataclasses.astuple(self)


@dataclass(frozen=True)
class StagedLayout:
    """A range of a page's layers in device staging: staged page j is
    ``stride`` bytes at ``j * stride``, run c of the range's n-th layer at
    ``run_offsets[n][c]`` in it; a page moves between host and staging as its
    ``pieces`` ``(host offset, staged offset, bytes)``, one copy each."""

    stride: int
    run_offsets: tuple[tuple[int, int, int, int], ...]
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def piece_bytes(self) -> int:
        """The smallest piece: what decides how fast the copy engines move it."""
        return min(size for _, _, size in self.pieces)


@dataclass(frozen=True)
class HostPage:
    """The byte order of one host page (module docstring) for one pool. Its
    parts and span are computed once: L3 page lookups read them per batch."""

    k: ScaleGeometry
    v: ScaleGeometry
    layer_num: int
    heads_major: bool = False

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

    def _part(self, side: ScaleGeometry) -> PagePart:
        part = PagePart(side.payload_page_bytes, side.page_bytes, self.layer_num)
        if self.heads_major:  # no seal (module docstring)
            return part
        return dataclasses.replace(
            part, seal_bytes=seal_bytes(part.span_bytes, self.page_size)
        )

    @cached_property
    def k_part(self) -> PagePart:
        return self._part(self.k)

    @cached_property
    def v_part(self) -> PagePart:
        return self._part(self.v)

    @property
    def seal_bytes(self) -> int:
        """Bytes of both parts' seal areas; none on a heads-major page."""
        return self.k_part.seal_bytes + self.v_part.seal_bytes

    @cached_property
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

    @property
    def heads(self) -> int:
        """Chunks per part and layer: one, or one per head (heads-major)."""
        return self.k.head_num if self.heads_major else 1

    def run_bytes(self) -> tuple[int, int, int, int]:
        """Bytes of each part (``PARTS``) of one page and layer, all heads."""
        k, v = self.k_part, self.v_part
        return k.payload_bytes, k.scale_bytes, v.payload_bytes, v.scale_bytes

    def _head_part(self, side: ScaleGeometry) -> PagePart:
        """One head's chunks of one side: a heads-major part is H of these."""
        return PagePart(
            side.payload_page_bytes // side.head_num,
            side.page_bytes // side.head_num,
            self.layer_num,
        )

    def head_span_bytes(self) -> tuple[int, int]:
        """Bytes of one head's K and V chunks of every layer (heads-major)."""
        return (
            self._head_part(self.k).span_bytes,
            self._head_part(self.v).span_bytes,
        )

    def chunk_shapes(self) -> tuple[ChunkShape, ...]:
        """How each part (``PARTS``) moves."""
        shapes = []
        for side in (self.k, self.v):
            payload, scales = side.payload_page_bytes, side.page_bytes
            if not self.heads_major:
                shapes += [
                    ChunkShape(payload, payload, payload, 0, payload, 0),
                    ChunkShape(scales, scales, scales, 0, scales, 0),
                ]
                continue
            head, row = self._head_part(side), side.payload_head_bytes
            span, row_bytes = head.span_bytes, side.payload_bytes_per_token
            # MXFP8's atom keeps a head's scales of a page contiguous; FP4's
            # per-token rows hold them as a strided column.
            sf_row = head.scale_bytes if side.fmt.interleaved else side.sf_dim
            shapes += [
                ChunkShape(head.payload_bytes, row, payload, row, row_bytes, span),
                ChunkShape(
                    head.scale_bytes, sf_row, scales, sf_row, side.bytes_per_token, span
                ),
            ]
        return tuple(shapes)

    def run_offsets(self, layer: int) -> tuple[int, int, int, int]:
        """Where each part (``PARTS``) of ``layer`` starts in a host page (its
        first head's chunk, heads-major)."""
        k, v = self.k_part, self.v_part
        if self.heads_major:
            k, v = self._head_part(self.k), self._head_part(self.v)
        k_span = self.k_part.span_bytes
        return (
            k.payload_offset(layer),
            k.scale_offset(layer),
            k_span + v.payload_offset(layer),
            k_span + v.scale_offset(layer),
        )

    def staged_layout(self, layers: range) -> StagedLayout | None:
        """How ``layers`` of a page sit in device staging (``StagedLayout``),
        or None where they are not whole contiguous pieces of the page (a
        layer range of a heads-major page: each head holds every layer)."""
        if layers == range(self.layer_num):
            # The whole span, seals included: one piece per page, and pieces
            # of consecutive host pages join (a seal's bytes mean nothing
            # until a put to L3 writes it).
            return StagedLayout(
                stride=self.span_bytes,
                run_offsets=tuple(self.run_offsets(layer) for layer in layers),
                pieces=((0, 0, self.span_bytes),),
            )
        if self.heads_major:
            return None
        k, v = self.k_part, self.v_part
        k_bytes, v_bytes = len(layers) * k.layer_bytes, len(layers) * v.layer_bytes
        run_offsets = []
        for n in range(len(layers)):
            k_at, v_at = n * k.layer_bytes, k_bytes + n * v.layer_bytes
            run_offsets.append(
                (k_at, k_at + k.payload_bytes, v_at, v_at + v.payload_bytes)
            )
        k_from, v_from = (part.payload_offset(layers.start) for part in (k, v))
        return StagedLayout(
            stride=k_bytes + v_bytes,
            run_offsets=tuple(run_offsets),
            pieces=((k_from, 0, k_bytes), (k.span_bytes + v_from, k_bytes, v_bytes)),
        )

    def describe(self) -> str:
        k, v = self.k_part, self.v_part
        if self.heads_major:
            k, v = self._head_part(self.k), self._head_part(self.v)
        unit = f"{self.heads} heads of " if self.heads_major else ""
        said = (
            f"{self.span_bytes} B per page: K {self.k_part.span_bytes} B then V "
            f"{self.v_part.span_bytes} B, each {unit}{self.layer_num} layers of "
            f"[payload {k.payload_bytes} B | scales {k.scale_bytes} B]"
        )
        if k != v:
            said += f" for K, [payload {v.payload_bytes} B | scales {v.scale_bytes} B] for V"
        if self.seal_bytes:
            said += (
                f", then a seal area ({self.k_part.seal_bytes} B for K, "
                f"{self.v_part.seal_bytes} B for V: parts of whole 4 KiB blocks)"
            )
        return said

    def storage_format_tag(self) -> str:
        """SGLang's L3 key tag for pages of this byte order: the format, the
        page format version and every number that fixes a page's bytes, so a
        page of another never shares a key with ours. A heads-major page
        (``hm``) names no head count: ranks of other TP sizes share its heads."""
        dims = f"d{self.k.head_dim}"
        if self.v.head_dim != self.k.head_dim:
            dims += f"v{self.v.head_dim}"
        heads = "hm" if self.heads_major else f"h{self.k.head_num}"
        return (
            f"{self.fmt.name}v{STORAGE_FORMAT_VERSION}-l{self.layer_num}"
            f"{heads}{dims}p{self.page_size}"
        )
