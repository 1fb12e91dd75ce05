"""Real MXFP8 KV through SGLang's own HiCache controller on a GPU (issue 3).

Three fresh processes (the plugin hook is process-wide): ours through the plugin,
SGLang's own MXFP8 host class with the plugin disabled (an independent
implementation to cross-check the restored bytes), and the payload-only host
pool SGLang 0.5.16-0.5.20 pick (the control that must lose the scales).
"""

from __future__ import annotations

import pytest

from sglang_mxfp8_hicache.tools.e2e import run_modes

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def verdicts():
    return run_modes()


@pytest.mark.parametrize("mode", ["ours", "sglang"])
def test_restore_is_exact(verdicts, mode):
    v = verdicts[mode]
    assert "error" not in v, v.get("error")
    assert v["payload_restored"] and v["scales_restored"], v
    assert v["dequantized_max_diff"] == 0.0, v
    assert v["untouched_pages_kept"], v
    if v["write_path"].startswith("set_kv_buffer"):
        assert v["quantized_within_mxfp8_error"], v


def test_host_classes(verdicts):
    assert verdicts["ours"]["host_class"] == (
        "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
    )
    assert verdicts["sglang"]["host_class"] == (
        "sglang.srt.mem_cache.pool_host.mha_mxfp8.MHATokenToKVPoolMXFP8Host"
    )
    assert verdicts["plain"]["host_class"] == (
        "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
    )


def test_cross_check_with_sglang_class(verdicts):
    assert verdicts["ours"]["restored_sha256"] == verdicts["sglang"]["restored_sha256"]


def test_payload_only_pool_loses_scales(verdicts):
    v = verdicts["plain"]
    assert "error" not in v, v.get("error")
    assert v["payload_restored"], v
    assert not v["scales_restored"], v
    assert v["dequantized_max_diff"] > 0, v
