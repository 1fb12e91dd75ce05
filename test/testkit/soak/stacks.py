"""The cache the soak drives: the tree cache the scheduler builds over SGLang's
device pools, with the plugin's host pool, and the geometry it is built to."""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

PAGE, HEAD_DIM, LAYERS = 128, 128, 4
HYBRID_FULL_LAYERS, SLIDING_WINDOW, DRAFTS = (1, 3), 2 * PAGE, 2
DEVICE_PAGES, HICACHE_RATIO = 16, 2.0
MAX_RUNNING = 3
"""Requests running at once; the request pool holds twice as many and two more."""


@dataclass(frozen=True)
class SoakLayer:
    """One attention layer the shadow writes and checks: its device pool, its
    layer there, and whether it is a sliding-window layer (addressed through
    the allocator's full-to-SWA mapping, read only inside the window)."""

    pool: Any
    layer: int
    swa: bool = False


def build_cache(args: argparse.Namespace, device: str, l3_dir: str):
    """The tree cache the scheduler builds (``kv_cache_builder.build_kv_cache``
    then ``registry.create_tree_cache``), its allocator (which holds the
    device pools), its request pool and the layers the shadow writes."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if args.payload_only:
        _use_payload_only_host()
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = l3_dir
    server_args = _publish_server_args(args)
    group, alone = _process_groups(args)
    allocator, layers = STACKS[args.stack](args, device)
    requests = ReqToTokenPool(
        size=2 * MAX_RUNNING + 2,
        max_context_len=4096,
        device=device,
        enable_memory_saver=False,
    )
    cache = create_tree_cache(
        TreeCacheBuildContext(
            server_args=server_args,
            params=_cache_params(args, allocator, requests, layers, group, alone),
            is_hybrid_swa=args.stack == "hybrid_swa",
            is_hybrid_ssm=False,
            enable_hierarchical_cache=True,
            disable_radix_cache=False,
            tp_worker=SimpleNamespace(
                register_hicache_layer_transfer_counter=lambda counter: None
            ),
            model_config=None,
            tp_size=args.tp,
            tp_rank=args.rank,
            tp_group=group,
        )
    )
    controller = cache.cache_controller
    stream = torch.get_device_module(device).current_stream()
    controller.load_fence_stream = controller.write_fence_stream = stream
    return cache, allocator, requests, layers


def _use_payload_only_host() -> None:
    """The control: what SGLang 0.5.16-0.5.20 pick for an MXFP8 pool."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    from sglang_mxfp8_hicache.tools.pools import PayloadOnlyHost

    hybrid_pool_assembler.get_mha_host_pool_cls = lambda info: PayloadOnlyHost


def _publish_server_args(args: argparse.Namespace):
    """The scheduler's ServerArgs for this run, published as this rank's."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    # model_path "dummy" skips model resolution and HiCache flag
    # normalisation: every flag it would settle is given.
    server_args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_hierarchical_cache=True,
        hicache_ratio=HICACHE_RATIO,
        hicache_size=0,
        hicache_mem_layout=args.layout,
        hicache_io_backend="kernel",
        hicache_write_policy=args.write_policy,
        hicache_host_memory_mode="cache",
        hicache_storage_backend=args.l3,
        hicache_storage_backend_extra_config=args.l3_config,
        hicache_storage_prefetch_policy="wait_complete",
        disable_cuda_graph=True,
        tp_size=args.tp,
    )
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=args.rank, dp_rank=None, gpu_id=args.rank),
    )
    return server_args


def _process_groups(args: argparse.Namespace):
    """The scheduler's groups: tensor parallel over every rank (the world);
    attention context parallel and pipeline of each rank alone (each rank
    makes every group, in one order: new_group is collective)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file or tempfile.mktemp()}",
        world_size=args.tp,
        rank=args.rank,
    )
    alone = [dist.new_group([rank], backend="gloo") for rank in range(args.tp)]
    if args.l3:  # L3 keys hash through a C++ extension built on first use:
        # built here, one rank at a time, not inside a storage thread that a
        # reset must join.
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        for rank in range(args.tp):
            if rank == args.rank:
                get_storage_hash_str(list(range(PAGE)), None, page_size=PAGE)
            dist.barrier()
    return dist.group.WORLD, alone[args.rank]


def _cache_params(args, allocator, requests, layers, group, alone):
    """SGLang's ``CacheInitParams`` over this rank's pools and groups."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=False,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_cp_cache_group=alone,
        attn_tp_cache_group=group,
        pp_cache_group=alone,
        sliding_window_size=SLIDING_WINDOW if args.stack == "hybrid_swa" else None,
        mtp_draft_device_pools=tuple(d.pool for d in layers[LAYERS:]),  # MTP drafts
        tree_core_backend=args.core,
    )


def _kv_stack(args: argparse.Namespace, device: str):
    """One block-scaled pool of ``--kv-cache-dtype`` and SGLang's paged
    allocator; ``draft``: and ``DRAFTS`` one-layer MTP draft pools of the same
    slots, which SGLang packs into the target's host pages."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from sglang_mxfp8_hicache.tools.pools import build_device_pool

    pools = [
        build_device_pool(
            head_num=args.heads,
            head_dim=HEAD_DIM,
            layer_num=layer_num,
            pages=DEVICE_PAGES,
            device=device,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        for layer_num in (LAYERS, *(1,) * (DRAFTS if args.stack == "draft" else 0))
    ]
    kv = pools[0]
    allocator = PagedTokenToKVPoolAllocator(
        kv.size, PAGE, torch.int64, device, kv, need_sort=False
    )
    layers = [SoakLayer(kv, layer) for layer in range(LAYERS)]
    return allocator, layers + [SoakLayer(draft, 0) for draft in pools[1:]]


def _hybrid_swa_stack(args: argparse.Namespace, device: str):
    """Full and sliding-window MXFP8 pools and SGLang's SWA allocator, as the
    configurator builds them for a hybrid SWA model
    (``kv_cache_configurator._build_hybrid_swa_kv_pool``)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    kv = SWAKVPool(
        size=DEVICE_PAGES * PAGE,
        size_swa=DEVICE_PAGES * PAGE,
        page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        head_num=args.heads,
        head_dim=HEAD_DIM,
        full_attention_layer_ids=list(HYBRID_FULL_LAYERS),
        swa_attention_layer_ids=[
            i for i in range(LAYERS) if i not in HYBRID_FULL_LAYERS
        ],
        device=device,
        token_to_kv_pool_class=MHATokenToKVPoolMXFP8,
    )
    allocator = SWATokenToKVPoolAllocator(
        kv.size, kv.size_swa, PAGE, torch.int64, device, kv, need_sort=False
    )
    layers = []
    for layer in range(LAYERS):
        index, swa = kv.layers_mapping[layer]
        pool = kv.swa_kv_pool if swa else kv.full_kv_pool
        layers.append(SoakLayer(pool, index, swa))
    return allocator, layers


STACKS = {"kv": _kv_stack, "draft": _kv_stack, "hybrid_swa": _hybrid_swa_stack}
"""``--stack``: one pool of ``--kv-cache-dtype`` (mxfp8, fp4_mx_block16), or a
hybrid SWA model's full and sliding-window MXFP8 pools; ``draft``: ``kv`` with
packed MTP draft pools. Each builder returns SGLang's allocator over the
pools and the layers the shadow writes."""
