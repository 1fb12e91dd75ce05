"""A cache hit's time to first token, as SGLang's forward pass consumes it.

SGLang's controller issues a hit's loads layer by layer on its load stream,
an event recorded after each layer (``L2TransferEngine.submit_host_to_device``
with ``LayerLoadingEvent.complete``), and the forward pass waits for layer
i's event when its attention reads layer i's KV (``wait_until``). Here the
same engine issues each host pool's loads, and the forward pass is a
Llama-8B-like decoder layer at M new tokens (``bench.LAYER_GEMMS``) whose
attention stand-in reads the layer's loaded pages. The time to first token
runs from the hit's start event to the forward's end on the compute stream.
``raw`` loads each layer's bytes (payload and scales) with one contiguous
pinned copy on the load stream, ``device`` is the same hit with its pages
already on the GPU (no loads). ``beside``: another batch decodes on a third
stream meanwhile.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from sglang_mxfp8_hicache.tools import bench
from sglang_mxfp8_hicache.tools.pools import (
    IO_BACKEND,
    PAGE_SIZE,
    build_device_pool,
    build_host_pool,
    host_indices_for,
    page_token_indices,
)
from sglang_mxfp8_hicache.tools.results import HitRow

Loads = Callable[[torch.cuda.Event, list[torch.cuda.Event]], None]
"""Issues a hit's loads after the start event, recording layer i's event
once layer i is on the GPU."""


class Forward:
    """The forward pass of a hit of ``tokens`` new tokens over the cached
    ``device_pages``: per layer the QKV GEMM, the wait for the layer's load,
    an attention stand-in that reads every byte of the layer's pages (payload
    and scales, K and V), then the O, gate/up and down GEMMs."""

    def __init__(self, device_pool, device_pages: torch.Tensor, tokens: int) -> None:
        device = device_pool.device
        bf16 = dict(device=device, dtype=torch.bfloat16)
        self._weights = [torch.randn(k, m, **bf16) / 64 for k, m in bench.LAYER_GEMMS]
        self._inputs = [torch.randn(tokens, k, **bf16) for k, _ in bench.LAYER_GEMMS]
        rows = device_pool.size // PAGE_SIZE + 1
        self._pages = device_pages.to(device)
        self._kv = [
            [t.view(torch.uint8).view(rows, -1) for t in tensors]
            for tensors in zip(
                device_pool.k_buffer,
                device_pool.k_scale_buffer,
                device_pool.v_buffer,
                device_pool.v_scale_buffer,
                strict=True,
            )
        ]
        self.layers = len(self._kv)

    def run(self, ready: list[torch.cuda.Event] | None, waits: list) -> None:
        """Every layer on the current stream; ``waits[i]``: events around
        layer i's wait for ``ready[i]`` (none without loads)."""
        stream = torch.cuda.current_stream()
        (x_qkv, *x_rest), (w_qkv, *w_rest) = self._inputs, self._weights
        for layer, (before, after) in enumerate(waits):
            torch.matmul(x_qkv, w_qkv)
            before.record()
            if ready is not None:
                stream.wait_event(ready[layer])
            after.record()
            for rows in self._kv[layer]:
                rows.index_select(0, self._pages).sum(dtype=torch.int32)
            for x_in, w in zip(x_rest, w_rest, strict=True):
                torch.matmul(x_in, w)


def engine_loads(host_pool, device_pool, host_indices, device_indices) -> Loads:
    """The pool's loads through SGLang's own L2 engine, as its controller
    submits a hit (``HiCacheController.start_loading``)."""
    from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine

    engine = L2TransferEngine(IO_BACKEND)
    transfer = L2Transfer(host_pool, device_pool, host_indices, device_indices)

    def issue(start: torch.cuda.Event, ready: list[torch.cuda.Event]) -> None:
        engine.submit_host_to_device(
            [transfer],
            transfer_layer_id_max=len(ready),
            start_event=start,
            on_layer_done=lambda layer: ready[layer].record(),
        )

    return issue


def raw_loads(layers: int, layer_bytes: int, device) -> Loads:
    """One pinned contiguous copy of each layer's bytes, on a load stream."""
    host = torch.empty(layers, layer_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    on_device = torch.empty_like(host, device=device)
    stream = torch.cuda.Stream(device)

    def issue(start: torch.cuda.Event, ready: list[torch.cuda.Event]) -> None:
        with torch.cuda.stream(stream):
            stream.wait_event(start)
            for layer, event in enumerate(ready):
                on_device[layer].copy_(host[layer], non_blocking=True)
                event.record()

    return issue


def _time_hits(
    forward: Forward,
    loads: dict[str, Loads | None],
    *,
    warmup: int,
    repeat: int,
    beside: Callable[[], None] | None,
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, float]]:
    """Each column's median time to first token (ms), median wait per layer
    and median CPU time issuing its loads (ms), its columns run once a round
    in a seeded random order."""
    timed = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    ttft: dict[str, list[float]] = {name: [] for name in loads}
    waits: dict[str, list[list[float]]] = {name: [] for name in loads}
    issued: dict[str, list[float]] = {name: [] for name in loads}
    items, order = list(loads.items()), random.Random(0)
    third = torch.cuda.Stream()
    for round_ in range(warmup + repeat):
        order.shuffle(items)
        for name, issue in items:
            torch.cuda.synchronize()
            start, end = timed(), timed()
            ready = [torch.cuda.Event() for _ in range(forward.layers)]
            around = [(timed(), timed()) for _ in range(forward.layers)]
            if beside is not None:
                third.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(third):
                    beside()
            start.record()
            began = time.perf_counter()
            if issue is not None:
                issue(start, ready)
            issue_ms = 1e3 * (time.perf_counter() - began)
            forward.run(ready if issue is not None else None, around)
            end.record()
            end.synchronize()
            if round_ >= warmup:
                ttft[name].append(start.elapsed_time(end))
                waits[name].append([a.elapsed_time(b) for a, b in around])
                issued[name].append(issue_ms)
        torch.cuda.synchronize()
    median = statistics.median
    return (
        {name: median(times) for name, times in ttft.items()},
        {
            name: [median(layer) for layer in zip(*w, strict=True)]
            for name, w in waits.items()
        },
        {name: median(times) for name, times in issued.items()},
    )


def bench_hits(
    geometry: tuple[int, int, int],
    pages_list: Sequence[int],
    tokens_list: Sequence[int],
    *,
    classes: dict[str, type],
    warmup: int,
    repeat: int,
    beside: str | None = None,
    progress: Callable[[], None] = lambda: None,
) -> list[HitRow]:
    """Every batch of pages and new tokens of one geometry: each host pool of
    ``classes`` backs up the batch's random device pages to random host
    pages once, then every round loads them back during the hit."""
    heads, head_dim, layers = geometry
    device_pool = build_device_pool(
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        pages=max(pages_list),
        device="cuda",
    )
    hosts = {}
    rows = []
    other_batch = None
    if beside is not None:  # two decode passes of the same model's layers
        loop = bench.beside_loops(device_pool.device)[beside]
        other_batch = functools.partial(loop, 2 * layers)
    try:
        for name, cls in classes.items():
            hosts[name] = build_host_pool(
                device_pool, cls, host_to_device_ratio=1.0, pin_memory=True
            )
        page_bytes = bench.bytes_per_page(heads, head_dim, layers)
        gen = torch.Generator().manual_seed(0)
        for pages in pages_list:
            device_pages = torch.randperm(pages, generator=gen) + 1
            host_pages = torch.randperm(pages, generator=gen)
            device_tokens = page_token_indices(device_pages).cuda()
            host_tokens = page_token_indices(host_pages)
            loads: dict[str, Loads | None] = {}
            for name, host in hosts.items():
                backup = host_indices_for(host, host_tokens, "cuda", backup=True)
                host.backup_from_device_all_layer(
                    device_pool, backup, device_tokens, IO_BACKEND
                )
                load = host_indices_for(host, host_tokens, "cuda", backup=False)
                loads[name] = engine_loads(host, device_pool, load, device_tokens)
            loads["raw"] = raw_loads(layers, pages * page_bytes // layers, "cuda")
            loads["device"] = None
            for tokens in tokens_list:
                forward = Forward(device_pool, device_pages, tokens)
                ttft, waits, issued = _time_hits(
                    forward,
                    loads,
                    warmup=warmup,
                    repeat=repeat,
                    beside=other_batch,
                )
                cell = (pages, tokens, ttft, waits, issued, beside)
                rows.append(HitRow(*geometry, *cell))
                progress()
            del loads
    finally:
        for host in hosts.values():
            host.destroy()
    return rows


def run(
    geometries: Sequence[tuple[int, int, int]],
    pages_list: Sequence[int],
    tokens_list: Sequence[int],
    *,
    classes: dict[str, type],
    warmup: int,
    repeat: int,
    beside: Sequence[str] = (),
) -> list[HitRow]:
    from tqdm import tqdm  # SGLang's dependency

    modes = list(beside) or [None]
    fits = {g: bench.pages_that_fit(g, pages_list) for g in geometries}
    cases = sum(len(p) for p in fits.values()) * len(tokens_list) * len(modes)
    bar = tqdm(total=cases, desc="bench --hit", unit="case")
    rows = []
    for geometry, pages in fits.items():
        for mode in modes:
            if pages:
                rows += bench_hits(
                    geometry,
                    pages,
                    tokens_list,
                    classes=classes,
                    warmup=warmup,
                    repeat=repeat,
                    beside=mode,
                    progress=bar.update,
                )
            torch.cuda.empty_cache()
    bar.close()
    return rows


def table(rows: list[HitRow]) -> tuple[list[str], list[list[str]]]:
    names = list(dict.fromkeys(name for row in rows for name in row.ttft_ms))
    headers = ["KVxDxL", "pages", "M", "beside", *(f"{n} ms" for n in names)]
    headers += ["ours/raw", "ours/device", "ours L0 wait", "ours max wait"]
    headers += ["ours issue ms", "missed"]
    body = []
    for row in rows:
        waits = row.waits_ms.get("ours") or [0.0]
        body.append(
            [
                row.geometry,
                str(row.pages),
                str(row.tokens),
                row.beside or "-",
                *(bench._fmt(row.ttft_ms.get(n)) for n in names),
                bench._fmt(row.ratio("ours", "raw")),
                bench._fmt(row.ratio("ours", "device")),
                bench._fmt(waits[0]),
                bench._fmt(max(waits)),
                bench._fmt(row.issue_ms.get("ours")),
                " ".join(row.missed()) or "-",
            ]
        )
    return headers, body
