"""``bench --setup`` on the CPU: the kernels emulated (conftest's ``cpu_kernels``),
the CUDA-event timing replaced by one run of each transfer. What each setup
builds, which columns it refuses, how rows name it, and the order of a load's
calls with packed draft layers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_mxfp8_hicache.tools import bench
from testkit.pools import device_buffers

GEOMETRY = (2, 128, 3)  # KV heads, head_dim, target layers
DRAFTS = 2
WHOLE_MS, LAYER0_MS = 2.0, 1.0


@pytest.fixture
def cpu_bench(cpu_kernels, monkeypatch) -> list[tuple[type, str, int]]:
    """bench.run works on the CPU; returns (class, layout, layers) of each host
    pool it builds."""
    from sglang.srt.mem_cache.pool_host import mha_mxfp8

    pointers = cpu_kernels.pointers
    build_device_pool, build_host_pool = bench.build_device_pool, bench.build_host_pool
    built = []

    def device_pool(**kwargs):
        pool = build_device_pool(**kwargs)
        pointers.register(device_buffers(pool))
        return pool

    def host_pool(*args, **kwargs):
        host = build_host_pool(*args, **kwargs)
        built.append((type(host), host.layout, host.layer_num))
        pointers.register([host.kv_buffer])
        if getattr(host, "scale_host", None) is not None:
            pointers.register([host.scale_host])
        return host

    def time_all(fns, *, warmup, repeat, loop=None):
        """Each transfer once, in place of CUDA events (beside no loop)."""
        marked = []
        for name, fn in fns.items():
            fn(lambda name=name: marked.append(name))
        return (
            {name: WHOLE_MS for name in fns},
            {name: LAYER0_MS for name in marked},
            {},
        )

    # SGLang's MXFP8 class moves its scales with kernels the emulation lacks:
    # on the CPU only its payload moves (what it builds is what is tested here).
    for name in (
        "jit_transfer_hicache_all_layer_mla_staged_lf_pf",
        "jit_transfer_hicache_one_layer_mla",
    ):
        monkeypatch.setattr(mha_mxfp8, name, lambda **kwargs: None)
    monkeypatch.setattr(bench, "build_device_pool", device_pool)
    monkeypatch.setattr(bench, "build_host_pool", host_pool)
    monkeypatch.setattr(bench, "_time_all", time_all)
    return built


@pytest.mark.parametrize(
    "name, layout, drafts",
    [
        pytest.param("page_first", "page_first", 0, id="page_first"),
        pytest.param("draft", "page_first", DRAFTS, id="draft"),
        pytest.param("layer_first", "layer_first", 0, id="layer_first"),
        pytest.param("fp4_mx_block16", "page_first", 0, id="fp4_mx_block16"),
        pytest.param("nvfp4", "page_first", 0, id="nvfp4"),
    ],
)
def test_setup_rows(cpu_bench, name, layout, drafts):
    """Every column's pool built for the setup; SGLang's MXFP8 class refuses
    packed drafts, layer_first and FP4 pools: 'refused' cells, no bound on
    ours, no crash."""
    classes = bench.host_classes()
    if "sglang" not in classes:
        pytest.skip("this SGLang has no MXFP8 host class")
    rows = bench.run(
        [GEOMETRY],
        [1, 2],
        classes=classes,
        setups=bench.setups([name], DRAFTS),
        warmup=0,
        repeat=1,
        device="cpu",
    )
    layers = GEOMETRY[2]
    refused = [] if name == "page_first" else ["sglang"]
    assert cpu_bench == [
        (cls, layout, layers + drafts)
        for column, cls in classes.items()
        if column not in refused
    ]
    assert [(r.pages, r.direction) for r in rows] == [
        (1, "backup"),
        (1, "load"),
        (2, "backup"),
        (2, "load"),
    ]
    for r in rows:
        assert (r.setup, r.drafts, r.refused) == (name, drafts, refused)
        assert list(r.ms) == ["ours", "sglang", "payload", "raw"]
        assert r.meets_goal()
    _assert_named_in_tables(rows, name, drafts, refused)


def _assert_named_in_tables(rows, name: str, drafts: int, refused: list[str]) -> None:
    """The setup's rows as the tables and the JSON show them: named
    ``draft(n)`` or by the setup, SGLang's cells 'refused' where it refuses."""
    label = f"draft({DRAFTS})" if drafts else name
    sglang_cell = "refused" if refused else f"{WHOLE_MS:.3f}"
    headers, body = bench.table(rows)
    assert headers[0] == "setup"
    cells = dict(zip(headers, body[1], strict=True))
    assert (cells["setup"], cells["dir"], cells["sglang ms"]) == (
        label,
        "load",
        sglang_cell,
    )
    assert cells["ours/sglang"] == ("-" if refused else "1.000")
    headers, body = bench.table(rows, layer0=True)
    cells = dict(zip(headers, body[0], strict=True))
    assert (cells["setup"], cells["ours L0 ms"]) == (label, f"{LAYER0_MS:.3f}")
    assert cells["sglang L0 ms"] == ("refused" if refused else f"{LAYER0_MS:.3f}")
    load = json.loads(bench.to_json(rows))["rows"][1]
    assert (load["setup"], load["drafts"], load["refused"]) == (name, drafts, refused)
    assert load["ms"]["sglang"] == (None if refused else WHOLE_MS)
    assert load["met"]


class RecordingHost:
    """Records the calls a transfer makes, and where layer 0's work is issued."""

    page_num = 4
    layout = "page_first"
    can_use_write_back_jit = True

    def __init__(self) -> None:
        self.calls: list = []

    def backup_from_device_all_layer(self, device_pool, host_i, device_i, io):
        self.calls.append(("backup", device_pool))

    def load_to_device_per_layer(
        self, device_pool, host_i, device_i, layer_id, io, *, is_draft=False
    ):
        self.calls.append((device_pool, layer_id, is_draft))


LAYERS = 3
TARGET = SimpleNamespace(name="target", device="cpu", layer_num=LAYERS, size=4 * 128)
DRAFT_POOLS = [SimpleNamespace(name=f"draft{d}") for d in range(4)]
MARK = "layer 0 done"


def target(layer):
    return (TARGET, layer, False)


def draft(depth):
    return (DRAFT_POOLS[depth], LAYERS + depth, True)


@pytest.mark.parametrize(
    "drafts, expected",
    [
        pytest.param(
            0, [target(0), MARK, target(1), target(2)], id="page_first_no_drafts"
        ),
        pytest.param(
            1, [target(0), draft(0), MARK, target(1), target(2)], id="draft_1"
        ),
        pytest.param(
            2,
            [target(0), draft(0), MARK, target(1), draft(1), target(2)],
            id="draft_2",
        ),
        pytest.param(
            4,
            [target(0), draft(0), MARK, target(1), draft(1), target(2)]
            + [draft(2), draft(3)],
            id="draft_4_deeper_than_target",
        ),
    ],
)
def test_draft_load_order(drafts, expected):
    """As SGLang's HybridCacheController: draft depth d (is_draft, host layer
    target layers + d) right after target layer min(d, layers - 1), in the
    same loop; layer 0's wait includes draft 0. The backup is the one
    all-layer call on the target pool, which covers the packed drafts."""
    host = RecordingHost()
    fns = bench._transfers(
        TARGET,
        DRAFT_POOLS[:drafts],
        {"payload": host},
        pages=2,
        bytes_per_page=16,
        gen=torch.Generator().manual_seed(0),
    )
    fns["load"]["payload"](lambda: host.calls.append(MARK))
    assert host.calls == expected
    host.calls.clear()
    fns["backup"]["payload"](lambda: host.calls.append(MARK))
    assert host.calls == [("backup", TARGET)]


@pytest.mark.parametrize(
    "names, expected",
    [
        pytest.param(["page_first"], [bench.Setup()], id="page_first"),
        pytest.param(
            ["draft", "layer_first", "draft"],
            [
                bench.Setup("draft", drafts=3),
                bench.Setup("layer_first", layout="layer_first"),
            ],
            id="draft_layer_first_once_each",
        ),
    ],
)
def test_setups_by_name(names, expected):
    assert bench.setups(names, 3) == expected


def test_unknown_setup_is_refused():
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        bench.setups(["draft", "nope"])
