"""A cache hit's time to first token, its loads issued as SGLang's controller
issues them (``L2TransferEngine.submit_host_to_device``, an event after each
layer) and a forward pass waiting for each layer's event (``wait_until``):
from the hit's start event to the forward's end on the compute stream.
``raw``: one pinned copy of each layer's bytes; ``device``: no loads."""

from __future__ import annotations

import functools
import itertools
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
"""Issues a hit's loads after the start event, layer i's event after layer i."""


class Forward:
    """A Llama-8B-like forward pass at ``tokens`` new tokens: per layer the QKV
    GEMM, the wait for its load, an attention stand-in reading every byte of
    the layer's ``device_pages``, then the O, gate/up and down GEMMs."""

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
        """Every layer; ``waits[i]``: events around layer i's wait for ``ready[i]``."""
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
    """The pool's loads through SGLang's own L2 engine (``start_loading``)."""
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
    """Per column, the medians of the time to first token, of each layer's wait
    and of the CPU's time issuing the loads (ms); a round runs every column
    once in a seeded random order."""
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
    per_layer = {n: [median(t) for t in zip(*w, strict=True)] for n, w in waits.items()}
    return _medians(ttft), per_layer, _medians(issued)


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) for name, t in times.items()}


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
    """Each batch of one geometry: each pool backs up random device pages to
    random host pages once, and every round loads them back in the hit."""
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
    beside: Sequence[str] = (),
    **timing,
) -> list[HitRow]:
    """Every geometry at every batch that fits, alone or beside each loop;
    ``timing``: :func:`bench_hits`'s ``classes``, ``warmup``, ``repeat``."""
    from tqdm import tqdm  # SGLang's dependency

    modes = list(beside) or [None]
    fits = {g: bench.pages_that_fit(g, pages_list) for g in geometries}
    cases = sum(len(p) for p in fits.values()) * len(tokens_list) * len(modes)
    bar = tqdm(total=cases, desc="bench --hit", unit="case")
    rows = []
    for (geometry, pages), mode in itertools.product(fits.items(), modes):
        if pages:
            rows += bench_hits(
                geometry, pages, tokens_list, beside=mode, progress=bar.update, **timing
            )
        torch.cuda.empty_cache()
    bar.close()
    return rows


def table(rows: list[HitRow]) -> tuple[list[str], list[list[str]]]:
    """Each column's time to first token, then ours over raw and the device
    hit, layer 0's and the longest wait of ours, and its CPU time issuing."""
    names = list(dict.fromkeys(name for row in rows for name in row.ttft_ms))
    headers = ["KVxDxL", "pages", "M", "beside", *(f"{n} ms" for n in names)]
    headers += ["ours/raw", "ours/device", "ours L0 wait", "ours max wait"]
    headers += ["ours issue ms", "missed"]
    body = []
    for r in rows:
        waits = r.waits_ms.get("ours") or [0.0]
        ours = [r.ratio("ours", "raw"), r.ratio("ours", "device"), waits[0]]
        ours += [max(waits), r.issue_ms.get("ours")]
        cells = [r.ttft_ms.get(n) for n in names] + ours
        lead = [r.geometry, str(r.pages), str(r.tokens), r.beside or "-"]
        body.append(
            lead + [bench._fmt(x) for x in cells] + [" ".join(r.missed()) or "-"]
        )
    return headers, body
