from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from sglang_mxfp8_hicache import __version__, hooks, settings
from sglang_mxfp8_hicache.hooks import HookState
from sglang_mxfp8_hicache.tools import cli, results
from sglang_mxfp8_hicache.tools.cli import main
from sglang_mxfp8_hicache.tools.results import BENCH_GEOMETRIES, BENCH_PAGES
from testkit import ROOT
from testkit.cli_runner import MASTER, run_cli

LLAMA_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
}
BENCH_RUN = ROOT / "docs" / "data" / "bench-h100-alone.json"
"""A committed L2 bench run, for ``--plot --from``."""
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


def test_size_table(capsys):
    assert (
        main(
            [
                "size",
                "--layers",
                "80",
                "--kv-heads",
                "8",
                "--head-dim",
                "128",
                "--tp-size",
                "8",
                "--device-tokens",
                "400000",
                "--hicache-size",
                "100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "TP 8, --kv-cache-dtype mxfp8, page_size 128, --hicache-size 100 GB" in out
    # 100e9 // 21184 = 4720543 -> 36879 pages + 1 padding (21184 B per token:
    # payload, scales, 64 B of seal areas); payload only: // 20480.
    [row] = [line.split() for line in out.splitlines() if line.startswith("kv ")]
    assert row[:5] == ["kv", "80", "1", "x", "128"]
    assert row[6:8] == ["21184", "(20480+640+64)"]
    assert row[8] == str(36880 * 128)
    assert row[10] == str((100_000_000_000 // 20480 // 128 + 1) * 128)
    host = 36880 * 128 * 21184
    assert f"host tier per rank: {host / 1e9:.3f} GB ({host / 2**30:.3f} GiB)" in out
    assert f"per node (8 ranks, --gpus-per-node 8): {8 * host / 1e9:.3f} GB" in out


@pytest.mark.parametrize("kv_cache_dtype", ["fp4_mx_block16", "nvfp4"])
def test_size_fp4(capsys, kv_cache_dtype):
    """32 layers of 8x128 in FP4: 36,864 B per token (payload 32,768 at half a
    byte per element, scales 4,096 at one byte per 16), the device cell."""
    argv = size("--kv-cache-dtype", kv_cache_dtype, "--page-size", "64")
    assert main(argv) == 0
    [pool] = json.loads(capsys.readouterr().out)["pools"]
    assert pool["payload_bytes_per_token"] == 32768
    assert pool["scale_bytes_per_token"] == 4096
    assert pool["host_tokens"] == (2000 // 64 + 1) * 64
    table = argv[:1] + argv[2:]  # the same without --json
    assert main(table) == 0
    out = capsys.readouterr().out
    assert f"--kv-cache-dtype {kv_cache_dtype}, page_size 64" in out
    assert "36992 (32768+4096+128)" in out  # + seal areas: 4 KiB a part


def test_size_from_hf_config(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                **LLAMA_8B,
                "num_hidden_layers": 64,
                "num_attention_heads": 64,
                "hidden_size": 5120,
                "head_dim": 128,
            }
        )
    )
    argv = ["size", "--config", str(config), "--device-tokens", "1000", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    [pool] = plan["pools"]
    assert pool["bytes_per_token"] == 131072 + 4096 + 64  # + seal areas
    assert pool["host_tokens"] == (2000 // 128 + 1) * 128
    assert plan["source"] == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("flags", "unused"),
    [
        (["--swa-full-tokens-ratio", "0.5"], ["--swa-full-tokens-ratio"]),
        (["--max-mamba-cache-size", "64"], ["--max-mamba-cache-size"]),
        (["--hicache-size", "10", "--hicache-ratio", "3"], ["--hicache-ratio"]),
        (["--hicache-ratio", "3"], []),
    ],
)
def test_size_says_which_flags_do_not_apply(capsys, flags, unused):
    assert main(size(*flags)) == 0
    notes = capsys.readouterr().err.splitlines()
    assert [n.split()[1] for n in notes] == unused, notes
    assert all(n.startswith("note: ") and "is not used: " in n for n in notes)


def test_size_names_whose_host_memory_it_compares(capsys):
    """The budget is in the JSON, with the machine it is of: this one, or the
    server's as --host-memory-gb gives it (less SGLang's 10 GiB reserve)."""
    assert main(size()) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["host_budget_of"].startswith("this machine's")
    assert main(size("--host-memory-gb", "1000", "--tp-size", "8")) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["host_budget_of"] == "the server's, by --host-memory-gb"
    assert plan["host_budget_per_rank"] == (10**12 - (10 << 30)) // 8
    from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES

    assert HICACHE_HOST_MEMORY_RESERVE_BYTES == 10 << 30


def test_size_of_flags_imports_neither_sglang_nor_torch():
    """``size`` from flags answers in well under a second: SGLang's import,
    which brings torch, takes seconds, and flags need neither."""
    code = (
        "import sys; from sglang_mxfp8_hicache.tools.cli import main; "
        "code = main(sys.argv[1:]); "
        "print(sorted({'sglang', 'torch'} & set(sys.modules)), file=sys.stderr); "
        "sys.exit(code)"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, *size()], capture_output=True, text=True
    )
    took = time.monotonic() - started
    assert done.returncode == 0 and done.stderr == "[]\n", done.stderr
    assert json.loads(done.stdout)["host_budget_of"].startswith("this machine's")
    assert took < 10, took  # about 0.6 s; SGLang's import alone takes 10 or more


def config_text(text: str | None) -> Callable[[Path], str]:
    """A --config argument made in the test's tmp_path: a file holding ``text``,
    or a directory where ``text`` is None."""

    def make(tmp_path: Path) -> str:
        path = tmp_path / "config.json"
        if text is None:
            path.mkdir()
        else:
            path.write_text(text)
        return str(path)

    return make


def config(**fields) -> Callable[[Path], str]:
    """Llama-3.1-8B's config.json with ``fields`` changed (None: key removed)."""
    merged = {**LLAMA_8B, **fields}
    return config_text(json.dumps({k: v for k, v in merged.items() if v is not None}))


def size(*flags, config=None, device_tokens="1000", **geometry) -> list:
    """``size --json`` of Llama-3.1-8B's geometry given as flags, or of ``config``."""
    argv = ["size", "--json", "--device-tokens", device_tokens, *flags]
    if config is not None:
        return [*argv, "--config", config]
    dims = {"layers": "32", "kv_heads": "8", "head_dim": "128", **geometry}
    for name, value in dims.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", value]
    return argv


def bad(case_id: str, argv: list, *expected: str):
    return pytest.param(argv, expected, id=case_id)


BAD_INPUTS = [
    # --config: the file
    bad(
        "missing_config",
        size(config=lambda tmp_path: str(tmp_path / "missing.json")),
        "--config",
        "missing.json",
    ),
    bad(
        "config_is_directory",
        size(config=config_text(None)),
        "config.json/config.json",
        "No such file",
    ),
    bad(
        "malformed_json",
        size(config=config_text('{"num_hidden_layers": 32,')),
        "config.json",
        "not valid JSON",
    ),
    bad("json_list", size(config=config_text("[]")), "JSON object", "list"),
    bad(
        "text_config_list",
        size(config=config_text('{"text_config": [1]}')),
        "ModelConfig cannot read it",
        "model_type",
    ),
    # --config: its keys
    # --config: its keys, as SGLang's ModelConfig (and transformers) read them
    bad(
        "zero_attention_heads",
        size(config=config(num_attention_heads=0)),
        "ModelConfig cannot read it",
        "ZeroDivisionError",
    ),
    bad("head_dim_80", size(config=config(head_dim=80)), "head_dim", "80", "32"),
    bad("derived_head_dim_80", size(config=config(hidden_size=2560)), "80", "32"),
    bad(
        "layers_string",
        size(config=config(num_hidden_layers="32")),
        "num_hidden_layers",
    ),
    bad(
        "kv_heads_boolean",
        size(config=config(num_key_value_heads=True)),
        "num_key_value_heads",
    ),
    bad(
        "kv_heads_0_in_config",
        size(config=config(num_key_value_heads=0)),
        "num_key_value_heads must be a positive integer, got 0",
    ),
    bad(
        "kv_heads_negative_in_config",
        size(config=config(num_key_value_heads=-8)),
        "num_key_value_heads must be a positive integer, got -8",
    ),
    bad("layers_in_config_huge", size(config=config(num_hidden_layers=99999)), "99999"),
    bad(
        "layers_in_config_negative",
        size(config=config(num_hidden_layers=-4)),
        "num_hidden_layers must be a positive integer, got -4",
    ),
    bad(
        "layers_in_config_0",
        size(config=config(num_hidden_layers=0)),
        "num_hidden_layers must be a positive integer, got 0",
    ),
    bad(
        "layers_missing_from_config",
        size(config=config(num_hidden_layers=None)),
        "num_hidden_layers is missing",
    ),
    bad(
        "mla_config",
        size(config=config_text(json.dumps(DEEPSEEK_V3))),
        "MLA",
        "MHA",
    ),
    # size: flags
    bad("layers_0", size(layers="0"), "--layers", "0"),
    bad("layers_negative", size(layers="-32"), "--layers", "-32"),
    bad("layers_not_int", size(layers="1.5"), "--layers", "1.5"),
    bad("layers_huge", size(layers="99999999999999"), "layers", "over 4096"),
    bad("kv_heads_huge", size(kv_heads="99999"), "kv_heads", "over 4096"),
    bad(
        "host_tier_past_any_server",
        size("--hicache-ratio", "1000", device_tokens=str(10_000_000)),
        "TiB of host tier per node",
        "--hicache-ratio",
    ),
    bad("kv_heads_0", size(kv_heads="0"), "--kv-heads", "0"),
    bad("kv_heads_negative", size(kv_heads="-8"), "--kv-heads", "-8"),
    bad("tp_size_0", size("--tp-size", "0"), "--tp-size", "0"),
    bad("tp_size_negative", size("--tp-size", "-8"), "--tp-size", "-8"),
    bad("tp_size_3_of_8_heads", size("--tp-size", "3"), "--tp-size 3", "8 KV heads"),
    bad("tp_size_12_of_8_heads", size("--tp-size", "12"), "--tp-size 12", "8 KV"),
    bad("head_dim_0", size(head_dim="0"), "--head-dim", "0"),
    bad("head_dim_flag_125", size(head_dim="125"), "--head-dim", "125", "32"),
    bad(
        "mxfp8_head_dim_80",
        size(head_dim="80"),
        "head_dim must be a multiple of 32",
        "mxfp8",
    ),
    bad("mxfp8_page_size_64", size("--page-size", "64"), "--page-size 128", "64"),
    bad(
        "unknown_kv_cache_dtype",
        size("--kv-cache-dtype", "fp8_e4m3"),
        "--kv-cache-dtype",
        "fp8_e4m3",
    ),
    bad(
        "device_tokens_negative",
        size(device_tokens="-1000"),
        "--device-tokens",
        "-1000",
    ),
    bad("ratio_nan", size("--hicache-ratio", "nan"), "--hicache-ratio", "nan"),
    bad("ratio_inf", size("--hicache-ratio", "inf"), "--hicache-ratio", "inf"),
    bad("ratio_negative", size("--hicache-ratio", "-2"), "--hicache-ratio", "-2"),
    bad("size_inf", size("--hicache-size", "inf"), "--hicache-size", "inf"),
    bad("size_negative", size("--hicache-size", "-5"), "--hicache-size", "-5"),
    bad("size_nan", size("--hicache-size", "nan"), "--hicache-size", "nan"),
    # size: where the geometry comes from
    bad(
        "layers_with_config",
        size("--layers", "32", config=config()),
        "--config",
        "--layers",
    ),
    bad(
        "geometry_incomplete",
        size(kv_heads=None, head_dim=None),
        "--config",
        "--kv-heads",
        "--head-dim",
    ),
    # bench: every argument is checked before CUDA is looked for
    bad(
        "bench_geometry_8by128",
        ["bench", "--geometries", "8by128"],
        "--geometries",
        "8by128",
    ),
    bad(
        "bench_geometry_head_dim_125",
        ["bench", "--geometries", "8x128,8x125"],
        "--geometries",
        "8x125",
    ),
    bad(
        "bench_geometry_layers_0",
        ["bench", "--geometries", "8x128x0"],
        "--geometries",
        "8x128x0",
    ),
    bad(
        "bench_geometry_empty_item",
        ["bench", "--geometries", "8x128,"],
        "--geometries",
    ),
    bad("bench_pages_0", ["bench", "--pages", "1,0"], "--pages", "1,0"),
    bad("bench_pages_negative", ["bench", "--pages", "-4"], "--pages", "-4"),
    bad("bench_warmup_negative", ["bench", "--warmup", "-1"], "--warmup", "-1"),
    bad("bench_repeat_0", ["bench", "--repeat", "0"], "--repeat", "0"),
    bad(
        "bench_json_out_no_directory",
        ["bench", "--json-out", "/nonexistent/bench.json"],
        "--json-out",
        "/nonexistent/bench.json",
    ),
    bad(
        "bench_json_out_unwritable",
        ["bench", "--json-out", "/proc/bench.json"],
        "--json-out",
        "/proc/bench.json",
    ),
    bad(
        "bench_plot_unwritable",
        ["bench", "--plot", "/proc/x.png", "--from", str(BENCH_RUN)],
        "--plot",
        "/proc/x.png",
    ),
    bad(
        "bench_plot_not_an_image",
        ["bench", "--plot", lambda tmp: str(tmp / "x.txt"), "--from", str(BENCH_RUN)],
        "--plot",
        "x.txt",
        ".png",
    ),
    bad(
        "bench_unknown_ablation",
        ["bench", "--ablations", "sm,nope"],
        "unknown ablation(s) ['nope']",
        "fallback",
    ),
    bad(
        "bench_setup_unknown",
        ["bench", "--setup", "draft", "--setup", "page_first,nope"],
        "--setup",
        "['nope']",
        "layer_first",
    ),
    bad("bench_setup_empty", ["bench", "--setup", ","], "--setup", "','"),
    bad("bench_drafts_0", ["bench", "--setup", "draft", "--drafts", "0"], "--drafts"),
    bad(
        "bench_drafts_without_draft_setup",
        ["bench", "--setup", "layer_first", "--drafts", "2"],
        "--drafts needs --setup draft",
    ),
    # bench --l3 (tools/bench_l3.py; its runs are in test_bench_l3.py)
    bad(
        "l3_bogus",
        ["bench", "--l3", "bogus"],
        "--l3",
        "'bogus'",
        "'mooncake', 'seaweedfs', 'dynamic'",
    ),
    bad("l3_refused_backend", ["bench", "--l3", "sim"], "--l3", "'sim'"),
    bad(
        "l3_untimed_backend",
        ["bench", "--l3", "aibrix"],
        "--l3",
        "'seaweedfs', 'dynamic'",
    ),
    bad(
        "l3_geometry_8by128",
        ["bench", "--l3", "file", "--geometries", "8by128"],
        "8by128",
    ),
    bad(
        "l3_geometry_head_dim",
        ["bench", "--l3", "file", "--geometries", "8x100x4"],
        "8x100x4",
    ),
    bad(
        "l3_two_geometries",
        ["bench", "--l3", "file", "--geometries", "8x128x4,8x128x8"],
        "--l3 takes one geometry, got 2",
    ),
    bad("l3_pages_0", ["bench", "--l3", "file", "--pages", "64,0"], "--pages", "64,0"),
    bad("l3_repeat_0", ["bench", "--l3", "file", "--repeat", "0"], "--repeat", "0"),
    bad(
        "l3_json_out_no_directory",
        ["bench", "--l3", "file", "--json-out", "/nonexistent/l3.json"],
        "--json-out",
    ),
    bad(
        "l3_with_ablations",
        ["bench", "--l3", "file", "--ablations", "sm"],
        "--ablations",
    ),
    bad(
        "l3_with_setup_draft",
        ["bench", "--l3", "file", "--setup", "draft"],
        "--setup",
        "not with --l3",
    ),
    bad(
        "l3_dir_missing",
        ["bench", "--l3", "file", "--l3-dir", "/nonexistent/dir"],
        "--l3-dir",
        "existing directory",
    ),
    bad(
        "l3_dir_with_mooncake",
        ["bench", "--l3", "mooncake", "--l3-dir", lambda tmp: str(tmp)],
        "--l3-dir is for --l3 file",
    ),
    bad(
        "l3_dir_without_l3",
        ["bench", "--l3-dir", lambda tmp: str(tmp)],
        "--l3-dir needs",
    ),
    bad(
        "l3_config_not_json",
        ["bench", "--l3", "mooncake", "--l3-config", "master=1"],
        "--l3-config",
        "JSON object",
        "'master=1'",
    ),
    bad(
        "l3_config_not_object",
        ["bench", "--l3", "mooncake", "--l3-config", '["127.0.0.1:50051"]'],
        "--l3-config",
        "JSON object",
    ),
    bad(
        "l3_config_multiline",
        ["bench", "--l3", "mooncake", "--l3-config", "{\n"],
        "--l3-config",
    ),
    bad(
        "l3_config_no_master",
        ["bench", "--l3", "mooncake", "--l3-config", '{"protocol": "tcp"}'],
        "--l3-config",
        "master_server_address",
    ),
    bad(
        "l3_config_with_file",
        ["bench", "--l3", "file", "--l3-config", MASTER],
        "--l3-config is for --l3 mooncake or seaweedfs or dynamic, not --l3 file",
    ),
    bad(
        "l3_config_without_l3",
        ["bench", "--l3-config", MASTER],
        "--l3-config needs --l3 mooncake",
    ),
    bad(
        "bench-no_cuda", ["bench", "--l3", "file", "--pages", "64"], "needs a CUDA GPU"
    ),
]


@pytest.mark.parametrize("argv, expected", BAD_INPUTS)
def test_bad_input_is_one_line(argv, expected, tmp_path, capsys, monkeypatch):
    """Exit 2, nothing on stdout (not even with --json), one line on stderr that
    names the value and what is allowed, no traceback."""
    # A GPU must not rescue a bad argument, nor its absence hide one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [arg(tmp_path) if callable(arg) else arg for arg in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, err
    assert out == ""
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert err.startswith(f"sglang-mxfp8-hicache {argv[0]}: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, err


def test_size_reads_text_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llava",
                "architectures": ["LlavaForConditionalGeneration"],
                "text_config": LLAMA_8B,
            }
        )
    )
    code, out, _ = run_cli(size(config=str(path)), capsys)
    assert code == 0
    [pool] = json.loads(out)["pools"]
    assert pool["bytes_per_token"] == 2 * 32 * 8 * (128 + 4) + 64


def test_version(capsys):
    assert run_cli(["--version"], capsys) == (
        0,
        f"sglang-mxfp8-hicache {__version__}\n",
        "",
    )


def test_help_lists_every_command(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for command in ("check", "size", "bench"):
        assert command in out
    code, out, _ = run_cli(["check", "--help"], capsys)
    assert code == 0 and "--require-gpu" in out
    code, out, _ = run_cli(["bench", "--help"], capsys)
    assert code == 0
    for flag in (
        "--l3 BACKEND",
        "--l3-dir",
        "--l3-config",
        "--setup",
        "--drafts",
    ):
        assert flag in out
    from sglang_mxfp8_hicache.tools import results

    flat = " ".join(out.split())
    for name in (*results.BENCH_SETUPS, *results.L3_BACKENDS, "(default: 3; --l3: 1)"):
        assert name in flat


def test_bench_unknown_names_are_refused_before_torch_and_sglang():
    """An unknown --setup, --ablations or --beside name is one line within a
    second: torch and SGLang, seconds to import, are not imported for it."""
    code = (
        "import sys; from sglang_mxfp8_hicache.tools.cli import main\n"
        "for flag in ('--setup', '--ablations', '--beside'):\n"
        "    print(main(['bench', flag, 'nope']))\n"
        "print(sorted({'sglang', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines() == ["2", "2", "2", "[]"], done.stderr
    assert done.stderr.splitlines() == [
        f"sglang-mxfp8-hicache bench: error: {flag}: unknown {kind}(s) ['nope']; "
        f"known: {list(known)}"
        for flag, kind, known in (
            ("--setup", "setup", results.BENCH_SETUPS),
            ("--ablations", "ablation", results.BENCH_ABLATIONS),
            ("--beside", "loop", results.BESIDE_LOOPS),
        )
    ]


def test_bench_needs_cuda_after_good_arguments(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(
        ["bench", "--geometries", "8x128x80", "--pages", "1,4", "--check"], capsys
    )
    assert (code, out) == (2, "")
    assert (
        err == "sglang-mxfp8-hicache bench: error: needs a CUDA GPU "
        "(the JIT transfer kernels)\n"
    )


class FakeRow:
    def __init__(self, met: bool):
        self.met = met

    def meets_goal(self) -> bool:
        return self.met


@pytest.fixture
def fake_bench(monkeypatch) -> SimpleNamespace:
    """bench as on a CUDA GPU, without one: ``run`` records its arguments and
    returns one row per entry of ``met``."""
    from sglang_mxfp8_hicache.tools import bench

    fake = SimpleNamespace(bench=bench, calls=[], setups=[], met=[True])

    def run(geometries, pages, *, classes, setups, warmup, repeat, beside):
        fake.calls.append((geometries, pages, warmup, repeat))
        fake.setups.append(setups)
        return [FakeRow(met) for met in fake.met]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    monkeypatch.setattr(bench, "host_classes", lambda ablations: {})
    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(
        bench, "table", lambda rows, layer0=False: (["met"], [[r.met] for r in rows])
    )
    monkeypatch.setattr(bench, "to_json", lambda rows: b"[]")
    return fake


@pytest.mark.parametrize(
    "flags, met, code",
    [
        pytest.param([], [True, False], 0, id="completed_with_a_miss"),
        pytest.param(["--check"], [True, True], 0, id="check_all_met"),
        pytest.param(["--check"], [True, False], 1, id="check_a_miss"),
    ],
)
def test_bench_exit_code(flags, met, code, fake_bench, capsys):
    """A completed benchmark exits 0; --check makes an unmet goal exit 1 (CI)."""
    fake_bench.met = met
    exit_code, out, err = run_cli(["bench", *flags], capsys)
    assert exit_code == code and "Fake GPU" in out
    missed = "sglang-mxfp8-hicache bench: 1 of 2 cells miss their goal\n"
    assert err == (missed if code else "")


def test_bench_arguments_reach_run(fake_bench, tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    argv = ["bench", "--geometries", "8x128,4x64x80", "--pages", "1,4"]
    assert run_cli([*argv, "--json-out", str(out_file)], capsys)[0] == 0
    # bench.run takes (heads, head_dim, layers); layers default to 8.
    assert fake_bench.calls == [(((8, 128, 8), (4, 64, 80)), (1, 4), 3, 20)]
    assert out_file.read_text() == "[]"
    assert run_cli(["bench", "--warmup", "0", "--repeat", "5"], capsys)[0] == 0
    bench = fake_bench.bench
    assert fake_bench.calls[-1] == (BENCH_GEOMETRIES, BENCH_PAGES, 0, 5)
    # Today's bench unless --setup says otherwise: page_first, no drafts.
    assert fake_bench.setups == [[bench.Setup()]] * 2


@pytest.mark.parametrize(
    "flags, expected",
    [
        pytest.param(
            ["--setup", "draft"],
            [("draft", "page_first", "DEFAULT")],
            id="draft_default_drafts",
        ),
        pytest.param(
            ["--setup", "draft", "--drafts", "3"],
            [("draft", "page_first", 3)],
            id="draft_3",
        ),
        pytest.param(
            ["--setup", "layer_first"],
            [("layer_first", "layer_first", 0)],
            id="layer_first",
        ),
        pytest.param(
            ["--setup", "page_first,draft", "--setup", "layer_first,draft"],
            [
                ("page_first", "page_first", 0),
                ("draft", "page_first", "DEFAULT"),
                ("layer_first", "layer_first", 0),
            ],
            id="page_first_draft_layer_first_comma_and_repeated",
        ),
    ],
)
def test_bench_setups_reach_run(flags, expected, fake_bench, capsys):
    """--setup, comma separated or repeated, in the order given, each once."""
    assert run_cli(["bench", *flags], capsys)[0] == 0
    default = fake_bench.bench.DEFAULT_DRAFTS
    assert [(s.name, s.layout, s.drafts) for s in fake_bench.setups[-1]] == [
        (name, layout, default if drafts == "DEFAULT" else drafts)
        for name, layout, drafts in expected
    ]


def test_check_command():
    """The README's main command, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-m", "sglang_mxfp8_hicache.tools.cli", "check", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    steps = {s["name"]: s for s in json.loads(done.stdout)}
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert steps["settings"]["detail"] == settings.current().describe()
    assert steps["dispatch in a fresh process"]["detail"] == (
        "mxfp8, fp4_mx_block16, nvfp4 -> ours, bf16 -> SGLang's, in a new process"
    )
    hooks_in_force = f"all {len(hooks.served_hooks())} in force in a new process"
    assert steps["plugin hooks"]["detail"] == hooks_in_force
    assert steps["host sizing (example)"]["detail"].startswith(
        "Llama-3.1-8B, ratio 2: 67648 B/token (65536 payload, 2048 scales, 64 seal)"
    )
    for name, step in steps.items():
        if name == "GPU round trip" and not torch.cuda.is_available():
            assert step["status"] == "skipped" and "no CUDA" in step["detail"]
        else:
            assert step["status"] == "ok", step
    # One progress line per step on stderr, in order, as each ends.
    ended = re.compile(r"(.+: \w+) \(\d+ s\)")
    progress = [
        m[1] for line in done.stderr.splitlines() if (m := ended.fullmatch(line))
    ]
    assert progress == [f"{name}: {step['status']}" for name, step in steps.items()]


def test_check_says_how_to_reinstall_a_missing_entry_point(monkeypatch):
    """The package is on no index: the hint names the clone and its wheel."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    status, detail = cli._check_entry_point()
    assert status == cli.FAIL
    assert "pip install sglang-mxfp8-hicache" not in detail
    assert "from its clone (pip install .) or its wheel" in detail


def _hook(short: str, in_force: bool, pages_wrong: bool = False) -> HookState:
    return HookState(f"sglang.srt.x.{short}", in_force, f"{short}'s cost", pages_wrong)


@pytest.mark.parametrize(
    "states, status, detail",
    [
        ([_hook("a", True), _hook("b", True)], "ok", "all 2 in force in a new process"),
        (
            [_hook("a", True), _hook("b", False), _hook("c", False)],
            "warn",
            "b missing: b's cost; c missing: c's cost",
        ),
        (
            [_hook("a", False), _hook("b", False, pages_wrong=True)],
            "FAIL",
            "a missing: a's cost; b missing: b's cost",
        ),
    ],
    ids=["all_in_force", "missing", "missing_makes_pages_wrong"],
)
def test_check_names_each_missing_hook_and_its_cost(states, status, detail):
    """The fresh process's hook states as ``check`` reads them back: each
    missing hook by its short target and cost, a failure where it could make
    pages wrong."""
    written = msgspec.json.encode(results.Dispatch({}, tuple(states)))
    found = msgspec.json.decode(written, type=results.Dispatch)
    assert cli._check_hooks(found) == (status, detail)


@pytest.mark.parametrize(
    "variable, value",
    [("STAGING_MB", "lots"), ("DISABLE", "maybe"), ("SEAL_THREADS", "0")],
)
def test_check_refuses_a_bad_setting(monkeypatch, capsys, variable, value):
    """A variable's bad value is one line naming it, exit 2, before any step."""
    assert _check_error(monkeypatch, capsys, variable, value) == (
        f"SGLANG_MXFP8_HICACHE_{variable}={value!r} is not accepted: give "
        f"{_accepts(variable)}, or leave it unset."
    )


def test_check_refuses_a_misspelt_variable(monkeypatch, capsys):
    """A name with the package's prefix that it does not read is one line
    naming the closest variable, exit 2, before any step."""
    assert _check_error(monkeypatch, capsys, "STAGING", "128") == (
        "SGLANG_MXFP8_HICACHE_STAGING is not a variable sglang-mxfp8-hicache "
        "reads: did you mean SGLANG_MXFP8_HICACHE_STAGING_MB? Rename or unset it."
    )


def _check_error(monkeypatch, capsys, variable: str, value: str) -> str:
    """``check``'s one error line with ``SGLANG_MXFP8_HICACHE_{variable}`` set;
    fails if it exits otherwise, prints to stdout or runs a step."""
    monkeypatch.setenv(f"SGLANG_MXFP8_HICACHE_{variable}", value)
    monkeypatch.setattr(cli, "_fresh_process", lambda: pytest.fail("a step ran"))
    settings.current.cache_clear()
    try:
        code, out, err = run_cli(["check"], capsys)
    finally:
        settings.current.cache_clear()
    assert (code, out) == (2, "")
    prefix = "sglang-mxfp8-hicache check: error: "
    assert err.startswith(prefix) and err.endswith("\n")
    return err[len(prefix) : -1]


def _accepts(variable: str) -> str:
    [found] = [v for v in settings.VARIABLES if v.setting == variable.lower()]
    return found.accepts


@pytest.mark.parametrize("control", [False, True], ids=["ours", "payload_only"])
def test_check_round_trip(make_pools, control):
    """``check``'s own round trip (``tools.pools.round_trip``), on each device:
    our host pool brings payload and scales back byte for byte and keeps every
    other page; the payload-only control's lost scales fail it."""
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
    from sglang_mxfp8_hicache.tools import pools

    host_cls = pools.PayloadOnlyHost if control else MHATokenToKVPoolMXFP8Host
    device_pool, host = make_pools(
        heads=2, head_dim=128, layers=3, pages=8, host_cls=host_cls
    )
    ok, found = pools.round_trip(device_pool, host, pages=8, seed=3)
    scales = "DIFFER" if control else "exact"
    assert ok != control, found
    assert re.fullmatch(
        rf"8 pages: backup [\d.]+ GB/s, load [\d.]+ GB/s; payload exact, "
        rf"scales {scales}, untouched pages kept",
        found,
    ), found


@pytest.mark.parametrize(
    "flags, code", [([], 0), (["--require-gpu"], 1)], ids=["plain", "require_gpu"]
)
def test_check_require_gpu(monkeypatch, capsys, flags, code):
    """A GPU step that could not run is not a failure, unless --require-gpu
    asks for the GPU steps (CI of GPU users); the exit names the step."""
    monkeypatch.setattr(cli, "_fresh_process", lambda: "stand-in")
    for name in ("version", "entry_point", "dispatch", "hooks", "sizing"):
        monkeypatch.setattr(cli, f"_check_{name}", lambda *_: (cli.OK, "stand-in"))
    monkeypatch.setattr(cli, "_check_round_trip", lambda: (cli.SKIPPED, "no CUDA"))
    exit_code, out, err = run_cli(["check", *flags], capsys)
    assert exit_code == code
    assert "Not run on this machine: GPU round trip." in out
    assert ("--require-gpu: GPU round trip did not run." in err) == bool(code)


def test_bench_plot_from_json(tmp_path, capsys):
    """``bench --plot`` draws the committed runs' JSON, no GPU needed (the test
    extra brings matplotlib)."""
    fp4_run = ROOT / "docs" / "data" / "bench-h200-fp4.json"
    sources = f"{BENCH_RUN},{fp4_run}"
    out = tmp_path / "plot.png"
    code, said, _ = run_cli(["bench", "--plot", str(out), "--from", sources], capsys)
    assert code == 0 and said == f"wrote {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(["bench", "--plot", str(out)], capsys)
    assert code == 2 and "--plot and --from go together" in err


@pytest.mark.parametrize(
    ("runs", "panel_rows"),
    [("bench-h100-alone", 2), ("bench-h200-direct-page_head", 1)],
)
def test_bench_plot_draws_only_panels_with_data(tmp_path, capsys, runs, panel_rows):
    """A run without payload-only cells (direct, page_head) gets no empty
    "ours / payload" panels: the figure is one row of panels shorter."""
    source = ROOT / "docs" / "data" / f"{runs}.json"
    out = tmp_path / "plot.png"
    assert run_cli(["bench", "--plot", str(out), "--from", str(source)], capsys)[0] == 0
    height = int.from_bytes(out.read_bytes()[20:24], "big")  # the PNG's IHDR
    assert round(height / (3.75 * 110)) == panel_rows


@pytest.mark.parametrize("content", ["{}", "truncated", "l3"])
def test_bench_plot_of_other_json_is_one_line(tmp_path, capsys, content):
    """``bench --plot --from`` a file that is not an L2 bench run (an L3
    report, a truncated file, ``{}``) says so in one line, exit 2."""
    source = tmp_path / "run.json"
    if content == "l3":
        source = ROOT / "docs" / "data" / "bench-l3-file-h200.json"
    elif content == "truncated":
        source.write_bytes(BENCH_RUN.read_bytes()[:100])
    else:
        source.write_text(content)
    out = tmp_path / "plot.png"
    code, _, err = run_cli(["bench", "--plot", str(out), "--from", str(source)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and f"{source}: not the JSON of an L2 bench run" in err
    assert not out.exists()


def test_bench_help_shows_defaults_as_typed(capsys):
    from sglang_mxfp8_hicache.tools.ablations import ABLATIONS

    assert tuple(ABLATIONS) == results.BENCH_ABLATIONS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "(default: 1,4,16,64,256,1024)" in said
    assert "ours with one choice undone: sm, fallback, load_doubling" in said
