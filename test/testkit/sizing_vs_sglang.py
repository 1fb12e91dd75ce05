"""The host pools SGLang's assembler builds for setups, beside what ``size``
plans for the same models: in a process of their own, since the plugin hook
is process-wide; one process for many cases, each stack destroyed before the
next is built.

    python test/sizing_vs_sglang.py SETUP:HICACHE_RATIO:HICACHE_SIZE_GB [...]

Prints one JSON object per case: its ``case`` as given, and for each host pool
SGLang built (by its name), its bytes per token and tokens, and the same from
``sizing.host_plan``. A malformed case is refused (exit 2) before anything
runs.
"""

from __future__ import annotations

import argparse
import json

from testkit.command import interrupt_on_sigterm


def planned(setup: str, ratio: float, size_gb: int) -> dict[str, dict]:
    """``size``'s plan for the model the e2e stack of ``setup`` stands for."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    from sglang_mxfp8_hicache.geometry import FORMATS
    from sglang_mxfp8_hicache.tools.sizing import KVPool, ModelKV, host_plan
    from testkit import e2e

    heads, dim = e2e.KV_HEADS, e2e.HEAD_DIM
    full = len(e2e.HYBRID_FULL_LAYERS)
    mamba_slots = None
    if setup == "hybrid_swa":
        model = ModelKV(
            (
                KVPool("full", full, heads, dim, dim),
                KVPool(
                    "swa",
                    e2e.HYBRID_LAYERS - full,
                    heads,
                    dim,
                    dim,
                    token_ratio=e2e.SWA_DEVICE_PAGES / e2e.DEVICE_PAGES,
                ),
            )
        )
    elif setup.startswith("mamba"):
        mamba_layers = [
            i for i in range(e2e.HYBRID_LAYERS) if i not in e2e.HYBRID_FULL_LAYERS
        ]
        state = Mamba2CacheParams(
            shape=Mamba2StateShape.create(**e2e.MAMBA_SHAPE), layers=mamba_layers
        ).mamba_cache_per_req
        model = ModelKV((KVPool("kv", full, heads, dim, dim),), mamba_state_bytes=state)
        mamba_slots = e2e.MAMBA_SLOTS
    else:
        model = ModelKV((KVPool("kv", e2e.LAYERS, heads, dim, dim),))
    plan = host_plan(
        model,
        device_tokens=e2e.DEVICE_PAGES * e2e.PAGE,
        hicache_ratio=ratio,
        hicache_size_gb=size_gb,
        fmt=FORMATS[e2e.kv_cache_dtype(setup)],
        max_mamba_cache_size=mamba_slots,
        draft_layers=e2e.DRAFTS if setup == "draft" else 0,
    )
    return {
        p.name: {"bytes_per_token": p.bytes_per_token, "tokens": p.host_tokens}
        for p in plan.pools
    }


def built(setup: str, ratio: float, size_gb: int) -> dict[str, dict]:
    """The MHA host pools SGLang's assembler builds for ``setup`` (in the
    process group ``main`` made), destroyed once read."""
    import torch.distributed as dist

    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
    from testkit import e2e

    e2e._publish(setup, hicache_ratio=ratio, hicache_size=size_gb)
    stack = e2e._build_stack(setup, dist.group.WORLD, "cpu")
    try:
        return {
            entry.host_pool.pool_label: {
                "bytes_per_token": entry.host_pool.size_per_token,
                "tokens": entry.host_pool.size,
            }
            for entry in stack.host_group.entries
            if isinstance(entry.host_pool, MHATokenToKVPoolMXFP8Host)
        }
    finally:
        stack.host_group.destroy()


def _case(text: str) -> tuple[str, str, float, int]:
    """``SETUP:HICACHE_RATIO:HICACHE_SIZE_GB``, as given and in its parts: a
    size above 0 GB sizes the host pools; a size of 0 leaves it to a ratio
    above 0."""
    parts = text.split(":")
    try:
        setup, ratio, size_gb = parts[0], float(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: SETUP:HICACHE_RATIO:HICACHE_SIZE_GB"
        ) from None
    if len(parts) != 3 or ratio < 0 or size_gb < 0 or not (ratio > 0 or size_gb):
        raise argparse.ArgumentTypeError(
            f"{text!r}: SETUP:HICACHE_RATIO:HICACHE_SIZE_GB, a size above 0 or "
            "a size of 0 and a ratio above 0"
        )
    return text, setup, ratio, size_gb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "cases",
        nargs="+",
        type=_case,
        metavar="CASE",
        help="SETUP:HICACHE_RATIO:HICACHE_SIZE_GB (kv:2.0:0, kv:0:1)",
    )
    cases = parser.parse_args().cases
    interrupt_on_sigterm()
    import pytest
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    from testkit.e2e import SETUPS
    from testkit.kernel_emulation import install_stack_emulation
    from testkit.mooncake_loopback import free_ports

    if unknown := [setup for _, setup, _, _ in cases if setup not in SETUPS]:
        parser.error(f"argument CASE: unknown setup {unknown}; of {', '.join(SETUPS)}")
    load_plugins()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", world_size=1, rank=0
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_stack_emulation(monkeypatch)
        for case, setup, ratio, size_gb in cases:
            result = {
                "case": case,
                "planned": planned(setup, ratio, size_gb),
                "built": built(setup, ratio, size_gb),
            }
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()
