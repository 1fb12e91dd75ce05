"""A seeded soak of the host pool through the scheduler's own radix cache.

Builds the tree cache the scheduler builds for ``--enable-hierarchical-cache``
(``registry.create_tree_cache`` over ``CacheInitParams``: SGLang's paged or
SWA allocator, ``ReqToTokenPool``, assembler and ``HybridCacheController``,
with the plugin's host pool) over real device pools (``STACKS``), and drives
it as ``Scheduler.event_loop_normal`` does: requests whose token ids share
prefixes in a Zipf-like mix arrive (with L3, ``prefetch_from_storage`` at
arrival), are matched and admitted (host hits loaded back with
``init_load_back`` / ``ready_to_load_host_cache``, L3 hits through
``check_prefetch_progress``), extended, decoded token by token, checkpointed
and released, while device and host pressure evict; ``check_hicache_events``
opens every step and ``flush_pending_backups`` closes it. With L3, every
``--flush-every`` steps the device and host tiers are emptied and overwritten
(``flush_cache``), so that later hits come from L3. With ``--tp N``, N
processes do it in step over gloo, as N scheduler ranks (each on its own GPU
where the machine has N, else all on the CPU).

The shadow: the KV bytes of a token (payload and scales, K and V, every layer)
are a function of its whole prefix, row ``h`` of a table where ``h`` is the
prefix's rolling hash, as a model's KV is a function of its prefix (on a GPU
the rows are what SGLang's ``set_kv_buffer`` makes of random bf16 K and V;
without one, random bytes). Every prefix the cache serves (device hits, pages
loaded back from host, pages from L3) is compared with it at admission, and
every request's whole row when it finishes (pages no transfer should have
touched); sliding-window layers inside the window. A mismatch is counted, not
raised, so a run reports them all; every wait is bounded and a wait that runs
out counts as a hang.

    python test/soak.py --seconds 60 --seed 0 [--stack kv|draft|hybrid_swa]
        [--kv-cache-dtype fp4_mx_block16] [--write-policy write_back]
        [--l3 file|mooncake] [--faults ...] [--tp N] [--core python|rust]

One process per rank (the plugin hook is process-wide); on a machine without
CUDA the kernels are emulated (``kernel_emulation``). Prints one JSON line,
:class:`SoakFigures`, per rank.

By concern: ``stacks`` builds the cache and holds the geometry, ``workload``
makes the requests and admits one, ``driver`` runs the scheduler's loop,
``shadow`` holds the bytes every token must have and checks them, ``faults``
injects and counts ``--faults``, ``beside`` runs SGLang's own MXFP8 host
class beside ours (``--beside-sglang``), ``figures`` is what a run reports,
``cli`` the command line.
"""

from testkit.soak.cli import main, parse_args
from testkit.soak.driver import Soak
from testkit.soak.figures import SoakFigures
from testkit.soak.stacks import PAGE, build_cache

__all__ = ["PAGE", "Soak", "SoakFigures", "build_cache", "main", "parse_args"]
