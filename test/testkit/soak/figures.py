"""What one soak run did and found, and the hooks that count the cache's
transfers into it."""

from __future__ import annotations

import argparse

import msgspec

from testkit.soak.stacks import PAGE


class SoakFigures(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one run did and found; written as one JSON line, read by the tests."""

    device: str
    tp_rank: int = 0
    tp_size: int = 1
    stack: str
    kv_cache_dtype: str
    tree_core: str
    write_policy: str
    l3: str | None
    host_pool: str = ""
    seed: int
    seconds: float
    wall_s: float = 0.0
    """From the cache's build to the idle check."""
    steps: int = 0
    requests_served: int = 0
    pages_backed_up: int = 0
    device_pages_evicted: int = 0
    host_pages_evicted: int = 0
    pages_loaded_from_host: int = 0
    pages_loaded_from_l3: int = 0
    pages_loaded_from_l3_after_node_restart: int = 0
    """Of those, loaded after the storage node was first started again
    (``node_restart``): the store serves again once it is back."""
    tier_flushes: int = 0
    beside_sglang_backed_up: int = 0
    """With ``--beside-sglang``: pages SGLang's MXFP8 host class backed up
    beside ours, each compared with the device and ours."""
    beside_sglang_loaded: int = 0
    """Pages ours loaded whose device bytes were compared with both hosts'."""
    faults: dict[str, int] = {}
    tokens_checked: int = 0
    mismatches: int = 0
    hangs: int = 0
    clean_error: str = ""
    """The error that ended the run, as it would end the scheduler (only a
    refused kernel may end one)."""
    first_mismatches: list[str] = []


def start_figures(args: argparse.Namespace, device: str, cache) -> SoakFigures:
    """The run's figures before its first step: what it runs, over which cache."""
    return SoakFigures(
        device=device,
        tp_rank=args.rank,
        tp_size=args.tp,
        stack=args.stack,
        kv_cache_dtype=args.kv_cache_dtype,
        tree_core=type(cache.tree_core).__name__,
        write_policy=args.write_policy,
        l3=args.l3,
        seed=args.seed,
        seconds=args.seconds,
        host_pool=type(
            cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        ).__name__,
    )


def count_transfers(cache, figures: SoakFigures) -> None:
    """Pages backed up, device and host tokens evicted, as the cache does
    them: counted on the instances, the methods themselves unchanged."""
    host = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    backup = host.backup_from_device_all_layer

    def counted_backup(device_pool, host_indices, *rest, **kwargs):
        figures.pages_backed_up += len(host_indices) // PAGE
        return backup(device_pool, host_indices, *rest, **kwargs)

    host.backup_from_device_all_layer = counted_backup
    for name in ("evict", "evict_for_alloc"):
        evict = getattr(cache, name)

        def counted_evict(*args, _evict=evict, **kwargs):
            result = _evict(*args, **kwargs)
            figures.device_pages_evicted += result.num_tokens_evicted // PAGE
            return result

        setattr(cache, name, counted_evict)
    evict_host = cache.evict_host

    def counted_evict_host(*args, **kwargs):
        evicted = evict_host(*args, **kwargs)
        figures.host_pages_evicted += evicted // PAGE
        return evicted

    cache.evict_host = counted_evict_host
