"""Seal and check throughput of host pages, per thread count and memory kind.

    python test/seal_throughput.py [--pages 64] [--threads 1,2,4,8]

Times ``seal.write`` and ``seal.holds`` (one xxh3 pass over a page part, as
the storage guards run them) over 1 MiB pages of three kinds of host memory:
plain pageable memory, pinned memory (``pin_memory``, as the host pool
allocates it), and, on a CUDA machine, pinned pages the GPU has just written
(a backup's pages, which the CPU reads from DRAM). Each figure is the best of
five passes over every page, spread over N threads (xxh3 runs outside the
GIL). Prints one JSON object. A count below 1 is refused (exit 2) before
anything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from sglang_mxfp8_hicache import seal
from testkit.command import interrupt_on_sigterm, positive_int, positive_ints

if TYPE_CHECKING:
    import torch

PAGE_BYTES = 1 << 20


def _parts(pages: torch.Tensor) -> list:
    import torch

    return [page.numpy() for page in pages.view(torch.uint8)]


def _best(run, refresh=None, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        if refresh is not None:
            refresh()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(pages: int, threads: list[int]) -> dict:
    import torch

    kinds = {"pageable": torch.empty(pages, PAGE_BYTES, dtype=torch.uint8)}
    source = None
    if torch.cuda.is_available():
        kinds["pinned"] = torch.empty(pages, PAGE_BYTES, dtype=torch.uint8).pin_memory()
        kinds["pinned_gpu_written"] = kinds["pinned"]
        source = torch.randint(0, 256, (pages, PAGE_BYTES), dtype=torch.uint8).cuda()
    figures = {}
    for kind, memory in kinds.items():
        memory.random_(0, 256) if kind != "pinned_gpu_written" else None
        parts = _parts(memory)
        refresh = None
        if kind == "pinned_gpu_written":

            def refresh(memory=memory):
                memory.copy_(source, non_blocking=False)
                torch.cuda.synchronize()

        for n in threads:
            with ThreadPoolExecutor(n) as pool:

                def write(parts=parts, pool=pool):
                    list(pool.map(lambda p: seal.write(p, 7), parts))

                def check(parts=parts, pool=pool):
                    list(pool.map(lambda p: seal.holds(p, 7), parts))

                for name, run in (("seal", write), ("check", check)):
                    seconds = _best(run, refresh)
                    figures[f"{kind}/{name}/{n}"] = {
                        "GB/s": round(pages * PAGE_BYTES / seconds / 1e9, 2),
                        "ms_per_page": round(seconds / pages * 1e3, 4),
                    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=positive_int, default=64)
    parser.add_argument(
        "--threads", type=positive_ints, default="1,2,4,8", help="comma separated"
    )
    args = parser.parse_args()
    interrupt_on_sigterm()
    import torch
    import xxhash

    report = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "xxhash": xxhash.VERSION,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "figures": measure(args.pages, args.threads),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
