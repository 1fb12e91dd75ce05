"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours."""

from __future__ import annotations

from sglang_mxfp8_hicache import transfer
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host, TransferChoice
from sglang_mxfp8_hicache.loads import doubling_layer_groups


def _doubling(layer_num: int, layer_bytes: int, *, min_layers: int) -> list[range]:
    """Doubling layer groups at every load size, however few bytes each carries."""
    return doubling_layer_groups(layer_num)


CHOICES = {
    # Every byte by our SM kernel across the link: no device staging.
    "sm": TransferChoice(mover=transfer.PageChunkKernel),
    # SGLang's JIT kernel over page numbers: the path when ours does not build.
    "fallback": TransferChoice(mover=transfer.SGLangChunkKernels),
    "load_doubling": TransferChoice(layer_groups=_doubling),
}
"""How each ablation moves its pages (``MHATokenToKVPoolMXFP8Host.with_transfer``)."""
ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    name: MHATokenToKVPoolMXFP8Host.with_transfer(choice)
    for name, choice in CHOICES.items()
}
