"""The served releases other than the one this environment installs, on their
real sources (``conftest.release_parts``: a process per release and
plugin state): SGLang 0.5.21 and 0.5.22, which build
host pools from the device pool (``releases``). Through the release's own
plugin loading, assembler, ``HybridCacheController`` and transfer engine, with
the kernels emulated on the CPU (``testkit/e2e_cpu.py``), every setup restores
payload and scales exactly, also through L3 (0.5.21's keys, which carry no
format, get the pool's tag); alone, each keeps MXFP8 scales with its own class
and loses FP4 scales with its plain one."""

from __future__ import annotations

import json

import msgspec
import pytest

from testkit.e2e import Verdict
from testkit.e2e_cpu import assert_exact

RELEASES = ("0.5.21", "0.5.22")
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


E2E_CPU = """
import sys
from testkit.e2e_cpu import main
sys.argv = ["e2e_cpu", "ours", {setups!r}{l3}]
main()
"""
L3_SETUPS = ("kv", "fp4_mx_block16")


def _plugin_on(release: str) -> dict[str, str]:
    """Every check of ``release`` with the package on, as parts of one process
    (``conftest.release_parts``): they share its one SGLang import."""
    parts = {
        "setups": E2E_CPU.format(setups=SETUPS, l3=""),
        "l3_file": E2E_CPU.format(setups=",".join(L3_SETUPS), l3=', "file"'),
        "dispatch": DISPATCH,
    }
    if release == "0.5.21":
        parts["file_keys"] = FILE_KEYS
    return parts


def _stdout(part: dict) -> str:
    assert part["error"] is None, part["error"][-3000:]
    return part["stdout"]


def _verdicts(part: dict) -> list[Verdict]:
    return [
        msgspec.json.decode(line, type=Verdict)
        for line in _stdout(part).splitlines()
        if line.startswith("{")
    ]


@pytest.mark.parametrize("release", RELEASES)
def test_every_setup_restores_exactly(release_parts, release):
    verdicts = _verdicts(release_parts(release, _plugin_on(release))["setups"])
    assert [v.setup for v in verdicts] == SETUPS.split(",")
    for verdict in verdicts:
        assert verdict.host_class == OURS, verdict
        assert_exact(verdict)


@pytest.mark.parametrize("setup", L3_SETUPS)
@pytest.mark.parametrize("release", RELEASES)
def test_l3_file_restores_exactly(release_parts, release, setup):
    verdicts = _verdicts(release_parts(release, _plugin_on(release))["l3_file"])
    [verdict] = [v for v in verdicts if v.setup == setup]
    assert_exact(verdict)
    assert verdict.l3.payload_restored and verdict.l3.scales_restored, verdict
    assert verdict.l3.format_tag.startswith(setup.replace("kv", "mxfp8"))


@pytest.mark.parametrize("disabled", [False, True])
@pytest.mark.parametrize("release", RELEASES)
def test_dispatch_with_and_without_the_package(release_parts, release, disabled):
    """With the package, ours for every block-scaled pool; without it
    (``SGLANG_MXFP8_HICACHE_DISABLE``, a process of its own: the plugin reads
    it once), SGLang's own MXFP8 class, and its plain class for FP4, which
    has no scales to move."""
    if disabled:
        part = release_parts(
            release, {"dispatch": DISPATCH}, SGLANG_MXFP8_HICACHE_DISABLE="1"
        )["dispatch"]
    else:
        part = release_parts(release, _plugin_on(release))["dispatch"]
    chosen = json.loads(_stdout(part).strip().splitlines()[-1])
    assert chosen["bf16"] == f"{SGLANG}.mha.MHATokenToKVPoolHost"
    if not disabled:
        assert {chosen[k] for k in ("mxfp8", "fp4_mx_block16", "nvfp4")} == {OURS}
        return
    assert chosen["mxfp8"] == f"{SGLANG}.mha_mxfp8.MHATokenToKVPoolMXFP8Host"
    assert chosen["fp4_mx_block16"] == chosen["nvfp4"] == chosen["bf16"]


FILE_KEYS = """
import dataclasses, os, sys, tempfile
import pytest
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.pools import build_device_pool, build_host_pool
from testkit.kernel_emulation import install_stack_emulation
install_stack_emulation(pytest.MonkeyPatch())
os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = tempfile.mkdtemp()
device_pool = build_device_pool(head_num=2, head_dim=128, layer_num=2, pages=3, device="cpu")
host = build_host_pool(device_pool, MHATokenToKVPoolMXFP8Host,
                       host_to_device_ratio=1.0, pin_memory=False)
given = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
             attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
             is_page_first_layout=True, model_name="org/model")
names = {field.name for field in dataclasses.fields(HiCacheStorageConfig)}
config = HiCacheStorageConfig(**{k: v for k, v in given.items() if k in names})
backend = StorageBackendFactory.create_backend("file", config, host)
print(host.storage_format_tag, backend.config_suffix)
"""


def test_file_keys_carry_the_format_on_0_5_21(release_parts):
    """0.5.21 puts no format in L3 keys: the storage config the pool's backend
    is built with names its tag, so a page of another format or geometry
    under the same model is never read as this pool's."""
    part = release_parts("0.5.21", _plugin_on("0.5.21"))["file_keys"]
    tag, suffix = _stdout(part).strip().splitlines()[-1].split()
    assert suffix.startswith(f"_org-model-{tag}_")
