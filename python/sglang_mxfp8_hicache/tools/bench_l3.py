"""L3 put and get of MXFP8 pages against the same model's payload-only pages.

Both pools, ``mxfp8`` (ours) and ``payload`` (``pools.PayloadOnlyHost``: the
floor), run side by side, each with a backend opened as the cache controller
attaches one (:class:`~.l3.StoragePageIO`; Mooncake's two share a client),
pages moving through the controller's page functions in its batches. Wall
clock; per batch size the median of ``results.l3_reps`` after the warm-up, the
pools taking turns to go first. Every put has fresh keys, what a rep stored is
removed before the next, gets land in poisoned host pages, and the last rep's
are compared byte for byte: a mismatch fails the run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from sglang_mxfp8_hicache import guards
from sglang_mxfp8_hicache.tools import l3, results
from sglang_mxfp8_hicache.tools.l3 import LOCAL_BACKENDS, StoragePageIO, sglang_backend
from sglang_mxfp8_hicache.tools.pools import (
    PAGE_SIZE,
    PayloadOnlyHost,
    build_device_pool,
    build_host_pool,
    fill_random,
    host_page_rows,
    page_token_indices,
)
from sglang_mxfp8_hicache.tools.results import L3_DIRECTIONS, L3_POOLS, Cell, Report

SEGMENT_HEADROOM = 1.3
"""hf3fs's file holds this many times one batch of a pool."""
POISON = 0xA5
VERIFY_CHUNK_PAGES = 64


class L3BenchError(RuntimeError):
    """The benchmark ran but L3 did not do its job: a put failed, a get missed
    pages, or pages came back with other bytes. The numbers mean nothing."""


class L3Unavailable(RuntimeError):
    """The benchmark cannot run here: no service named, a backend that cannot
    be opened, host pools that do not fit."""


def build_pools(
    geometry: tuple[int, int, int], max_pages: int, *, device: str, pin_memory: bool
) -> dict[str, Any]:
    """Ours and the payload-only control, each of ``2 * max_pages + 1`` pages
    (puts from one half, gets into the other), over a one-page MXFP8 device
    pool: L3 never touches the device."""
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host

    heads, head_dim, layers = geometry
    device_pool = build_device_pool(
        head_num=heads, head_dim=head_dim, layer_num=layers, pages=1, device=device
    )
    pools: dict[str, Any] = {}
    sizing = dict(host_to_device_ratio=2 * max_pages, pin_memory=pin_memory)
    try:
        classes = (MHATokenToKVPoolMXFP8Host, PayloadOnlyHost)
        for name, cls in zip(L3_POOLS, classes, strict=True):
            pools[name] = build_host_pool(device_pool, cls, **sizing)
    except BaseException:
        for pool in pools.values():
            pool.destroy()
        raise
    return pools


def page_bytes(pool: Any) -> int:
    """Bytes of one page on L3: everything the host pool holds per page."""
    return pool.get_size_per_token() * pool.page_size


def _same_pages(pool: Any, got: torch.Tensor, put: torch.Tensor) -> bool:
    """Host pages ``got`` hold the bytes of pages ``put``, payload and scales."""
    rows, n = host_page_rows(pool), VERIFY_CHUNK_PAGES
    return all(
        rows[got[i : i + n]].equal(rows[put[i : i + n]]) for i in range(0, len(got), n)
    )


def _remove(
    io: StoragePageIO, hashes: list[str], host_indices: torch.Tensor, *, strict: bool
) -> None:
    """Removes what ``backup(hashes, ...)`` stored and nothing else (a store may be
    shared); Mooncake's forced (a get leaves a 10 s lease), ``strict`` raising if it
    keeps one. A ``dynamic`` class keeps all: SGLang's interface has no remove."""
    backend, name = sglang_backend(io.storage_backend), io.backend_name
    if name == "hf3fs":  # frees the slots of the pages' parts
        if backend is not io.storage_backend:
            tag = io.storage_host_pool.storage_format_tag
            hashes = [f"{tag}_{key}" for key in hashes]
        if backend.mha_zero_copy:
            hashes = backend._get_mha_zero_copy_keys(hashes)
        backend.metadata_client.delete_keys(backend.rank, hashes)
    elif name in ("file", "nixl"):
        paths = (
            [guards.file_page_path(backend, key) for key in hashes]
            if name == "file"
            else guards.nixl_page_paths(backend, hashes)
        )
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    elif name == "seaweedfs":
        bucket = backend.config.bucket
        for key in hashes:
            backend._s3.delete_object(Bucket=bucket, Key=backend._object_key(key))
    elif name == "mooncake":
        keys, _, _ = backend._batch_preprocess(backend._tag_keys(hashes), host_indices)
        codes = backend.store.batch_remove(keys, True)
        failed = [(k, c) for k, c in zip(keys, codes, strict=True) if c != 0]
        if failed and strict:
            raise L3BenchError(
                f"Mooncake could not remove {len(failed)} of {len(keys)} objects "
                f"(first: {failed[0][0]}, code {failed[0][1]})"
            )


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """HiCacheHF3FS replaces SIGINT/SIGTERM/SIGQUIT handlers with ones that
    only close it; the bench keeps its own, so Ctrl-C still stops it."""
    import signal

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
    kept = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler)


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def _one_rep(
    ios: Mapping[str, StoragePageIO],
    order: Sequence[str],
    hashes: list[str],
    put_pages: torch.Tensor,
    get_pages: torch.Tensor,
    *,
    verify: bool,
) -> dict[str, dict[str, float]]:
    """Seconds of one put and one get per pool, each pool's put before any get;
    what was put is removed afterwards, whatever happened."""
    pages = len(put_pages)
    put_at, get_at = page_token_indices(put_pages), page_token_indices(get_pages)
    took: dict[str, dict[str, float]] = {d: {} for d in L3_DIRECTIONS}
    for name in order:
        host_page_rows(ios[name].storage_host_pool)[get_pages] = POISON
    done = False
    try:
        for name in order:
            took["put"][name], stored = _timed(ios[name].backup, hashes, put_at)
            if not stored:
                raise L3BenchError(f"{name}: put of {pages} pages failed (store full?)")
        for name in order:
            took["get"][name], arrived = _timed(ios[name].fetch, hashes, get_at)
            if arrived != pages:
                raise L3BenchError(f"{name}: get of {pages} pages returned {arrived}")
        for name in order if verify else ():
            if not _same_pages(ios[name].storage_host_pool, get_pages, put_pages):
                raise L3BenchError(f"{name}: {pages} pages came back changed")
        done = True
    finally:
        for name in order:
            _remove(ios[name], hashes, put_at, strict=done)
    return took


def measure(
    ios: Mapping[str, StoragePageIO],
    pages_list: Sequence[int],
    *,
    reps: int = results.L3_REPEAT,
    warmup: int = results.L3_WARMUP,
    seed: int = 0,
    progress: Callable[[], None] = lambda: None,
) -> list[Cell]:
    """Put and get times of each batch size on both pools (host pools of twice
    the largest batch); :class:`L3BenchError` if L3 loses or changes a page."""
    pools = {name: io.storage_host_pool for name, io in ios.items()}
    page_num = min(p.page_num for p in pools.values())
    if 2 * max(pages_list) > page_num:
        raise ValueError(f"{max(pages_list)} pages need 2x as many host pages")
    gen = torch.Generator().manual_seed(seed)
    fill_random([pool.kv_buffer for pool in pools.values()], gen)
    sizes = {name: page_bytes(pool) for name, pool in pools.items()}
    cells = []
    for pages in pages_list:
        perm = torch.randperm(page_num, generator=gen)
        put_pages, get_pages = perm[:pages], perm[pages : 2 * pages]
        seconds = {d: {name: [] for name in L3_POOLS} for d in L3_DIRECTIONS}
        rounds = warmup + results.l3_reps(pages, reps)
        for rep in range(rounds):
            # Fresh keys: a backend skips the put of a key it holds.
            tokens = torch.randint(0, 1 << 30, (pages * PAGE_SIZE,), generator=gen)
            hashes = l3.page_hashes(tokens.tolist(), PAGE_SIZE)
            order = L3_POOLS[rep % 2 :] + L3_POOLS[: rep % 2]
            last = rep == rounds - 1
            took = _one_rep(ios, order, hashes, put_pages, get_pages, verify=last)
            for d in L3_DIRECTIONS:
                for name in L3_POOLS if rep >= warmup else ():
                    seconds[d][name].append(took[d][name])
            progress()
        cells.append(Cell(pages, seconds, sizes))
    return cells


def run_metadata() -> dict[str, Any]:
    from sglang_mxfp8_hicache import __version__
    from sglang_mxfp8_hicache.releases import sglang_version

    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "sglang_version": sglang_version(),
        "plugin_version": __version__,
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": now.isoformat(timespec="seconds"),
    }


def apply_plugin_hooks() -> None:
    """The plugin's hooks, applied as SGLang's ``load_plugins`` applies them, so
    that the MXFP8 backends carry the storage guard a server's would."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_mxfp8_hicache import plugin, releases

    plugin.register()
    if not plugin.is_registered():
        raise L3Unavailable(
            "the plugin registered no hooks (SGLANG_MXFP8_HICACHE_DISABLE set, or "
            f"sglang {releases.sglang_version()} unsupported): a server would not use this "
            "host pool"
        )
    HookRegistry.apply_hooks()


def _unavailable(what: str, exc: BaseException) -> L3Unavailable:
    """``what`` could not be had, with the first line of ``exc``."""
    line = (str(exc).strip().splitlines() or [""])[0]
    return L3Unavailable(f"{what}: {type(exc).__name__}: {line}")


def _open_all(
    stack: contextlib.ExitStack,
    backend: str,
    pools: Mapping[str, Any],
    max_pages: int,
    l3_dir: str | None,
    l3_config: dict[str, Any] | None,
) -> tuple[dict[str, StoragePageIO], str]:
    """Each pool's backend, and where pages go, undone when ``stack`` closes. A
    local backend gets a directory per pool (hf3fs keys have no model name);
    Mooncake's two share a client (one process's clients differ in speed)."""
    run_id, local = uuid.uuid4().hex[:8], backend in LOCAL_BACKENDS
    if local:
        parent = l3_dir or os.environ.get(l3.FILE_DIR_ENV) or None
        store = tempfile.mkdtemp(prefix=f"sglang-mxfp8-hicache-{backend}-", dir=parent)
        stack.callback(shutil.rmtree, store, ignore_errors=True)
    else:
        keys = ("master_server_address", "endpoint", "module_path")
        where = next(filter(None, map(l3_config.get, keys)), "its config")
        store = f"{backend} at {where}"
    ios = {}
    for name, pool in pools.items():
        if local:
            os.mkdir(root := os.path.join(store, name))
            size = SEGMENT_HEADROOM * max_pages * page_bytes(pool)
            config = l3.local_backend(backend, root, size_bytes=size)
        else:
            config = l3.BackendConfig(dict(l3_config), {})
        model, extra = f"bench-l3-{run_id}-{name}", config.extra_config
        try:
            with config.environment(), _signal_handlers_kept():
                ios[name] = StoragePageIO.open(
                    backend, pool, model_name=model, extra_config=extra
                )
        except Exception as exc:
            raise _unavailable(
                f"cannot open {backend} for the {name} pool", exc
            ) from exc
        stack.callback(ios[name].close)
    if backend == "mooncake":  # one client for both (docs/benchmarks.md, L3)
        payload = sglang_backend(ios["payload"].storage_backend)
        payload.store = sglang_backend(ios["mxfp8"].storage_backend).store
        payload.register_buffer(ios["payload"].storage_host_pool.kv_buffer)
    return ios, store


def run(
    backend: str,
    geometry: tuple[int, int, int] = results.L3_GEOMETRY,
    pages_list: Sequence[int] = results.L3_PAGES,
    *,
    reps: int = results.L3_REPEAT,
    warmup: int = results.L3_WARMUP,
    device: str = "cuda",
    pin_memory: bool = True,
    l3_dir: str | None = None,
    l3_config: dict[str, Any] | None = None,
) -> Report:
    """Builds both pools, opens ``backend`` for each (a fresh directory if local,
    else the service or class ``l3_config`` names), measures, and removes what
    it wrote; progress goes to stderr, one step per repetition."""
    if backend not in (known := results.L3_BACKENDS):
        raise ValueError(f"backend must be one of {known}, got {backend!r}")
    if backend not in LOCAL_BACKENDS and l3_config is None:
        raise L3Unavailable(
            f"--l3 {backend} needs --l3-config: the extra config of a running "
            "service (a clone's test/mooncake_loopback.py and "
            "test/seaweedfs_loopback.py start one on loopback), or of a dynamic "
            "class (backend_name, module_path, class_name)"
        )
    max_pages = max(pages_list)
    with contextlib.ExitStack() as stack:
        try:
            pools = build_pools(
                geometry, max_pages, device=device, pin_memory=pin_memory
            )
        except (ValueError, RuntimeError) as exc:  # e.g. not enough host memory
            raise _unavailable("cannot build the host pools", exc) from exc
        for pool in pools.values():
            stack.callback(pool.destroy)
        ios, store = _open_all(stack, backend, pools, max_pages, l3_dir, l3_config)
        from tqdm import tqdm  # SGLang's dependency

        rounds = sum(warmup + results.l3_reps(pages, reps) for pages in pages_list)
        bar = tqdm(total=rounds, desc="bench --l3")
        stack.callback(bar.close)
        cells = measure(ios, pages_list, reps=reps, warmup=warmup, progress=bar.update)
        return Report(
            backend=backend,
            store=store,
            geometry=tuple(geometry),
            reps=reps,
            warmup=warmup,
            format_tag=pools["mxfp8"].storage_format_tag,
            page_bytes={name: page_bytes(pool) for name, pool in pools.items()},
            cells=cells,
            meta=run_metadata(),
        )


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    headers = ["pages"]
    for d in L3_DIRECTIONS:
        headers += [f"{d} MXFP8 ms", f"{d} payload ms", f"{d} x"]
    headers += ["MXFP8 put pages/s", "put GB/s", "MXFP8 get pages/s", "get GB/s"]
    headers += ["bytes x", "goal x", "met"]
    body = []
    for c in report.cells:
        row = [str(c.pages)]
        for d in L3_DIRECTIONS:
            row += [f"{c.ms(d, p):.3f}" for p in L3_POOLS] + [f"{c.ratio(d):.3f}"]
        for d in L3_DIRECTIONS:
            row += [f"{c.pages_per_s(d, 'mxfp8'):.0f}", f"{c.gb_per_s(d, 'mxfp8'):.2f}"]
        row.append(f"{report.byte_ratio:.4f}")
        row += [f"{c.goal:.2f}", "NO" if c.missed() else "yes"]
        body.append(row)
    return headers, body


def describe(report: Report) -> str:
    """The line above the table: what ran, where, and how it was counted."""
    pb = report.page_bytes
    return (
        f"L3 {report.backend} ({report.store}), {'x'.join(map(str, report.geometry))} "
        f"(heads x head_dim x layers), page_size {PAGE_SIZE}: MXFP8 page "
        f"{pb['mxfp8']} B, payload-only {pb['payload']} B; key tag "
        f"{report.format_tag}; median of {report.reps} reps (more under 16 pages) "
        f"after {report.warmup} warm-up, wall clock; the last rep's gets compared "
        f"byte for byte; {report.meta.get('device') or 'no GPU'}, "
        f"sglang {report.meta.get('sglang_version')}"
    )
