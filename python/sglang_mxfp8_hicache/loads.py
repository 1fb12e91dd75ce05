"""A load's layer groups: what each ``load_to_device_per_layer`` call issues.

The controller records an event after each layer's call, and the forward pass
waits for it; a layer's event covers its whole group, whose layers are then
computed after the group's last byte. Layer 0 goes alone, then groups of
equal length: one layer each from ``MIN_LOAD_GROUP_BYTES`` a layer, fewer
calls (CPU time before the forward pass is launched) below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_mxfp8_hicache.page import HostPage
    from sglang_mxfp8_hicache.transfer import PageChunkMover

MIN_LOAD_GROUP_BYTES = 16 << 20
"""The least a group after layer 0 carries: a smaller one's call costs more."""
ONE_LAUNCH_BYTES = 256 << 10
"""A load whose layers after layer 0 carry less moves in one launch."""

LayerGroups = Callable[..., list[range]]
"""``(layer_num, layer_bytes, *, min_layers)`` to a load's layer groups."""
Group = tuple[object, int]
"""A layer group as the mover prepared it, and its number of layers."""
_Plan = tuple[list[Group], dict[int, int]]  # the groups, the group of each layer


def even_layer_groups(
    layer_num: int,
    layer_bytes: int,
    min_group_bytes: int = MIN_LOAD_GROUP_BYTES,
    one_launch_bytes: int = ONE_LAUNCH_BYTES,
    min_layers: int = 1,
) -> list[range]:
    """Layer 0, then the most groups (lengths a layer apart) that each carry
    ``min_group_bytes`` and ``min_layers``, or one; all in one under ``one_launch_bytes``."""
    if (layer_num - 1) * layer_bytes < one_launch_bytes:
        return [range(layer_num)]
    size = max(min_layers, -(-min_group_bytes // max(1, layer_bytes)))
    count = max(1, (layer_num - 1) // size)
    ends = [1 + (layer_num - 1) * k // count for k in range(count + 1)]
    return [range(1), *map(range, ends, ends[1:])]


class LoadPlanner:
    """What a pool's mover issues for each layer call of a load, in any layer
    order: a transfer is one pair of index tensors; a layer seen again begins
    a new one. Draft layers move alone."""

    def __init__(
        self,
        mover: PageChunkMover,
        page: HostPage,
        *,
        target_layers: int,
        layer_groups: LayerGroups,
    ) -> None:
        self._mover, self._page_size = mover, page.page_size
        self._target_layers, self._layer_groups = target_layers, layer_groups
        layer_piece = min(page.k_part.layer_bytes, page.v_part.layer_bytes)
        pieces = -(-mover.min_piece_bytes // layer_piece)
        self._min_layers = 1 if page.heads_major else max(1, pieces)
        self._layer_bytes = page.span_bytes // page.layer_num
        # From this many pages on, each layer carries the minimum: one plan.
        self._full_pages = -(-MIN_LOAD_GROUP_BYTES // self._layer_bytes)
        self._plans: dict[tuple[range, ...], _Plan] = {}  # one per set of groups
        self._drafts = {
            layer: (mover.prepare(range(layer, layer + 1)), 1)
            for layer in range(target_layers, page.layer_num)
        }
        # The load under way (its index tensors kept: no later pair reuses their id).
        self._indices: tuple[object, object] = (None, None)
        self._plan: _Plan = ([], {})
        self._seen, self._issued = set[int](), set[int]()

    @property
    def most_groups(self) -> int:
        return len(self._plan_of(self._full_pages)[0])

    def _plan_of(self, pages: int) -> _Plan:
        layer_bytes = min(pages, self._full_pages) * self._layer_bytes
        args = (self._target_layers, layer_bytes)
        groups = tuple(self._layer_groups(*args, min_layers=self._min_layers))
        if groups not in self._plans:
            prepared = [
                (self._mover.prepare(g, by_sm=n == 0), len(g))
                for n, g in enumerate(groups)
            ]
            group_of = {layer: n for n, g in enumerate(groups) for layer in g}
            self._plans[groups] = (prepared, group_of)
        return self._plans[groups]

    def issue(
        self, layer_id: int, host_indices, device_indices, *, is_draft: bool
    ) -> Group | None:
        """The group to move for ``layer_id``, or None if on its way; the
        mover's ``begin_load`` first where a load begins."""
        host, device = self._indices
        new = host is not host_indices or device is not device_indices
        if new or layer_id in self._seen:  # a draft layer may come first
            self._mover.begin_load()
            self._indices = (host_indices, device_indices)
            self._plan = self._plan_of(len(host_indices) // self._page_size)
            self._seen, self._issued = set(), set()
        self._seen.add(layer_id)
        if is_draft:
            return self._drafts.get(layer_id)
        if layer_id >= self._target_layers:
            return None
        prepared, group_of = self._plan
        group = group_of[layer_id]
        if group in self._issued:
            return None
        self._issued.add(group)
        return prepared[group]
