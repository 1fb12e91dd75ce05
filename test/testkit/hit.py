"""A cache hit's time to first token, its loads issued as SGLang's controller
issues them and a forward pass waiting for each layer's event.

    python test/hit.py [--geometries 8x128x32,8x128x80,1x128x80] [--pages 1,16,64,256]
        [--tokens 64,512] [--ablations load_doubling,sm] [--beside decode]
        [--warmup 3] [--repeat 20] [--json-out PATH] [--check]

Each host pool's loads go through SGLang's own L2 engine
(``L2TransferEngine.submit_host_to_device``, an event after each layer, as
``HiCacheController.start_loading`` issues them), and a forward pass on the
compute stream waits for layer i's event (``LayerDoneCounter.wait_until``),
then runs a Llama-8B-like decoder layer at M new tokens (``bench.LAYER_GEMMS``)
whose attention stand-in reads every byte of the layer's pages. The time to
first token runs from the hit's start event to the forward's end. Columns: the
pools (ours, ``--ablations``, SGLang's MXFP8 class, payload-only), ``raw`` (one
pinned copy of each layer's bytes on a load stream, an event after each) and
``device`` (the same forward pass, no loads). ``--beside decode``: another
batch decodes (two passes of the model's layers at 64 tokens) on a third
stream meanwhile. Prints each column's time, ours over raw and over the device
hit, layer 0's and the longest wait of ours, and the CPU's time issuing ours
(every load call is made before the forward pass is launched); ``--json-out``
keeps every layer's wait. Goal (``HIT_GOALS``): ours at most 1.05x raw, never
above SGLang's class or payload-only; ``--check`` exits 1 on a miss. Needs a
CUDA GPU; a bad flag is refused (exit 2) before anything runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
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
from sglang_mxfp8_hicache.tools.results import BENCH_REPEAT, BENCH_WARMUP

HIT_GEOMETRIES = ((8, 128, 32), (8, 128, 80), (1, 128, 80))
HIT_PAGES = (1, 16, 64, 256)
HIT_TOKENS = (64, 512)
"""The default cases: new tokens M of a hit whose cached prefix is the pages."""
HIT_GOALS = (("raw", 1.05), ("sglang", 1.0), ("payload", 1.0))
"""A hit's time to first token with ours at most these times each column's."""


class HitRow(msgspec.Struct):
    """One hit: ``pages`` cached, ``tokens`` new; per column the median time
    to first token (ms), the median wait of the forward pass per layer, and
    the CPU's time issuing the loads."""

    heads: int
    head_dim: int
    layers: int
    pages: int
    tokens: int
    ttft_ms: dict[str, float]
    waits_ms: dict[str, list[float]]
    issue_ms: dict[str, float]
    """The CPU's time issuing the loads, before the forward pass is launched."""
    beside: str | None = None
    """The loop another batch ran on a third stream meanwhile, or None."""

    @property
    def geometry(self) -> str:
        return f"{self.heads}x{self.head_dim}x{self.layers}"

    def ratio(self, name: str, to: str) -> float | None:
        if self.ttft_ms.get(name) is None or self.ttft_ms.get(to) is None:
            return None
        return self.ttft_ms[name] / self.ttft_ms[to]

    def missed(self) -> list[str]:
        """``HIT_GOALS`` that ours misses, as ``column<=limit``."""
        return [
            f"{to}<={limit}"
            for to, limit in HIT_GOALS
            if (ratio := self.ratio("ours", to)) is not None and ratio > limit
        ]


class HitRun(msgspec.Struct):
    """``--json-out``: the hits of one run and where it ran."""

    device: str | None
    page_size: int
    rows: list[HitRow]

    def to_json(self) -> bytes:
        rows = [
            msgspec.structs.asdict(r)
            | {"ours_over": {to: r.ratio("ours", to) for to, _ in HIT_GOALS}}
            | {"missed": r.missed()}
            for r in self.rows
        ]
        run = msgspec.structs.asdict(self) | {"rows": rows}
        return msgspec.json.format(msgspec.json.encode(run), indent=1)


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
    bar = tqdm(total=cases, desc="hit", unit="case")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from sglang_mxfp8_hicache.tools import cli
    from sglang_mxfp8_hicache.tools.ablations import ABLATIONS

    numbers = cli.comma_list(cli.positive_int, "positive integers, comma separated")
    names = cli.comma_list(cli.name, "names, comma separated")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = cli.comma_list(cli.geometry, "HEADSxHEAD_DIMxLAYERS,...")
    parser.add_argument("--geometries", type=shapes, default=HIT_GEOMETRIES)
    parser.add_argument("--pages", type=numbers, default=HIT_PAGES)
    parser.add_argument("--tokens", type=numbers, default=HIT_TOKENS)
    parser.add_argument("--ablations", type=names, default=())
    parser.add_argument("--beside", type=names, default=())
    parser.add_argument("--warmup", type=cli.non_negative_int, default=BENCH_WARMUP)
    parser.add_argument("--repeat", type=cli.positive_int, default=BENCH_REPEAT)
    parser.add_argument("--json-out", type=cli.json_out_path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    for flag, given, known in (
        ("--ablations", args.ablations, tuple(ABLATIONS)),
        ("--beside", args.beside, ("decode",)),
    ):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from sglang_mxfp8_hicache.tools import cli

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "test/hit.py: needs a CUDA GPU (the JIT transfer kernels)", file=sys.stderr
        )
        return 2
    rows = run(
        args.geometries,
        args.pages,
        args.tokens,
        classes=bench.host_classes(args.ablations),
        warmup=args.warmup,
        repeat=args.repeat,
        beside=args.beside,
    )
    device = torch.cuda.get_device_name()
    print(f"{device}, time to first token, median of {args.repeat}")
    cli.print_table(*table(rows))
    if args.json_out:
        Path(args.json_out).write_bytes(HitRun(device, PAGE_SIZE, rows).to_json())
    missed = sum(bool(row.missed()) for row in rows)
    return 1 if args.check and missed else 0
