"""Issue 11's setups through SGLang's real assembler, HybridCacheController and
transfer engine (``test/e2e.py``), on the CPU with the kernels emulated; the same
runs with the real kernels are in ``test_e2e_gpu``.

``draft``: two packed MTP/NextN draft layers (``is_draft`` loads after target
layers 0 and 1); ``sidecar_draft``: a two-layer draft in its own host pool
(``build_hicache_draft_sidecars``, EAGLE3 / standalone); ``layer_first``: that host layout; ``hybrid_swa``: an
``SWAKVPool`` of MXFP8 full and sliding-window pools through
``build_hybrid_swa_stack``; ``mamba``: a ``HybridLinearKVPool`` over an MXFP8
pool beside Mamba2 state through SGLang's strategy and
``build_hybrid_mamba_stack``. In both hybrids full attention is at layers 3
and 7 of 8, so the full pool's first layer loads in transfer iteration 3.
``fp4_mx_block16`` and ``nvfp4``: the plain KV stack of that FP4 KV cache;
fp4_mx_block16 is written by SGLang's own set_kv_buffer (its quantizer is torch
code), nvfp4's quantizer needs Blackwell, so its pages are random bytes.
``mamba_fp4_mx_block16``: ``mamba`` over an fp4_mx_block16 full attention pool.
"""

from __future__ import annotations

import pytest

from testkit.e2e import SETUPS
from testkit.e2e_cpu import (
    assert_control_loses_scales,
    assert_exact,
    plain_class_takes_fp4,
    run_cpu,
)

OURS = "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict]:
    return run_cpu(("ours", "plain"), SETUPS)


def _key(setup: str, mode: str) -> str:
    return mode if setup == "kv" else f"{setup}:{mode}"


@pytest.mark.parametrize("setup", SETUPS)
def test_controller_restores_exactly(verdicts, setup):
    verdict = verdicts[_key(setup, "ours")]
    assert_exact(verdict)
    # Every MXFP8 sub-pool the assembler built is ours (hybrid_swa: kv and swa);
    # the Mamba state keeps SGLang's own host pool, and comes back too.
    mxfp8 = {k: v for k, v in verdict.host_classes.items() if k != "mamba"}
    assert set(mxfp8.values()) == {OURS}, verdict.host_classes
    assert verdict.state_restored is not False, verdict


@pytest.mark.parametrize("setup", SETUPS)
def test_payload_only_control_loses_scales(verdicts, setup):
    if plain_class_takes_fp4(setup):
        pytest.skip(
            "before 0.5.23 SGLang's plain host class sizes an FP4 pool a byte per "
            "element and takes no payload-only view of it: no control to run"
        )
    assert_control_loses_scales(verdicts[_key(setup, "plain")])


def test_setups_cover_their_layers(verdicts):
    layers = {setup: verdicts[_key(setup, "ours")].layers for setup in SETUPS}
    assert layers == {
        "kv": 4,
        "draft": 6,
        "sidecar_draft": 6,
        "layer_first": 4,
        "hybrid_swa": 8,
        "mamba": 2,
        "fp4_mx_block16": 4,
        "nvfp4": 4,
        "mamba_fp4_mx_block16": 2,
    }
    host_classes = {
        setup: set(verdicts[_key(setup, "ours")].host_classes)
        for setup in ("sidecar_draft", "hybrid_swa", "mamba", "mamba_fp4_mx_block16")
    }
    assert host_classes == {
        "sidecar_draft": {"kv", "draft"},
        "hybrid_swa": {"kv", "swa"},
        "mamba": {"kv", "mamba"},
        "mamba_fp4_mx_block16": {"kv", "mamba"},
    }
    for setup in ("mamba", "mamba_fp4_mx_block16"):
        assert verdicts[_key(setup, "ours")].state_restored
