"""Which host pool class SGLang picks after loading its plugins, in this process.

Run as ``python test/probe.py [--assembler-first]`` so that the
answer comes from a fresh process, as in a scheduler: prints one JSON object
``{"<pool>/<lookup>": "<module>.<class>"}`` for an MXFP8 pool (page_size 128
and 64), the two FP4 pools (fp4_mx_block16, nvfp4), a bf16 pool and a plain
fp8 pool, looked up through ``mha`` and through
the name ``hybrid_pool_assembler`` imported (the one SGLang calls), and
under ``storage/factory`` whether SGLang's storage backend factory is hooked.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from sglang_mxfp8_hicache import releases
from sglang_mxfp8_hicache.geometry import FP4_FORMAT_NAMES


def selector_input(kind: str, page_size: int = 128):
    """What the release's assembler hands ``get_mha_host_pool_cls`` for a small
    CPU pool of ``kind`` (``releases.host_pool_selector_input``)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MHATokenToKVPoolMXFP8

    if kind in FP4_FORMAT_NAMES:
        from sglang_mxfp8_hicache.tools.pools import build_device_pool

        pool = build_device_pool(
            head_num=2,
            head_dim=128,
            layer_num=2,
            pages=2,
            page_size=page_size,
            device="cpu",
            kv_cache_dtype=kind,
        )
        return releases.host_pool_selector_input(pool)

    cls, dtype = {
        "mxfp8": (MHATokenToKVPoolMXFP8, torch.float8_e4m3fn),
        "bf16": (MHATokenToKVPool, torch.bfloat16),
        "fp8": (MHATokenToKVPool, torch.float8_e4m3fn),
    }[kind]
    pool = cls(
        size=2 * page_size,
        page_size=page_size,
        dtype=dtype,
        head_num=2,
        head_dim=128,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    return releases.host_pool_selector_input(pool)


def probe(assembler_first: bool = False) -> dict[str, str]:
    if assembler_first:
        # Bound before the hooks apply: the registry must rebind this alias too.
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: F401
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host import mha

    infos = {
        "mxfp8": selector_input("mxfp8"),
        "mxfp8_page64": selector_input("mxfp8", page_size=64),
        **{kind: selector_input(kind) for kind in FP4_FORMAT_NAMES},
        "bf16": selector_input("bf16"),
        "fp8": selector_input("fp8"),
    }
    chosen = {}
    for name, info in infos.items():
        for where, select in (
            ("mha", mha.get_mha_host_pool_cls),
            ("assembler", hybrid_pool_assembler.get_mha_host_pool_cls),
        ):
            cls = select(info)
            chosen[f"{name}/{where}"] = f"{cls.__module__}.{cls.__qualname__}"
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    # HookRegistry's wrappers keep the original as __wrapped__.
    hooked = hasattr(StorageBackendFactory.create_backend, "__wrapped__")
    chosen["storage/factory"] = "hooked" if hooked else "sglang"
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--assembler-first",
        action="store_true",
        help="import SGLang's assembler before its plugins load",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(json.dumps(probe(args.assembler_first)))
