"""A seeded soak of the host pool through the scheduler's own radix cache.

Builds the tree cache the scheduler builds for ``--enable-hierarchical-cache``
(``registry.create_tree_cache`` over ``CacheInitParams``: SGLang's paged or
SWA allocator, ``ReqToTokenPool``, assembler and ``HybridCacheController``,
with the plugin's host pool) over real device pools (``STACKS``), and drives
it as ``Scheduler.event_loop_normal`` does: requests whose token ids share
prefixes in a Zipf-like mix arrive (with L3, ``prefetch_from_storage`` at
arrival), are matched and admitted (host hits loaded back with
``init_load_back`` / ``ready_to_load_host_cache``, L3 hits through
``check_prefetch_progress``), extended, decoded token by token, checkpointed
and released, while device and host pressure evict; ``check_hicache_events``
opens every step and ``flush_pending_backups`` closes it. With L3, every
``--flush-every`` steps the device and host tiers are emptied and overwritten
(``flush_cache``), so that later hits come from L3. With ``--tp 2`` two
processes do it in step over gloo, as two scheduler ranks.

The shadow: the KV bytes of a token (payload and scales, K and V, every layer)
are a function of its whole prefix, row ``h`` of a table where ``h`` is the
prefix's rolling hash, as a model's KV is a function of its prefix (on a GPU
the rows are what SGLang's ``set_kv_buffer`` makes of random bf16 K and V;
without one, random bytes). Every prefix the cache serves (device hits, pages
loaded back from host, pages from L3) is compared with it at admission, and
every request's whole row when it finishes (pages no transfer should have
touched); sliding-window layers inside the window. A mismatch is counted, not
raised, so a run reports them all; every wait is bounded and a wait that runs
out counts as a hang.

    python test/soak.py --seconds 60 --seed 0 [--stack kv|draft|hybrid_swa]
        [--kv-cache-dtype fp4_mx_block16] [--write-policy write_back]
        [--l3 file|mooncake] [--faults ...] [--tp 2] [--core python|rust]

One process per rank (the plugin hook is process-wide); on a machine without
CUDA the kernels are emulated (``kernel_emulation``). Prints one JSON line,
:class:`SoakFigures`, per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from testkit import script

PAGE, HEAD_DIM, LAYERS = 128, 128, 4
HYBRID_FULL_LAYERS, SLIDING_WINDOW, DRAFTS = (1, 3), 2 * PAGE, 2
DEVICE_PAGES, HICACHE_RATIO = 16, 2.0
DOCUMENTS, DOCUMENT_PAGES, ZIPF = 8, 6, 1.1
MAX_RUNNING, MAX_NEW_TOKENS = 3, 40
TABLE_ROWS = 4093
"""Rows of the shadow table: a token's row is its prefix's hash modulo this."""
WAIT_S = 60.0
"""Longest any wait may take before it counts as a hang."""
FAULTS = (
    "file",
    "backend_error",
    "host_exhausted",
    "eviction_race",
    "kernel_refused",
    "node_restart",
)
"""What ``--faults`` injects while the soak runs: ``file``, stored pages of
L3 ``file`` truncated, lengthened or deleted under it; ``backend_error``, an
L3 read that raises after writing its batch's host pages, or a write that
raises; ``host_exhausted``, most of the free host pool taken for a while;
``eviction_race``, everything evictable on host and device evicted while a
load back is queued and again while it is in flight; ``kernel_refused``, one
load (after ``REFUSE_AFTER_STEPS``) whose device indices hold a page that is
not one aligned run; ``node_restart``, the Mooncake storage node killed every
``NODE_RESTART_EVERY`` steps and started again (every object it held gone)
once the master has unmounted it, ``NODE_CLIENT_TTL_S`` after its last
heartbeat, and ``NODE_DOWN_STEPS`` have passed. Each must end as a miss, a
recompute or (the refused kernel) a clean error, never as wrong bytes or a
hang."""
FAULT_EVERY, HOST_HOLD_STEPS, REFUSE_AFTER_STEPS = 7, 10, 50
NODE_RESTART_EVERY, NODE_DOWN_STEPS, NODE_CLIENT_TTL_S = 400, 10, 2


class SoakFigures(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one run did and found; written as one JSON line, read by the tests."""

    device: str
    tp_rank: int = 0
    tp_size: int = 1
    stack: str
    kv_cache_dtype: str
    tree_core: str
    write_policy: str
    l3: str | None
    host_pool: str = ""
    seed: int
    seconds: float
    wall_s: float = 0.0
    """From the cache's build to the idle check."""
    steps: int = 0
    requests_served: int = 0
    pages_backed_up: int = 0
    device_pages_evicted: int = 0
    host_pages_evicted: int = 0
    pages_loaded_from_host: int = 0
    pages_loaded_from_l3: int = 0
    pages_loaded_from_l3_after_node_restart: int = 0
    """Of those, loaded after the storage node was first started again
    (``node_restart``): the store serves again once it is back."""
    tier_flushes: int = 0
    faults: dict[str, int] = {}
    tokens_checked: int = 0
    mismatches: int = 0
    hangs: int = 0
    clean_error: str = ""
    """The error that ended the run, as it would end the scheduler (only a
    refused kernel may end one)."""
    first_mismatches: list[str] = []


@dataclass(frozen=True)
class SoakLayer:
    """One attention layer the shadow writes and checks: its device pool, its
    layer there, and whether it is a sliding-window layer (addressed through
    the allocator's full-to-SWA mapping, read only inside the window)."""

    pool: Any
    layer: int
    swa: bool = False


class TokenBytes:
    """One per-layer buffer seen as a token's bytes: a row of the payload or
    of per-token scales, or, for MXFP8, the token's scales in the
    FA4-interleaved ``(pages, H, 32, P/32, D/32)`` layout."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.raw = buffer.view(torch.uint8)
        self.interleaved = buffer.dim() == 5
        self.width = self.raw[0].numel() // (PAGE if self.interleaved else 1)

    def _index(self, slots: torch.Tensor):
        if not self.interleaved:
            return (slots,)
        offset = slots % PAGE
        return slots // PAGE, slice(None), offset % 32, offset // 32, slice(None)

    def get(self, slots: torch.Tensor) -> torch.Tensor:
        return self.raw[self._index(slots)].reshape(len(slots), self.width)

    def set(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        target = self._index(slots)
        self.raw[target] = rows.view(self.raw[target].shape)


class Shadow:
    """The bytes every token's KV must hold: for each buffer of each layer
    (K and V, payload and scales), a table of ``TABLE_ROWS`` rows. On the CPU
    the rows are random bytes written straight into the pool; with
    ``quantize`` (a GPU) they are what SGLang's own ``set_kv_buffer`` makes of
    random bf16 K and V rows, and the soak writes its KV through it."""

    def __init__(
        self, seed: int, layers: list[SoakLayer], allocator, quantize: bool
    ) -> None:
        self.layers, self.allocator = layers, allocator
        self.buffers = [
            [
                TokenBytes(buffers[d.layer])
                for buffers in (
                    d.pool.k_buffer,
                    d.pool.v_buffer,
                    d.pool.k_scale_buffer,
                    d.pool.v_scale_buffer,
                )
            ]
            for d in layers
        ]
        gen = torch.Generator().manual_seed(seed)
        device = layers[0].pool.device
        if not quantize:
            self.bf16 = None
            self.tables = [
                [
                    torch.randint(
                        0, 256, (TABLE_ROWS, b.width), dtype=torch.uint8, generator=gen
                    ).to(device)
                    for b in buffers
                ]
                for buffers in self.buffers
            ]
            return
        self.bf16 = [
            tuple(
                torch.randn(TABLE_ROWS, d.pool.head_num, d.pool.head_dim, generator=gen)
                .mul_(3.0)
                .to(device, torch.bfloat16)
                for _ in "kv"
            )
            for d in layers
        ]
        self.tables = [
            [
                torch.empty(TABLE_ROWS, b.width, dtype=torch.uint8, device=device)
                for b in buffers
            ]
            for buffers in self.buffers
        ]
        chunk = PAGE * (layers[0].pool.size // PAGE - 1)
        for first in range(0, TABLE_ROWS, chunk):
            rows = torch.arange(first, min(first + chunk, TABLE_ROWS), device=device)
            slots = rows - first + PAGE  # the pool's own slots, past page 0
            for n, d in enumerate(layers):
                self._set_kv_buffer(n, d, slots, rows)
                for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                    table[rows] = b.get(slots)

    def _set_kv_buffer(self, n: int, d: SoakLayer, slots, rows) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        pool = d.pool
        layer = RadixAttention(
            pool.head_num,
            pool.head_dim,
            pool.head_dim**-0.5,
            pool.head_num,
            layer_id=d.layer,
        )
        k, v = self.bf16[n]
        pool.set_kv_buffer(layer, slots, k[rows], v[rows])

    def snapshot(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Every buffer's bytes at full-attention ``slots``."""
        return [
            b.get(slots).clone()
            for d, buffers in zip(self.layers, self.buffers, strict=True)
            for b in buffers
            if not d.swa
        ]

    @staticmethod
    def rows(token_ids: list[int]) -> list[int]:
        """Each token's table row: the rolling hash of the prefix ending there."""
        h, out = 0, []
        for token in token_ids:
            h = (h * 1000003 + token + 1) % TABLE_ROWS
            out.append(h)
        return out

    def _slots(self, d: SoakLayer, slots: torch.Tensor) -> torch.Tensor:
        if not d.swa:
            return slots
        return self.allocator.translate_loc_from_full_to_swa(slots).long()

    def write(self, slots: torch.Tensor, rows: list[int]) -> None:
        rows_t = torch.tensor(rows, dtype=torch.long, device=slots.device)
        for n, d in enumerate(self.layers):
            space = self._slots(d, slots)
            if self.bf16 is not None:
                self._set_kv_buffer(n, d, space, rows_t)
                continue
            for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                b.set(space, table[rows_t])

    def mismatched(
        self, slots: torch.Tensor, rows: list[int], window_from: int
    ) -> list[int]:
        """The positions in ``slots`` whose bytes differ from the shadow;
        sliding-window layers from position ``window_from`` on."""
        rows_t = torch.tensor(rows, dtype=torch.long, device=slots.device)
        bad = torch.zeros(len(rows), dtype=torch.bool, device=slots.device)
        for n, d in enumerate(self.layers):
            start = window_from if d.swa else 0
            space = self._slots(d, slots[start:])
            for table, b in zip(self.tables[n], self.buffers[n], strict=True):
                bad[start:] |= (b.get(space) != table[rows_t[start:]]).any(dim=1)
        return bad.nonzero().flatten().tolist()


def build_cache(args: argparse.Namespace, device: str, l3_dir: str):
    """The tree cache the scheduler builds (``kv_cache_builder.build_kv_cache``
    then ``registry.create_tree_cache``), its allocator (which holds the
    device pools), its request pool and the layers the shadow writes."""
    import torch.distributed as dist
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    if args.payload_only:
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

        from sglang_mxfp8_hicache.tools.pools import PayloadOnlyHost

        # The control: what SGLang 0.5.16-0.5.20 pick for an MXFP8 pool.
        hybrid_pool_assembler.get_mha_host_pool_cls = lambda info: PayloadOnlyHost
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = l3_dir
    # model_path "dummy" skips model resolution and HiCache flag
    # normalisation: every flag it would settle is given.
    server_args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_hierarchical_cache=True,
        hicache_ratio=HICACHE_RATIO,
        hicache_size=0,
        hicache_mem_layout="page_first",
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
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file or tempfile.mktemp()}",
        world_size=args.tp,
        rank=args.rank,
    )
    # The scheduler's groups: tensor parallel over every rank; attention
    # context parallel and pipeline of this rank alone (each rank makes
    # every group, in one order: new_group is collective).
    group = dist.group.WORLD
    alone = [dist.new_group([rank], backend="gloo") for rank in range(args.tp)]
    if args.l3:  # L3 keys hash through a C++ extension built on first use:
        # built here, one rank at a time, not inside a storage thread that a
        # reset must join.
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        for rank in range(args.tp):
            if rank == args.rank:
                get_storage_hash_str(list(range(PAGE)), None, page_size=PAGE)
            dist.barrier()
    allocator, layers = STACKS[args.stack](args, device)
    drafts = tuple(d.pool for d in layers[LAYERS:])  # the stack's MTP drafts
    requests = ReqToTokenPool(
        size=2 * MAX_RUNNING + 2,
        max_context_len=4096,
        device=device,
        enable_memory_saver=False,
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_cp_cache_group=alone[args.rank],
        attn_tp_cache_group=group,
        pp_cache_group=alone[args.rank],
        sliding_window_size=SLIDING_WINDOW if args.stack == "hybrid_swa" else None,
        mtp_draft_device_pools=drafts,
        tree_core_backend=args.core,
    )
    cache = create_tree_cache(
        TreeCacheBuildContext(
            server_args=server_args,
            params=params,
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


class Soak:
    """The scheduler's loop over the cache, with the shadow checked."""

    def __init__(
        self, args: argparse.Namespace, device: str, l3_dir: str, mooncake=None
    ) -> None:
        """``mooncake``: the ``MooncakeLoopback`` that ``--l3 mooncake``
        runs on, when this process started it (its node can be restarted)."""
        self.started = time.monotonic()
        self.args, self.device, self.l3_dir = args, device, l3_dir
        self.mooncake, self.node_killed_at = mooncake, None
        self.rng = random.Random(args.seed)
        self.cache, self.allocator, self.requests, layers = build_cache(
            args, device, l3_dir
        )
        # One workload on every rank; each rank's heads hold their own bytes.
        self.shadow = Shadow(
            args.seed + 1000 * args.rank, layers, self.allocator, device != "cpu"
        )
        self.fault_rng = random.Random(args.seed + 7 + args.rank)
        self.controller = self.cache.cache_controller
        self.figures = SoakFigures(
            device=device,
            tp_rank=args.rank,
            tp_size=args.tp,
            stack=args.stack,
            kv_cache_dtype=args.kv_cache_dtype,
            tree_core=type(self.cache.tree_core).__name__,
            write_policy=args.write_policy,
            l3=args.l3,
            seed=args.seed,
            seconds=args.seconds,
            host_pool=type(
                self.controller.mem_pool_host.anchor_entry.host_pool
            ).__name__,
        )
        self.documents = [
            [self.rng.randrange(1, 30000) for _ in range(DOCUMENT_PAGES * PAGE)]
            for _ in range(DOCUMENTS)
        ]
        self.weights = [1 / (rank + 1) ** ZIPF for rank in range(DOCUMENTS)]
        self.waiting: list = []
        self.running: list = []
        self.arrived = 0
        self.held_host: list[tuple[int, torch.Tensor]] = []
        self.fault_lock = threading.Lock()
        self._count_transfers()
        if "backend_error" in args.faults:
            self._make_backend_fail()
        if "kernel_refused" in args.faults:
            self._make_a_load_malformed()
        if args.no_l3_writes:  # what is in L3 came from another process
            self.controller.page_set_func = lambda *args, **kwargs: False

    def _count_transfers(self) -> None:
        """Pages backed up, device and host tokens evicted, as the cache does
        them: counted on the instances, the methods themselves unchanged."""
        figures = self.figures
        host = self.controller.mem_pool_host.anchor_entry.host_pool
        backup = host.backup_from_device_all_layer

        def counted_backup(device_pool, host_indices, *rest, **kwargs):
            figures.pages_backed_up += len(host_indices) // PAGE
            return backup(device_pool, host_indices, *rest, **kwargs)

        host.backup_from_device_all_layer = counted_backup
        for name in ("evict", "evict_for_alloc"):
            evict = getattr(self.cache, name)

            def counted_evict(*args, _evict=evict, **kwargs):
                result = _evict(*args, **kwargs)
                figures.device_pages_evicted += result.num_tokens_evicted // PAGE
                return result

            setattr(self.cache, name, counted_evict)
        evict_host = self.cache.evict_host

        def counted_evict_host(*args, **kwargs):
            evicted = evict_host(*args, **kwargs)
            figures.host_pages_evicted += evicted // PAGE
            return evicted

        self.cache.evict_host = counted_evict_host

    # -- faults -----------------------------------------------------------------

    def _fault(self, kind: str) -> None:
        """Counted from the storage threads too: under a lock."""
        with self.fault_lock:
            self.figures.faults[kind] = self.figures.faults.get(kind, 0) + 1

    def _make_backend_fail(self) -> None:
        """One L3 read or write in eight raises; a read raises after the
        backend has written its batch's host pages, as a failure mid-batch."""
        controller, rng = self.controller, self.fault_rng
        get, put = controller.page_get_func, controller.page_set_func

        def failing_get(*args, **kwargs):
            hits = get(*args, **kwargs)
            if rng.random() < 1 / 8:
                self._fault("backend_error")
                raise RuntimeError("injected: L3 read failed mid-batch")
            return hits

        def failing_put(*args, **kwargs):
            if rng.random() < 1 / 8:
                self._fault("backend_error")
                raise RuntimeError("injected: L3 write failed")
            return put(*args, **kwargs)

        controller.page_get_func, controller.page_set_func = failing_get, failing_put

    def _make_a_load_malformed(self) -> None:
        """The first load after ``REFUSE_AFTER_STEPS`` gets device indices
        whose first page is its tokens in reverse (not one aligned run). The
        kernel must move no byte of that page and the pool's next transfer
        raise (made here at once: a synchronise and the check that opens every
        transfer); what the page held before is compared after."""
        from testkit.pools import synchronize

        host = self.controller.mem_pool_host.anchor_entry.host_pool
        load = host.load_to_device_per_layer
        malformed: dict[int, torch.Tensor] = {}

        def refused_load(device_pool, host_indices, device_indices, *args, **kwargs):
            if self.figures.steps < REFUSE_AFTER_STEPS or self.figures.faults.get(
                "kernel_refused"
            ):
                return load(device_pool, host_indices, device_indices, *args, **kwargs)
            if id(device_indices) not in malformed:
                bad = device_indices.clone()
                bad[:PAGE] = device_indices[:PAGE].flip(0)
                malformed[id(device_indices)] = bad
            bad = malformed[id(device_indices)]
            slots = bad[:PAGE].to(self.device).long()
            before = self.shadow.snapshot(slots)
            try:
                load(device_pool, host_indices, bad, *args, **kwargs)
                synchronize(self.device)
                host._mover.raise_if_refused()
            finally:
                if any(
                    not torch.equal(a, b)
                    for a, b in zip(before, self.shadow.snapshot(slots), strict=True)
                ):
                    self.figures.mismatches += 1
                    self.figures.first_mismatches.append(
                        "kernel_refused: the refused page was written"
                    )
                self._fault("kernel_refused")
            raise AssertionError("the malformed page was not refused")

        host.load_to_device_per_layer = refused_load

    def _race_eviction(self) -> None:
        """Everything evictable, on host and device, evicted now."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if "eviction_race" not in self.args.faults:
            return
        self.cache.evict_host(self.controller.mem_pool_host.size)
        self.cache.evict(EvictParams(num_tokens=self.allocator.size))
        self._fault("eviction_race")

    def _damage_stored_pages(self) -> None:
        """A stored page of L3 ``file`` truncated, lengthened or deleted; with
        ranks, only the last rank's pages (each rank stores its own heads)."""
        args = self.args
        if args.rank != args.tp - 1:
            return
        own = f"_{args.rank}_{args.tp}.bin"
        names = sorted(name for name in os.listdir(self.l3_dir) if name.endswith(own))
        if not names:
            return
        path = os.path.join(self.l3_dir, self.fault_rng.choice(names))
        how = self.fault_rng.choice(("truncated", "lengthened", "deleted"))
        try:
            if how == "deleted":
                os.remove(path)
            else:
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.truncate(size - 64 if how == "truncated" else size + 64)
        except FileNotFoundError:  # evicted or rewritten meanwhile
            return
        self._fault(f"file_{how}")

    def _exhaust_host(self) -> None:
        """Most of the free host pool held for ``HOST_HOLD_STEPS`` steps."""
        host = self.controller.mem_pool_host
        steps = self.figures.steps
        while self.held_host and self.held_host[0][0] <= steps:
            host.free(self.held_host.pop(0)[1])
        if not self.held_host:
            take = host.available_size() * 9 // 10 // PAGE * PAGE
            held = host.alloc(take) if take else None
            if held is not None:
                self.held_host.append((steps + HOST_HOLD_STEPS, held))
                self._fault("host_exhausted")

    def _release_host(self) -> None:
        for _, held in self.held_host:
            self.controller.mem_pool_host.free(held)
        self.held_host.clear()

    def _inject_faults(self) -> None:
        if "node_restart" in self.args.faults:
            self._restart_node()
        if self.figures.steps % FAULT_EVERY:
            return
        if "file" in self.args.faults:
            self._damage_stored_pages()
        if "host_exhausted" in self.args.faults:
            self._exhaust_host()

    def _restart_node(self) -> None:
        """The storage node SIGKILLed every ``NODE_RESTART_EVERY`` steps and
        started again (empty) once the master has unmounted it: a node that
        came back before that would find the master placing objects on its
        dead segment as well as its new one."""
        steps = self.figures.steps
        if self.node_killed_at is None and steps % NODE_RESTART_EVERY == 0:
            self.mooncake.kill_node()
            self.node_killed_at = steps
            self._fault("node_killed")
        elif self.node_killed_at is not None:
            down = steps - self.node_killed_at >= NODE_DOWN_STEPS
            if down and not self.mooncake.segments():
                self.mooncake.start_node()
                self.node_killed_at = None
                self._fault("node_restarted")

    # -- checks ---------------------------------------------------------------

    def _check(self, req, length: int, token_ids: list[int], where: str) -> None:
        """``length`` tokens of ``req``'s row against the shadow; sliding-window
        layers in the window before ``length`` only (SGLang frees a request's
        sliding-window slots behind it as it goes)."""
        if length == 0:
            return
        window_from = max(0, length - SLIDING_WINDOW)
        slots = self.requests.req_to_token[req.kv.req_pool_idx, :length].long()
        rows = self.shadow.rows(token_ids[:length])
        bad = self.shadow.mismatched(slots, rows, window_from)
        self.figures.tokens_checked += length
        if bad:
            self.figures.mismatches += len(bad)
            if len(self.figures.first_mismatches) < 10:
                self.figures.first_mismatches.append(
                    f"{req.rid} {where}: {len(bad)} of {length} tokens, first at "
                    f"position {bad[0]} (slot {int(slots[bad[0]])})"
                )

    def _agreed(self, flag: bool) -> bool:
        """``flag`` on any rank: every rank steps and waits alike, as the
        scheduler's collectives need (one clock would not be every rank's)."""
        if self.args.tp == 1:
            return flag
        import torch.distributed as dist

        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return bool(vote.item())

    def _wait(self, busy, what: str) -> None:
        """Run ``check_hicache_events`` until ``busy()`` is false, bounded."""
        deadline = time.monotonic() + WAIT_S
        while self._agreed(bool(busy())):
            self.cache.check_hicache_events()
            if self._agreed(time.monotonic() > deadline):
                self.figures.hangs += 1
                raise TimeoutError(f"{what} still busy after {WAIT_S:.0f} s")
            time.sleep(0.005)

    # -- a request's life -------------------------------------------------------

    def _arrive(self) -> None:
        """A request on a shared document prefix, and its L3 prefetch
        (``Scheduler._prefetch_kvcache``)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        rng, cache = self.rng, self.cache
        document = rng.choices(self.documents, self.weights)[0]
        shared = rng.randrange(PAGE // 2, len(document))
        own = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 2 * PAGE))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, MAX_NEW_TOKENS))
        req = Req(f"r{self.arrived}", "", array("q", document[:shared] + own), params)
        self.arrived += 1
        if cache.enable_storage:
            req.init_next_round_input(cache, cow_mamba=False)
            matched = req.prefix_len + req.host_hit_length
            if cache.is_backuped(req.last_host_node) or cache.is_root(
                req.last_host_node
            ):
                fill = req.full_untruncated_fill_ids
                end = req._compute_max_prefix_len(len(fill))
                cache.prefetch_from_storage(
                    req.cache_request_handle,
                    req.last_host_node,
                    fill[matched:end],
                    cache.get_last_hash_value(req.last_host_node),
                    None,
                    matched_prefix_tokens=fill[:matched],
                    extra_key=req.extra_key,
                    cache_salt=req.cache_salt,
                )
        self.waiting.append(req)

    def _admit(self, req, batch: list) -> bool:
        """``PrefillAdder.add_one_req`` for one request: its storage hit, its
        match, the budget with its prefix locked, the host load-back, the lock."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.cache
        if cache.enable_storage:
            if not cache.check_prefetch_progress(req.cache_request_handle):
                return False
            loaded, start = cache.pop_prefetch_loaded_span(req.cache_request_handle)
            req.storage_hit_length, req.storage_hit_start = loaded, start
            self.figures.pages_loaded_from_l3 += loaded // PAGE
            if self.figures.faults.get("node_restarted"):
                self.figures.pages_loaded_from_l3_after_node_restart += loaded // PAGE
        req.init_next_round_input(cache)
        fill = len(req.full_untruncated_fill_ids)
        need = fill - req.prefix_len + req.sampling_params.max_new_tokens + PAGE
        need += sum(
            r.sampling_params.max_new_tokens - len(r.output_ids) + PAGE
            for r in self.running + batch
        )
        need += sum(r.extend_end - r.prefix_len for r in batch)
        probe = cache.lock(req.last_node)
        try:
            if self.allocator.available_size() + cache.evictable_size() < need:
                return False
            if req.needs_host_load_back():
                host_lock = cache.inc_host_lock_ref(req.best_match_node).to_dec_params()
                lock = cache.lock(req.best_match_node)
                try:
                    loaded = cache.init_load_back(
                        InitLoadBackParams(
                            best_match_node=req.best_match_node,
                            host_hit_length=req.host_hit_length,
                            req=req,
                        )
                    )
                finally:
                    cache.unlock(lock)
                    cache.dec_host_lock_ref(req.best_match_node, host_lock)
                req.host_loaded_length, req.last_node = loaded
                req.prefix_len += req.host_loaded_length
                req.kv.cache_protected_len = req.prefix_len
                self.figures.pages_loaded_from_host += req.host_loaded_length // PAGE
            req.extend_end = fill
            req.lock = cache.lock(req.last_node)
            if req.host_loaded_length:
                self._race_eviction()  # the load is queued
        finally:
            cache.unlock(probe)
        cache.finish_storage_prefetch_admission(
            req.cache_request_handle,
            fulfilled_tokens=req.fulfilled_storage_hit_len(req.prefix_len),
            reason=None,
        )
        return True

    def _allocate_extend(self, req) -> torch.Tensor:
        """``allocation.alloc_for_extend`` for one request."""
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

        cache, device = self.cache, self.device
        start, end = req.prefix_len, req.extend_end
        prefix = (
            cache.prefix_device_indices(req)
            if start
            else torch.empty(0, dtype=torch.int64, device=device)
        )
        self.requests.alloc([req])
        last = prefix[-1:] if start else torch.full((1,), -1, device=device)

        def one(value: int) -> torch.Tensor:
            return torch.tensor([value], dtype=torch.int64)

        out = alloc_paged_token_slots_extend(
            cache,
            one(start).to(device),
            one(start),
            one(end).to(device),
            one(end),
            last,
            end - start,
        )
        row = req.kv.req_pool_idx
        self.requests.write((row, slice(0, start)), prefix)
        self.requests.write((row, slice(start, end)), out)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        return out

    def _finish(self, req) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        token_ids = list(req.origin_input_ids) + list(req.output_ids)
        self._check(req, req.kv.kv_committed_len, token_ids, "whole row at finish")
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.figures.requests_served += 1

    def _prefill(self, batch: list) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        consumer = self.cache.ready_to_load_host_cache()
        if consumer >= 0:
            self._race_eviction()  # the load is in flight
        slots = [self._allocate_extend(req) for req in batch]
        if consumer >= 0:  # the forward's layers wait on the loads
            event = self.controller.layer_done_counter.events[consumer].finish_event
            torch.get_device_module(self.device).current_stream().wait_event(event)
        for req, out in zip(batch, slots, strict=True):
            token_ids = list(req.full_untruncated_fill_ids)
            self._check(req, req.prefix_len, token_ids, "served prefix")
            rows = self.shadow.rows(token_ids)[req.prefix_len : req.extend_end]
            self.shadow.write(out, rows)
            req.output_ids.append(self.rng.randrange(1, 30000))
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self._finish(req)
            else:
                checkpoint_kv_cache(req, self.cache)
                self.running.append(req)

    def _decode(self) -> None:
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode

        device = self.device
        for req in list(self.running):
            position = req.kv.kv_committed_len
            row = req.kv.req_pool_idx
            last = self.requests.req_to_token[row, position - 1 : position].long()
            length = torch.tensor([position + 1])
            out = alloc_paged_token_slots_decode(
                self.cache, length.to(device), length, last
            )
            self.requests.write(
                (row, torch.tensor([position], device=device)), out.to(torch.int32)
            )
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
            token_ids = list(req.origin_input_ids) + list(req.output_ids)
            self.shadow.write(out, self.shadow.rows(token_ids)[position:])
            req.output_ids.append(self.rng.randrange(1, 30000))
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self.running.remove(req)
                self._finish(req)

    def _drain(self) -> None:
        """Every running request finished, the held host slots released, and
        every backup, load-back and L3 write landed."""
        for req in self.running:
            self._finish(req)
        self.running.clear()
        self._release_host()
        cache = self.cache
        self._wait(
            lambda: (
                cache.ongoing_write_through
                or cache.ongoing_load_back
                or cache.ongoing_backup
                # a reset stops the storage threads: none may be inside a
                # prefetch whose all-reduce another rank would not join
                or cache.ongoing_prefetch
            ),
            "transfers",
        )

    def _flush_tiers(self) -> None:
        """``Scheduler.flush_cache`` with L3 kept: the device and host tiers
        emptied and every byte of them overwritten, so later hits come from L3."""
        from sglang_mxfp8_hicache.tools.pools import host_page_rows
        from testkit.pools import device_buffers

        self._drain()  # the held host slots first: a reset frees every host slot
        cache = self.cache
        cache.reset()
        self.requests.clear()
        self.allocator.clear()
        for pool in {id(d.pool): d.pool for d in self.shadow.layers}.values():
            for tensor in device_buffers(pool):
                tensor.view(torch.uint8).fill_(0xEE)
        for entry in self.controller.mem_pool_host.entries:
            host_page_rows(entry.host_pool).fill_(0xDD)
        self.figures.tier_flushes += 1

    def _step(self) -> None:
        """One turn of ``event_loop_normal``: events, arrivals, a prefill batch
        or a decode step, the pending backups, then faults and tier flushes."""
        self.cache.check_hicache_events()
        while len(self.waiting) < 2 * MAX_RUNNING:
            self._arrive()
        batch: list = []
        for req in list(self.waiting):
            if len(self.running) + len(batch) >= MAX_RUNNING:
                break
            if self._admit(req, batch):
                self.waiting.remove(req)
                batch.append(req)
        if batch:
            self._prefill(batch)
        elif self.running:
            self._decode()
        self.cache.flush_pending_backups()
        self.figures.steps += 1
        self._inject_faults()
        if self.args.l3 and self.figures.steps % self.args.flush_every == 0:
            self._flush_tiers()

    def run(self) -> SoakFigures:
        deadline = time.monotonic() + self.args.seconds
        while not self._agreed(time.monotonic() >= deadline):
            try:
                self._step()
            except Exception as error:  # a refused kernel ends the scheduler
                if not self.figures.faults.get("kernel_refused") or isinstance(
                    error, AssertionError
                ):
                    raise
                self.figures.clean_error = f"{type(error).__name__}: {error}"
                self.figures.wall_s = round(time.monotonic() - self.started, 1)
                return self.figures
        self._drain()
        cache = self.cache
        # The scheduler's idle check: every device token free, evictable or held.
        leaked = self.allocator.size - (
            self.allocator.available_size()
            + cache.evictable_size()
            + cache.protected_size()
        )
        if leaked or cache.protected_size():
            self.figures.first_mismatches.append(
                f"idle check: {leaked} tokens leaked, {cache.protected_size()} protected"
            )
            self.figures.mismatches += 1
        self.figures.wall_s = round(time.monotonic() - self.started, 1)
        return self.figures

    def close(self) -> None:
        import torch.distributed as dist
        from sglang.srt.runtime_context import reset_context

        torch.get_device_module(self.device).synchronize()
        dist.barrier()
        self.cache.shutdown()  # detaches L3 first: a reset would restart its threads
        self.controller.reset()
        self.cache.release_host_resources()
        dist.barrier()
        dist.destroy_process_group()
        reset_context()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's flags, with the combinations it refuses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--write-policy",
        choices=("write_through", "write_back", "write_through_selective"),
        default="write_through",
    )
    parser.add_argument("--l3", choices=("file", "mooncake"), default=None)
    parser.add_argument(
        "--l3-config",
        help="--hicache-storage-backend-extra-config (mooncake: a running store; "
        "default: a loopback master and storage node for this run)",
    )
    parser.add_argument("--flush-every", type=int, default=40, help="steps, with --l3")
    parser.add_argument("--stack", choices=tuple(STACKS), default="kv")
    parser.add_argument(
        "--kv-cache-dtype", choices=("mxfp8", "fp4_mx_block16"), default="mxfp8"
    )
    parser.add_argument(
        "--tp", type=int, choices=(1, 2), default=1, help="ranks, one process each"
    )
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    parser.add_argument("--core", choices=("python", "rust"), default=None)
    parser.add_argument("--heads", type=int, default=2, help="KV heads (geometry)")
    parser.add_argument(
        "--l3-dir", help="the L3 file store, kept (default: a fresh one, removed)"
    )
    parser.add_argument(
        "--no-l3-writes",
        action="store_true",
        help="store nothing: every L3 hit is another process's page",
    )
    parser.add_argument(
        "--faults",
        type=lambda text: tuple(kind for kind in text.split(",") if kind),
        default=(),
        help=f"comma separated, of {', '.join(FAULTS)}",
    )
    parser.add_argument(
        "--payload-only",
        action="store_true",
        help="the control: SGLang's host pool moving the payload alone",
    )
    args = parser.parse_args(argv)
    if unknown := set(args.faults) - set(FAULTS):
        parser.error(f"--faults: unknown {sorted(unknown)}")
    if args.l3 is None and "backend_error" in args.faults:
        parser.error("--faults backend_error needs --l3")
    if args.l3 != "file" and "file" in args.faults:
        parser.error("--faults file needs --l3 file")
    if "node_restart" in args.faults and (args.l3 != "mooncake" or args.l3_config):
        parser.error("--faults node_restart needs --l3 mooncake of this run's own")
    if args.stack == "hybrid_swa" and args.kv_cache_dtype != "mxfp8":
        parser.error("--stack hybrid_swa is built over mxfp8 pools")
    if (
        args.write_policy == "write_back"
        and args.l3
        and "host_exhausted" in args.faults
    ):
        parser.error(
            "--write-policy write_back with --l3 and --faults host_exhausted: SGLang "
            "0.5.23's write-back eviction cannot free a node whose subtree holds "
            "an L3 write's host lock while the host pool is full, yet counts it "
            "as evictable, so an admitted prefill fails with 'Prefill out of "
            "memory' (test/sglang_write_back_oom.py reproduces it)"
        )
    if args.tp > 1 and args.l3 == "mooncake":
        parser.error("--tp 2 shares one L3 --l3 file directory; not --l3 mooncake")
    if args.tp > 1 and "kernel_refused" in args.faults:
        parser.error("--faults kernel_refused ends one rank: run it with --tp 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tp > 1 and args.init_file is None:
        return launch_ranks(args, argv if argv is not None else sys.argv[1:])
    # Ranks run on the CPU (gloo, emulated kernels), as many as asked.
    device = "cuda" if torch.cuda.is_available() and args.tp == 1 else "cpu"
    with pytest.MonkeyPatch.context() as monkeypatch:
        if device == "cpu":
            from testkit.kernel_emulation import install_stack_emulation

            install_stack_emulation(monkeypatch)
        with contextlib.ExitStack() as stack:
            fresh = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-l3-"))
            mooncake = None
            if args.l3 == "mooncake" and args.l3_config is None:
                from testkit.mooncake_loopback import MooncakeLoopback

                ttl = NODE_CLIENT_TTL_S if "node_restart" in args.faults else None
                mooncake = stack.enter_context(MooncakeLoopback(client_ttl_s=ttl))
                args.l3_config = json.dumps(mooncake.extra_config())
            soak = Soak(args, device, args.l3_dir or fresh, mooncake)
            try:
                figures = soak.run()
            finally:
                soak.close()
    print(msgspec.json.encode(figures).decode(), flush=True)


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> None:
    """``--tp`` processes of this script over one gloo rendezvous file and
    one L3 directory; each prints its rank's figures, in rank order here."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="soak-ranks-") as work:
        l3_dir = args.l3_dir or os.path.join(work, "l3")
        os.makedirs(l3_dir, exist_ok=True)  # only rank 0 would make it
        ranks = [
            subprocess.Popen(
                [sys.executable, script("soak"), *argv, "--rank", str(rank)]
                + ["--init-file", os.path.join(work, "rendezvous")]
                + ([] if args.l3_dir else ["--l3-dir", l3_dir]),
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(args.tp)
        ]
        outputs = []
        for rank in ranks:
            try:
                out, _ = rank.communicate(timeout=args.seconds + 600)
            except subprocess.TimeoutExpired:
                for other in ranks:
                    other.kill()
                raise
            outputs.append(out)
    for out in outputs:
        print(out.strip().splitlines()[-1] if out.strip() else "", flush=True)
    if failed := [n for n, rank in enumerate(ranks) if rank.returncode]:
        sys.exit(f"rank(s) {failed} failed")
