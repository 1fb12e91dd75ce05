"""The model's side of the soak's steps and their results (``run_batch``,
``process_batch_result``), as the shadow sees them: each new token's KV is
the shadow's bytes, one token is sampled per request and forward, and every
served prefix and every finished request's whole row is checked."""

from __future__ import annotations

import torch

from testkit.soak.figures import SoakFigures
from testkit.soak.shadow import Shadow
from testkit.soak.workload import Workload, allocate_extend


class Forward:
    """Prefill batches and decode steps over the running requests."""

    def __init__(
        self,
        cache,
        requests,
        shadow: Shadow,
        workload: Workload,
        figures: SoakFigures,
        device: str,
        on_load_in_flight,
    ) -> None:
        """``on_load_in_flight()`` runs where a prefill's host loads are in
        flight (the ``eviction_race`` fault)."""
        self.cache, self.requests, self.shadow = cache, requests, shadow
        self.workload, self.figures, self.device = workload, figures, device
        self.on_load_in_flight = on_load_in_flight
        self.running: list = []

    def prefill(self, batch: list) -> None:
        """The batch's extends: their served prefixes checked, their new
        tokens written, one output token each."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        consumer = self.cache.ready_to_load_host_cache()
        if consumer >= 0:
            self.on_load_in_flight()
        slots = [
            allocate_extend(self.cache, self.requests, req, self.device)
            for req in batch
        ]
        if consumer >= 0:  # the forward's layers wait on the loads
            counter = self.cache.cache_controller.layer_done_counter
            event = counter.events[consumer].finish_event
            torch.get_device_module(self.device).current_stream().wait_event(event)
        for req, out in zip(batch, slots, strict=True):
            token_ids = list(req.full_untruncated_fill_ids)
            self._check(req, req.prefix_len, token_ids, "served prefix")
            rows = self.shadow.rows(token_ids)[req.prefix_len : req.extend_end]
            self.shadow.write(out, rows)
            req.output_ids.append(self.workload.next_token())
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self.finish(req)
            else:
                checkpoint_kv_cache(req, self.cache)
                self.running.append(req)

    def decode(self) -> None:
        """One token for every running request, written to its next slot."""
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode

        device = self.device
        for req in list(self.running):
            position = req.kv.kv_committed_len
            row = req.kv.req_pool_idx
            last = self.requests.req_to_token[row, position - 1 : position].long()
            length = torch.tensor([position + 1])
            out = alloc_paged_token_slots_decode(
                self.cache, length.to(device), length, last
            )
            self.requests.write(
                (row, torch.tensor([position], device=device)), out.to(torch.int32)
            )
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
            token_ids = list(req.origin_input_ids) + list(req.output_ids)
            self.shadow.write(out, self.shadow.rows(token_ids)[position:])
            req.output_ids.append(self.workload.next_token())
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                self.running.remove(req)
                self.finish(req)

    def finish_running(self) -> None:
        """Every running request finished now."""
        for req in self.running:
            self.finish(req)
        self.running.clear()

    def finish(self, req) -> None:
        """The request's whole row checked, then released and checkpointed
        into the tree."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        token_ids = list(req.origin_input_ids) + list(req.output_ids)
        self._check(req, req.kv.kv_committed_len, token_ids, "whole row at finish")
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.figures.requests_served += 1

    def _check(self, req, length: int, token_ids: list[int], where: str) -> None:
        """The first ``length`` tokens of ``req``'s row against the shadow."""
        slots = self.requests.req_to_token[req.kv.req_pool_idx, :length].long()
        self.shadow.check(self.figures, slots, token_ids, f"{req.rid} {where}")
