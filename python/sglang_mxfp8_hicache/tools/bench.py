"""Side-by-side timing of HiCache host pools on one GPU, in one process.

For each geometry (KV heads x head_dim x layers), setup (:class:`Setup`) and
batch of pages, both directions are timed with CUDA events (the median after
a warm-up) for ``ours``; ``sglang``, SGLang's own MXFP8 host pool;
``payload``, SGLang's MHA host pool moving the payload alone; ``raw``, one
pinned ``copy_`` of payload plus scales (a load's, layer 0's share first); and
the ablations asked for. A backup
is one ``backup_from_device_all_layer`` call, a load one call per layer (draft
depth ``d`` right after target layer ``d``, as SGLang's controller issues
them), with indices where the controller puts them; loads also until layer
0's work completes. A class that refuses a setup gets ``None`` cells.
``beside``: each transfer on a side stream while a loop (``BESIDE_LOOPS``)
runs on the main stream: the loop's time beside it over its time alone.
"""

from __future__ import annotations

import functools
import importlib
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from sglang_mxfp8_hicache.geometry import FORMATS, FP4_FORMAT_NAMES, ScaleGeometry
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.ablations import ABLATIONS
from sglang_mxfp8_hicache.tools.pools import (
    IO_BACKEND,
    PAGE_SIZE,
    PayloadOnlyHost,
    build_device_pool,
    build_host_pool,
    host_indices_for,
    page_token_indices,
)
from sglang_mxfp8_hicache.tools.results import (
    BENCH_GEOMETRIES,
    BENCH_PAGES,
    BENCH_REPEAT,
    BENCH_SETUPS,
    BENCH_WARMUP,
    BenchRun,
    Row,
)

# Largest device pool (payload and scales) a geometry gets; larger batches are
# skipped, since every column pins a host pool of the same size.
MAX_POOL_BYTES = 10 * 2**30


DEFAULT_DRAFTS = 1
"""Draft layers of the ``draft`` setup: one, as DeepSeek-V3's MTP module."""
REFUSED = "refused"


@dataclass(frozen=True)
class Setup:
    """How the host pools are built: their payload ``layout`` and ``drafts``,
    one-layer draft device pools packed as tail layers."""

    name: str = "page_first"
    layout: str = "page_first"
    drafts: int = 0
    kv_cache_dtype: str = "mxfp8"
    io_backend: str = IO_BACKEND


def setups(names: Sequence[str], drafts: int = DEFAULT_DRAFTS) -> list[Setup]:
    """The setups of :data:`SETUPS` by name, in the order given; ``drafts`` is
    the draft layer count of ``draft``."""
    known = {
        "page_first": Setup(),
        "draft": Setup("draft", drafts=drafts),
        "layer_first": Setup("layer_first", layout="layer_first"),
        "direct": Setup("direct", layout="page_first_direct", io_backend="direct"),
        "page_head": Setup("page_head", layout="page_head"),
        **{name: Setup(name, kv_cache_dtype=name) for name in FP4_FORMAT_NAMES},
    }
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown setup(s) {unknown}; known: {list(BENCH_SETUPS)}")
    return [known[name] for name in dict.fromkeys(names)]


Transfer = Callable[[Callable[[], None]], object]
"""One transfer; it calls its argument once layer 0's work is issued (loads)."""


Loop = Callable[[int], None]


def beside_loops(device) -> dict[str, Loop]:
    """The main stream's work beside a transfer (``results.BESIDE_LOOPS``), ``n``
    rounds of: a bf16 4096^3 GEMM (every SM, wave after wave); an add over
    256 MiB; a Llama-8B-like decoder layer's GEMMs at 64 tokens and a read of
    512 MiB of KV (``decode``), or its GEMMs at 4096 tokens (``prefill``)."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    a, b, c = (torch.randn(4096, 4096, **bf16) for _ in range(3))
    x, y = (torch.zeros(1 << 26, dtype=torch.int32, device=device) for _ in "xy")
    weights = [torch.randn(k, m, **bf16) for k, m in LAYER_GEMMS]
    inputs = {
        t: [torch.randn(t, k, **bf16) for k, _ in LAYER_GEMMS] for t in (64, 4096)
    }
    kv = torch.zeros(256 << 20, **bf16)

    def layer(tokens: int, n: int) -> None:
        for _ in range(n):
            for x_in, w in zip(inputs[tokens], weights, strict=True):
                torch.matmul(x_in, w)
            if tokens < 4096:
                kv.sum()

    return {
        "gemm": lambda n: [torch.matmul(a, b, out=c) for _ in range(n)],
        "hbm": lambda n: [torch.add(x, 1, out=y) for _ in range(n)],
        "decode": functools.partial(layer, 64),
        "prefill": functools.partial(layer, 4096),
    }


LAYER_GEMMS = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))
"""(in, out) of a Llama-8B-like layer's GEMMs: QKV (32 + 2 x 8 heads of 128),
O, gate and up, down."""


GATE_CYCLES = 6_000_000
"""A sleep both streams start with beside a loop: the transfer and the loop
are queued behind it and start together."""


def _ms(start, end) -> float:
    end.synchronize()
    return start.elapsed_time(end)


def _events(n: int) -> list[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _loop_ms(loop: Loop, n: int, *, gate: bool = False) -> float:
    """``n`` rounds of ``loop`` on the current stream, behind the gate's sleep."""
    if gate:
        torch.cuda._sleep(GATE_CYCLES)
    start, end = _events(2)
    start.record(), loop(n), end.record()
    return _ms(start, end)


def _time_all(
    fns: dict[str, Transfer], *, warmup: int, repeat: int, loop: Loop | None = None
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median ms of each transfer, whole and to layer 0; with ``loop`` (the
    transfer on a side stream), its median time beside the transfer over its
    time alone, as long as the transfer alone. Each round runs every column
    once in a seeded random order, so drift, the position in a round and the
    column run just before hit every column alike."""
    side = torch.cuda.Stream() if loop else torch.cuda.current_stream()
    sizes: dict[str, int] = {}
    if loop is not None:
        with torch.cuda.stream(side):
            alone, *_ = _time_all(fns, warmup=warmup, repeat=max(3, repeat // 2))
        per_round = _loop_ms(loop, 10) / 10
        sizes = {name: max(1, round(t / per_round)) for name, t in alone.items()}
        warmup = 0
    for _ in range(warmup):
        for fn in fns.values():
            fn(lambda: None)
    torch.cuda.synchronize()
    items = list(fns.items())
    whole, layer0, ratio = ({name: [] for name in fns} for _ in "123")
    order = random.Random(0)
    for _ in range(repeat):
        order.shuffle(items)
        for name, fn in items:
            start, first, end = _events(3)
            if loop is not None:
                loop_alone = _loop_ms(loop, sizes[name])
            marked: list[None] = []
            with torch.cuda.stream(side):
                if loop is not None:
                    torch.cuda._sleep(GATE_CYCLES)
                start.record()
                fn(lambda e=first, m=marked: m.append(e.record()))
                end.record()
            if loop is not None:
                beside = _loop_ms(loop, sizes[name], gate=True)
                ratio[name].append(beside / loop_alone)
            whole[name].append(_ms(start, end))
            if marked:
                layer0[name].append(start.elapsed_time(first))
    median = statistics.median
    return tuple(
        {name: median(t) for name, t in times.items() if t}
        for times in (whole, layer0, ratio)
    )


def draft_depths_after(layer: int, layers: int, drafts: int) -> list[int]:
    """The draft depths SGLang loads right after target ``layer``: depth ``d``
    after layer ``min(d, layers - 1)`` (``HybridCacheController._l2_load_transfers``),
    so drafts deeper than the target model follow its last layer."""
    return [depth for depth in range(drafts) if min(depth, layers - 1) == layer]


def _transfers(
    device_pool,
    drafts: Sequence,
    hosts: dict,
    pages: int,
    bytes_per_page: int,
    gen: torch.Generator,
    io_backend: str = IO_BACKEND,
) -> dict[str, dict[str, Transfer]]:
    """One backup and one all-layer load per pool, over the same random pages;
    ``drafts``: the draft device pools packed into every host pool. With
    ``direct`` io every index is on the CPU, as SGLang's controller moves them."""
    device = device_pool.device
    layers = device_pool.layer_num
    device_pages = torch.randperm(device_pool.size // PAGE_SIZE, generator=gen) + 1
    host_pages = torch.randperm(next(iter(hosts.values())).page_num, generator=gen)
    index_device = "cpu" if io_backend == "direct" else device
    device_tokens = page_token_indices(device_pages[:pages]).to(index_device)
    host_tokens = page_token_indices(host_pages[:pages])
    raw_device = torch.empty(pages * bytes_per_page, dtype=torch.uint8, device=device)
    raw_host = torch.empty_like(raw_device, device="cpu", pin_memory=raw_device.is_cuda)

    indices = functools.partial(
        host_indices_for, host_tokens=host_tokens, device=device, io_backend=io_backend
    )

    def backup(host) -> Transfer:
        hosts = indices(host, backup=True)
        return lambda mark: host.backup_from_device_all_layer(
            device_pool, hosts, device_tokens, io_backend
        )

    # Made before the timed loop, which then costs what a controller's does.
    drafts_after = [
        draft_depths_after(layer, layers, len(drafts)) for layer in range(layers)
    ]

    def raw_load(mark) -> None:
        """The bytes ours moves before its mark (layer 0, its drafts) first."""
        first = pages * bytes_per_page * (1 + len(drafts_after[0]))
        first //= layers + len(drafts)
        raw_device[:first].copy_(raw_host[:first], non_blocking=True)
        mark()
        raw_device[first:].copy_(raw_host[first:], non_blocking=True)

    def load(host) -> Transfer:
        host_tokens_gpu = indices(host, backup=False)

        def all_layers(mark):
            for layer, depths in enumerate(drafts_after):
                host.load_to_device_per_layer(
                    device_pool, host_tokens_gpu, device_tokens, layer, io_backend
                )
                for depth in depths:
                    host.load_to_device_per_layer(
                        drafts[depth],
                        host_tokens_gpu,
                        device_tokens,
                        layers + depth,
                        io_backend,
                        is_draft=True,
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
            "raw": raw_load,
        },
    }


def host_classes(ablations: Sequence[str] = ()) -> dict[str, type]:
    """The pools of one run, by column name, in table order."""
    sglang = importlib.import_module("sglang.srt.mem_cache.pool_host.mha_mxfp8")
    classes = {
        "ours": MHATokenToKVPoolMXFP8Host,
        **{name: ABLATIONS[name] for name in ablations},
        "sglang": getattr(sglang, "MHATokenToKVPoolMXFP8Host", None),
        "payload": PayloadOnlyHost,
    }
    return {name: cls for name, cls in classes.items() if cls is not None}


def bytes_per_page(
    heads: int, head_dim: int, layers: int, kv_cache_dtype: str = "mxfp8"
) -> int:
    """K and V, payload and scales, every layer: one page of the format."""
    fmt = FORMATS[kv_cache_dtype]
    geometry = ScaleGeometry(
        head_num=heads, head_dim=head_dim, page_size=PAGE_SIZE, fmt=fmt
    )
    per_token = geometry.payload_bytes_per_token + geometry.bytes_per_token
    return 2 * layers * PAGE_SIZE * per_token


def pages_that_fit(
    geometry: tuple[int, int, int],
    pages_list,
    drafts: int = 0,
    kv_cache_dtype: str = "mxfp8",
) -> tuple[int, ...]:
    heads, head_dim, layers = geometry
    page_bytes = bytes_per_page(heads, head_dim, layers + drafts, kv_cache_dtype)
    return tuple(p for p in pages_list if p * page_bytes <= MAX_POOL_BYTES)


def _drop_classes_that_cannot_move(device_pool, hosts: dict, setup: Setup) -> None:
    """SGLang's classes move some setups only through sgl_kernel's compiled ops
    (io ``direct``, ``page_head``), which may be missing: one page each way
    tells, and such a class is refused for the setup. Ours failing fails."""
    device = "cpu" if setup.io_backend == "direct" else device_pool.device
    tokens = page_token_indices(torch.tensor([1]))
    for name, host in hosts.items():
        if host is None or isinstance(host, MHATokenToKVPoolMXFP8Host):
            continue
        backup_hosts = host_indices_for(
            host, tokens, device, backup=True, io_backend=setup.io_backend
        )
        try:
            host.backup_from_device_all_layer(
                device_pool, backup_hosts, tokens.to(device), setup.io_backend
            )
            host.load_to_device_per_layer(
                device_pool, tokens.to(device), tokens.to(device), 0, setup.io_backend
            )
        except (NotImplementedError, RuntimeError, ValueError):
            host.destroy()
            hosts[name] = None


def bench_geometry(
    geometry: tuple[int, int, int],
    pages_list: tuple[int, ...],
    *,
    classes: dict[str, type],
    warmup: int,
    repeat: int,
    progress: Callable[[], None],
    setup: Setup = Setup(),
    device: str = "cuda",
    beside: tuple[str, Loop] | None = None,
) -> list[Row]:
    """One geometry in one setup: a device pool (and the setup's draft device
    pools), one host pool per column built for the setup, every batch timed,
    alone or ``beside`` a named loop (:func:`beside_loops`).

    ``device``: cuda; cpu only where the tests emulate the kernels (and stand
    in for :func:`_time_all`, which times with CUDA events)."""
    heads, head_dim, layers = geometry
    shape = dict(
        head_num=heads, head_dim=head_dim, pages=max(pages_list), device=device
    )
    shape.update(kv_cache_dtype=setup.kv_cache_dtype)
    pools = (layers, *[1] * setup.drafts)
    device_pool, *drafts = (build_device_pool(layer_num=n, **shape) for n in pools)
    hosts: dict[str, object | None] = {}
    rows = []
    try:
        for name, cls in classes.items():
            try:
                hosts[name] = build_host_pool(
                    device_pool,
                    cls,
                    host_to_device_ratio=1.0,
                    pin_memory=device == "cuda",
                    drafts=drafts,
                    layout=setup.layout,
                )
            except (NotImplementedError, ValueError):
                # SGLang's ways to refuse a setup (FP4: its 'token' ValueError);
                # ours, or an ablation of ours, refusing is a failed run.
                if issubclass(cls, MHATokenToKVPoolMXFP8Host):
                    raise
                hosts[name] = None
        _drop_classes_that_cannot_move(device_pool, hosts, setup)
        live = {name: host for name, host in hosts.items() if host is not None}
        page_bytes = bytes_per_page(
            heads, head_dim, layers + setup.drafts, setup.kv_cache_dtype
        )
        gen = torch.Generator().manual_seed(0)
        for pages in pages_list:
            for direction, fns in _transfers(
                device_pool, drafts, live, pages, page_bytes, gen, setup.io_backend
            ).items():
                ms, layer0, loop_ratio = _time_all(
                    fns, warmup=warmup, repeat=repeat, loop=beside and beside[1]
                )
                # Every column in table order, None where its class refused.
                columns = [*hosts, "raw"]
                ms = {name: ms.get(name) for name in columns}
                layer0 = {n: layer0.get(n) for n in columns} if layer0 else {}
                if beside is not None:
                    loop_ratio = {name: loop_ratio.get(name) for name in columns}
                cell = (pages, direction, ms, layer0, setup.name, setup.drafts)
                loop = dict(beside=beside and beside[0], loop_ratio=loop_ratio)
                rows.append(Row(*geometry, *cell, **loop))
                progress()
    finally:
        for host in hosts.values():
            if host is not None:
                host.destroy()
    return rows


def run(
    geometries: Sequence[tuple[int, int, int]] = BENCH_GEOMETRIES,
    pages_list: Sequence[int] = BENCH_PAGES,
    *,
    classes: dict[str, type] | None = None,
    setups: Sequence[Setup] = (Setup(),),
    warmup: int = BENCH_WARMUP,
    repeat: int = BENCH_REPEAT,
    device: str = "cuda",
    beside: Sequence[str] = (),
) -> list[Row]:
    """Every geometry in every setup at every batch that fits
    :data:`MAX_POOL_BYTES`, alone, or beside each loop named in ``beside``."""
    classes = classes or host_classes()
    loops = beside_loops(device) if beside else {}
    modes = [(name, loops[name]) for name in beside] or [None]
    plan = [
        (g, s, pages_that_fit(g, pages_list, s.drafts, s.kv_cache_dtype), mode)
        for g in geometries
        for s in setups
        for mode in modes
    ]
    from tqdm import tqdm  # SGLang's dependency

    bar = tqdm(total=sum(2 * len(p) for _, _, p, _ in plan), desc="bench", unit="case")
    rows, timing = [], dict(classes=classes, warmup=warmup, repeat=repeat)
    for geometry, setup, pages, mode in plan:
        if not pages:
            continue
        cases = dict(progress=bar.update, setup=setup, device=device, beside=mode)
        rows += bench_geometry(geometry, pages, **timing, **cases)
        torch.cuda.empty_cache()
    bar.close()
    return rows


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _cell(ms: dict[str, float | None], name: str) -> str:
    return REFUSED if name in ms and ms[name] is None else _fmt(ms.get(name))


def table(
    rows: list[Row], *, layer0: bool = False, beside: bool = False
) -> tuple[list, list[list]]:
    """Whole transfers alone, both directions; ``layer0``: loads, until layer
    0's work is done; ``beside``: each column's slowdown of the loop."""
    rows = [r for r in rows if (r.beside is not None) == beside]
    rows = [r for r in rows if r.layer0_ms] if layer0 else rows
    cells = [r.loop_ratio if beside else r.layer0_ms if layer0 else r.ms for r in rows]
    names = list(dict.fromkeys(name for cell in cells for name in cell))
    unit = "loop x" if beside else "L0 ms" if layer0 else "ms"
    ratios = ("payload", "sglang") if layer0 else ("payload", "raw", "sglang")
    ratios = ("raw",) if beside else ratios
    lead = [] if layer0 else ["dir", "loop"] if beside else ["dir"]
    headers = ["setup", "KVxDxL", "pages", *lead, *(f"{n} {unit}" for n in names)]
    headers += [f"ours/{to}" for to in ratios] + ["missed"]
    body = [
        [
            r.setup_label,
            r.geometry,
            str(r.pages),
            *[{"dir": r.direction, "loop": r.beside}[h] for h in lead],
            *(_cell(cell, n) for n in names),
            *(_fmt(r.ratio("ours", to, layer0=layer0)) for to in ratios),
            " ".join(g.label() for g in r.missed(layer0=layer0)) or "-",
        ]
        for r, cell in zip(rows, cells, strict=True)
    ]
    return headers, body


def to_json(rows: list[Row]) -> bytes:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return BenchRun(device, PAGE_SIZE, rows).to_json()


def plot(json_paths: Sequence[str], out: str) -> None:
    """Ours over payload-only and over a raw copy against pages, one panel per
    direction, a line per (setup, geometry), from ``--json-out`` files; the
    byte ratio (what the scales add) drawn in. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for path in json_paths:
        try:
            rows += msgspec.json.decode(open(path, "rb").read(), type=BenchRun).rows
        except msgspec.DecodeError as exc:
            raise ValueError(
                f"{path}: not the JSON of an L2 bench run ({exc})"
            ) from None

    def ratios(direction: str, to: str) -> list[tuple[object, float]]:
        return [
            (r, ratio)
            for r in rows
            if r.direction == direction and not r.beside
            if (ratio := r.ratio("ours", to)) is not None
        ]

    # A reference no run timed (payload-only is not in every setup) gets no panel.
    drawn = [
        to for to in ("payload", "raw") if ratios("backup", to) + ratios("load", to)
    ]
    if not drawn:
        raise ValueError(f"{', '.join(json_paths)}: no timed cells of ours to draw")
    height = 3.75 * len(drawn)
    fig, axes = plt.subplots(len(drawn), 2, figsize=(11, height), squeeze=False)
    colors = plt.cm.tab20.colors
    for col, direction in enumerate(("backup", "load")):
        for row_index, to in enumerate(drawn):
            ax = axes[row_index][col]
            lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
            for r, ratio in ratios(direction, to):
                lines.setdefault((r.setup, r.geometry), []).append((r.pages, ratio))
            for n, ((setup, geometry), points) in enumerate(sorted(lines.items())):
                points.sort()
                ax.plot(
                    *zip(*points, strict=True),
                    marker="o",
                    color=colors[n % len(colors)],
                    label=f"{setup} {geometry}",
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            if to == "payload":
                # What the scales add to the payload's bytes.
                for ratio, name in ((1.03125, "MXFP8"), (1.125, "FP4")):
                    ax.axhline(ratio, color="grey", linestyle="--", linewidth=0.8)
                    ax.text(1, ratio + 0.004, f"{name} bytes / payload", fontsize=7)
            else:
                ax.axhline(1.05, color="red", linestyle=":", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}: ours / {to}")
            ax.set_xlabel("pages")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
