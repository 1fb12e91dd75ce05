"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours."""

from __future__ import annotations

import functools

from sglang_mxfp8_hicache import transfer
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import (
    doubling_layer_groups,
    even_layer_groups,
    load_layer_groups,
)


def _doubling(layer_num: int, layer_bytes: int, *, min_layers: int) -> list[range]:
    """Doubling layer groups at every load size, however few bytes each carries."""
    return doubling_layer_groups(layer_num)


def _mirror(layer_num: int, layer_bytes: int, *, min_layers: int) -> list[range]:
    """Doubling groups over the first half of layers 1.., halving over the rest."""
    rest = layer_num - 1
    front = load_layer_groups(1 + rest - rest // 2, layer_bytes, min_layers=min_layers)
    back = load_layer_groups(1 + rest // 2, layer_bytes, min_layers=min_layers)[1:]
    end = layer_num
    mirrored = []
    for group in back:
        mirrored.append(range(end - len(group), end))
        end -= len(group)
    return front + mirrored[::-1]


CHOICES = {
    # Every byte by our SM kernel across the link: no device staging.
    "sm": TransferChoice(mover=transfer.PageChunkKernel),
    # SGLang's JIT kernel over page numbers: the path when ours does not build.
    "fallback": TransferChoice(mover=transfer.SGLangChunkKernels),
    "load_doubling": TransferChoice(layer_groups=_doubling),
    "load_even": TransferChoice(layer_groups=even_layer_groups),
    "load_even16": TransferChoice(
        layer_groups=functools.partial(even_layer_groups, min_group_bytes=16 << 20)
    ),
    "load_even4": TransferChoice(
        layer_groups=lambda n, b, *, min_layers: even_layer_groups(
            n, b, min_group_bytes=16 << 20, min_layers=max(4, min_layers)
        )
    ),
    "load_mirror": TransferChoice(layer_groups=_mirror),
}
"""How each ablation moves its pages (``MHATokenToKVPoolMXFP8Host.with_transfer``)."""
ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    name: MHATokenToKVPoolMXFP8Host.with_transfer(choice)
    for name, choice in CHOICES.items()
}
