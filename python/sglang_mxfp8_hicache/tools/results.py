"""Typed results (msgspec) the tools write and every reader shares (the CLI,
``bench --plot``, the tests, the JSON under ``docs/data``): ``check``'s steps,
its fresh process's findings, the L2 bench's rows, the L3 bench's report; and what a run covers by default.
No torch here: ``--help`` and ``bench --plot`` start at once."""

from __future__ import annotations

import statistics

import msgspec

from sglang_mxfp8_hicache.geometry import FP4_FORMAT_NAMES
from sglang_mxfp8_hicache.hooks import HookState

BENCH_GEOMETRIES = ((1, 128, 8), (8, 128, 8), (32, 128, 8), (8, 128, 80))
"""(KV heads, head_dim, layers)."""
BENCH_PAGES = (1, 4, 16, 64, 256, 1024)
BENCH_SETUPS = ("page_first", "draft", "layer_first", "direct", "page_head")
BENCH_SETUPS += FP4_FORMAT_NAMES
"""The host pool setups of ``bench --setup`` (``bench.setups`` builds them)."""
L3_BACKENDS = ("file", "hf3fs", "nixl", "mooncake", "seaweedfs", "dynamic")
"""What ``bench --l3`` times; mooncake and seaweedfs against a running service."""
L3_GEOMETRY = (8, 128, 4)
"""K and V of a page are each 512 KiB of payload plus 16 KiB of scales."""
L3_PAGES = BENCH_PAGES
BENCH_WARMUP, BENCH_REPEAT = 3, 20
L3_WARMUP, L3_REPEAT = 1, 5
"""Untimed and timed rounds: an L3 round of 1024 pages moves GBs through a
file system or a network, an L2 round takes milliseconds."""


class Step(msgspec.Struct, frozen=True):
    """One step of ``check``, as its table row and its ``--json`` entry."""

    name: str
    status: str
    detail: str


class Dispatch(msgspec.Struct, frozen=True):
    """``check``'s fresh process after ``load_plugins()`` (``cli.print_dispatch``):
    SGLang's host pool class by device pool dtype, and each plugin hook."""

    chosen: dict[str, str]
    hooks: tuple[HookState, ...]


BENCH_ABLATIONS = ("sm", "fallback", "load_doubling")
"""What ``bench --ablations`` takes (``ablations.ABLATIONS``)."""
BESIDE_LOOPS = ("gemm", "hbm", "decode", "prefill")
"""What ``bench --beside`` runs on the main stream (``bench.beside_loops``)."""


class Goal(msgspec.Struct, frozen=True):
    """Ours over column ``to`` at most ``limit``, for batches of ``pages`` up
    to ``up_to`` (whole transfers, or the wait for layer 0 of a load), alone
    or (``beside``) beside a loop on the main stream.

    ``to="loop"``: the loop's time beside the transfer over its time alone at
    most ``limit`` (``loop``: beside that loop only); ``loop_over``: at most
    ``limit`` above that column's slowdown of the loop."""

    to: str
    limit: float
    pages: int = 1
    up_to: int | None = None
    direction: str | None = None
    layer0: bool = False
    mxfp8_only: bool = False
    beside: bool = False
    loop: str | None = None
    loop_over: str | None = None

    def applies(self, row: Row, *, layer0: bool) -> bool:
        return (
            self.layer0 == layer0
            and self.beside == (row.beside is not None)
            and (self.loop is None or self.loop == row.beside)
            and row.pages >= self.pages
            and (self.up_to is None or row.pages <= self.up_to)
            and (self.direction is None or self.direction == row.direction)
            and not (self.mxfp8_only and row.setup in FP4_FORMAT_NAMES)
        )

    def measure(self, row: Row, *, layer0: bool) -> float | None:
        """What the goal bounds in ``row``: a ratio, or a loop slowdown's excess."""
        if self.to != "loop":
            return row.ratio("ours", self.to, layer0=layer0)
        ours = row.loop_ratio.get("ours")
        if self.loop_over is None or ours is None:
            return ours
        other = row.loop_ratio.get(self.loop_over)
        return None if other is None else ours - other

    def label(self) -> str:
        pages = f"{self.pages}" if self.up_to is None else f"{self.pages}-{self.up_to}"
        if self.to == "loop":
            over = f"{self.loop_over}+" if self.loop_over else ""
            return f"{self.loop or ''}loop<={over}{self.limit}@{pages}p"
        return f"{self.to}<={self.limit}@{pages}p"


GOALS = (
    # Whole transfers: with scales, no slower than SGLang moves the payload
    # alone (MXFP8; an FP4 page is 1.125x its payload), and near the link.
    Goal("payload", 1.0, pages=16, mxfp8_only=True),
    Goal("raw", 1.05, pages=64),
    Goal("raw", 1.5, up_to=1, direction="load"),
    Goal("sglang", 1.0),
    # The forward pass's wait for layer 0 of a load; "sm": our SM-copy path
    # (the ``sm`` ablation), when it is timed beside.
    Goal("payload", 1.05, pages=4, layer0=True, mxfp8_only=True),
    Goal("sglang", 1.0, layer0=True),
    Goal("sm", 1.05, layer0=True),
    # Beside the forward pass: what a transfer costs the loop on the main
    # stream, and the transfer's own time there.
    Goal("loop", 1.05, direction="backup", beside=True, loop="gemm"),
    Goal("loop", 1.10, direction="load", beside=True, loop="gemm"),
    Goal("loop", 1.03, beside=True, loop="hbm"),
    Goal("loop", 0.02, beside=True, loop_over="sglang"),
    Goal("raw", 1.15, pages=16, direction="load", beside=True),
    Goal("raw", 1.5, up_to=1, direction="load", beside=True),
    Goal("raw", 1.3, pages=16, layer0=True, beside=True),
    Goal("raw", 1.2, pages=16, direction="backup", beside=True),
)
"""What ``bench --check`` holds every cell to (docs/benchmarks.md)."""


class Row(msgspec.Struct):
    """One (geometry, setup, batch, direction) cell: median ms per column, None
    where the column's class refused the setup; loads also until layer 0's
    work is done. ``drafts``: packed draft layers beside ``layers``."""

    heads: int
    head_dim: int
    layers: int
    pages: int
    direction: str
    ms: dict[str, float | None]
    layer0_ms: dict[str, float | None] = {}
    setup: str = "page_first"
    drafts: int = 0
    beside: str | None = None
    """The loop the transfers ran beside (``BESIDE_LOOPS``), or None: alone;
    ``loop_ratio``: its time beside each column's transfer over its time alone."""
    loop_ratio: dict[str, float | None] = {}

    @property
    def geometry(self) -> str:
        return f"{self.heads}x{self.head_dim}x{self.layers}"

    @property
    def setup_label(self) -> str:
        return f"{self.setup}({self.drafts})" if self.drafts else self.setup

    @property
    def refused(self) -> list[str]:
        return [name for name, ms in self.ms.items() if ms is None]

    def ratio(self, name: str, to: str = "payload", *, layer0: bool = False):
        ms = self.layer0_ms if layer0 else self.ms
        if ms.get(name) is None or ms.get(to) is None:
            return None
        return ms[name] / ms[to]

    def goals(self, *, layer0: bool = False) -> list[Goal]:
        return [g for g in GOALS if g.applies(self, layer0=layer0)]

    def missed(self, *, layer0: bool = False) -> list[Goal]:
        """The goals of this cell that ours misses (a refused column checks nothing)."""
        if self.ms.get("ours") is None:
            return self.goals(layer0=layer0)
        return [
            g
            for g in self.goals(layer0=layer0)
            if (value := g.measure(self, layer0=layer0)) is not None and value > g.limit
        ]

    def meets_goal(self) -> bool:
        """Every goal of the whole transfer and, for a load, of layer 0's wait."""
        return not self.missed() and not (self.layer0_ms and self.missed(layer0=True))


class BenchRun(msgspec.Struct):
    """``bench --json-out``: the rows of one run and where it ran. Each row is
    written with what it decides (``refused``, ``missed``, ``met``), which a
    reader may ignore."""

    device: str | None
    page_size: int
    rows: list[Row]

    def to_json(self) -> bytes:
        rows = [
            msgspec.structs.asdict(r)
            | {
                "refused": r.refused,
                "missed": [g.label() for g in r.missed()],
                "layer0_missed": [g.label() for g in r.missed(layer0=True)],
                "met": r.meets_goal(),
            }
            for r in self.rows
        ]
        run = msgspec.structs.asdict(self) | {"rows": rows}
        return msgspec.json.format(msgspec.json.encode(run), indent=1)


L3_POOLS = ("mxfp8", "payload")
L3_DIRECTIONS = ("put", "get")
L3_GOAL_RATIO = 1.05
L3_GOAL_FROM_PAGES = 16
L3_SMALL_BATCH_GOAL_RATIO = 1.2
"""MXFP8 time at most L3_GOAL_RATIO x payload-only time from
L3_GOAL_FROM_PAGES pages up, L3_SMALL_BATCH_GOAL_RATIO x below."""


def l3_reps(pages: int, reps: int) -> int:
    """Timed rounds of a batch of ``pages``: under ``L3_GOAL_FROM_PAGES``, as many
    as move that many pages ``reps`` times (a store's speed varies by object)."""
    return max(reps, -(-reps * L3_GOAL_FROM_PAGES // pages))


class Cell(msgspec.Struct):
    """One batch size: seconds of every timed repetition, per direction and pool."""

    pages: int
    seconds: dict[str, dict[str, list[float]]]
    page_bytes: dict[str, int]

    def ms(self, direction: str, pool: str) -> float:
        return 1e3 * statistics.median(self.seconds[direction][pool])

    def ratio(self, direction: str) -> float:
        return self.ms(direction, "mxfp8") / self.ms(direction, "payload")

    def pages_per_s(self, direction: str, pool: str) -> float:
        return self.pages / (self.ms(direction, pool) / 1e3)

    def gb_per_s(self, direction: str, pool: str) -> float:
        return self.pages_per_s(direction, pool) * self.page_bytes[pool] / 1e9

    @property
    def goal(self) -> float:
        """The most MXFP8 may take, as a multiple of payload-only's time."""
        small = self.pages < L3_GOAL_FROM_PAGES
        return L3_SMALL_BATCH_GOAL_RATIO if small else L3_GOAL_RATIO

    def missed(self) -> list[str]:
        """The directions over this batch's goal."""
        return [d for d in L3_DIRECTIONS if self.ratio(d) > self.goal]


class Report(msgspec.Struct, kw_only=True):
    """``bench --l3``: where pages went (``store``: the directory, the master),
    the geometry (KV heads, head_dim, layers), and every batch's cell."""

    backend: str
    store: str
    geometry: tuple[int, int, int]
    reps: int
    warmup: int
    format_tag: str
    page_bytes: dict[str, int]
    cells: list[Cell]
    meta: dict[str, str | None] = {}

    @property
    def byte_ratio(self) -> float:
        """What 'their extra bytes' allow: MXFP8 page bytes / payload page bytes."""
        return self.page_bytes["mxfp8"] / self.page_bytes["payload"]

    def missed(self) -> list[tuple[int, str, float]]:
        """(pages, direction, ratio) of every cell over its goal."""
        return [(c.pages, d, c.ratio(d)) for c in self.cells for d in c.missed()]

    def to_json(self) -> bytes:
        """The report, with each cell's medians, rates, ratios and verdict."""
        cells = [
            msgspec.structs.asdict(c)
            | {
                d: {
                    "median_ms": {p: c.ms(d, p) for p in L3_POOLS},
                    "gb_per_s": {p: c.gb_per_s(d, p) for p in L3_POOLS},
                    "ratio": c.ratio(d),
                }
                for d in L3_DIRECTIONS
            }
            | {"goal": c.goal, "met": not c.missed()}
            for c in self.cells
        ]
        report = msgspec.structs.asdict(self) | {
            "byte_ratio": self.byte_ratio,
            "goal": {
                "ratio": L3_GOAL_RATIO,
                "from_pages": L3_GOAL_FROM_PAGES,
                "below": L3_SMALL_BATCH_GOAL_RATIO,
            },
            "cells": cells,
        }
        return msgspec.json.format(msgspec.json.encode(report), indent=1)
