"""Our host pool with one design choice undone, for ``bench --ablations``: the
same bytes (the tests round-trip each), timed beside ours to show what the
choice is worth."""

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


class TwoBlocksKernel(transfer.PageChunkKernel):
    max_blocks = 2


class TwoBlocksHost(MHATokenToKVPoolMXFP8Host):
    """Our kernel on two thread blocks, SGLang's quota for its HiCache kernels."""

    def _choose_mover(self, page, pool_label):
        return TwoBlocksKernel


class LoadAtLayerZeroHost(MHATokenToKVPoolMXFP8Host):
    """Every layer with layer 0: one launch per load."""

    def _load_layer_groups(self, pages: int) -> list[range]:
        return [range(self.target_layer_num)]


class LoadEachLayerHost(MHATokenToKVPoolMXFP8Host):
    """Each layer with its own call: one launch per layer."""

    def _load_layer_groups(self, pages: int) -> list[range]:
        return [range(layer, layer + 1) for layer in range(self.target_layer_num)]


class LoadDoublingHost(MHATokenToKVPoolMXFP8Host):
    """Doubling layer groups at every load size, however few bytes each carries."""

    def _load_layer_groups(self, pages: int) -> list[range]:
        return doubling_layer_groups(self.target_layer_num)


ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    "sm": SMCopyHost,
    "fallback": FallbackKernelHost,
    "blocks2": TwoBlocksHost,
    "load_at_layer0": LoadAtLayerZeroHost,
    "load_each_layer": LoadEachLayerHost,
    "load_doubling": LoadDoublingHost,
}
