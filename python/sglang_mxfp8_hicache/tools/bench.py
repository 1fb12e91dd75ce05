"""Side-by-side timing of HiCache host pools on one GPU, in one process.

For each geometry (KV heads x head_dim, 8 layers, page_size 128) and batch of
pages, both directions are timed with CUDA events (warm-up, then the median of
``repeat`` runs) for:

- ``ours``: :class:`MHATokenToKVPoolMXFP8Host`;
- ``sglang``: SGLang's own MXFP8 host pool, when the installed SGLang has one;
- ``payload``: SGLang's ``MHATokenToKVPoolHost`` on the same device pool, which
  moves the fp8 payload only (the floor any MXFP8 pool is compared with);
- ``raw``: one pinned ``copy_`` of as many bytes as payload plus scales;
- on request, the ablations in :data:`ABLATIONS`: ours with one design choice
  undone, to measure what that choice is worth.

A backup is one ``backup_from_device_all_layer`` call with CPU host indices, as
SGLang's controller hands them to a pool with the staged write-back; a load is
one ``load_to_device_per_layer`` call per layer with GPU indices.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from sglang.kernels.ops.kvcache import hicache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.tools.selfcheck import (
    IO_BACKEND,
    PAGE_SIZE,
    build_device_pool,
    build_host_pool,
    page_token_indices,
)

GEOMETRIES = ((1, 128), (8, 128), (32, 128))
PAGES = (1, 4, 16, 64, 256, 1024)
LAYERS = 8
# The goals: (largest ratio to payload-only, for batches from `pages` up).
BACKUP_GOALS = ((64, 1.04), (1, 1.15))
LOAD_GOALS = ((64, 1.05), (16, 1.25), (1, 1.5))


class StagedScalesHost(MHATokenToKVPoolMXFP8Host):
    """Ours as first shipped: staged D2H, one single-layer gather per layer for H2D."""

    def _init_scale_transfer(self, buffer_info) -> None:
        super()._init_scale_transfer(buffer_info)
        self.device_k_scale_ptrs, self.device_v_scale_ptrs = self._backup_tables[2:]
        page_bytes = self.scale_geometry.page_bytes
        # The first version's host layout: one page row per layer.
        self.k_pages_host, self.v_pages_host = self.scale_host.view(
            2, self.page_num, self.layer_num, page_bytes
        )
        self.k_scale_staging, self.v_scale_staging = torch.empty(
            (2, min(self.page_num, 64), self.layer_num, page_bytes),
            dtype=torch.uint8,
            device=self._transfer_device,
        )
        self.device_k_rows = [
            s.view(torch.uint8).view(-1, page_bytes) for s in buffer_info.scales.k
        ]
        self.device_v_rows = [
            s.view(torch.uint8).view(-1, page_bytes) for s in buffer_info.scales.v
        ]

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        MHATokenToKVPoolHost.backup_from_device_all_layer(
            self, device_pool, host_indices, device_indices, io_backend
        )
        ps = self.page_size
        hicache.transfer_hicache_all_layer_staged_lf_pf(
            k_ptr_src=self.device_k_scale_ptrs,
            v_ptr_src=self.device_v_scale_ptrs,
            src_indices=device_indices[::ps] // ps,
            dst_indices=host_indices[::ps] // ps,
            staging_k=self.k_scale_staging,
            staging_v=self.v_scale_staging,
            dst_k=self.k_pages_host,
            dst_v=self.v_pages_host,
            page_size=1,
        )

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
    ) -> None:
        MHATokenToKVPoolHost.load_to_device_per_layer(
            self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
        )
        ps = self.page_size
        hicache.transfer_hicache_one_layer(
            k_cache_dst=self.device_k_rows[layer_id],
            v_cache_dst=self.device_v_rows[layer_id],
            indices_dst=device_indices[::ps] // ps,
            k_cache_src=self.k_pages_host[:, layer_id],
            v_cache_src=self.v_pages_host[:, layer_id],
            indices_src=host_indices[::ps] // ps,
            element_dim=self.scale_geometry.page_bytes,
        )


class StockKernelHost(MHATokenToKVPoolMXFP8Host):
    """Ours before the scale-row kernel (table E): the same rows through SGLang's
    all-layer kernel, which needs packed GPU indices, prepared per transfer: a
    pinned upload and a gather for a backup, one gather for a load."""

    def _init_scale_transfer(self, buffer_info) -> None:
        super()._init_scale_transfer(buffer_info)
        row_bytes = self.scale_geometry.row_bytes
        self._launch_all_layer = hicache._jit_hicache_module(
            element_size=row_bytes,
            unroll=hicache._default_unroll(row_bytes),
            block_quota=hicache.DEFAULT_BLOCK_QUOTA,
        ).launch_all

    def _stock_rows(self, host_indices, device_indices):
        step = self._row_tokens
        if host_indices.device != device_indices.device:
            host_rows = host_indices[::step].pin_memory()
            host_rows = host_rows.to(device_indices.device, non_blocking=True)
            return host_rows, device_indices[::step].contiguous()
        if step == 1:
            return host_indices, device_indices
        host_rows, device_rows = torch.stack(
            (host_indices[::step], device_indices[::step])
        )
        return host_rows, device_rows

    def _stock_move(self, tables, host_indices, device_indices, *, to_host) -> None:
        host_k, host_v, device_k, device_v = tables
        host_rows, device_rows = self._stock_rows(host_indices, device_indices)
        host = (host_k, host_v, host_rows)
        device = (device_k, device_v, device_rows)
        # (K dst, V dst, rows dst, K src, V src, rows src, src stride, dst stride)
        if to_host:
            self._launch_all_layer(
                *host, *device, self._device_stride, self._host_stride
            )
        else:
            self._launch_all_layer(
                *device, *host, self._host_stride, self._device_stride
            )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        MHATokenToKVPoolHost.backup_from_device_all_layer(
            self, device_pool, host_indices, device_indices, io_backend
        )
        self._stock_move(
            self._backup_tables, host_indices, device_indices, to_host=True
        )

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
    ) -> None:
        MHATokenToKVPoolHost.load_to_device_per_layer(
            self, device_pool, host_indices, device_indices, layer_id, io_backend, **kw
        )
        if layer_id == 0:
            self._stock_move(
                self._load_tables, host_indices, device_indices, to_host=False
            )


class NarrowRowsHost(MHATokenToKVPoolMXFP8Host):
    """Ours with scale rows of at least 128 B (the kernel's minimum) instead of 512 B."""

    scale_min_row_bytes = 128


class LayerWorkersHost(MHATokenToKVPoolMXFP8Host):
    """Ours with one kernel worker per (row, layer) instead of per row."""

    scale_walk_layers = False


ABLATIONS: dict[str, type[MHATokenToKVPoolMXFP8Host]] = {
    "stock": StockKernelHost,
    "layer_workers": LayerWorkersHost,
    "v1": StagedScalesHost,
    "rows128": NarrowRowsHost,
}


def sglang_mxfp8_host_cls() -> type | None:
    try:
        from sglang.srt.mem_cache.pool_host.mha_mxfp8 import (
            MHATokenToKVPoolMXFP8Host as SGLangMXFP8Host,
        )
    except ImportError:
        return None
    return SGLangMXFP8Host


@dataclass
class Row:
    heads: int
    head_dim: int
    pages: int
    direction: str
    ms: dict[str, float]

    def ratio(self, name: str, to: str = "payload") -> float | None:
        if name not in self.ms or to not in self.ms:
            return None
        return self.ms[name] / self.ms[to]

    def goal(self) -> float:
        goals = BACKUP_GOALS if self.direction == "backup" else LOAD_GOALS
        return next(limit for pages, limit in goals if self.pages >= pages)

    def meets_goal(self) -> bool:
        ours = self.ratio("ours")
        not_slower = "sglang" not in self.ms or self.ms["ours"] <= self.ms["sglang"]
        return ours is not None and ours <= self.goal() and not_slower


def _time_all(
    fns: dict[str, Callable[[], object]], *, warmup: int, repeat: int
) -> dict[str, float]:
    """Median ms of each function. The runs go round-robin over the functions,
    each round starting one function later, so drift and the position in a
    round (the first column ran slowest when the order was fixed) hit every
    column alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    items = list(fns.items())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeat):
        shift = round_ % len(items)
        for name, fn in items[shift:] + items[:shift]:
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def _transfers(
    device_pool, hosts: dict, pages: int, bytes_per_page: int, gen: torch.Generator
) -> dict[str, dict[str, Callable[[], object]]]:
    """One backup and one all-layer load per pool, over the same random pages."""
    device_pages = torch.randperm(device_pool.size // PAGE_SIZE, generator=gen) + 1
    host_pages = torch.randperm(hosts["payload"].page_num, generator=gen)
    device_tokens = page_token_indices(device_pages[:pages]).cuda()
    host_tokens = page_token_indices(host_pages[:pages])
    host_tokens_gpu = host_tokens.cuda()
    raw_device = torch.empty(pages * bytes_per_page, dtype=torch.uint8, device="cuda")
    raw_host = torch.empty_like(raw_device, device="cpu", pin_memory=True)

    def backup(host):
        return lambda: host.backup_from_device_all_layer(
            device_pool, host_tokens, device_tokens, IO_BACKEND
        )

    def load(host):
        def all_layers():
            for layer in range(LAYERS):
                host.load_to_device_per_layer(
                    device_pool, host_tokens_gpu, device_tokens, layer, IO_BACKEND
                )

        return all_layers

    return {
        "backup": {
            **{name: backup(host) for name, host in hosts.items()},
            "raw": lambda: raw_host.copy_(raw_device, non_blocking=True),
        },
        "load": {
            **{name: load(host) for name, host in hosts.items()},
            "raw": lambda: raw_device.copy_(raw_host, non_blocking=True),
        },
    }


def host_classes(ablations: tuple[str, ...] = ()) -> dict[str, type]:
    """The pools of one run, by column name, in table order."""
    classes = {
        "ours": MHATokenToKVPoolMXFP8Host,
        **{name: ABLATIONS[name] for name in ablations},
        "sglang": sglang_mxfp8_host_cls(),
        "payload": MHATokenToKVPoolHost,
    }
    return {name: cls for name, cls in classes.items() if cls is not None}


def bench_geometry(
    heads: int,
    head_dim: int,
    pages_list: tuple[int, ...],
    *,
    classes: dict[str, type],
    warmup: int,
    repeat: int,
    progress: Callable[[], None],
) -> list[Row]:
    device_pool = build_device_pool(
        head_num=heads,
        head_dim=head_dim,
        layer_num=LAYERS,
        pages=max(pages_list),
        device="cuda",
    )
    hosts = {
        name: build_host_pool(
            device_pool, cls, host_to_device_ratio=1.0, pin_memory=True
        )
        for name, cls in classes.items()
    }
    geometry = hosts["ours"].scale_geometry
    # K and V, payload and scales, every layer: what one page moves.
    bytes_per_token = geometry.payload_bytes_per_token + geometry.bytes_per_token
    bytes_per_page = 2 * LAYERS * PAGE_SIZE * bytes_per_token
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        for pages in pages_list:
            for direction, fns in _transfers(
                device_pool, hosts, pages, bytes_per_page, gen
            ).items():
                ms = _time_all(fns, warmup=warmup, repeat=repeat)
                rows.append(Row(heads, head_dim, pages, direction, ms))
                progress()
    finally:
        for host in hosts.values():
            host.destroy()
    return rows


def run(
    geometries=GEOMETRIES,
    pages_list=PAGES,
    *,
    classes: dict[str, type] | None = None,
    warmup: int = 3,
    repeat: int = 20,
) -> list[Row]:
    classes = classes or host_classes()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with sglang
        tqdm = None
    total = len(geometries) * len(pages_list) * 2
    bar = tqdm(total=total, desc="bench", unit="case") if tqdm else None
    rows = []
    for heads, head_dim in geometries:
        rows += bench_geometry(
            heads,
            head_dim,
            tuple(pages_list),
            classes=classes,
            warmup=warmup,
            repeat=repeat,
            progress=(bar.update if bar else lambda: None),
        )
        torch.cuda.empty_cache()
    if bar:
        bar.close()
    return rows


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    names = list(dict.fromkeys(name for r in rows for name in r.ms))
    headers = ["KVxD", "pages", "dir", *(f"{n} ms" for n in names)]
    headers += ["ours/payload", "sglang/payload", "ours/sglang", "goal", "met"]

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    body = []
    for r in rows:
        body.append(
            [
                f"{r.heads}x{r.head_dim}",
                str(r.pages),
                r.direction,
                *(fmt(r.ms.get(n), ".3f") for n in names),
                fmt(r.ratio("ours"), ".3f"),
                fmt(r.ratio("sglang"), ".3f"),
                fmt(r.ratio("ours", "sglang"), ".3f"),
                f"<={r.goal()}",
                "yes" if r.meets_goal() else "NO",
            ]
        )
    return headers, body


def to_json(rows: list[Row]) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return json.dumps(
        {
            "device": device,
            "layers": LAYERS,
            "page_size": PAGE_SIZE,
            "rows": [
                {**asdict(r), "goal": r.goal(), "met": r.meets_goal()} for r in rows
            ],
        },
        indent=1,
    )
