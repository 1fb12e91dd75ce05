# ruff: noqa: B023  (the lambdas run inside the loop iteration that builds them)
"""Issue-4 experiment, as run on 2026-11-29 (H100) at commit 4b7dca5 (run 2).

CPU cost per call of the pieces of a transfer, then ``bench.run`` with design
variants as extra columns: ``one`` (every layer's scales with layer 0, which
became the shipped design) and the ablations ``bench.ABLATIONS`` had at that
commit. ``OverlapHost`` (a side stream; it needs that commit's host pool) was a
column of the first run (commit 3ad3d5d), together with thread-block quotas of
2, 4 and 64. Output: exp1-*.json and exp3-*.json beside this file. Run from the
project root on a GPU machine: ``python3 docs/data/issue4_experiment.py``; at a
later commit its columns measure that commit's code.
"""

import os
import sys
import time

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_mxfp8_hicache import bench
from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
from sglang_mxfp8_hicache.selfcheck import (
    IO_BACKEND,
    build_device_pool,
    build_host_pool,
    page_token_indices,
)


class OverlapHost(MHATokenToKVPoolMXFP8Host):
    """Scales on a side stream, concurrent with the payload."""

    def _side(self):
        s = getattr(self, "_side_stream", None)
        if s is None:
            s = self._side_stream = torch.cuda.Stream()
        return s

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        main = torch.cuda.current_stream()
        side = self._side()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            h, d = self._rows(host_indices, device_indices)
            self._move_scales(
                self._all_layers, to_host=True, host_rows=h, device_rows=d
            )
        MHATokenToKVPoolHost.backup_from_device_all_layer(
            self, device_pool, host_indices, device_indices, io_backend
        )
        main.wait_stream(side)

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id,
        io_backend,
        *,
        is_draft=False,
    ):
        main = torch.cuda.current_stream()
        if layer_id == 0:
            side = self._side()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                h, d = self._rows(host_indices, device_indices)
                self._move_scales(
                    self._load_layer_groups[0],
                    to_host=False,
                    host_rows=h,
                    device_rows=d,
                )
                e0 = side.record_event()
                self._move_scales(
                    self._load_layer_groups[1],
                    to_host=False,
                    host_rows=h,
                    device_rows=d,
                )
                self._e1 = side.record_event()
        MHATokenToKVPoolHost.load_to_device_per_layer(
            self,
            device_pool,
            host_indices,
            device_indices,
            layer_id,
            io_backend,
            is_draft=is_draft,
        )
        if layer_id == 0:
            main.wait_event(e0)
        elif layer_id == 1:
            main.wait_event(self._e1)


class OneLaunchLoadHost(MHATokenToKVPoolMXFP8Host):
    """Every layer's scales with layer 0, one launch."""

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id,
        io_backend,
        *,
        is_draft=False,
    ):
        MHATokenToKVPoolHost.load_to_device_per_layer(
            self,
            device_pool,
            host_indices,
            device_indices,
            layer_id,
            io_backend,
            is_draft=is_draft,
        )
        if layer_id == 0:
            h, d = self._rows(host_indices, device_indices)
            self._move_scales(
                self._all_layers, to_host=False, host_rows=h, device_rows=d
            )


def cpu_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def micro():
    print("== CPU cost per call (us), 8 layers ==", flush=True)
    for heads in (1, 8):
        dp = build_device_pool(
            head_num=heads, head_dim=128, layer_num=8, pages=64, device="cuda"
        )
        ours = build_host_pool(
            dp, MHATokenToKVPoolMXFP8Host, host_to_device_ratio=1.0, pin_memory=True
        )
        pay = build_host_pool(
            dp, MHATokenToKVPoolHost, host_to_device_ratio=1.0, pin_memory=True
        )
        for pages in (1, 16):
            d = page_token_indices(torch.arange(pages) + 3).cuda()
            hc = page_token_indices(torch.arange(pages) + 5)
            hg = hc.cuda()
            h_rows, d_rows = ours._rows(hg, d)
            k = ours.scale_geometry.row_tokens
            cases = {
                "launch (module resolved once)": lambda: ours._move_scales(
                    ours._all_layers,
                    to_host=False,
                    host_rows=h_rows,
                    device_rows=d_rows,
                ),
                "_rows backup (pinned upload + gather)": lambda: ours._rows(hc, d),
                "_rows load (stack)": lambda: ours._rows(hg, d),
                "hc[::k].pin_memory()": lambda: hc[::k].pin_memory(),
                "payload backup": lambda: pay.backup_from_device_all_layer(
                    dp, hc, d, IO_BACKEND
                ),
                "ours backup": lambda: ours.backup_from_device_all_layer(
                    dp, hc, d, IO_BACKEND
                ),
                "payload load 8 layers": lambda: [
                    pay.load_to_device_per_layer(dp, hg, d, i, IO_BACKEND)
                    for i in range(8)
                ],
                "ours load 8 layers": lambda: [
                    ours.load_to_device_per_layer(dp, hg, d, i, IO_BACKEND)
                    for i in range(8)
                ],
            }
            for name, fn in cases.items():
                print(
                    f"  {heads}x128 {pages:3d}p  {name:40s} {cpu_us(fn):8.1f}",
                    flush=True,
                )
        ours.destroy()
        pay.destroy()


def main():
    micro()
    pages = tuple(int(p) for p in os.environ.get("PAGES", "1,4,16,64,256").split(","))
    classes = {
        "ours": MHATokenToKVPoolMXFP8Host,
        "one": OneLaunchLoadHost,
        **bench.ABLATIONS,
        "sglang": bench.sglang_mxfp8_host_cls(),
        "payload": MHATokenToKVPoolHost,
    }
    classes.pop("v1")
    rows = []
    for geom in bench.GEOMETRIES:
        part = bench.run((geom,), pages, classes=classes)
        rows += part
        headers, body = bench.table(part)
        print(" | ".join(headers))
        for b in body:
            print(" | ".join(b), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "exp.json"), "w") as f:
            f.write(bench.to_json(rows))


if __name__ == "__main__":
    sys.exit(main())
