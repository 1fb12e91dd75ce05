"""SGLang 0.5.23: under ``--hicache-write-policy write_back`` with L3, a device
node that eviction cannot free still counts as evictable, so a prefill the
scheduler admits fails with "Prefill out of memory" (a RuntimeError that ends
the scheduler) instead of waiting.

The minimal case, through the tree the scheduler builds (``soak.build_cache``;
the host pool's class plays no part, ``--payload-only`` gives the same):

1. a request inserts node P (3 pages; write-back: on the device only), a
   second extends it with child C (2 pages);
2. eviction backs C up to host and, with L3, starts C's L3 write, which holds
   C's host lock until the write lands (held here by a slow L3 write);
3. the host pool fills (anything holding host slots: prefetches, other
   backups);
4. P is now a device leaf and ``evictable_size()`` counts it; evicting it
   needs a host backup (no room) or dropping its subtree (declined: C is
   locked), so P "stays device-resident until host space frees" and the
   eviction frees nothing;
5. a request the budget admits (``available_size() + evictable_size()``, as
   ``PrefillAdder`` counts) then fails in ``alloc_paged_token_slots_extend``.

    python test/sglang_write_back_oom.py [--payload-only]

Prints one JSON line: what ``evictable_size`` said, what eviction freed, and
the error. The soak refuses ``--write-policy write_back`` with
``--faults host_exhausted`` and L3 for this reason.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading

from testkit.command import interrupt_on_sigterm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--payload-only",
        action="store_true",
        help="the same with SGLang's host pool moving the payload alone",
    )
    flags = ["--payload-only"] if parser.parse_args().payload_only else []
    interrupt_on_sigterm()
    import pytest
    import torch

    from testkit import soak

    args = soak.parse_args(["--write-policy", "write_back", "--l3", "file", *flags])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        tempfile.TemporaryDirectory() as l3,
        tempfile.TemporaryDirectory() as work,
    ):
        args.init_file = os.path.join(work, "rendezvous")  # gloo's, removed with it
        if device == "cpu":
            from testkit.kernel_emulation import install_stack_emulation

            install_stack_emulation(monkeypatch)
        run = soak.Soak(args, device, l3)
        cache, controller = run.cache, run.controller
        landed = threading.Event()  # a slow L3: writes wait until released
        put = controller.page_set_func
        controller.page_set_func = lambda *a, **k: landed.wait(60) and put(*a, **k)
        try:
            report = _reproduce(run, cache, controller)
        finally:
            landed.set()
            run._drain()
            run.close()
    print(json.dumps(report), flush=True)


def _serve(run, token_ids: list[int]) -> None:
    """One request prefilled with one output token, then released."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        f"r{len(token_ids)}",
        "",
        array("q", token_ids),
        SamplingParams(max_new_tokens=1),
    )
    assert run._admit(req, []), "admission"
    run.forward.prefill([req])


def _reproduce(run, cache, controller) -> dict:
    """The five steps of the module docstring; what each said."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from testkit.soak import PAGE

    tokens = list(range(1, 6 * PAGE))
    _serve(run, tokens[: 3 * PAGE])  # P
    _serve(run, tokens[: 5 * PAGE])  # C under P
    cache.evict(EvictParams(num_tokens=2 * PAGE))  # C to host; its L3 write waits
    host = controller.mem_pool_host
    held = host.alloc(host.available_size() // PAGE * PAGE)  # the host pool full
    evictable = cache.evictable_size()
    available = run.allocator.available_size()
    freed = cache.evict(EvictParams(num_tokens=evictable)).num_tokens_evicted
    report = dict(evictable_before=evictable, freed=freed, available=available)
    try:  # a request the scheduler's budget admits
        _serve(run, [7] * (available + evictable - 2 * PAGE))
        report["error"] = None
    except RuntimeError as error:
        report["error"] = str(error).splitlines()[0]
    host.free(held)
    return report
