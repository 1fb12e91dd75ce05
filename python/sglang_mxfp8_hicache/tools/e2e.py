"""End to end on a GPU: real MXFP8 KV through SGLang's own HiCache machinery.

One mode per process, because the plugin hook is process-wide:

    python -m sglang_mxfp8_hicache.tools.e2e --mode ours     # the plugin picks our class
    python -m sglang_mxfp8_hicache.tools.e2e --mode sglang   # plugin disabled: SGLang's own class
    python -m sglang_mxfp8_hicache.tools.e2e --mode plain    # payload-only MHATokenToKVPoolHost (0.5.16-0.5.20)

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
Mooncake's configuration comes from ``SGLANG_MXFP8_HICACHE_MOONCAKE`` (the JSON
of ``--hicache-storage-backend-extra-config``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import threading

import torch

from sglang_mxfp8_hicache.tools.selfcheck import PAGE_SIZE as PAGE
from sglang_mxfp8_hicache.tools.selfcheck import (
    build_device_pool,
    device_buffers,
    fill_random,
    host_page_rows,
)

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 4, 8, 16, 128
# Different lengths, one a whole number of pages, the others not.
SEQ_LENS = (3 * PAGE, 2 * PAGE + 37, PAGE + 5, 300)
DEVICE_PAGES = 32
MODES = ("ours", "sglang", "plain")
L3_BACKENDS = ("file", "mooncake")
MOONCAKE_CONFIG_ENV = "SGLANG_MXFP8_HICACHE_MOONCAKE"
REFUSED_ATTACH = "nixl"
L3_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _publish():
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    # model_path "dummy" skips model resolution, which includes the check that
    # refuses mxfp8 off Blackwell: everything this run touches is below the
    # attention kernel. It also skips HiCache flag normalisation, so the
    # defaults it would pick are given explicitly.
    server_args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        kv_cache_dtype="mxfp8",
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_mem_layout="page_first",
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


def run(mode: str, l3: str | None = None) -> dict:
    if mode != "ours":
        from sglang_mxfp8_hicache.plugin import DISABLE_ENV

        os.environ[DISABLE_ENV] = "1"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch.distributed as dist
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.runtime_context import get_serving, reset_context

    if mode == "plain":
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        # What SGLang 0.5.16-0.5.20 pick for an MXFP8 pool. Patched where the
        # assembler looks the selector up.
        hybrid_pool_assembler.get_mha_host_pool_cls = lambda info: MHATokenToKVPoolHost

    _publish()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0
    )
    group = dist.group.WORLD
    device = "cuda"
    req_to_token_pool = ReqToTokenPool(
        size=len(SEQ_LENS),
        max_context_len=4096,
        device=device,
        enable_memory_saver=False,
    )
    kv_pool = build_device_pool(
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        pages=DEVICE_PAGES,
        device=device,
    )
    allocator = PagedTokenToKVPoolAllocator(
        kv_pool.size, PAGE, torch.int64, device, kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_cp_cache_group=group,
        attn_tp_cache_group=group,
        pp_cache_group=group,
    )
    host_group, controller = hybrid_pool_assembler.build_kv_only_stack(
        params=params,
        kv_pool=kv_pool,
        full_layer_mapping={i: i for i in range(LAYERS)},
        load_cache_event=threading.Event(),
        storage_backend=None,
        use_mla=False,
        model_name=get_serving().served_model_name,
    )
    stream = torch.cuda.current_stream()
    controller.write_fence_stream = controller.load_fence_stream = stream
    host_pool = host_group.get_pool(PoolName.KV)
    verdict = {
        "mode": mode,
        "host_class": f"{type(host_pool).__module__}.{type(host_pool).__qualname__}",
        "seq_lens": list(SEQ_LENS),
        "layers": LAYERS,
        "geometry": f"{KV_HEADS}x{HEAD_DIM}",
    }
    try:
        verdict.update(_exercise(kv_pool, allocator, controller, RadixAttention, l3))
    finally:
        torch.cuda.synchronize()
        controller.reset()
        host_group.destroy()
        dist.destroy_process_group()
        reset_context()
    return verdict


def _exercise(kv_pool, allocator, controller, RadixAttention, l3) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1234)
    layers = [
        RadixAttention(Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, layer_id=i)
        for i in range(LAYERS)
    ]
    # 1. Real MXFP8 KV, written by SGLang's own quantize-and-store path.
    seq_slots, tokens, bf16 = [], [], []
    for length in SEQ_LENS:
        slots = allocator.alloc(-(-length // PAGE) * PAGE)
        seq_slots.append(slots)
        tokens.append(slots[:length])
    src_slots = torch.cat(seq_slots)
    written = torch.cat(tokens)
    write_path = "set_kv_buffer (SGLang's fused MXFP8 quantize and store, Triton)"
    try:
        for layer in layers:
            k, v = (
                torch.randn(
                    len(written), KV_HEADS, HEAD_DIM, generator=gen, device="cuda"
                )
                .mul_(3.0)
                .to(torch.bfloat16)
                for _ in range(2)
            )
            kv_pool.set_kv_buffer(layer, written, k, v)
            bf16.append((k, v))
    except Exception as exc:  # the fallback the issue allows, with the reason kept
        write_path = f"random payload and valid scales (set_kv_buffer failed: {exc!r})"
        bf16 = []
        for buf in (*kv_pool.k_buffer, *kv_pool.v_buffer):
            _u8(buf).copy_(
                torch.randint(
                    0, 0x7E, buf.shape, dtype=torch.uint8, generator=gen, device="cuda"
                )
            )
        for buf in (*kv_pool.k_scale_buffer, *kv_pool.v_scale_buffer):
            _u8(buf).copy_(
                torch.randint(
                    100, 140, buf.shape, dtype=torch.uint8, generator=gen, device="cuda"
                )
            )
    torch.cuda.synchronize()

    def snapshot(slots: torch.Tensor) -> list[torch.Tensor]:
        pages = slots[::PAGE] // PAGE
        return [
            _u8(buf[i])[index].clone()
            for i in range(LAYERS)
            for buf, index in (
                (kv_pool.k_buffer, slots),
                (kv_pool.v_buffer, slots),
                (kv_pool.k_scale_buffer, pages),
                (kv_pool.v_scale_buffer, pages),
            )
        ]

    def dequantized(slots: torch.Tensor) -> list[torch.Tensor]:
        return [
            dequantize(payload[i][slots], token_scales(scales[i], slots))
            for i in range(LAYERS)
            for payload, scales in (
                (kv_pool.k_buffer, kv_pool.k_scale_buffer),
                (kv_pool.v_buffer, kv_pool.v_scale_buffer),
            )
        ]

    original = snapshot(src_slots)
    original_kv = dequantized(written)
    quant_ok = bool(bf16) and all(
        within_mxfp8_error(x.float(), deq, token_scales(scales[i], written))
        for i in range(LAYERS)
        for x, deq, scales in (
            (bf16[i][0], original_kv[2 * i], kv_pool.k_scale_buffer),
            (bf16[i][1], original_kv[2 * i + 1], kv_pool.v_scale_buffer),
        )
    )

    # 2. Write back through the controller (write-through: submitted at once).
    host_indices = [
        controller.write(slots, node_id=n) for n, slots in enumerate(seq_slots)
    ]
    if any(h is None for h in host_indices):
        raise RuntimeError("the host pool had no room for the write-back")
    while controller.ack_write_queue:
        controller.ack_write_queue.pop(0).finish_event.synchronize()

    def load_and_judge(hosts: list[torch.Tensor]) -> dict:
        """Overwrite the device, load ``hosts`` into new device pages through
        the controller; what came back, against the originals."""
        result, dst_seq_slots = _load_and_compare(
            kv_pool, allocator, controller, hosts, snapshot, gen
        )
        restored_kv = dequantized(
            torch.cat([d[: len(t)] for d, t in zip(dst_seq_slots, tokens, strict=True)])
        )
        diffs = [
            (a - b).abs().nan_to_num(nan=float("inf")).max().item()
            for a, b in zip(restored_kv, original_kv, strict=True)
        ]
        for slots in dst_seq_slots:
            allocator.free(slots)
        return {
            **_restored_flags(result["restored"], original),
            "dequantized_max_diff": max(diffs),
            **result,
        }

    # 3. Other device pages for the load (the originals are still allocated),
    #    every byte of the device pool overwritten, then the load.
    verdict = {
        "write_path": write_path,
        "quantized_within_mxfp8_error": quant_ok,
        **load_and_judge(host_indices),
    }
    allocator.free(src_slots)
    digest = hashlib.sha256()
    for tensor in verdict.pop("restored"):
        digest.update(tensor.cpu().numpy().tobytes())
    verdict["restored_sha256"] = digest.hexdigest()
    if l3 is not None:  # it evicts the pages from L2 itself
        verdict["l3"] = _exercise_l3(l3, controller, host_indices, load_and_judge)
    else:
        for host in host_indices:
            controller.evict_host(host)
    return verdict


def _restored_flags(restored: list, original: list) -> dict:
    """Payload and scales equal, from snapshot()'s [K, V, K scale, V scale] per layer."""
    pairs = list(zip(restored, original, strict=True))
    return {
        "payload_restored": all(
            torch.equal(a, b) for n, (a, b) in enumerate(pairs) if n % 4 < 2
        ),
        "scales_restored": all(
            torch.equal(a, b) for n, (a, b) in enumerate(pairs) if n % 4 >= 2
        ),
    }


def _load_and_compare(kv_pool, allocator, controller, host_indices, snapshot, gen):
    """Overwrite every device byte, load ``host_indices`` into new device pages
    through the controller, layer by layer on its events; what they hold now
    (snapshot()'s tensors), whether every other device page kept its bytes, and
    the new pages (the caller frees them)."""
    dst_seq_slots = [allocator.alloc(len(h)) for h in host_indices]
    dst_slots = torch.cat(dst_seq_slots)
    fill_random(device_buffers(kv_pool), gen)
    torch.cuda.synchronize()
    device_pages = kv_pool.k_buffer[0].shape[0] // PAGE
    untouched_pages = torch.ones(device_pages, dtype=torch.bool, device="cuda")
    untouched_pages[dst_slots[::PAGE] // PAGE] = False
    before_load = [
        _u8(b).reshape(device_pages, -1)[untouched_pages].clone()
        for b in device_buffers(kv_pool)
    ]
    # 4. Load through the controller, layer by layer, on its completion events.
    for host, dst in zip(host_indices, dst_seq_slots, strict=True):
        if controller.load(host, node_id=99, device_indices=dst) is None:
            raise RuntimeError("the controller refused the load")
    producer = controller.start_loading()
    controller.layer_done_counter.set_consumer(producer)
    events = controller.layer_done_counter.events[producer].load_events
    for i in range(LAYERS):
        kv_pool.get_key_buffer(
            i
        )  # the consumer's wait: current stream waits on layer i
        events[i].synchronize()
    while controller.ack_load_queue:
        controller.ack_load_queue.pop(0).finish_event.synchronize()
    controller.layer_done_counter.set_consumer(-1)
    torch.cuda.synchronize()
    after_load = [
        _u8(b).reshape(device_pages, -1)[untouched_pages]
        for b in device_buffers(kv_pool)
    ]
    untouched = all(
        torch.equal(a, b) for a, b in zip(after_load, before_load, strict=True)
    )
    result = {"restored": snapshot(dst_slots), "untouched_pages_kept": untouched}
    return result, dst_seq_slots


def _l3_extra_config(backend: str) -> dict:
    if backend == "file":
        import tempfile

        return {"file_storage_path": tempfile.mkdtemp(prefix="mxfp8-l3-")}
    config = os.environ.get(MOONCAKE_CONFIG_ENV)
    if not config:
        raise RuntimeError(
            f"--l3 mooncake needs {MOONCAKE_CONFIG_ENV}: the JSON of "
            "--hicache-storage-backend-extra-config for a running master"
        )
    return json.loads(config)


def _exercise_l3(backend, controller, host_indices, load_and_judge) -> dict:
    """L2 pages to L3 and back through the controller's storage threads."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from sglang_mxfp8_hicache.host_pool import MXFP8HiCacheConfigError

    model = "e2e-model"
    extra_config = _l3_extra_config(backend)
    # Runtime attach, SGLang's admin path: a refused backend first.
    try:
        controller.attach_storage_backend(REFUSED_ATTACH, model_name=model)
        refused = f"{REFUSED_ATTACH} was attached"
    except MXFP8HiCacheConfigError as exc:
        refused = str(exc)
    refusal_clean = not controller.enable_storage
    controller.attach_storage_backend(
        backend, model_name=model, storage_backend_extra_config=dict(extra_config)
    )
    all_host = torch.cat(host_indices)
    tokens = torch.randint(
        0, 1 << 20, (len(all_host),), generator=torch.Generator().manual_seed(7)
    ).tolist()
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    # 5. L2 -> L3 through the backup thread.
    controller.write_storage(all_host, tokens, hash_value=hashes)
    backup = controller.ack_backup_queue.get(timeout=L3_TIMEOUT_S)
    stored_tokens = backup.completed_tokens
    # 6. Out of L2: host pages freed and every host byte overwritten.
    for host in host_indices:
        controller.evict_host(host)
    host_pool = controller.storage_host_pool
    fill_random(host_page_rows(host_pool), torch.Generator().manual_seed(8))
    # 7. L3 -> L2: the hit query, the host allocation the radix cache makes,
    #    then the prefetch I/O thread.
    controller.prefetch(CacheRequestHandle(rid="e2e-l3", attempt_id=0), tokens)
    hit = controller.prefetch_hit_queue.get(timeout=L3_TIMEOUT_S)
    hit_tokens = hit.storage_hit_count
    fetched_host = controller.alloc_prefetch_host_buffers(hit, hit_tokens)
    hit.host_indices = fetched_host
    controller.prefetch_buffer.put(hit)
    fetched_tokens = 0
    while True:
        ack = controller.ack_prefetch_queue.get(timeout=L3_TIMEOUT_S)
        if ack.completed_tokens is not None:
            fetched_tokens = ack.completed_tokens
        if ack.completed_req:
            break
    # 8. L2 -> device, into yet other pages; compare with the first originals.
    lengths = [len(h) for h in host_indices]
    judged = load_and_judge(list(fetched_host.split(lengths)))
    judged.pop("restored")
    controller.evict_host(fetched_host)
    controller.detach_storage_backend()
    return {
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


def within_mxfp8_error(
    x: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor
) -> bool:
    """|x - deq| within half an e4m3 step: 2^-4 relative, 2^-10 of the block scale near 0."""
    block = torch.exp2(scales.to(torch.float32) - 127.0).repeat_interleave(32, dim=-1)
    bound = x.abs() * 2.0**-4 + block * 2.0**-10
    return bool(((x - deq).abs() <= bound).all())


def run_modes(
    modes=MODES,
    timeout: float = 600,
    l3: tuple[str, ...] = (),
    mooncake_config: dict | None = None,
) -> dict[str, dict]:
    """Each mode in a fresh process, then mode ours once per L3 backend in
    ``l3`` (keyed ``ours+file``, ...); the verdicts by key. ``mooncake_config``
    is the extra config of a running Mooncake master, for ``l3`` mooncake."""
    import subprocess

    runs = {mode: [mode] for mode in modes}
    runs.update({f"ours+{b}": ["ours", "--l3", b] for b in l3})
    env = dict(os.environ)
    if mooncake_config is not None:
        env[MOONCAKE_CONFIG_ENV] = json.dumps(mooncake_config)
    verdicts = {}
    for key, argv in runs.items():
        done = subprocess.run(
            [sys.executable, "-m", "sglang_mxfp8_hicache.tools.e2e", "--mode", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
        if done.returncode:
            verdicts[key] = {"mode": key, "error": done.stderr.strip()[-2000:]}
        else:
            verdicts[key] = json.loads(done.stdout.strip().splitlines()[-1])
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, default="ours")
    parser.add_argument(
        "--l3",
        choices=L3_BACKENDS,
        help="then L2 -> L3 -> L2 -> device through the controller (mode ours)",
    )
    args = parser.parse_args()
    if args.l3 and args.mode != "ours":
        parser.error("--l3 needs --mode ours")
    if not torch.cuda.is_available():
        print(json.dumps({"mode": args.mode, "skipped": "no CUDA GPU"}))
        return
    print(json.dumps(run(args.mode, args.l3)))


if __name__ == "__main__":
    main()
