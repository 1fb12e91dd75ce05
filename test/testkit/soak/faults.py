"""The faults ``--faults`` injects while the soak runs, each counted in the
run's figures. Each must end as a miss, a recompute or (the refused kernel) a
clean error, never as wrong bytes or a hang."""

from __future__ import annotations

import argparse
import os
import random
import threading

import torch

from testkit.soak.figures import SoakFigures
from testkit.soak.shadow import Shadow
from testkit.soak.stacks import PAGE

FAULTS = (
    "file",
    "backend_error",
    "host_exhausted",
    "eviction_race",
    "kernel_refused",
    "node_restart",
    "rank_read_error",
)
"""What ``--faults`` injects: ``file``, stored pages of L3 ``file`` truncated,
lengthened or deleted under it; ``backend_error``, an L3 read that raises
after writing its batch's host pages, or a write that raises;
``host_exhausted``, most of the free host pool taken for a while;
``eviction_race``, everything evictable on host and device evicted while a
load back is queued and again while it is in flight; ``kernel_refused``, one
load (after ``REFUSE_AFTER_STEPS``) whose device indices hold a page that is
not one aligned run; ``node_restart``, the Mooncake storage node killed every
``NODE_RESTART_EVERY`` steps and started again (every object it held gone)
once the master has unmounted it, ``NODE_CLIENT_TTL_S`` after its last
heartbeat, and ``NODE_DOWN_STEPS`` have passed; ``rank_read_error``, one L3
read in ``RANK_READ_FAIL_EVERY`` of the last rank raising after writing its
host pages while the other ranks' reads succeed (the ranks must still take
the same hits)."""
FAULT_COUNTS = (
    "file_truncated",
    "file_lengthened",
    "file_deleted",
    "backend_error",
    "host_exhausted",
    "eviction_race",
    "kernel_refused",
    "node_killed",
    "node_restarted",
    "rank_read_error",
)
"""What ``figures.faults`` counts, by name (``--at-least faults.KIND=N``)."""
FAULT_EVERY, HOST_HOLD_STEPS, REFUSE_AFTER_STEPS = 7, 10, 50
RANK_READ_FAIL_EVERY = 3
NODE_RESTART_EVERY, NODE_DOWN_STEPS, NODE_CLIENT_TTL_S = 400, 10, 2


class Faults:
    """Injects the run's ``--faults`` into its cache and counts each kind in
    ``figures.faults``. The backend and kernel faults wrap the controller and
    host pool once, at construction; the driver calls :meth:`inject` after
    every step, :meth:`race_eviction` where a load back is queued and where
    it is in flight, and :meth:`release_host` before it drains."""

    def __init__(
        self,
        args: argparse.Namespace,
        figures: SoakFigures,
        cache,
        allocator,
        shadow: Shadow,
        device: str,
        l3_dir: str,
        mooncake=None,
    ) -> None:
        """``mooncake``: the ``MooncakeLoopback`` that ``--l3 mooncake`` runs
        on, when this process started it (its node can be restarted)."""
        self.kinds, self.rank, self.tp = args.faults, args.rank, args.tp
        self.figures, self.cache, self.allocator = figures, cache, allocator
        self.controller = cache.cache_controller
        self.shadow, self.device, self.l3_dir = shadow, device, l3_dir
        self.mooncake, self.node_killed_at = mooncake, None
        self.rng = random.Random(args.seed + 7 + args.rank)
        self.held_host: list[tuple[int, torch.Tensor]] = []
        self.lock = threading.Lock()
        if "backend_error" in self.kinds:
            self._make_backend_fail()
        if "rank_read_error" in self.kinds and self.rank == self.tp - 1:
            self._make_reads_fail(1 / RANK_READ_FAIL_EVERY, "rank_read_error")
        if "kernel_refused" in self.kinds:
            self._make_a_load_malformed()

    def count(self, kind: str) -> None:
        """Counted from the storage threads too: under a lock."""
        with self.lock:
            self.figures.faults[kind] = self.figures.faults.get(kind, 0) + 1

    def inject(self) -> None:
        """After each step: the node restart's turn, and every
        ``FAULT_EVERY`` steps the stored pages' damage and the host's hold."""
        if "node_restart" in self.kinds:
            self._restart_node()
        if self.figures.steps % FAULT_EVERY:
            return
        if "file" in self.kinds:
            self._damage_stored_pages()
        if "host_exhausted" in self.kinds:
            self._exhaust_host()

    def race_eviction(self) -> None:
        """Everything evictable, on host and device, evicted now."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if "eviction_race" not in self.kinds:
            return
        self.cache.evict_host(self.controller.mem_pool_host.size)
        self.cache.evict(EvictParams(num_tokens=self.allocator.size))
        self.count("eviction_race")

    def release_host(self) -> None:
        """The host slots ``host_exhausted`` holds, freed."""
        for _, held in self.held_host:
            self.controller.mem_pool_host.free(held)
        self.held_host.clear()

    def _make_backend_fail(self) -> None:
        """One L3 read or write in eight raises; a read raises after the
        backend has written its batch's host pages, as a failure mid-batch."""
        controller, rng = self.controller, self.rng
        put = controller.page_set_func

        def failing_put(*args, **kwargs):
            if rng.random() < 1 / 8:
                self.count("backend_error")
                raise RuntimeError("injected: L3 write failed")
            return put(*args, **kwargs)

        self._make_reads_fail(1 / 8, "backend_error")
        controller.page_set_func = failing_put

    def _make_reads_fail(self, rate: float, kind: str) -> None:
        """A ``rate`` of this rank's L3 reads raise after the backend has
        written their batch's host pages, as a failure mid-batch."""
        controller, rng = self.controller, self.rng
        get = controller.page_get_func

        def failing_get(*args, **kwargs):
            hits = get(*args, **kwargs)
            if rng.random() < rate:
                self.count(kind)
                raise RuntimeError("injected: L3 read failed mid-batch")
            return hits

        controller.page_get_func = failing_get

    def _make_a_load_malformed(self) -> None:
        """The first load after ``REFUSE_AFTER_STEPS`` gets device indices
        whose first page is its tokens in reverse (not one aligned run)."""
        host = self.controller.mem_pool_host.anchor_entry.host_pool
        load = host.load_to_device_per_layer
        malformed: dict[int, torch.Tensor] = {}

        def refused_load(device_pool, host_indices, device_indices, *args, **kwargs):
            if self.figures.steps < REFUSE_AFTER_STEPS or self.figures.faults.get(
                "kernel_refused"
            ):
                return load(device_pool, host_indices, device_indices, *args, **kwargs)
            if id(device_indices) not in malformed:
                bad = device_indices.clone()
                bad[:PAGE] = device_indices[:PAGE].flip(0)
                malformed[id(device_indices)] = bad
            bad = malformed[id(device_indices)]
            self._expect_refused(
                host, bad, lambda: load(device_pool, host_indices, bad, *args, **kwargs)
            )

        host.load_to_device_per_layer = refused_load

    def _expect_refused(self, host, bad: torch.Tensor, load) -> None:
        """Run ``load`` of malformed ``bad`` indices: the kernel must move no
        byte of the malformed page and the pool's next transfer raise (made
        here at once: a synchronise and the check that opens every transfer);
        what the page held before is compared after."""
        from testkit.pools import synchronize

        slots = bad[:PAGE].to(self.device).long()
        before = self.shadow.snapshot(slots)
        try:
            load()
            synchronize(self.device)
            host._mover.raise_if_refused()
        finally:
            if any(
                not torch.equal(a, b)
                for a, b in zip(before, self.shadow.snapshot(slots), strict=True)
            ):
                self.figures.mismatches += 1
                self.figures.first_mismatches.append(
                    "kernel_refused: the refused page was written"
                )
            self.count("kernel_refused")
        raise AssertionError("the malformed page was not refused")

    def _damage_stored_pages(self) -> None:
        """A stored page of L3 ``file`` truncated, lengthened or deleted; with
        ranks, only the last rank's pages (each rank stores its own heads)."""
        if self.rank != self.tp - 1:
            return
        own = f"_{self.rank}_{self.tp}.bin"
        names = sorted(name for name in os.listdir(self.l3_dir) if name.endswith(own))
        if not names:
            return
        path = os.path.join(self.l3_dir, self.rng.choice(names))
        how = self.rng.choice(("truncated", "lengthened", "deleted"))
        try:
            if how == "deleted":
                os.remove(path)
            else:
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.truncate(size - 64 if how == "truncated" else size + 64)
        except FileNotFoundError:  # evicted or rewritten meanwhile
            return
        self.count(f"file_{how}")

    def _exhaust_host(self) -> None:
        """Most of the free host pool held for ``HOST_HOLD_STEPS`` steps."""
        host = self.controller.mem_pool_host
        steps = self.figures.steps
        while self.held_host and self.held_host[0][0] <= steps:
            host.free(self.held_host.pop(0)[1])
        if not self.held_host:
            take = host.available_size() * 9 // 10 // PAGE * PAGE
            held = host.alloc(take) if take else None
            if held is not None:
                self.held_host.append((steps + HOST_HOLD_STEPS, held))
                self.count("host_exhausted")

    def _restart_node(self) -> None:
        """The storage node SIGKILLed every ``NODE_RESTART_EVERY`` steps and
        started again (empty) once the master has unmounted it: a node that
        came back before that would find the master placing objects on its
        dead segment as well as its new one."""
        steps = self.figures.steps
        if self.node_killed_at is None and steps % NODE_RESTART_EVERY == 0:
            self.mooncake.kill_node()
            self.node_killed_at = steps
            self.count("node_killed")
        elif self.node_killed_at is not None:
            down = steps - self.node_killed_at >= NODE_DOWN_STEPS
            if down and not self.mooncake.segments():
                self.mooncake.start_node()
                self.node_killed_at = None
                self.count("node_restarted")
