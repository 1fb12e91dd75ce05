"""The soak's driver: the scheduler's loop (``Scheduler.event_loop_normal``)
over the cache, step by step, with the shadow written and checked and the
faults injected between steps."""

from __future__ import annotations

import argparse
import time

import torch

from testkit.soak.faults import Faults
from testkit.soak.figures import SoakFigures, count_transfers, start_figures
from testkit.soak.forward import Forward
from testkit.soak.shadow import Shadow
from testkit.soak.stacks import MAX_RUNNING, build_cache
from testkit.soak.workload import Workload, admit, prefetch

WAIT_S = 60.0
"""Longest any wait may take before it counts as a hang."""


class Soak:
    """The scheduler's loop over the cache, with the shadow checked."""

    def __init__(
        self, args: argparse.Namespace, device: str, l3_dir: str, mooncake=None
    ) -> None:
        """``mooncake``: the ``MooncakeLoopback`` that ``--l3 mooncake``
        runs on, when this process started it (its node can be restarted)."""
        self.started = time.monotonic()
        self.args, self.device = args, device
        self.workload = Workload(args.seed)  # the same on every rank
        self.cache, self.allocator, self.requests, layers = build_cache(
            args, device, l3_dir
        )
        # Each of the model's heads holds its own bytes, on whichever rank.
        self.shadow = Shadow(
            args.seed,
            layers,
            self.allocator,
            device != "cpu",
            first_head=args.rank * args.heads,
        )
        self.controller = self.cache.cache_controller
        self.figures = start_figures(args, device, self.cache)
        self.waiting: list = []
        count_transfers(self.cache, self.figures)
        self.faults = Faults(
            args,
            self.figures,
            self.cache,
            self.allocator,
            self.shadow,
            device,
            l3_dir,
            mooncake,
        )
        if args.beside_sglang:
            from testkit.soak.beside import BesideSGLang

            BesideSGLang(
                self.cache,
                layers[0].pool,
                self.figures,
                device,
                control=args.beside_sglang_control,
            )
        if args.no_l3_writes:  # what is in L3 came from another process
            self.controller.page_set_func = lambda *args, **kwargs: False
        self.forward = Forward(
            self.cache,
            self.requests,
            self.shadow,
            self.workload,
            self.figures,
            device,
            self.faults.race_eviction,  # the load is in flight
        )

    # -- every rank in step ----------------------------------------------------

    def _agreed(self, flag: bool) -> bool:
        """``flag`` on any rank: every rank steps and waits alike, as the
        scheduler's collectives need (one clock would not be every rank's)."""
        if self.args.tp == 1:
            return flag
        import torch.distributed as dist

        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return bool(vote.item())

    def _wait(self, busy, what: str) -> None:
        """Run ``check_hicache_events`` until ``busy()`` is false, bounded."""
        deadline = time.monotonic() + WAIT_S
        while self._agreed(bool(busy())):
            self.cache.check_hicache_events()
            if self._agreed(time.monotonic() > deadline):
                self.figures.hangs += 1
                raise TimeoutError(f"{what} still busy after {WAIT_S:.0f} s")
            time.sleep(0.005)

    # -- arrival and admission -------------------------------------------------

    def _arrive(self) -> None:
        """A request arrives, and with L3 its prefetch starts."""
        req = self.workload.next_request()
        if self.cache.enable_storage:
            prefetch(self.cache, req)
        self.waiting.append(req)

    def _admit(self, req, batch: list) -> bool:
        """``PrefillAdder.add_one_req`` (``workload.admit``); with
        ``eviction_race``, everything evicted while its load back is queued."""
        return admit(
            self.cache,
            self.allocator,
            req,
            self.forward.running,
            batch,
            self.figures,
            self.faults.race_eviction,
        )

    # -- the loop --------------------------------------------------------------

    def _drain(self) -> None:
        """Every running request finished, the held host slots released, and
        every backup, load-back and L3 write landed."""
        self.forward.finish_running()
        self.faults.release_host()
        cache = self.cache
        self._wait(
            lambda: (
                cache.ongoing_write_through
                or cache.ongoing_load_back
                or cache.ongoing_backup
                # a reset stops the storage threads: none may be inside a
                # prefetch whose all-reduce another rank would not join
                or cache.ongoing_prefetch
            ),
            "transfers",
        )

    def _flush_tiers(self) -> None:
        """``Scheduler.flush_cache`` with L3 kept: the device and host tiers
        emptied and every byte of them overwritten, so later hits come from L3."""
        from sglang_mxfp8_hicache.tools.pools import host_page_rows
        from testkit.pools import device_buffers

        self._drain()  # the held host slots first: a reset frees every host slot
        self.cache.reset()
        self.requests.clear()
        self.allocator.clear()
        for pool in {id(d.pool): d.pool for d in self.shadow.layers}.values():
            for tensor in device_buffers(pool):
                tensor.view(torch.uint8).fill_(0xEE)
        for entry in self.controller.mem_pool_host.entries:
            host_page_rows(entry.host_pool).fill_(0xDD)
        self.figures.tier_flushes += 1

    def _step(self) -> None:
        """One turn of ``event_loop_normal``: events, arrivals, a prefill batch
        or a decode step, the pending backups, then faults and tier flushes."""
        self.cache.check_hicache_events()
        while len(self.waiting) < 2 * MAX_RUNNING:
            self._arrive()
        batch: list = []
        for req in list(self.waiting):
            if len(self.forward.running) + len(batch) >= MAX_RUNNING:
                break
            if self._admit(req, batch):
                self.waiting.remove(req)
                batch.append(req)
        if batch:
            self.forward.prefill(batch)
        elif self.forward.running:
            self.forward.decode()
        self.cache.flush_pending_backups()
        self.figures.steps += 1
        self.faults.inject()
        if self.args.l3 and self.figures.steps % self.args.flush_every == 0:
            self._flush_tiers()

    def run(self) -> SoakFigures:
        """Steps until ``--seconds`` have passed and every ``--at-least``
        floor is met (for at most ``--floor-grace`` seconds more), then the
        drain and the idle check; a refused kernel (``kernel_refused``) ends
        it as a clean error."""
        deadline = time.monotonic() + self.args.seconds
        give_up = deadline + self.args.floor_grace
        while self._going_on(deadline, give_up):
            try:
                self._step()
            except Exception as error:  # a refused kernel ends the scheduler
                if not self.figures.faults.get("kernel_refused") or isinstance(
                    error, AssertionError
                ):
                    raise
                self.figures.clean_error = f"{type(error).__name__}: {error}"
                self.figures.wall_s = round(time.monotonic() - self.started, 1)
                return self.figures
        self._drain()
        self._idle_check()
        self.figures.wall_s = round(time.monotonic() - self.started, 1)
        return self.figures

    def _going_on(self, deadline: float, give_up: float) -> bool:
        """Whether every rank takes another step: until the first rank's
        ``--seconds`` have passed, then while a floor is met on no rank (a
        rank's own faults count on it alone), until ``give_up``."""
        now = time.monotonic()
        if self._agreed(now >= deadline):
            floors = self.args.at_least
            met = [self._figure(name) >= count for name, count in floors]
            return not all(self._met_on_a_rank(met)) and not self._agreed(
                now >= give_up
            )
        return True

    def _figure(self, name: str) -> int:
        """A count of the figures, or ``faults.KIND``."""
        if name.startswith("faults."):
            return self.figures.faults.get(name.split(".", 1)[1], 0)
        return getattr(self.figures, name)

    def _met_on_a_rank(self, met: list[bool]) -> list[bool]:
        """Each floor met on this rank or another."""
        if self.args.tp == 1 or not met:
            return met
        import torch.distributed as dist

        votes = torch.tensor([int(m) for m in met])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return [bool(v) for v in votes.tolist()]

    def _idle_check(self) -> None:
        """The scheduler's idle check: every device token free, evictable or
        held, and none held (protected) once every request has finished."""
        cache = self.cache
        leaked = self.allocator.size - (
            self.allocator.available_size()
            + cache.evictable_size()
            + cache.protected_size()
        )
        if leaked or cache.protected_size():
            self.figures.first_mismatches.append(
                f"idle check: {leaked} tokens leaked, {cache.protected_size()} protected"
            )
            self.figures.mismatches += 1

    def close(self) -> None:
        import torch.distributed as dist
        from sglang.srt.runtime_context import reset_context

        torch.get_device_module(self.device).synchronize()
        dist.barrier()
        self.cache.shutdown()  # detaches L3 first: a reset would restart its threads
        self.controller.reset()
        self.cache.release_host_resources()
        dist.barrier()
        dist.destroy_process_group()
        reset_context()
