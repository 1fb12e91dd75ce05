"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours."""

from __future__ import annotations

from sglang_mxfp8_hicache import transfer
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import ONE_LAUNCH_BYTES


def doubling_load_groups(
    layer_num: int, layer_bytes: int, *, min_layers: int = 1
) -> list[range]:
    """Layer 0, then doubling groups 1 | 2-3 | 4-7 | ..., each merged with the
    next until it carries 1 MiB and ``min_layers`` (a short last one joins the
    one before); one group if layers 1.. carry under ``ONE_LAUNCH_BYTES``."""
    if (layer_num - 1) * layer_bytes < ONE_LAUNCH_BYTES:
        return [range(layer_num)]

    def short(layers: int) -> bool:
        return layers * layer_bytes < 1 << 20 or layers < min_layers

    groups, start = [range(1)], 1
    while start < layer_num:
        stop = min(2 * start, layer_num)
        while stop < layer_num and short(stop - start):
            stop = min(2 * stop, layer_num)
        groups.append(range(start, stop))
        start = stop
    if len(groups) > 2 and short(len(groups[-1])):
        tail = groups.pop()
        groups[-1] = range(groups[-1].start, tail.stop)
    return groups


CHOICES = {
    # Every byte by our SM kernel across the link: no device staging.
    "sm": TransferChoice(mover=transfer.PageChunkKernel),
    # SGLang's JIT kernel over page numbers: the path when ours does not build.
    "fallback": TransferChoice(mover=transfer.SGLangChunkKernels),
    # Doubling layer groups: a load in 1 + log2(layers) calls.
    "load_doubling": TransferChoice(layer_groups=doubling_load_groups),
}
"""How each ablation moves its pages (``MHATokenToKVPoolMXFP8Host.with_transfer``)."""
ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    name: MHATokenToKVPoolMXFP8Host.with_transfer(choice)
    for name, choice in CHOICES.items()
}
