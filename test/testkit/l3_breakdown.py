"""Where an L3 put and get of MXFP8 pages spend their time, per backend.

    python test/l3_breakdown.py [--backends file,nixl,hf3fs] [--threads 1,4]
        [--chunks 4,0] [--pages 1,4,16,64,256] [--device cpu] [--out DIR]
        [--l3-config JSON] [--no-seal]

Runs ``bench --l3`` (``tools/bench_l3.run``: ours and payload-only side by
side, median of 5 reps, more under 16 pages) once per local backend, seal
thread count (``SGLANG_MXFP8_HICACHE_SEAL_THREADS``) and smallest chunk of a
sealed batch (``SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES``; 0: one call) in one
process, and times, inside the same runs, what ours does that payload-only
does not: ``seal.Sealer.write_all`` on
puts, ``seal.Sealer.hold_all`` on gets (the xxh3 passes), and the rest of the
guard's own work (the whole guarded call less the backend's calls and the
seal). Writes each run's report as ``bench-l3-BACKEND-tTHREADS-cCHUNK.json``
under ``--out`` (an existing folder; without it, prints the report) and prints
one JSON object of the split, per run and batch size (the controller's
batches: 256 pages go as two of 128; the seal and backend stages of a chunked
batch per chunk size), in ms per call, the median over every rep. ``--device
cpu`` (the default on a machine without CUDA) runs without a GPU: the pools on
the CPU, SGLang's and our kernels emulated (``kernel_emulation``), pages not
pinned. ``dynamic`` and ``dynamic_v1`` are the tests' own classes
(``dict_l3_backend``, generic and zero-copy); ``mooncake`` and ``seaweedfs``
need ``--l3-config``, the extra config a loopback service prints.
``--no-seal`` makes the seal passes no-ops (every page holds its seal): what
is left is the backend and the guard's own work. A bad flag is refused (exit
2) before anything runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from sglang_mxfp8_hicache import seal, sealed, settings, storage
from testkit.command import (
    existing_dir,
    interrupt_on_sigterm,
    positive_ints,
    whole_numbers,
)

BACKENDS = (*storage.BACKENDS, "dynamic_v1")
"""The served backends, and ``dynamic`` driven through ``batch_*_v1``."""
NEED_CONFIG = ("mooncake", "seaweedfs")
"""The backends timed against a running service, named by ``--l3-config``."""

_spent: collections.defaultdict[tuple[str, int], list[float]] = collections.defaultdict(
    list
)


def _timed(name: str, fn: Callable[..., Any], pages_of: Callable[..., int]):
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[(name, pages_of(*args, **kwargs))].append(
                time.perf_counter() - start
            )

    return timed


def _install() -> None:
    """Timers around the seal passes, the sealed puts and gets of ours, and
    the backend's own call inside each (the size checks' reads included)."""
    seal.Sealer.write_all = _timed(
        "seal", seal.Sealer.write_all, lambda self, parts, *a: len(parts) // 2
    )
    seal.Sealer.hold_all = _timed(
        "check", seal.Sealer.hold_all, lambda self, parts, *a: len(parts) // 2
    )
    for kind in ("put", "get"):
        guarded = getattr(sealed.SealedBatches, kind)

        def with_backend_timed(self, call, batch, _g=guarded, _k=kind):
            inner = _timed(f"backend {_k}", call, lambda k, *a, **kw: len(k))
            return _g(self, inner, batch)

        timed = _timed(
            f"guarded {kind}", with_backend_timed, lambda s, c, batch: len(batch.keys)
        )
        setattr(sealed.SealedBatches, kind, timed)


def _backends(text: str) -> list[str]:
    """Comma-separated names of ``BACKENDS``."""
    names = text.split(",")
    if unknown := [name for name in names if name not in BACKENDS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; of {', '.join(BACKENDS)}")
    return names


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: ``--device`` is the machine's (``cuda`` where it has
    a GPU, else ``cpu``) unless given, and ``cuda`` needs one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", type=_backends, default="file,nixl,hf3fs")
    parser.add_argument("--threads", type=positive_ints, default="1,4")
    parser.add_argument("--chunks", type=whole_numbers, default="0,4")
    parser.add_argument("--pages", type=positive_ints, default="1,4,16,64,256")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="default: cuda on a machine with a CUDA GPU, else cpu",
    )
    parser.add_argument(
        "--out", type=existing_dir, help="the folder for the reports (default: printed)"
    )
    parser.add_argument("--l3-config", type=_json_object)
    parser.add_argument("--no-seal", action="store_true")
    args = parser.parse_args(argv)
    if args.l3_config is None:
        if needing := [name for name in args.backends if name in NEED_CONFIG]:
            parser.error(
                f"argument --backends: {', '.join(needing)} needs --l3-config, the "
                "extra config a loopback service prints"
            )
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda, on a machine without a CUDA GPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    interrupt_on_sigterm()
    from sglang_mxfp8_hicache.tools import bench_l3
    from testkit import dict_l3_backend

    if args.no_seal:
        seal.Sealer.write_all = lambda self, parts, seeds: None
        seal.Sealer.hold_all = lambda self, parts, seeds: [True] * len(parts)
    if args.device == "cpu":
        from _pytest.monkeypatch import MonkeyPatch

        from testkit.kernel_emulation import install_emulation

        install_emulation(MonkeyPatch())
    _install()
    bench_l3.apply_plugin_hooks()
    split: dict[str, Any] = {}
    threads_list, chunks_list = args.threads, args.chunks
    runs = [
        (backend, threads, smallest)
        for backend in args.backends
        for threads in threads_list
        for smallest in chunks_list
        # what is not sealed: one run
        if storage.BACKENDS[backend.removesuffix("_v1")].sealed
        or (threads, smallest) == (threads_list[0], chunks_list[0])
    ]
    for backend, threads, smallest in runs:
        os.environ["SGLANG_MXFP8_HICACHE_SEAL_THREADS"] = str(threads)
        os.environ["SGLANG_MXFP8_HICACHE_L3_CHUNK_PAGES"] = str(smallest)
        settings.current.cache_clear()
        _spent.clear()
        config = args.l3_config
        dict_l3_backend.STORE.clear()  # bench --l3 removes nothing a class holds
        if backend.startswith("dynamic"):
            config = dict_l3_backend.extra_config(v1=backend == "dynamic_v1")
        report = bench_l3.run(
            backend.removesuffix("_v1"),
            pages_list=args.pages,
            device=args.device,
            pin_memory=args.device == "cuda",
            l3_config=config,
        )
        name = f"bench-l3-{backend}-t{threads}-c{smallest}"
        if args.out is None:
            print(report.to_json().decode(), flush=True)
        else:
            with open(os.path.join(args.out, f"{name}.json"), "wb") as f:
                f.write(report.to_json())
        print(bench_l3.describe(report))
        for cell in report.cells:
            print(
                f"  {name} {cell.pages:4d} pages: put {cell.ratio('put'):.3f}x "
                f"get {cell.ratio('get'):.3f}x"
            )
        split[name] = {
            f"{stage} {n}": round(1e3 * statistics.median(spent), 4)
            for (stage, n), spent in sorted(_spent.items())
        }
    print(json.dumps(split, indent=1))
