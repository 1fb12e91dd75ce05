"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours."""

from __future__ import annotations

from sglang_mxfp8_hicache import transfer
from sglang_mxfp8_hicache.host_pool import (
    MHATokenToKVPoolMXFP8Host,
    doubling_layer_groups,
)


class FallbackKernelHost(MHATokenToKVPoolMXFP8Host):
    """SGLang's JIT kernel over page numbers: the path when ours does not build."""

    def _choose_mover(self, page, pool_label):
        return transfer.SGLangChunkKernels


class SMCopyHost(MHATokenToKVPoolMXFP8Host):
    """Every byte by our SM kernel across the link: no device staging."""

    def _choose_mover(self, page, pool_label):
        return transfer.PageChunkKernel


class LoadDoublingHost(MHATokenToKVPoolMXFP8Host):
    """Doubling layer groups at every load size, however few bytes each carries."""

    def _load_layer_groups(self, pages: int) -> list[range]:
        return doubling_layer_groups(self.target_layer_num)


ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    "sm": SMCopyHost,
    "fallback": FallbackKernelHost,
    "load_doubling": LoadDoublingHost,
}
