"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours."""

from __future__ import annotations

import functools

from sglang_mxfp8_hicache import transfer
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import ONE_LAUNCH_BYTES, even_layer_groups

DOUBLING_GROUP_BYTES = 1 << 20
"""The least a doubling group carries (``load_doubling``)."""


def doubling_layer_groups(layer_num: int) -> list[range]:
    """Layers 0 | 1 | 2-3 | 4-7 | ..."""
    starts = [0, *(1 << k for k in range(layer_num.bit_length()) if 1 << k < layer_num)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], layer_num], strict=True)]


def doubling_load_groups(
    layer_num: int,
    layer_bytes: int,
    min_group_bytes: int = DOUBLING_GROUP_BYTES,
    one_launch_bytes: int = ONE_LAUNCH_BYTES,
    min_layers: int = 1,
) -> list[range]:
    """Layer 0, then the doubling groups, each merged on until it carries
    ``min_group_bytes`` and ``min_layers`` (a short last group joins the one
    before); one group if layers 1.. carry under ``one_launch_bytes``: the
    fewest calls, and the forward pass waits for the last group, half the
    layers, before computing any of them."""
    if (layer_num - 1) * layer_bytes < one_launch_bytes:
        return [range(layer_num)]

    def short(group: range) -> bool:
        return len(group) * layer_bytes < min_group_bytes or len(group) < min_layers

    first, *rest = doubling_layer_groups(layer_num)
    merged: list[range] = []
    for group in rest:
        if merged and short(merged[-1]):
            merged[-1] = range(merged[-1].start, group.stop)
        else:
            merged.append(group)
    if len(merged) > 1 and short(merged[-1]):
        tail = merged.pop()
        merged[-1] = range(merged[-1].start, tail.stop)
    return [first, *merged]


CHOICES = {
    # Every byte by our SM kernel across the link: no device staging.
    "sm": TransferChoice(mover=transfer.PageChunkKernel),
    # SGLang's JIT kernel over page numbers: the path when ours does not build.
    "fallback": TransferChoice(mover=transfer.SGLangChunkKernels),
    # Doubling layer groups: a load in 1 + log2(layers) calls.
    "load_doubling": TransferChoice(layer_groups=doubling_load_groups),
    # Each layer its own group from 1 MiB: ready layer by layer, more calls.
    "load_per_layer": TransferChoice(
        layer_groups=functools.partial(even_layer_groups, min_group_bytes=1 << 20)
    ),
}
"""How each ablation moves its pages (``MHATokenToKVPoolMXFP8Host.with_transfer``)."""
ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    name: MHATokenToKVPoolMXFP8Host.with_transfer(choice)
    for name, choice in CHOICES.items()
}
