"""Real MXFP8 KV through SGLang's own HiCache controller on a GPU (issues 3, 10).

Fresh processes (the plugin hook is process-wide): ours through the plugin,
SGLang's own MXFP8 host class with the plugin disabled (an independent
implementation to cross-check the restored bytes), the payload-only host pool
SGLang 0.5.16-0.5.20 pick (the control that must lose the scales), and ours
through L3: ``file``, and Mooncake on loopback where it runs.
"""

from __future__ import annotations

import pytest

from testkit.e2e import SETUPS, run_modes
from testkit.e2e_cpu import (
    assert_control_loses_scales,
    assert_exact,
    plain_class_takes_fp4,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def verdicts():
    return run_modes(l3=("file", "hf3fs", "nixl"), setups=SETUPS)


@pytest.fixture(scope="module")
def mooncake_verdict(mooncake):
    return run_modes(modes=(), l3=("mooncake",), l3_config=mooncake.extra_config())[
        "ours+mooncake"
    ]


@pytest.mark.parametrize("mode", ["ours", "sglang"])
def test_restore_is_exact(verdicts, mode):
    assert_exact(verdicts[mode])


def test_host_classes(verdicts):
    assert verdicts["ours"].host_class == (
        "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
    )
    assert verdicts["sglang"].host_class == (
        "sglang.srt.mem_cache.pool_host.mha_mxfp8.MHATokenToKVPoolMXFP8Host"
    )
    assert verdicts["plain"].host_class == (
        "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
    )


def test_cross_check_with_sglang_class(verdicts):
    assert verdicts["ours"].restored_sha256 == verdicts["sglang"].restored_sha256


def test_payload_only_pool_loses_scales(verdicts):
    v = verdicts["plain"]
    assert v.error is None, v.error
    assert v.payload_restored, v
    assert not v.scales_restored, v
    assert v.dequantized_max_diff > 0, v


def _assert_l3_exact(v: dict, backend: str) -> None:
    assert v.error is None, v.error
    l3 = v.l3
    assert l3.backend == backend
    # The refused backend named itself and left the controller as it was.
    assert "--hicache-storage-backend sim cannot store mxfp8 pages" in l3.refused_attach
    assert l3.refusal_left_controller_clean
    tokens = l3.pages * 128
    assert l3.stored_tokens == l3.hit_tokens == l3.fetched_tokens == tokens, l3
    assert l3.payload_restored and l3.scales_restored, l3
    assert l3.dequantized_max_diff == 0.0, l3
    assert l3.untouched_pages_kept, l3
    assert l3.format_tag.startswith("mxfp8v4-l4h8d128p128"), l3


@pytest.mark.parametrize("backend", ["file", "hf3fs", "nixl"])
def test_l3(verdicts, backend):
    _assert_l3_exact(verdicts[f"ours+{backend}"], backend)


def test_l3_mooncake(mooncake_verdict):
    _assert_l3_exact(mooncake_verdict, "mooncake")


OURS = "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"


@pytest.mark.parametrize("setup", [s for s in SETUPS if s != "kv"])
def test_setup_restores_exactly(verdicts, setup):
    """Issue 11's and 12's setups with the real kernels: real KV from set_kv_buffer,
    dequantized difference 0; the payload-only control loses the scales."""
    v = verdicts[f"{setup}:ours"]
    assert_exact(v)
    # nvfp4's quantizer needs Blackwell: on Hopper its pages are random bytes.
    if setup != "nvfp4":
        assert v.write_path.startswith("set_kv_buffer"), v.write_path
    assert {k: c for k, c in v.host_classes.items() if k != "mamba"} == {
        k: OURS for k in v.host_classes if k != "mamba"
    }
    assert v.state_restored is not False, v
    if plain_class_takes_fp4(setup):
        return  # no payload-only control to run
    assert_control_loses_scales(verdicts[f"{setup}:plain"])


@pytest.mark.parametrize("setup", ["sidecar_draft", "hybrid_swa", "mamba"])
def test_setup_cross_check_with_sglang_class(verdicts, setup):
    """SGLang's own MXFP8 class serves sidecar and hybrid page_first pools: the
    restored bytes agree."""
    ours, sglang = verdicts[f"{setup}:ours"], verdicts[f"{setup}:sglang"]
    assert sglang.error is None, sglang.error
    assert ours.restored_sha256 == sglang.restored_sha256


@pytest.mark.parametrize(
    "setup, error",
    [
        ("draft", "NotImplementedError"),
        ("layer_first", "NotImplementedError"),
        ("fp4_mx_block16", "scale layout 'token'"),
        ("nvfp4", "scale layout 'token'"),
        ("mamba_fp4_mx_block16", "scale layout 'token'"),
    ],
)
def test_sglang_class_refuses(verdicts, setup, error):
    if plain_class_takes_fp4(setup):
        pytest.skip("before 0.5.23 SGLang's plain host class takes FP4 pools")
    assert error in verdicts[f"{setup}:sglang"].error
