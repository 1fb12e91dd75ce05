"""End to end on a GPU: real MXFP8 KV through SGLang's own HiCache machinery.

One mode per process, because the plugin hook is process-wide:

    python test/e2e.py --mode ours     # the plugin picks our class
    python test/e2e.py --mode sglang   # plugin disabled: SGLang's own class
    python test/e2e.py --mode plain    # payload-only MHATokenToKVPoolHost (0.5.16-0.5.20)

Each builds what the scheduler builds for ``--kv-cache-dtype mxfp8
--enable-hierarchical-cache`` (a published ServerArgs, a gloo group of size 1,
SGLang's ReqToTokenPool, MHATokenToKVPoolMXFP8 and paged allocator, then
``hybrid_pool_assembler.build_kv_only_stack``, the plain-KV strategy's
builder, which takes the host class from ``get_mha_host_pool_cls``); writes bf16
K/V through the device pool's ``set_kv_buffer`` (SGLang's fused MXFP8 quantize
and store); backs the pages up through ``HybridCacheController.write``; moves
the originals out and overwrites the whole device pool; loads into other pages
through ``load`` / ``start_loading`` and waits layer by layer on the
controller's own events. It prints one JSON verdict.

With ``--l3 file`` or ``--l3 mooncake`` (mode ours), the L3 step follows:
the storage backend is attached at runtime through the controller's
``attach_storage_backend`` (SGLang's admin path; a refused backend is tried
first and must leave the controller as it was), the pages go to L3 through
``write_storage``, are evicted from L2 and the device is overwritten again,
come back through ``prefetch`` (the hit query, the host allocation the radix
cache makes, the prefetch I/O thread) and are loaded into yet other device pages.
A backend's extra configuration (Mooncake's, SeaweedFS's, the ``dynamic``
class's) comes from ``L3_CONFIG_ENV`` (the JSON of
``--hicache-storage-backend-extra-config``).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from sglang_mxfp8_hicache.geometry import FP4_FORMAT_NAMES
from sglang_mxfp8_hicache.tools.l3 import LOCAL_BACKENDS, BackendConfig, local_backend
from sglang_mxfp8_hicache.tools.pools import PAGE_SIZE as PAGE
from sglang_mxfp8_hicache.tools.pools import (
    PayloadOnlyHost,
    build_device_pool,
    fill_random,
    host_page_rows,
)
from testkit import metrics as counted
from testkit import script
from testkit.command import interrupt_on_sigterm
from testkit.e2e_names import L3_BACKENDS, MODES, SETUPS
from testkit.mooncake_loopback import HOST, free_ports
from testkit.pools import device_buffers, synchronize

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 4, 8, 16, 128
# Different lengths, one a whole number of pages, the others not.
SEQ_LENS = (3 * PAGE, 2 * PAGE + 37, PAGE + 5, 300)
DEVICE_PAGES = 32
DRAFTS = 2
HYBRID_LAYERS, HYBRID_FULL_LAYERS = 8, (3, 7)
HYBRID_ATTENTION = dict(
    full_attention_layer_ids=list(HYBRID_FULL_LAYERS),
    swa_attention_layer_ids=[
        i for i in range(HYBRID_LAYERS) if i not in HYBRID_FULL_LAYERS
    ],
)
SWA_DEVICE_PAGES = 24
MAMBA_SLOTS = 2 * len(SEQ_LENS)
# Mamba2 state, small: conv (96, 3) bf16, temporal (4, 16, 16) fp32 per layer.
MAMBA_SHAPE = dict(
    tp_world_size=1,
    intermediate_size=64,
    n_groups=1,
    num_heads=4,
    head_dim=16,
    state_size=16,
    conv_kernel=4,
)
L3_CONFIG_ENV = "MXFP8_HICACHE_E2E_L3_CONFIG"
"""The JSON of --hicache-storage-backend-extra-config for ``--l3``: needed for
mooncake and seaweedfs (a running service) and dynamic (the class); file,
hf3fs and nixl run locally without it (``tools.l3.local_backend``). Not
under the package's prefix, whose names the settings refuse unless they read
them."""
REFUSED_ATTACH = "sim"
L3_MODEL = "e2e-model"
L3_TIMEOUT_S = 120


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def token_scales(scale_buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(T, H, D/32) scale bytes of token ``slots`` in the FA4-interleaved
    ``(pages, H, 32, P/32, D/32)`` layout: slot -> [page, :, off % 32, off // 32, :]."""
    page, offset = slots // PAGE, slots % PAGE
    return _u8(scale_buffer)[page, :, offset % 32, offset // 32, :]


def dequantize(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 value x 2^(scale - 127), block of 32 along the head dimension."""
    exponent = scales.to(torch.float32) - 127.0
    factor = torch.exp2(exponent).repeat_interleave(32, dim=-1)
    return payload.to(torch.float32) * factor


@dataclass(frozen=True)
class DeviceLayer:
    """One MXFP8 device layer the stack backs up and restores: its pool, its
    layer there, and the index space (``kv`` or ``swa``) that addresses it."""

    pool: Any
    layer: int
    space: str = "kv"


@dataclass
class Stack:
    """What SGLang's assembler built, and every MXFP8 layer in it."""

    host_group: Any
    controller: Any
    consumer_pool: Any  # the pool the attention layers wait on
    layers: list[DeviceLayer]
    # Index space -> allocator: "kv" (the anchor), then each side pool by its
    # PoolName value ("swa", "mamba").
    allocators: dict[str, Any]
    # Mamba state tensors, (layers, slots, ...), moved beside the KV, and
    # the model layers that hold them.
    state: list[torch.Tensor] = field(default_factory=list)
    state_layers: tuple[int, ...] = ()
    # Sidecar pools that move with the KV pool's indices ("draft").
    sidecars: tuple[str, ...] = ()

    @property
    def device_pools(self) -> list[Any]:
        return list({id(d.pool): d.pool for d in self.layers}.values())


NOT_FINITE = torch.finfo(torch.float32).max
"""What a non-finite dequantized difference counts as: JSON has no infinity."""


class Restore(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One load through the controller, judged against what was written."""

    payload_restored: bool | None = None
    scales_restored: bool | None = None
    state_restored: bool | None = None
    """Mamba state slots; None where the setup has none."""
    dequantized_max_diff: float | None = None
    """Non-finite differences (a wrong scale byte can make NaN) count as
    ``NOT_FINITE``: JSON has no infinity."""
    untouched_pages_kept: bool | None = None


class L3Trip(Restore, kw_only=True, forbid_unknown_fields=True):
    """L2 -> L3 -> L2 -> device through the controller's storage threads."""

    backend: str
    format_tag: str
    refused_attach: str
    refusal_left_controller_clean: bool
    pages: int
    stored_tokens: int
    hit_tokens: int
    fetched_tokens: int
    refetched_tokens: int | None = None
    """``file``: tokens fetched again once the last page's file is cut short."""
    missed: dict[str, float] = {}
    """The pool's L3 misses by reason (``metrics``) over that fetch."""


class Verdict(Restore, kw_only=True, forbid_unknown_fields=True):
    """What one e2e run of a (mode, setup) found: written as one JSON line by
    ``main``, read by ``run_modes``, ``check --e2e`` and the tests. A run that
    raised has ``error``; one without a GPU, ``skipped``."""

    mode: str
    setup: str = "kv"
    error: str | None = None
    skipped: str | None = None
    seq_lens: list[int] = []
    geometry: str = ""
    host_classes: dict[str, str] = {}
    host_class: str = ""
    layers: int = 0
    write_path: str = ""
    quantized_within_error: bool = False
    restored_sha256: str = ""
    moved: dict[str, list[float]] = {}
    """Pages and bytes the ``kv`` pool's counters grew by, by "path/direction"."""
    l3: L3Trip | None = None

    @property
    def key(self) -> str:
        """How ``run_modes`` names it: the mode for setup ``kv``, else
        ``setup:mode``."""
        return self.mode if self.setup == "kv" else f"{self.setup}:{self.mode}"

    @property
    def restored_exactly(self) -> bool:
        """Payload and scales equal, dequantized difference 0, every other
        device page kept, and set_kv_buffer's quantization within its error."""
        return bool(
            self.error is None
            and self.payload_restored
            and self.scales_restored
            and self.untouched_pages_kept
            and self.dequantized_max_diff == 0.0
            and (
                self.quantized_within_error
                or not self.write_path.startswith("set_kv_buffer")
            )
        )


def kv_cache_dtype(setup: str) -> str:
    """The --kv-cache-dtype of ``setup``: the FP4 recipe its name ends with,
    else mxfp8."""
    return next((n for n in FP4_FORMAT_NAMES if setup.endswith(n)), "mxfp8")


def _publish(setup: str, *, hicache_ratio: float = 2.0, hicache_size: int = 0):
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    # model_path "dummy" skips model resolution, which includes the check that
    # refuses mxfp8 off Blackwell: everything this run touches is below the
    # attention kernel. It also skips HiCache flag normalisation, so the
    # defaults it would pick are given explicitly.
    server_args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        kv_cache_dtype=kv_cache_dtype(setup),
        enable_hierarchical_cache=True,
        hicache_ratio=hicache_ratio,
        hicache_size=hicache_size,
        hicache_mem_layout="layer_first" if setup == "layer_first" else "page_first",
        hicache_io_backend="kernel",
        hicache_write_policy="write_through",
        hicache_host_memory_mode="cache",
        disable_cuda_graph=True,
    )
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0),
    )


@dataclass
class _StackArgs:
    """What every stack builder is given: SGLang's cache parameters without
    the allocator (it is built with the device pool), the controller's
    common arguments, and the device pools' heads and recipe."""

    params: dict[str, Any]
    common: dict[str, Any]
    pool_args: dict[str, Any]
    kv_args: dict[str, Any]
    setup: str


def _build_stack(setup: str, group, device: str) -> Stack:
    """The device pools and the HiCache stack SGLang builds for ``setup``
    (``STACK_BUILDERS``)."""
    from sglang.srt.runtime_context import get_serving

    pool_args = dict(head_num=KV_HEADS, head_dim=HEAD_DIM, device=device)
    args = _StackArgs(
        params=dict(
            disable=False,
            page_size=PAGE,
            tp_cache_group=group,
            attn_cp_cache_group=group,
            attn_tp_cache_group=group,
            pp_cache_group=group,
        ),
        common=dict(
            load_cache_event=threading.Event(),
            storage_backend=None,
            model_name=get_serving().served_model_name,
        ),
        pool_args=pool_args,
        kv_args=dict(pool_args, kv_cache_dtype=kv_cache_dtype(setup)),
        setup=setup,
    )
    return STACK_BUILDERS[setup](args)


def _request_pool(device: str):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(
        size=len(SEQ_LENS),
        max_context_len=4096,
        device=device,
        enable_memory_saver=False,
    )


def _build_kv_stack(args: _StackArgs) -> Stack:
    """The plain KV stack through ``build_kv_only_stack``; ``draft`` packs
    ``DRAFTS`` one-layer MTP pools into it."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    device = args.pool_args["device"]
    kv_pool = build_device_pool(layer_num=LAYERS, pages=DEVICE_PAGES, **args.kv_args)
    drafts = tuple(
        build_device_pool(layer_num=1, pages=DEVICE_PAGES, **args.kv_args)
        for _ in range(DRAFTS if args.setup == "draft" else 0)
    )
    allocator = PagedTokenToKVPoolAllocator(
        kv_pool.size, PAGE, torch.int64, device, kv_pool, need_sort=False
    )
    host_group, controller = assembler.build_kv_only_stack(
        params=CacheInitParams(
            token_to_kv_pool_allocator=allocator,
            req_to_token_pool=_request_pool(device),
            mtp_draft_device_pools=drafts,
            **args.params,
        ),
        kv_pool=kv_pool,
        full_layer_mapping={i: i for i in range(LAYERS)},
        use_mla=False,
        **args.common,
    )
    layers = [DeviceLayer(kv_pool, i) for i in range(LAYERS)]
    layers += [DeviceLayer(d, 0) for d in drafts]
    return Stack(host_group, controller, kv_pool, layers, {"kv": allocator})


def _build_swa_stack(args: _StackArgs) -> Stack:
    """Full and sliding-window MXFP8 pools through ``build_hybrid_swa_stack``."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    device = args.pool_args["device"]
    # What the configurator builds for --kv-cache-dtype mxfp8 on a hybrid SWA
    # model (kv_cache_configurator._build_hybrid_swa_kv_pool).
    kvcache = SWAKVPool(
        size=DEVICE_PAGES * PAGE,
        size_swa=SWA_DEVICE_PAGES * PAGE,
        page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        token_to_kv_pool_class=MHATokenToKVPoolMXFP8,
        **HYBRID_ATTENTION,
        **args.pool_args,
    )
    allocator = SWATokenToKVPoolAllocator(
        kvcache.size,
        kvcache.size_swa,
        PAGE,
        torch.int64,
        device,
        kvcache,
        need_sort=False,
    )
    full_mapping, swa_mapping = assembler._swa_layer_mappings(kvcache)
    host_group, controller = assembler.build_hybrid_swa_stack(
        params=CacheInitParams(
            token_to_kv_pool_allocator=allocator,
            req_to_token_pool=_request_pool(device),
            **args.params,
        ),
        full_kv_pool=kvcache.full_kv_pool,
        swa_kv_pool=kvcache.swa_kv_pool,
        full_layer_mapping=full_mapping,
        swa_layer_mapping=swa_mapping,
        use_mla=False,
        **args.common,
    )
    layers = [
        DeviceLayer(kvcache.swa_kv_pool if swa else kvcache.full_kv_pool, n, space)
        for n, swa, space in (
            (
                *kvcache.layers_mapping[i],
                "swa" if kvcache.layers_mapping[i][1] else "kv",
            )
            for i in range(HYBRID_LAYERS)
        )
    ]
    return Stack(
        host_group,
        controller,
        kvcache,
        layers,
        {"kv": allocator.full_attn_allocator, "swa": allocator.swa_attn_allocator},
    )


def _build_sidecar_stack(args: _StackArgs) -> Stack:
    """The plain KV stack and a two-layer draft pool registered as SGLang's
    sidecar, as ``maybe_register_hicache_draft`` does for a draft runner."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    stack = _build_kv_stack(args)
    draft = build_device_pool(layer_num=2, pages=DEVICE_PAGES, **args.pool_args)
    _, entries = assembler.build_hicache_draft_sidecars(
        draft_device_pools=(draft,),
        tree_cache=SimpleNamespace(cache_controller=stack.controller),
    )
    for entry in entries:
        stack.controller.register_host_pool_entry(entry)
    stack.layers += [DeviceLayer(draft, i) for i in range(draft.layer_num)]
    stack.sidecars = tuple(entry.name.value for entry in entries)
    return stack


def _build_mamba_stack(args: _StackArgs) -> Stack:
    """What the scheduler builds for a hybrid Mamba model with a block-scaled
    KV cache: its request pool with the Mamba state pool, a HybridLinearKVPool
    over MHATokenToKVPoolMXFP8, or over MHATokenToKVPool with the FP4 quant
    method (kv_cache_configurator), and the stack through
    SGLang's own strategy selection (``build_hybrid_mamba_stack``), with the
    layer-done counters wired as the radix cache wires them."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    device = args.pool_args["device"]
    mamba_layers = HYBRID_ATTENTION["swa_attention_layer_ids"]
    req_to_token_pool = _mamba_request_pool(device, mamba_layers)
    kvcache = _hybrid_linear_pool(args, req_to_token_pool.mamba_pool)
    allocator = PagedTokenToKVPoolAllocator(
        kvcache.size, PAGE, torch.int64, device, kvcache, need_sort=False
    )
    init_params = CacheInitParams(
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        **args.params,
    )
    strategy = assembler._select_strategy(
        kvcache, {ComponentType.FULL, ComponentType.MAMBA}
    )
    built = strategy.build(
        cache=SimpleNamespace(evict_host=lambda n, component: 0),
        kvcache=kvcache,
        params=init_params,
        server_args=None,
        **args.common,
    )
    counter = built.cache_controller.layer_done_counter
    kvcache.register_layer_transfer_counter(counter)
    if built.register_req_to_token_counter:
        req_to_token_pool.register_layer_transfer_counter(counter)
    full = kvcache.full_kv_pool
    mamba_cache = req_to_token_pool.mamba_pool.mamba_cache
    return Stack(
        built.host_pool_group,
        built.cache_controller,
        kvcache,
        [DeviceLayer(full, n) for n in range(full.layer_num)],
        {"kv": allocator, "mamba": req_to_token_pool.mamba_allocator},
        [mamba_cache.temporal, *mamba_cache.conv],
        tuple(mamba_layers),
    )


def _mamba_request_pool(device: str, mamba_layers: list[int]):
    """SGLang's request pool for a hybrid Mamba model, with its Mamba2 state
    pool (``MAMBA_SHAPE``, ``MAMBA_SLOTS`` slots) for ``mamba_layers``."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    return HybridReqToTokenPool(
        size=len(SEQ_LENS),
        mamba_size=MAMBA_SLOTS,
        mamba_spec_state_size=len(SEQ_LENS),
        max_context_len=4096,
        device=device,
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(
            shape=Mamba2StateShape.create(**MAMBA_SHAPE), layers=mamba_layers
        ),
        mamba_layer_ids=mamba_layers,
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=None,
        enable_overlap_schedule=False,
        start_layer=0,
    )


def _hybrid_linear_pool(args: _StackArgs, mamba_pool):
    """The ``HybridLinearKVPool`` over the full attention layers, of the
    class, dtype and (FP4) quant method the configurator gives them, as a
    one-page pool of the recipe shows them."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    pool_args = dict(args.kv_args)
    name = pool_args.pop("kv_cache_dtype")
    full_layers = HYBRID_ATTENTION["full_attention_layer_ids"]
    recipe = build_device_pool(
        layer_num=len(full_layers), pages=1, kv_cache_dtype=name, **pool_args
    )
    return HybridLinearKVPool(
        size=DEVICE_PAGES * PAGE,
        page_size=PAGE,
        full_attention_layer_ids=full_layers,
        mamba_pool=mamba_pool,
        enable_memory_saver=False,
        enable_kv_cache_copy=False,
        start_layer=0,
        use_mla=False,
        dtype=recipe.dtype,
        full_kv_pool_class=type(recipe),
        quant_method=None if name == "mxfp8" else recipe.quant_method,
        **pool_args,
    )


def run(
    mode: str, l3: str | None = None, setup: str = "kv", device: str = "cuda"
) -> dict:
    """One mode and setup; on ``device="cpu"`` the caller has put CPU stand-ins
    for the kernels in place (the tests do)."""
    if mode != "ours":
        os.environ["SGLANG_MXFP8_HICACHE_DISABLE"] = "1"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch.distributed as dist
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.runtime_context import reset_context

    if mode == "plain":
        _use_payload_only_hosts()
    _publish(setup)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{free_ports(1)[0]}", world_size=1, rank=0
    )
    verdict = {
        "mode": mode,
        "setup": setup,
        "seq_lens": list(SEQ_LENS),
        "geometry": f"{KV_HEADS}x{HEAD_DIM}",
    }
    stack = None
    try:
        stack = _build_stack(setup, dist.group.WORLD, device)
        stream = torch.get_device_module(device).current_stream()
        stack.controller.write_fence_stream = stream
        stack.controller.load_fence_stream = stream
        verdict["host_classes"] = {
            entry.name.value: f"{type(entry.host_pool).__module__}."
            f"{type(entry.host_pool).__qualname__}"
            for entry in stack.host_group.entries
        }
        verdict["host_class"] = verdict["host_classes"][PoolName.KV.value]
        verdict["layers"] = len(stack.layers)
        verdict.update(_exercise(stack, RadixAttention, l3, device))
    finally:
        synchronize(device)
        if stack is not None:
            stack.controller.reset()
            stack.host_group.destroy()
        dist.destroy_process_group()
        reset_context()
    return verdict


def _use_payload_only_hosts() -> None:
    """What SGLang 0.5.16-0.5.20 pick for an MXFP8 pool (and what an FP4 pool
    gets where it reports no scales). Patched where the assembler looks the
    selector up."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from sglang_mxfp8_hicache import releases
    from sglang_mxfp8_hicache.geometry import is_packed_fp4

    # Handed a buffer info (0.5.23) or the device pool (releases before it).
    hybrid_pool_assembler.get_mha_host_pool_cls = lambda given: (
        PayloadOnlyHost
        if is_packed_fp4(releases.buffer_info(given))
        else MHATokenToKVPoolHost
    )


class _Sequences:
    """The test sequences' device slots in each index space: whole pages of
    tokens, and one Mamba state slot per sequence (one radix node each)."""

    def __init__(self, stack: Stack, lengths=SEQ_LENS):
        self.lengths = list(lengths)
        self.slots = {space: [] for space in stack.allocators}
        for length in self.lengths:
            for space, allocator in stack.allocators.items():
                need = 1 if space == "mamba" else -(-length // PAGE) * PAGE
                self.slots[space].append(allocator.alloc(need))

    def all(self, space: str) -> torch.Tensor:
        return torch.cat(self.slots[space])

    def written(self, space: str) -> torch.Tensor:
        """The slots that hold the sequences' tokens (not the pages' tails)."""
        return torch.cat(
            [s[:n] for s, n in zip(self.slots[space], self.lengths, strict=True)]
        )

    def free(self, stack: Stack) -> None:
        for space, allocator in stack.allocators.items():
            allocator.free(self.all(space))


def _exercise(stack: Stack, RadixAttention, l3, device: str) -> dict:
    """The run's steps over a built stack: write real KV, back it up through
    the controller, clobber the device and load it into other pages, judge
    what came back; with ``l3``, then to L3 and back (``_exercise_l3``)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    moved_before = counted.moved("kv")
    src = _Sequences(stack)
    write_path, bf16 = _write_kv(stack, src, RadixAttention, gen)
    fill_random(stack.state, gen)
    synchronize(device)
    judge = _Judge(stack, gen, device, _snapshot(stack, src), _dequantized(stack, src))
    quant_ok = bool(bf16) and _quantized_within_error(stack, src, bf16, judge)
    host_indices = _back_up(stack, src)
    # Other device pages for the load (the originals are still allocated),
    # every byte of the device pools overwritten, then the load.
    verdict = {
        "write_path": write_path,
        "quantized_within_error": quant_ok,
        **judge.load(host_indices),
    }
    src.free(stack)
    digest = hashlib.sha256()
    for tensor in verdict.pop("restored"):
        digest.update(tensor.cpu().numpy().tobytes())
    verdict["restored_sha256"] = digest.hexdigest()
    kv_hosts = [h["kv"] for h in host_indices]
    if l3 is not None:  # it evicts the pages from L2 itself
        verdict["l3"] = _exercise_l3(l3, stack.controller, kv_hosts, judge.load)
    else:
        for host in kv_hosts:
            stack.controller.evict_host(host)
    moved = counted.grown(moved_before, counted.moved("kv"))
    verdict["moved"] = {"/".join(key): list(grew) for key, grew in moved.items()}
    return verdict


def _write_kv(stack: Stack, src: _Sequences, RadixAttention, gen):
    """Step 1: real block-scaled KV at ``src``'s tokens, written by SGLang's
    own quantize-and-store path (``set_kv_buffer``) from random bf16 K and V;
    where that fails, random payload and valid scales, the reason kept. How
    it was written, and the bf16 K and V of each layer (none if random)."""
    write_path = (
        "set_kv_buffer (SGLang's fused MXFP8 quantize and store, Triton)"
        if not _quant_method(stack.layers[0].pool)
        else "set_kv_buffer (SGLang's FP4 quant method's quantize_and_store)"
    )
    bf16 = []
    try:
        for d in stack.layers:
            slots = src.written(d.space)
            layer = RadixAttention(
                Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer_id=d.layer
            )
            k, v = (
                torch.randn(
                    len(slots), KV_HEADS, HEAD_DIM, generator=gen, device=gen.device
                )
                .mul_(3.0)
                .to(torch.bfloat16)
                for _ in range(2)
            )
            d.pool.set_kv_buffer(layer, slots, k, v)
            bf16.append((k, v))
    except Exception as exc:  # the fallback the issue allows, with the reason kept
        _write_random_kv(stack, gen)
        return f"random payload and valid scales (set_kv_buffer failed: {exc!r})", []
    return write_path, bf16


def _write_random_kv(stack: Stack, gen) -> None:
    """Random payload bytes and scale bytes of the recipe's valid range."""
    for pool in stack.device_pools:
        for buf in (*pool.k_buffer, *pool.v_buffer):
            _u8(buf).copy_(_randint(0, 0x7E, buf.shape, gen))
        # UE8M0 exponents 2^-27..2^12; nvfp4's e4m3 scales 2^-4..2^3
        # (random e4m3 bytes include NaN, 0x7F).
        method = _quant_method(pool)
        low, high = (0x20, 0x58) if method and method.name == "nvfp4" else (100, 140)
        for buf in (*pool.k_scale_buffer, *pool.v_scale_buffer):
            _u8(buf).copy_(_randint(low, high, buf.shape, gen))


def _snapshot(stack: Stack, seqs: _Sequences) -> list[torch.Tensor]:
    """[K, V, K scales, V scales] of each layer at ``seqs``' slots, then each
    Mamba state tensor's (layers, slots) rows."""
    out = []
    for d in stack.layers:
        slots = seqs.all(d.space)
        pages = slots[::PAGE] // PAGE
        page_num = d.pool.k_buffer[d.layer].shape[0] // PAGE
        out += [
            _u8(buf[d.layer])[slots].clone()
            for buf in (d.pool.k_buffer, d.pool.v_buffer)
        ]
        out += [
            _u8(buf[d.layer]).reshape(page_num, -1)[pages].clone()
            for buf in (d.pool.k_scale_buffer, d.pool.v_scale_buffer)
        ]
    if stack.state:
        slots = seqs.all("mamba")
        out += [_u8(t[:, slots]).clone() for t in stack.state]
    return out


def _dequantized(stack: Stack, seqs: _Sequences) -> list[torch.Tensor]:
    """K then V of each layer at ``seqs``' tokens, dequantized."""
    return [
        dequantize_slots(d, side, seqs.written(d.space))
        for d in stack.layers
        for side in "kv"
    ]


def _quantized_within_error(stack: Stack, src: _Sequences, bf16, judge) -> bool:
    """Whether ``set_kv_buffer``'s quantization of the bf16 K and V is within
    its rounding error, every layer and side."""
    return all(
        within_quantization_error(
            d,
            x.float(),
            judge.original_kv[2 * n + side],
            scales[d.layer],
            src.written(d.space),
        )
        for n, d in enumerate(stack.layers)
        for side, (x, scales) in enumerate(
            ((bf16[n][0], d.pool.k_scale_buffer), (bf16[n][1], d.pool.v_scale_buffer))
        )
    )


def _back_up(stack: Stack, src: _Sequences) -> list[dict]:
    """Step 2: each sequence written back through the controller
    (write-through: submitted at once), waited for; per sequence, the host
    indices of each index space."""
    controller = stack.controller
    host_indices = []
    for n in range(len(src.lengths)):
        side = _side_transfers(stack, src, n)
        kv_host = controller.write(
            src.slots["kv"][n], node_id=n, extra_pools=side or None
        )
        if kv_host is None:
            raise RuntimeError("the host pool had no room for the write-back")
        # The controller resolved each side pool's host slots into its transfer.
        host_indices.append(
            {
                "kv": kv_host,
                **{
                    t.name.value: t.host_indices
                    for t in side
                    if t.indices_from_pool is None
                },
            }
        )
    while controller.ack_write_queue:
        controller.ack_write_queue.pop(0).finish_event.synchronize()
    return host_indices


@dataclass
class _Judge:
    """What the stack held after the write, to judge every load against."""

    stack: Stack
    gen: torch.Generator
    device: str
    original: list[torch.Tensor]
    """``_snapshot`` of the written sequences."""
    original_kv: list[torch.Tensor]
    """``_dequantized`` of the written sequences."""

    def load(self, hosts: list[dict]) -> dict:
        """Overwrite the device, load ``hosts`` into new device pages through
        the controller; what came back, against the originals."""
        stack = self.stack
        dst = _Sequences(stack)
        result = _load_and_compare(stack, hosts, dst, self.gen, self.device)
        result["restored"] = _snapshot(stack, dst)
        restored_kv = _dequantized(stack, dst)
        diffs = [
            (a - b).abs().nan_to_num(nan=NOT_FINITE, posinf=NOT_FINITE).max().item()
            for a, b in zip(restored_kv, self.original_kv, strict=True)
        ]
        dst.free(stack)
        return {
            **_restored_flags(result["restored"], self.original, 4 * len(stack.layers)),
            "dequantized_max_diff": max(diffs),
            **result,
        }


def _side_transfers(
    stack: Stack, seqs: _Sequences, n: int, host: dict | None = None
) -> list:
    """Sequence ``n``'s side-pool transfers, as the radix cache passes them:
    each side pool's device slots in ``seqs`` (a load also names the host
    slots its write got, from ``host``), then the sidecars, which ride on the
    KV pool's indices (``SidecarPoolSpec``)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    side = [
        PoolTransfer(
            name=PoolName(space),
            host_indices=None if host is None else host[space],
            device_indices=slots[n],
        )
        for space, slots in seqs.slots.items()
        if space != "kv"
    ]
    return side + [
        PoolTransfer(name=PoolName(name), indices_from_pool=PoolName.KV)
        for name in stack.sidecars
    ]


def _randint(low: int, high: int, shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(
        low, high, shape, dtype=torch.uint8, generator=gen, device=gen.device
    )


def _restored_flags(restored: list, original: list, kv_entries: int) -> dict:
    """Payload and scales equal, from snapshot()'s [K, V, K scale, V scale] per
    layer; then the Mamba state, where the stack has one."""
    pairs = list(zip(restored, original, strict=True))
    flags = {
        "payload_restored": all(
            torch.equal(a, b)
            for n, (a, b) in enumerate(pairs[:kv_entries])
            if n % 4 < 2
        ),
        "scales_restored": all(
            torch.equal(a, b)
            for n, (a, b) in enumerate(pairs[:kv_entries])
            if n % 4 >= 2
        ),
    }
    if len(pairs) > kv_entries:
        flags["state_restored"] = all(torch.equal(a, b) for a, b in pairs[kv_entries:])
    return flags


def _load_and_compare(stack: Stack, hosts: list[dict], dst: _Sequences, gen, device):
    """Overwrite every device byte, load ``hosts`` into ``dst`` through the
    controller, waiting layer by layer on its events; whether every other
    device page kept its bytes."""
    for pool in stack.device_pools:
        fill_random(device_buffers(pool), gen)
    fill_random(stack.state, gen)
    synchronize(device)
    kept = _outside(stack, dst, device)
    _load(stack, hosts, dst)
    synchronize(device)
    untouched = all(
        torch.equal(r[mask], before)
        for rows, mask, befores in kept
        for r, before in zip(rows, befores, strict=True)
    )
    return {"untouched_pages_kept": untouched}


def _outside(stack: Stack, dst: _Sequences, device) -> list[tuple]:
    """Per pool, then for the Mamba state: its rows (views), the mask of the
    pages (or state slots) outside ``dst``, and their bytes now."""
    kept = []
    for pool in stack.device_pools:
        space = next(d.space for d in stack.layers if d.pool is pool)
        page_num = pool.k_buffer[0].shape[0] // PAGE
        untouched = torch.ones(page_num, dtype=torch.bool, device=device)
        untouched[dst.all(space)[::PAGE] // PAGE] = False
        rows = [_u8(b).reshape(page_num, -1) for b in device_buffers(pool)]
        kept.append((rows, untouched, [r[untouched].clone() for r in rows]))
    if stack.state:  # Mamba slots: (layers, slots, ...) -> rows per slot
        slot_num = stack.state[0].shape[1]
        untouched = torch.ones(slot_num, dtype=torch.bool, device=device)
        untouched[dst.all("mamba")] = False
        rows = [_u8(t).transpose(0, 1) for t in stack.state]  # views, slot first
        kept.append((rows, untouched, [r[untouched].clone() for r in rows]))
    return kept


def _load_into(controller, host_indices, rows, **kwargs):
    """``controller.load`` of ``host_indices`` into the device ``rows``: the
    controller takes them from 0.5.22 on; 0.5.21's allocates the rows itself,
    so its allocator hands out these for that one load."""
    if "device_indices" in inspect.signature(controller.load).parameters:
        return controller.load(host_indices, device_indices=rows, **kwargs)
    allocator = controller.mem_pool_device_allocator
    allocator = getattr(allocator, "full_attn_allocator", allocator)
    allocator.alloc = lambda need: rows if need == len(rows) else None
    try:
        return controller.load(host_indices, **kwargs)
    finally:
        del allocator.alloc


def _load(stack: Stack, hosts: list[dict], dst: _Sequences) -> None:
    """Step 4: ``hosts`` loaded into ``dst`` through the controller, layer by
    layer, on its completion events, as the attention layers consume them."""
    controller = stack.controller
    for n, host in enumerate(hosts):
        side = _side_transfers(stack, dst, n, host)
        loaded = _load_into(
            controller,
            host["kv"],
            dst.slots["kv"][n],
            node_id=99,
            extra_pools=side or None,
        )
        if loaded is None:
            raise RuntimeError("the controller refused the load")
    producer = controller.start_loading()
    controller.layer_done_counter.set_consumer(producer)
    events = controller.layer_done_counter.events[producer].load_events
    for i in range(controller.transfer_layer_id_max):
        # The consumer's wait: the current stream waits on transfer layer i
        # (attention layers; a Mamba layer's wait is the request pool's).
        if i not in stack.state_layers:
            stack.consumer_pool.get_key_buffer(i)
        events[i].synchronize()
    while controller.ack_load_queue:
        controller.ack_load_queue.pop(0).finish_event.synchronize()
    controller.layer_done_counter.set_consumer(-1)


def _l3_backend(backend: str) -> BackendConfig:
    """``tools.l3.BackendConfig`` of ``backend``: the extra config in
    ``L3_CONFIG_ENV`` if set, else a local run in a fresh directory."""
    import tempfile

    config = os.environ.get(L3_CONFIG_ENV)
    if config:
        return BackendConfig(json.loads(config), {})
    if backend not in LOCAL_BACKENDS:
        raise RuntimeError(
            f"--l3 {backend} needs {L3_CONFIG_ENV}: the JSON of "
            "--hicache-storage-backend-extra-config (a running service for "
            "mooncake and seaweedfs, the class for dynamic)"
        )
    return local_backend(backend, tempfile.mkdtemp(prefix=f"mxfp8-l3-{backend}-"))


def _exercise_l3(backend, controller, host_indices, load) -> dict:
    """L2 pages to L3 and back through the controller's storage threads,
    then loaded to the device by ``load`` (``_Judge.load``) and judged."""
    refused, refusal_clean = _attach_l3(controller, backend)
    all_host = torch.cat(host_indices)
    tokens = torch.randint(
        0, 1 << 20, (len(all_host),), generator=torch.Generator().manual_seed(7)
    ).tolist()
    hashes, stored_tokens = _store(controller, all_host, tokens)
    # 6. Out of L2: host pages freed and every host byte overwritten.
    for host in host_indices:
        controller.evict_host(host)
    host_pool = controller.storage_host_pool
    fill_random([host_page_rows(host_pool)], torch.Generator().manual_seed(8))
    hit_tokens, fetched_host, fetched_tokens = _fetch(controller, tokens)
    # 8. L2 -> device, into yet other pages; compare with the first originals.
    lengths = [len(h) for h in host_indices]
    judged = load([{"kv": h} for h in fetched_host.split(lengths)])
    judged.pop("restored")
    controller.evict_host(fetched_host)
    refetched, missed = _refetch_cut_short(backend, controller, hashes, tokens)
    controller.detach_storage_backend()
    return {
        "refetched_tokens": refetched,
        "missed": missed,
        "backend": backend,
        "format_tag": host_pool.storage_format_tag,
        "refused_attach": refused,
        "refusal_left_controller_clean": refusal_clean,
        "pages": len(hashes),
        "stored_tokens": stored_tokens,
        "hit_tokens": hit_tokens,
        "fetched_tokens": fetched_tokens,
        **judged,
    }


def _refetch_cut_short(backend, controller, hashes, tokens):
    """``file``: the last page's file cut to half, fetched again through the
    controller. The tokens that arrived, and the misses counted meanwhile."""
    from sglang_mxfp8_hicache.guards import file_page_path

    if backend != "file":
        return None, {}
    path = file_page_path(controller.storage_backend, hashes[-1])
    os.truncate(path, os.path.getsize(path) // 2)
    before = counted.missed("kv")
    _, fetched_host, fetched_tokens = _fetch(controller, tokens)
    controller.evict_host(fetched_host)
    return fetched_tokens, counted.grown(before, counted.missed("kv"))


def _attach_l3(controller, backend: str) -> tuple[str, bool]:
    """Runtime attach, SGLang's admin path: a refused backend first, then
    ``backend``. Why the first was refused, and whether the refusal left the
    controller without storage."""
    from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError

    local = _l3_backend(backend)
    try:
        controller.attach_storage_backend(REFUSED_ATTACH, model_name=L3_MODEL)
        refused = f"{REFUSED_ATTACH} was attached"
    except BlockScaledHiCacheConfigError as exc:
        refused = str(exc)
    refusal_clean = not controller.enable_storage
    with local.environment():  # the backend reads it when it is built
        controller.attach_storage_backend(
            backend,
            model_name=L3_MODEL,
            storage_backend_extra_config=dict(local.extra_config),
        )
    return refused, refusal_clean


def _store(controller, all_host: torch.Tensor, tokens: list[int]):
    """Step 5: L2 -> L3 through the backup thread. The pages' hashes, and
    how many tokens it stored."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    controller.write_storage(all_host, tokens, hash_value=hashes)
    backup = controller.ack_backup_queue.get(timeout=L3_TIMEOUT_S)
    return hashes, backup.completed_tokens


def _fetch(controller, tokens: list[int]):
    """Step 7: L3 -> L2: the hit query, the host allocation the radix cache
    makes, then the prefetch I/O thread. Tokens hit, the host indices
    fetched into, and tokens fetched."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    controller.prefetch(CacheRequestHandle(rid="e2e-l3", attempt_id=0), tokens)
    hit = controller.prefetch_hit_queue.get(timeout=L3_TIMEOUT_S)
    hit_tokens = hit.storage_hit_count
    if hasattr(controller, "alloc_prefetch_host_buffers"):
        fetched_host = controller.alloc_prefetch_host_buffers(hit, hit_tokens)
    else:  # 0.5.21: the radix cache takes the host pages itself
        fetched_host = controller.mem_pool_host.alloc(hit_tokens)
    hit.host_indices = fetched_host
    controller.prefetch_buffer.put(hit)
    fetched_tokens = 0
    while True:
        ack = controller.ack_prefetch_queue.get(timeout=L3_TIMEOUT_S)
        if ack.completed_tokens is not None:
            fetched_tokens = ack.completed_tokens
        if ack.completed_req:
            break
    return hit_tokens, fetched_host, fetched_tokens


STACK_BUILDERS: dict[str, Callable[[_StackArgs], Stack]] = {
    "kv": _build_kv_stack,
    "draft": _build_kv_stack,
    "sidecar_draft": _build_sidecar_stack,
    "layer_first": _build_kv_stack,
    "hybrid_swa": _build_swa_stack,
    "mamba": _build_mamba_stack,
    **{name: _build_kv_stack for name in FP4_FORMAT_NAMES},
    "mamba_fp4_mx_block16": _build_mamba_stack,
}
"""How each setup is built. ``kv``: the plain KV stack (MXFP8); ``draft``:
``DRAFTS`` packed one-layer MTP/NextN draft pools in it; ``sidecar_draft``: a
two-layer draft (EAGLE3, standalone) in its own host pool, registered as
SGLang's sidecar (``build_hicache_draft_sidecars``), its indices those of the
KV pool; ``layer_first``: that host layout (the published flag);
``hybrid_swa``: full and sliding-window MXFP8 pools through
``build_hybrid_swa_stack``; ``mamba``: an MXFP8 full attention pool beside
Mamba2 state through ``build_hybrid_mamba_stack``; ``fp4_mx_block16``,
``nvfp4``: the plain KV stack of that FP4 KV cache; ``mamba_fp4_mx_block16``:
``mamba`` with an fp4_mx_block16 full attention pool (the configurator passes
the FP4 quant method to ``HybridLinearKVPool``). The hybrids have 8 layers,
full attention at 3 and 7, as their models interleave. nvfp4's quantizer needs
Blackwell: elsewhere its pages are random bytes (the verdict's ``write_path``
says so)."""
assert tuple(STACK_BUILDERS) == SETUPS, (tuple(STACK_BUILDERS), SETUPS)


def _quant_method(pool):
    """An FP4 pool's quant method (SGLang's MHATokenToKVPool with one), or None."""
    if getattr(pool, "is_quantized_kv_cache", False):
        return pool.quant_method
    return None


def dequantize_slots(d: DeviceLayer, side: str, slots) -> torch.Tensor:
    """(T, H, D) float32 of token ``slots`` on ``side`` (``k`` or ``v``): an
    FP4 pool through its quant method's own dequantize (nvfp4: its decode,
    below), MXFP8 from the interleaved scales."""
    payload = getattr(d.pool, f"{side}_buffer")[d.layer]
    scales = getattr(d.pool, f"{side}_scale_buffer")[d.layer]
    method = _quant_method(d.pool)
    if method is None:
        return dequantize(payload[slots], token_scales(scales, slots))
    if method.name == "nvfp4":
        global_scale = getattr(method, f"{side}_scales_float")[d.layer]
        return nvfp4_decode(payload[slots], scales[slots], global_scale)
    return method.dequantize_kv_tensor(payload[slots], scales[slots], d.layer).float()


def nvfp4_decode(payload, block_scales, global_scale: float) -> torch.Tensor:
    """SGLang's SM90 nvfp4 decode (``NVFP4KVQuantizeUtil.dequantize``'s torch
    fallback: low nibble first, its E2M1 table, e4m3 block scales per 16,
    then the global scale) on any device: the CPU has no SM90 branch, and
    flashinfer's decode needs Blackwell."""
    from sglang.srt.layers.quantization.kvfp4_tensor import E2M1_VALUES

    nibbles = torch.stack((payload & 0x0F, payload >> 4), dim=-1).flatten(-2)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=payload.device)
    scale = block_scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    return values[nibbles.long()] * scale * global_scale


def within_quantization_error(
    d: DeviceLayer, x: torch.Tensor, deq: torch.Tensor, scales, slots
) -> bool:
    """|x - deq| within rounding: for MXFP8 half an e4m3 step (2^-4 relative,
    2^-10 of the block scale near 0); for fp4_mx_block16 half the widest e2m1
    step (4 to 6), one block scale 2^(e - 127), blocks of 16 across the heads."""
    if _quant_method(d.pool) is None:
        block = torch.exp2(token_scales(scales, slots).to(torch.float32) - 127.0)
        block = block.repeat_interleave(32, dim=-1)
        bound = x.abs() * 2.0**-4 + block * 2.0**-10
    else:
        block = torch.exp2(scales[slots].to(torch.float32) - 127.0)
        bound = block.repeat_interleave(16, dim=-1).view(x.shape) * (1 + 2.0**-8)
    return bool(((x - deq).abs() <= bound).all())


def run_modes(
    modes=MODES,
    timeout: float = 600,
    l3: tuple[str, ...] = (),
    l3_config: dict | None = None,
    setups: tuple[str, ...] = ("kv",),
) -> dict[str, Verdict]:
    """Each mode in a fresh process running every setup in ``setups``, then
    mode ours once per L3 backend in ``l3``; the verdicts by key: the mode for
    setup ``kv`` (``ours``), ``setup:mode`` for the others (``draft:ours``),
    ``ours+file`` for L3. ``l3_config`` (``L3_CONFIG_ENV``) is the extra
    config of every backend in ``l3``: pass it for those that need one
    (mooncake, seaweedfs, dynamic), in a call of their own."""
    import subprocess

    runs = {mode: ["--mode", mode, "--setup", ",".join(setups)] for mode in modes}
    runs.update({f"ours+{b}": ["--mode", "ours", "--l3", b] for b in l3})
    env = dict(os.environ)
    if l3_config is not None:
        env[L3_CONFIG_ENV] = json.dumps(l3_config)
    verdicts = {}
    for key, argv in runs.items():
        done = subprocess.run(
            [sys.executable, script("e2e"), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
        if done.returncode:
            verdicts[key] = Verdict(mode=key, error=done.stderr.strip()[-2000:])
            continue
        for line in done.stdout.strip().splitlines():
            if line.startswith("{"):
                v = msgspec.json.decode(line, type=Verdict)
                verdicts[key if key.startswith("ours+") else v.key] = v
    return verdicts


def run_setups(mode: str, setups, l3: str | None = None, device: str = "cuda"):
    """One verdict per setup, in this process; a setup that raises gives a
    verdict with its error (SGLang's own class refuses some setups)."""
    import traceback

    for setup in setups:
        try:
            yield msgspec.convert(run(mode, l3, setup, device), Verdict)
        except Exception as exc:
            traceback.print_exc()
            yield Verdict(mode=mode, setup=setup, error=f"{type(exc).__name__}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="ours")
    parser.add_argument(
        "--setup",
        default="kv",
        help=f"comma-separated, from {', '.join(SETUPS)} (default kv)",
    )
    parser.add_argument(
        "--l3",
        choices=L3_BACKENDS,
        help="then L2 -> L3 -> L2 -> device through the controller (mode ours, setup kv)",
    )
    args = parser.parse_args()
    setups = args.setup.split(",")
    if unknown := set(setups) - set(SETUPS):
        parser.error(
            f"argument --setup: unknown {sorted(unknown)}; of {', '.join(SETUPS)}"
        )
    if args.l3 and (args.mode != "ours" or setups != ["kv"]):
        parser.error("--l3 needs --mode ours and --setup kv")
    interrupt_on_sigterm()
    if not torch.cuda.is_available():
        for setup in setups:
            skipped = Verdict(mode=args.mode, setup=setup, skipped="no CUDA GPU")
            print(msgspec.json.encode(skipped).decode())
        return
    for verdict in run_setups(args.mode, setups, args.l3):
        print(msgspec.json.encode(verdict).decode(), flush=True)
