"""Side-by-side timing of HiCache host pools on one GPU, in one process.

For each geometry (KV heads x head_dim x layers, page_size 128) and batch of
pages, both directions are timed with CUDA events (warm-up, then the median of
``repeat`` runs) for:

- ``ours``: :class:`MHATokenToKVPoolMXFP8Host`;
- ``sglang``: SGLang's own MXFP8 host pool, when the installed SGLang has one;
- ``payload``: SGLang's ``MHATokenToKVPoolHost`` on the same device pool, which
  moves the fp8 payload only (the floor any MXFP8 pool is compared with);
- ``raw``: one pinned ``copy_`` of as many bytes as payload plus scales;
- on request, the ablations of :mod:`.ablations`: ours with one design choice
  undone, to measure what that choice is worth.

A backup is one ``backup_from_device_all_layer`` call with CPU host indices, as
SGLang's controller hands them to a pool with the staged write-back; a load is
one ``load_to_device_per_layer`` call per layer with GPU indices, as SGLang's
transfer engine makes them. For a load the bench also records when layer 0's
work completes: the event SGLang's forward pass waits on before layer 0.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.ablations import ABLATIONS
from sglang_mxfp8_hicache.tools.selfcheck import (
    IO_BACKEND,
    PAGE_SIZE,
    build_device_pool,
    build_host_pool,
    page_token_indices,
)

# (KV heads, head_dim, layers)
GEOMETRIES = ((1, 128, 8), (8, 128, 8), (32, 128, 8), (8, 128, 80))
PAGES = (1, 4, 16, 64, 256, 1024)
# Largest device pool (payload and scales) a geometry gets; larger batches are
# skipped, since every column pins a host pool of the same size.
MAX_POOL_BYTES = 10 * 2**30
# Goals: (largest ratio to payload-only, for batches from `pages` up).
BACKUP_GOALS = ((64, 1.04), (1, 1.15))
LOAD_GOALS = ((64, 1.05), (16, 1.25), (1, 1.5))
LAYER0_GOALS = ((64, 1.10),)


@dataclass
class Row:
    heads: int
    head_dim: int
    layers: int
    pages: int
    direction: str
    ms: dict[str, float]
    layer0_ms: dict[str, float] = field(default_factory=dict)
    """Loads: time until layer 0's work is done, per column."""

    @property
    def geometry(self) -> str:
        return f"{self.heads}x{self.head_dim}x{self.layers}"

    def ratio(self, name: str, to: str = "payload", *, layer0: bool = False):
        ms = self.layer0_ms if layer0 else self.ms
        if name not in ms or to not in ms:
            return None
        return ms[name] / ms[to]

    def goal(self, *, layer0: bool = False) -> float | None:
        goals = (
            LAYER0_GOALS
            if layer0
            else BACKUP_GOALS
            if self.direction == "backup"
            else LOAD_GOALS
        )
        return next((limit for pages, limit in goals if self.pages >= pages), None)

    def meets(self, *, layer0: bool) -> bool:
        ours = self.ratio("ours", layer0=layer0)
        goal = self.goal(layer0=layer0)
        not_slower = self.ratio("ours", "sglang", layer0=layer0)
        return (
            ours is not None
            and (goal is None or ours <= goal)
            and (not_slower is None or not_slower <= 1.0)
        )

    def meets_goal(self) -> bool:
        """Ours within the payload-only goal and not slower than SGLang's class;
        for a load, the same for layer 0's wait."""
        return self.meets(layer0=False) and (
            not self.layer0_ms or self.meets(layer0=True)
        )


def sglang_mxfp8_host_cls() -> type | None:
    try:
        from sglang.srt.mem_cache.pool_host.mha_mxfp8 import (
            MHATokenToKVPoolMXFP8Host as SGLangMXFP8Host,
        )
    except ImportError:
        return None
    return SGLangMXFP8Host


Transfer = Callable[[Callable[[], None]], object]
"""One transfer; it calls its argument once layer 0's work is issued (loads)."""


def _time_all(
    fns: dict[str, Transfer], *, warmup: int, repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of each transfer, whole and to layer 0. The runs go round-robin
    over the columns, each round starting one column later, so drift and the
    position in a round hit every column alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn(lambda: None)
    torch.cuda.synchronize()
    items = list(fns.items())
    whole: dict[str, list[float]] = {name: [] for name in fns}
    layer0: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeat):
        shift = round_ % len(items)
        for name, fn in items[shift:] + items[:shift]:
            start, first, end = (torch.cuda.Event(enable_timing=True) for _ in "123")
            marked: list[None] = []

            def mark(event=first, marked=marked) -> None:
                marked.append(event.record())

            start.record()
            fn(mark)
            end.record()
            end.synchronize()
            whole[name].append(start.elapsed_time(end))
            if marked:
                layer0[name].append(start.elapsed_time(first))
    median = {name: statistics.median(t) for name, t in whole.items()}
    median0 = {name: statistics.median(t) for name, t in layer0.items() if t}
    return median, median0


def _transfers(
    device_pool,
    hosts: dict,
    pages: int,
    layers: int,
    bytes_per_page: int,
    gen: torch.Generator,
) -> dict[str, dict[str, Transfer]]:
    """One backup and one all-layer load per pool, over the same random pages."""
    device_pages = torch.randperm(device_pool.size // PAGE_SIZE, generator=gen) + 1
    host_pages = torch.randperm(hosts["payload"].page_num, generator=gen)
    device_tokens = page_token_indices(device_pages[:pages]).cuda()
    host_tokens = page_token_indices(host_pages[:pages])
    host_tokens_gpu = host_tokens.cuda()
    raw_device = torch.empty(pages * bytes_per_page, dtype=torch.uint8, device="cuda")
    raw_host = torch.empty_like(raw_device, device="cpu", pin_memory=True)

    def backup(host) -> Transfer:
        return lambda mark: host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens, IO_BACKEND
        )

    def load(host) -> Transfer:
        def all_layers(mark):
            for layer in range(layers):
                host.load_to_device_per_layer(
                    device_pool, host_tokens_gpu, device_tokens, layer, IO_BACKEND
                )
                if layer == 0:
                    mark()

        return all_layers

    return {
        "backup": {
            **{name: backup(host) for name, host in hosts.items()},
            "raw": lambda mark: raw_host.copy_(raw_device, non_blocking=True),
        },
        "load": {
            **{name: load(host) for name, host in hosts.items()},
            "raw": lambda mark: raw_device.copy_(raw_host, non_blocking=True),
        },
    }


def host_classes(ablations: Sequence[str] = ()) -> dict[str, type]:
    """The pools of one run, by column name, in table order."""
    classes = {
        "ours": MHATokenToKVPoolMXFP8Host,
        **{name: ABLATIONS[name] for name in ablations},
        "sglang": sglang_mxfp8_host_cls(),
        "payload": MHATokenToKVPoolHost,
    }
    return {name: cls for name, cls in classes.items() if cls is not None}


def bytes_per_page(heads: int, head_dim: int, layers: int) -> int:
    """K and V, fp8 payload and one scale byte per 32, every layer: one page."""
    return 2 * layers * PAGE_SIZE * heads * (head_dim + head_dim // 32)


def pages_that_fit(geometry: tuple[int, int, int], pages_list) -> tuple[int, ...]:
    page_bytes = bytes_per_page(*geometry)
    return tuple(p for p in pages_list if p * page_bytes <= MAX_POOL_BYTES)


def bench_geometry(
    geometry: tuple[int, int, int],
    pages_list: tuple[int, ...],
    *,
    classes: dict[str, type],
    warmup: int,
    repeat: int,
    progress: Callable[[], None],
) -> list[Row]:
    heads, head_dim, layers = geometry
    device_pool = build_device_pool(
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        pages=max(pages_list),
        device="cuda",
    )
    hosts = {
        name: build_host_pool(
            device_pool, cls, host_to_device_ratio=1.0, pin_memory=True
        )
        for name, cls in classes.items()
    }
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        for pages in pages_list:
            for direction, fns in _transfers(
                device_pool, hosts, pages, layers, bytes_per_page(*geometry), gen
            ).items():
                ms, layer0_ms = _time_all(fns, warmup=warmup, repeat=repeat)
                rows.append(Row(*geometry, pages, direction, ms, layer0_ms))
                progress()
    finally:
        for host in hosts.values():
            host.destroy()
    return rows


def run(
    geometries: Sequence[tuple[int, int, int]] = GEOMETRIES,
    pages_list: Sequence[int] = PAGES,
    *,
    classes: dict[str, type] | None = None,
    warmup: int = 3,
    repeat: int = 20,
) -> list[Row]:
    """Every geometry at every batch that fits :data:`MAX_POOL_BYTES`."""
    classes = classes or host_classes()
    plan = [(g, pages_that_fit(g, pages_list)) for g in geometries]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with sglang
        tqdm = None
    total = sum(2 * len(pages) for _, pages in plan)
    bar = tqdm(total=total, desc="bench", unit="case") if tqdm else None
    rows = []
    for geometry, pages in plan:
        if not pages:
            continue
        rows += bench_geometry(
            geometry,
            pages,
            classes=classes,
            warmup=warmup,
            repeat=repeat,
            progress=(bar.update if bar else lambda: None),
        )
        torch.cuda.empty_cache()
    if bar:
        bar.close()
    return rows


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Whole transfers, both directions."""
    names = list(dict.fromkeys(name for r in rows for name in r.ms))
    headers = ["KVxDxL", "pages", "dir", *(f"{n} ms" for n in names)]
    headers += ["ours/payload", "sglang/payload", "ours/sglang", "goal", "met"]
    body = [
        [
            r.geometry,
            str(r.pages),
            r.direction,
            *(_fmt(r.ms.get(n)) for n in names),
            _fmt(r.ratio("ours")),
            _fmt(r.ratio("sglang")),
            _fmt(r.ratio("ours", "sglang")),
            f"<={r.goal()}",
            "yes" if r.meets_goal() else "NO",
        ]
        for r in rows
    ]
    return headers, body


def layer0_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Loads: time until layer 0's work is done."""
    loads = [r for r in rows if r.layer0_ms]
    names = list(dict.fromkeys(name for r in loads for name in r.layer0_ms))
    headers = ["KVxDxL", "pages", *(f"{n} L0 ms" for n in names)]
    headers += ["ours/payload", "ours/sglang", "goal", "met"]
    body = [
        [
            r.geometry,
            str(r.pages),
            *(_fmt(r.layer0_ms.get(n)) for n in names),
            _fmt(r.ratio("ours", layer0=True)),
            _fmt(r.ratio("ours", "sglang", layer0=True)),
            "<=sglang"
            if r.goal(layer0=True) is None
            else f"<={r.goal(layer0=True)}, <=sglang",
            "yes" if r.meets(layer0=True) else "NO",
        ]
        for r in loads
    ]
    return headers, body


def to_json(rows: list[Row]) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return json.dumps(
        {
            "device": device,
            "page_size": PAGE_SIZE,
            "rows": [
                {
                    **asdict(r),
                    "goal": r.goal(),
                    "layer0_goal": r.goal(layer0=True) if r.layer0_ms else None,
                    "met": r.meets_goal(),
                }
                for r in rows
            ],
        },
        indent=1,
    )
