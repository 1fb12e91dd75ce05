"""The block-scaled host pools' Prometheus counters, beside SGLang's own.

Made through ``prometheus_client`` as SGLang makes its own: in a process that
SGLang started with ``--enable-metrics`` (``PROMETHEUS_MULTIPROC_DIR`` set
before the scheduler is spawned) they land in its multiprocess files, and the
server's ``/metrics`` carries them. Elsewhere they stay in the process's
registry. Each pool counts under its labels (``tp_rank``, ``pool``); a count
is one increment per transfer or L3 batch, never per page.
"""

from __future__ import annotations

import functools
from typing import Any

PREFIX = "sglang_mxfp8_hicache:"
PATHS = ("copy_engines", "sm_kernel", "sglang_kernel")
"""How pages moved: staged through the copy engines, by our SM kernel, or by
SGLang's kernel where ours did not build."""
MISS_REASONS = (
    "seal_mismatch",
    "wrong_size",
    "part_missing",
    "read_error",
    "backend_raised",
    "behind_a_miss",
)
"""Why an L3 page was treated as not in L3: its own fault, or a page before it
in the batch had one (a batch arrives up to its first bad page)."""


@functools.cache
def _families() -> dict[str, Any]:
    """The process's metric families, made once (a registry takes each name
    once), after SGLang set up its multiprocess directory."""
    from prometheus_client import Counter, Gauge

    labels = ("tp_rank", "pool")
    moved = (*labels, "path", "direction")
    return {
        "l3_missed": Counter(
            PREFIX + "l3_missed_pages",
            "L3 pages a block-scaled pool treated as a miss, by reason.",
            (*labels, "reason"),
        ),
        "pages": Counter(
            PREFIX + "moved_pages",
            "Pages moved between device and host, by path and direction; a "
            "load's pages count once per layer group that moves them.",
            moved,
        ),
        "bytes": Counter(
            PREFIX + "moved_bytes",
            "Bytes moved between device and host, by path and direction.",
            moved,
        ),
        "staging": Gauge(
            PREFIX + "staging_reserved_bytes",
            "Device staging reserved for the block-scaled pools of this GPU.",
            ("tp_rank",),
            multiprocess_mode="mostrecent",
        ),
    }


def tp_rank() -> str:
    """This process's tensor-parallel rank, or 0 outside a TP group."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return str(get_tensor_model_parallel_rank())
    except Exception:  # no group here (tools, tests): one rank
        return "0"


class PoolMetrics:
    """One pool's counters, bound to its labels once."""

    def __init__(self, pool_label: str) -> None:
        families, rank = _families(), tp_rank()
        labels = {"tp_rank": rank, "pool": pool_label}
        self._missed = {
            reason: families["l3_missed"].labels(**labels, reason=reason)
            for reason in MISS_REASONS
        }
        self._moved = {
            (path, direction): (
                families["pages"].labels(**labels, path=path, direction=direction),
                families["bytes"].labels(**labels, path=path, direction=direction),
            )
            for path in PATHS
            for direction in ("load", "backup")
        }
        self._staging = families["staging"].labels(tp_rank=rank)

    def moved(self, path: str, to_host: bool, pages: int, nbytes: int) -> None:
        counted_pages, counted_bytes = self._moved[
            path, "backup" if to_host else "load"
        ]
        counted_pages.inc(pages)
        counted_bytes.inc(nbytes)

    def l3_missed(self, reason: str, pages: int) -> None:
        if pages:
            self._missed[reason].inc(pages)

    def staging_reserved(self, nbytes: int) -> None:
        self._staging.set(nbytes)
