"""The soak's requests: what arrives, and how one is admitted and given its
slots, as the scheduler does it for one request."""

from __future__ import annotations

import random
from array import array

import torch

from testkit.soak.figures import SoakFigures
from testkit.soak.stacks import PAGE

DOCUMENTS, DOCUMENT_PAGES, ZIPF = 8, 6, 1.1
MAX_NEW_TOKENS = 40


class Workload:
    """Requests on shared document prefixes in a Zipf-like mix, and their
    output tokens, from one seeded stream: the same on every rank."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.documents = [
            [self.rng.randrange(1, 30000) for _ in range(DOCUMENT_PAGES * PAGE)]
            for _ in range(DOCUMENTS)
        ]
        self.weights = [1 / (rank + 1) ** ZIPF for rank in range(DOCUMENTS)]
        self.arrived = 0

    def next_request(self):
        """A request on a shared document prefix, with its own tail."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        rng = self.rng
        document = rng.choices(self.documents, self.weights)[0]
        shared = rng.randrange(PAGE // 2, len(document))
        own = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 2 * PAGE))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, MAX_NEW_TOKENS))
        req = Req(f"r{self.arrived}", "", array("q", document[:shared] + own), params)
        self.arrived += 1
        return req

    def next_token(self) -> int:
        """The token a forward samples."""
        return self.rng.randrange(1, 30000)


def prefetch(cache, req) -> None:
    """A request's L3 prefetch at arrival (``Scheduler._prefetch_kvcache``)."""
    req.init_next_round_input(cache, cow_mamba=False)
    matched = req.prefix_len + req.host_hit_length
    if not (cache.is_backuped(req.last_host_node) or cache.is_root(req.last_host_node)):
        return
    fill = req.full_untruncated_fill_ids
    end = req._compute_max_prefix_len(len(fill))
    cache.prefetch_from_storage(
        req.cache_request_handle,
        req.last_host_node,
        fill[matched:end],
        cache.get_last_hash_value(req.last_host_node),
        None,
        matched_prefix_tokens=fill[:matched],
        extra_key=req.extra_key,
        cache_salt=req.cache_salt,
    )


def admit(cache, allocator, req, running: list, batch: list, figures, on_load_queued):
    """``PrefillAdder.add_one_req`` for one request: its storage hit, its
    match, the budget with its prefix locked, the host load-back (then
    ``on_load_queued()``), the lock. Whether it was admitted."""
    if cache.enable_storage and not _take_storage_hit(cache, req, figures):
        return False
    req.init_next_round_input(cache)
    fill = len(req.full_untruncated_fill_ids)
    need = fill - req.prefix_len + req.sampling_params.max_new_tokens + PAGE
    need += sum(
        r.sampling_params.max_new_tokens - len(r.output_ids) + PAGE
        for r in running + batch
    )
    need += sum(r.extend_end - r.prefix_len for r in batch)
    probe = cache.lock(req.last_node)
    try:
        if allocator.available_size() + cache.evictable_size() < need:
            return False
        if req.needs_host_load_back():
            _load_back(cache, req, figures)
        req.extend_end = fill
        req.lock = cache.lock(req.last_node)
        if req.host_loaded_length:
            on_load_queued()
    finally:
        cache.unlock(probe)
    cache.finish_storage_prefetch_admission(
        req.cache_request_handle,
        fulfilled_tokens=req.fulfilled_storage_hit_len(req.prefix_len),
        reason=None,
    )
    return True


def _take_storage_hit(cache, req, figures: SoakFigures) -> bool:
    """The request's L3 prefetch, if done: what it loaded, counted. False
    while it is still in progress."""
    if not cache.check_prefetch_progress(req.cache_request_handle):
        return False
    loaded, start = cache.pop_prefetch_loaded_span(req.cache_request_handle)
    req.storage_hit_length, req.storage_hit_start = loaded, start
    figures.pages_loaded_from_l3 += loaded // PAGE
    if figures.faults.get("node_restarted"):
        figures.pages_loaded_from_l3_after_node_restart += loaded // PAGE
    return True


def _load_back(cache, req, figures: SoakFigures) -> None:
    """The request's host hit queued to load back to the device
    (``init_load_back``), its prefix extended by what was loaded."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    host_lock = cache.inc_host_lock_ref(req.best_match_node).to_dec_params()
    lock = cache.lock(req.best_match_node)
    try:
        loaded = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )
    finally:
        cache.unlock(lock)
        cache.dec_host_lock_ref(req.best_match_node, host_lock)
    req.host_loaded_length, req.last_node = loaded
    req.prefix_len += req.host_loaded_length
    req.kv.cache_protected_len = req.prefix_len
    figures.pages_loaded_from_host += req.host_loaded_length // PAGE


def allocate_extend(cache, requests, req, device: str) -> torch.Tensor:
    """``allocation.alloc_for_extend`` for one request: its request-pool row
    and the device slots of its extend, written into the row."""
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

    start, end = req.prefix_len, req.extend_end
    prefix = (
        cache.prefix_device_indices(req)
        if start
        else torch.empty(0, dtype=torch.int64, device=device)
    )
    requests.alloc([req])
    last = prefix[-1:] if start else torch.full((1,), -1, device=device)

    def one(value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64)

    out = alloc_paged_token_slots_extend(
        cache,
        one(start).to(device),
        one(start),
        one(end).to(device),
        one(end),
        last,
        end - start,
    )
    row = req.kv.req_pool_idx
    requests.write((row, slice(0, start)), prefix)
    requests.write((row, slice(start, end)), out)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = end
    return out
