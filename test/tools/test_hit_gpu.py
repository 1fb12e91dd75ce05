"""``test/hit.py`` on a GPU: a hit of every column through SGLang's own L2
engine, the forward pass waiting per layer (timings are the benchmark's, not
checked here)."""

from __future__ import annotations

import pytest

from sglang_mxfp8_hicache.tools import bench
from testkit import hit


@pytest.mark.gpu
def test_hit_times_every_column_layer_by_layer():
    layers = 3
    rows = hit.bench_hits(
        (2, 128, layers),
        (1, 2),
        (64,),
        classes=bench.host_classes(("sm",)),
        warmup=1,
        repeat=2,
        beside="decode",
    )
    columns = {"ours", "sm", "sglang", "payload", "raw", "device"}
    assert [(r.pages, r.tokens, r.beside) for r in rows] == [
        (1, 64, "decode"),
        (2, 64, "decode"),
    ]
    for row in rows:
        assert set(row.ttft_ms) == columns and min(row.ttft_ms.values()) > 0
        assert all(len(w) == layers for w in row.waits_ms.values())
        assert row.issue_ms["device"] < row.issue_ms["ours"]
