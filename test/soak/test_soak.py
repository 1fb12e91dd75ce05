"""The scheduler's own radix cache drives the host pool under a seeded load
(``soak.py``) over each stack, with faults injected (``fault_*``), across a
restart (``restart``) and as several ranks (``ranks``): nothing it serves differs
from the shadow, no wait hangs, and the run did what it is for (backups,
evictions, loads from host and L3, the faults).

Each run is its own process (the plugin hook is process-wide) of
``--soak-seconds`` (20 by default; longer on request) with ``--soak-seed``
(0; a sweep is one session per seed); on the CPU the kernels are emulated, on
a GPU the real ones run. A run that is there for a few hits (a control that
must be caught, a restart that must find the first process's pages) runs
``FEW_HITS_SECONDS``. Every run goes on past its seconds until it did what its
test checks it did (``at_least``: ``--at-least`` floors, for at most 240 s
more), so a busy machine (CI's 2 cores, two tests at a time) slows a run down
instead of failing it. The payload-only control shows that the check fails
when scales are lost.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from testkit import script
from testkit.soak import SoakFigures

SOAK = script("soak")


NO_HIT_SECONDS = 8
"""A run that must find none of a store's pages: its first requests are the
store's first (one seed), so a few seconds ask for them all the same."""
FEW_HITS_SECONDS = 8
"""A run that is there for a few hits, not for the soak: a control that must
be caught, the storing or finding side of a restart. Its ``at_least`` floors
make it go on until it has them."""
SERVED = {"requests_served": 21}
"""What every soak run serves at least (``requests_served > 20``)."""


def soak(
    request,
    *flags: str,
    ranks: int = 1,
    seconds: float | None = None,
    at_least: dict[str, int] | None = None,
) -> SoakFigures | list[SoakFigures]:
    """One run's figures (with ``ranks``, one per rank, in rank order), of
    ``--soak-seconds`` unless ``seconds`` is given, and then until each figure
    of ``at_least`` (a count, or ``faults.KIND``) is reached on some rank."""
    seconds = seconds or request.config.getoption("--soak-seconds")
    seed = request.config.getoption("--soak-seed")
    floors = [f"--at-least={name}={n}" for name, n in (at_least or {}).items()]
    done = subprocess.run(
        [sys.executable, SOAK, "--seconds", str(seconds), "--seed", str(seed)]
        + floors
        + list(flags),
        capture_output=True,
        text=True,
        timeout=seconds + 900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-ranks:]
    # user_properties reach the session's summary (conftest) from xdist workers too
    request.node.user_properties.extend(
        ("soak figures", f"{request.node.name}: {line}") for line in lines
    )
    figures = [msgspec.json.decode(line, type=SoakFigures) for line in lines]
    return figures if ranks > 1 else figures[0]


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--core", "rust"], id="write_through-rust"),
        pytest.param(
            ["--write-policy", "write_back", "--core", "python"], id="write_back-python"
        ),
        pytest.param(["--l3", "file", "--flush-every", "30"], id="l3_file"),
        pytest.param(["--kv-cache-dtype", "fp4_mx_block16"], id="fp4_mx_block16"),
        pytest.param(["--stack", "hybrid_swa", "--core", "python"], id="hybrid_swa"),
        pytest.param(
            ["--stack", "hybrid_swa", "--l3", "file", "--flush-every", "30"],
            id="hybrid_swa-l3_file",
        ),
        pytest.param(
            ["--stack", "draft", "--l3", "file", "--flush-every", "30"],
            id="draft-l3_file",
        ),
    ],
)
def test_soak(request, flags):
    """Each stack and policy under the scheduler's loop: nothing served or
    kept differs from the shadow, and the run backed up, evicted and loaded
    back (from host; with L3, from L3 after the tiers were emptied)."""
    did = {**SERVED, "pages_backed_up": 1, "device_pages_evicted": 1}
    if "--l3" in flags:
        did |= {"tier_flushes": 1, "pages_loaded_from_l3": 1}
    else:
        did |= {"pages_loaded_from_host": 1, "host_pages_evicted": 1}
    figures = soak(request, *flags, at_least=did)
    assert figures.mismatches == 0, figures.first_mismatches
    assert figures.hangs == 0 and not figures.clean_error
    assert figures.host_pool == "MHATokenToKVPoolMXFP8Host"
    assert figures.requests_served > 20 and figures.tokens_checked > 0
    assert figures.pages_backed_up > 0 and figures.device_pages_evicted > 0
    if "--l3" in flags:
        assert figures.tier_flushes > 0 and figures.pages_loaded_from_l3 > 0
    else:
        assert figures.pages_loaded_from_host > 0 and figures.host_pages_evicted > 0


def test_soak_payload_only_control_is_caught(request):
    """SGLang's host pool given the payload alone restores pages with the
    scales that sit where they land: the shadow sees it."""
    figures = soak(
        request,
        "--payload-only",
        seconds=FEW_HITS_SECONDS,
        at_least={"pages_loaded_from_host": 1, "mismatches": 1},
    )
    assert figures.host_pool == "PayloadOnlyHost"
    assert figures.pages_loaded_from_host > 0 and figures.mismatches > 0


def test_soak_beside_sglang(request):
    """SGLang's own MXFP8 host class beside ours on the same device pool,
    through the tree's backups, loads and L3 round trips: after every backup,
    each page's payload and scales (every layer, K and V) are the same bytes
    on the device, in our host page and in SGLang's; after every load, the
    device pages hold what both hosts hold."""
    figures = soak(
        request,
        *("--beside-sglang", "--l3", "file", "--flush-every", "30"),
        at_least={"pages_backed_up": 1, "beside_sglang_loaded": 1},
    )
    assert figures.mismatches == 0 and figures.hangs == 0, figures.first_mismatches
    assert figures.beside_sglang_backed_up == figures.pages_backed_up > 0
    assert figures.beside_sglang_loaded > 0


def test_soak_beside_sglang_control_is_caught(request):
    """A scale byte of SGLang's copy of each backed-up page flipped: the
    comparison names SGLang's copy, and only it."""
    figures = soak(
        request,
        "--beside-sglang",
        "--beside-sglang-control",
        seconds=FEW_HITS_SECONDS,
        at_least={"beside_sglang_backed_up": 1, "mismatches": 1},
    )
    assert figures.beside_sglang_backed_up > 0 and figures.mismatches > 0
    assert all(
        "K scales: ours == device, SGLang's != device" in said
        for said in figures.first_mismatches
    ), figures.first_mismatches[:3]


@pytest.mark.parametrize(
    "faults, kinds",
    [
        pytest.param(
            "file",
            {"file_truncated", "file_lengthened", "file_deleted"},
            id="fault_file",
        ),
        pytest.param("backend_error", {"backend_error"}, id="fault_backend_error"),
        pytest.param("host_exhausted", {"host_exhausted"}, id="fault_host_exhausted"),
        pytest.param("eviction_race", {"eviction_race"}, id="fault_eviction_race"),
    ],
)
def test_soak_faults(request, faults, kinds):
    """Stored pages damaged under the cache, an L3 backend that raises (a read
    after writing its host pages), the host pool nearly all taken, everything
    evictable evicted while a load back is queued and in flight: misses and
    recomputes, never a wrong byte or a hang."""
    did = {**SERVED, "pages_loaded_from_l3": 1}
    did |= {f"faults.{kind}": 1 for kind in kinds}
    figures = soak(
        request, "--l3", "file", "--flush-every", "30", "--faults", faults, at_least=did
    )
    assert figures.mismatches == 0, figures.first_mismatches
    assert figures.hangs == 0 and not figures.clean_error
    assert kinds <= figures.faults.keys(), figures.faults
    assert figures.requests_served > 20 and figures.pages_loaded_from_l3 > 0


def test_soak_fault_kernel_refused(request):
    """A load whose device indices hold a page that is not one aligned run:
    the kernel moves no byte of it and the pool raises, naming the page (CPU
    indices at once, GPU indices at the next transfer), which ends the
    scheduler as a clean error; nothing served before it was wrong."""
    figures = soak(
        request, "--faults", "kernel_refused", at_least={"faults.kernel_refused": 1}
    )
    assert figures.faults == {"kernel_refused": 1}
    assert "not one aligned run" in figures.clean_error, figures.clean_error
    assert figures.mismatches == 0 and figures.hangs == 0, figures.first_mismatches


def test_soak_fault_node_restart(request):
    """The Mooncake storage node SIGKILLed under the cache (every object it
    held gone) and started again, over and over: reads and writes fail while
    it is down and miss what it lost after, never a wrong byte or a hang; once
    it is back, pages stored on it are loaded again."""
    from testkit.mooncake_loopback import mooncake_available

    if reason := mooncake_available():
        pytest.skip(reason)
    figures = soak(
        request,
        *("--l3", "mooncake", "--flush-every", "30", "--faults", "node_restart"),
        at_least={
            **SERVED,
            "faults.node_killed": 1,
            "faults.node_restarted": 1,
            "pages_loaded_from_l3_after_node_restart": 1,
        },
    )
    assert figures.mismatches == 0, figures.first_mismatches
    assert figures.hangs == 0 and not figures.clean_error
    assert figures.faults.get("node_killed", 0) >= 1, figures.faults
    assert figures.faults.get("node_restarted", 0) >= 1, figures.faults
    assert figures.requests_served > 20
    assert figures.pages_loaded_from_l3_after_node_restart > 0, figures


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_restart(request, tmp_path, backend):
    """A second process over the same ``file`` store or Mooncake master,
    storing nothing itself, finds the first process's pages through the
    tree's L3 prefetch and restores them exactly; a process of another
    geometry or format finds none (its keys carry both)."""
    if backend == "file":
        store = ["--l3", "file", "--l3-dir", str(tmp_path)]
    else:
        mooncake = request.getfixturevalue("mooncake")
        store = ["--l3", "mooncake", "--l3-config", json.dumps(mooncake.extra_config())]
    store += ["--flush-every", "30"]
    first = soak(
        request,
        *store,
        seconds=FEW_HITS_SECONDS,
        at_least={"pages_backed_up": 1, "tier_flushes": 1},
    )
    assert first.mismatches == 0 and first.pages_backed_up > 0
    second = soak(
        request,
        *store,
        "--no-l3-writes",
        seconds=FEW_HITS_SECONDS,
        at_least={"pages_loaded_from_l3": 1},
    )
    assert second.mismatches == 0 and second.hangs == 0, second.first_mismatches
    assert second.pages_loaded_from_l3 > 0
    for other in (["--heads", "4"], ["--kv-cache-dtype", "fp4_mx_block16"]):
        figures = soak(
            request,
            *store,
            "--no-l3-writes",
            *other,
            seconds=NO_HIT_SECONDS,
            at_least={"requests_served": 1},
        )
        assert figures.mismatches == 0 and figures.pages_loaded_from_l3 == 0, other
        assert figures.requests_served > 0, other


RANKS_AGREE_ON = (
    "steps",
    "requests_served",
    "pages_loaded_from_l3",
    "pages_loaded_from_host",
    "tokens_checked",
)
"""What every rank of a run must count alike: the controller's cross-rank
agreement gives them the same hits, so no rank restores a page another did not."""


def _assert_ranks_agree(
    ranks: list[SoakFigures], tp: int, min_requests: int = 21
) -> None:
    assert [r.tp_rank for r in ranks] == list(range(tp))
    for figures in ranks:
        assert figures.mismatches == 0 and figures.hangs == 0, figures.first_mismatches
        assert not figures.clean_error, figures.clean_error
    first = ranks[0]
    for field in RANKS_AGREE_ON:
        assert {getattr(r, field) for r in ranks} == {getattr(first, field)}, field
    assert first.requests_served >= min_requests


@pytest.mark.parametrize(
    "tp, flags, last_rank_only",
    [
        pytest.param(
            2,
            ["--l3", "file", "--faults", "file,host_exhausted"],
            {"file_truncated", "file_deleted"},
            id="tp2-file",
        ),
        pytest.param(
            2,
            ["--l3", "mooncake", "--faults", "rank_read_error"],
            {"rank_read_error"},
            id="tp2-mooncake",
        ),
        pytest.param(2, ["--beside-sglang"], set(), id="tp2-beside_sglang"),
        pytest.param(
            4,
            ["--l3", "file", "--faults", "rank_read_error", "--beside-sglang"],
            {"rank_read_error"},
            id="tp4-file-beside_sglang",
        ),
    ],
)
def test_ranks(request, tp, flags, last_rank_only):
    """``tp`` ranks (a process each, gloo; one GPU each where the machine has
    them), each with its own heads' bytes, host pool and L3 pages, driven in
    step over one L3 store (one ``file`` directory, or one Mooncake master
    and node); the last rank's stored pages are damaged or its reads fail
    while the others' succeed: every rank takes the same hits (the same pages
    from L3 and host, the same requests) and restores its own heads exactly.
    With SGLang's own class beside ours, every rank's backups (and, without
    L3 flushing the host tier, its loads) agree byte for byte with it."""
    if "mooncake" in flags:
        from testkit.mooncake_loopback import mooncake_available

        if reason := mooncake_available():
            pytest.skip(reason)
    l3 = "--l3" in flags
    beside = "--beside-sglang" in flags
    did = {**SERVED, "pages_loaded_from_l3" if l3 else "pages_loaded_from_host": 1}
    did |= {f"faults.{kind}": 1 for kind in last_rank_only}
    if beside:
        did["beside_sglang_backed_up"] = 1
        if not l3:
            did["beside_sglang_loaded"] = 1
    ranks = soak(
        request,
        *("--tp", str(tp), *flags, *["--flush-every", "30"] * l3),
        ranks=tp,
        at_least=did,
    )
    _assert_ranks_agree(ranks, tp)
    for figures in ranks[:-1]:
        assert not last_rank_only & figures.faults.keys(), figures.faults
    assert last_rank_only <= ranks[-1].faults.keys(), ranks[-1].faults
    for figures in ranks:
        assert (figures.beside_sglang_backed_up > 0) == beside, figures
        if beside and not l3:  # with L3 the host tier is flushed: few host loads
            assert figures.beside_sglang_loaded > 0, figures
    if l3:
        assert ranks[0].pages_loaded_from_l3 > 0
    else:
        assert ranks[0].pages_loaded_from_host > 0


def test_ranks_restart(request, tmp_path):
    """Two ranks store their pages in one ``file`` directory; two new ranks,
    storing nothing, find them and restore each rank's own heads exactly; four
    ranks of the same model (half the heads each: other head shards, other
    keys) find none of them."""
    store = ("--l3", "file", "--l3-dir", str(tmp_path), "--flush-every", "30")
    short = {"seconds": FEW_HITS_SECONDS, "ranks": 2}
    first = soak(request, "--tp", "2", "--heads", "2", *store, at_least=SERVED, **short)
    _assert_ranks_agree(first, 2)
    again = soak(
        request,
        *("--tp", "2", "--heads", "2", *store, "--no-l3-writes"),
        at_least={**SERVED, "pages_loaded_from_l3": 1},
        **short,
    )
    _assert_ranks_agree(again, 2)
    assert again[0].pages_loaded_from_l3 > 0
    wider = soak(
        request,
        *("--tp", "4", "--heads", "1", *store, "--no-l3-writes"),
        ranks=4,
        seconds=NO_HIT_SECONDS,
        at_least={"requests_served": 1},
    )
    _assert_ranks_agree(wider, 4, min_requests=1)
    assert wider[0].pages_loaded_from_l3 == 0


def test_ranks_restart_page_head_across_tp_sizes(request, mooncake):
    """``page_head`` pages that Mooncake splits by ``tp_lcm_size`` 4 are keyed
    by the model's head groups, not the ranks: two ranks of two heads store
    them, and four ranks of one head find them and restore each its own head
    exactly (the one store outlives both runs)."""
    config = {**mooncake.extra_config(), "tp_lcm_size": 4}
    store = ("--l3", "mooncake", "--l3-config", json.dumps(config))
    shared = ("--layout", "page_head", "--flush-every", "30")
    first = soak(
        request,
        *("--tp", "2", "--heads", "2", *store, *shared),
        ranks=2,
        seconds=FEW_HITS_SECONDS,
        at_least=SERVED,
    )
    _assert_ranks_agree(first, 2)
    wider = soak(
        request,
        *("--tp", "4", "--heads", "1", *store, *shared, "--no-l3-writes"),
        ranks=4,
        seconds=FEW_HITS_SECONDS,
        at_least={**SERVED, "pages_loaded_from_l3": 1},
    )
    _assert_ranks_agree(wider, 4)
    assert wider[0].pages_loaded_from_l3 > 0


def test_sglang_write_back_oom_reproduces():
    """SGLang 0.5.23's write-back eviction under host pressure with L3 counts
    a node it cannot free as evictable, and an admitted prefill fails
    (``sglang_write_back_oom.py``; the soak refuses that setup). With
    SGLang's own host pool as with ours: not the host pool's doing. When this
    fails, SGLang has fixed it and the soak's refusal can go."""
    for flags in ([], ["--payload-only"]):
        done = subprocess.run(
            [sys.executable, script("sglang_write_back_oom"), *flags],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["freed"] == 0 and report["evictable_before"] > 0, report
        assert report["error"].startswith("Prefill out of memory"), report


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--tp", "0"], "--tp 0: one rank or more"),
        (["--faults", "rank_read_error", "--l3", "file"], "needs --tp 2 or more"),
        (["--tp", "2", "--faults", "rank_read_error"], "needs --tp 2 or more and --l3"),
        (
            ["--tp", "2", "--l3", "mooncake", "--faults", "node_restart"],
            "run it with --tp 1",
        ),
    ],
)
def test_soak_refuses(capsys, argv, said):
    """Combinations the soak cannot run stop at once, saying why."""
    from testkit.soak import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert said in capsys.readouterr().err
