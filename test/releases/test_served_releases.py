"""A served release other than the one this environment installs, on its real
source (``conftest.on_release``): SGLang 0.5.22, which builds host pools from
the device pool (``releases``). Through that release's own plugin loading,
assembler, ``HybridCacheController`` and transfer engine, with the kernels
emulated on the CPU (``testkit/e2e_cpu.py``), every setup restores payload and
scales exactly, also through L3; alone, it keeps MXFP8 scales with its own
class and loses FP4 scales with its plain one."""

from __future__ import annotations

import json

import msgspec
import pytest

from testkit import script
from testkit.e2e import Verdict
from testkit.e2e_cpu import assert_exact

RELEASE = "0.5.22"
SETUPS = "kv,draft,sidecar_draft,layer_first,hybrid_swa,mamba,fp4_mx_block16,nvfp4"

DISPATCH = """
import json, torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang_mxfp8_hicache.tools.pools import build_device_pool
shape = dict(head_num=2, head_dim=128, layer_num=1, pages=1, device="cpu")
pools = {k: build_device_pool(**shape, kv_cache_dtype=k)
         for k in ("mxfp8", "fp4_mx_block16", "nvfp4")}
pools["bf16"] = build_device_pool(**shape, payload_dtype=torch.bfloat16)
chosen = {}
for kind, pool in pools.items():
    cls = hybrid_pool_assembler.get_mha_host_pool_cls(pool)
    chosen[kind] = f"{cls.__module__}.{cls.__qualname__}"
print(json.dumps(chosen))
"""
OURS = "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
SGLANG = "sglang.srt.mem_cache.pool_host"


def _verdicts(done) -> list[Verdict]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        msgspec.json.decode(line, type=Verdict)
        for line in done.stdout.splitlines()
        if line.startswith("{")
    ]


def test_every_setup_restores_exactly(on_release):
    verdicts = _verdicts(on_release(RELEASE, [script("e2e_cpu"), "ours", SETUPS]))
    assert [v.setup for v in verdicts] == SETUPS.split(",")
    for verdict in verdicts:
        assert verdict.host_class == OURS, verdict
        assert_exact(verdict)


@pytest.mark.parametrize("setup", ["kv", "fp4_mx_block16"])
def test_l3_file_restores_exactly(on_release, setup):
    [verdict] = _verdicts(
        on_release(RELEASE, [script("e2e_cpu"), "ours", setup, "file"])
    )
    assert_exact(verdict)
    assert verdict.l3.payload_restored and verdict.l3.scales_restored, verdict
    assert verdict.l3.format_tag.startswith(setup.replace("kv", "mxfp8"))


@pytest.mark.parametrize("disabled", [False, True])
def test_dispatch_with_and_without_the_package(on_release, disabled):
    """With the package, ours for every block-scaled pool; without it
    (``SGLANG_MXFP8_HICACHE_DISABLE``), SGLang's own MXFP8 class, and its
    plain class for FP4, which has no scales to move."""
    env = {"SGLANG_MXFP8_HICACHE_DISABLE": "1"} if disabled else {}
    done = on_release(RELEASE, ["-c", DISPATCH], **env)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = json.loads(done.stdout.strip().splitlines()[-1])
    assert chosen["bf16"] == f"{SGLANG}.mha.MHATokenToKVPoolHost"
    if not disabled:
        assert {chosen[k] for k in ("mxfp8", "fp4_mx_block16", "nvfp4")} == {OURS}
        return
    assert chosen["mxfp8"] == f"{SGLANG}.mha_mxfp8.MHATokenToKVPoolMXFP8Host"
    assert chosen["fp4_mx_block16"] == chosen["nvfp4"] == chosen["bf16"]
