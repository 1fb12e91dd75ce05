"""``size`` against SGLang: models read through its ModelConfig, host pools
planned as its assembler builds them."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import transformers

from sglang_mxfp8_hicache.tools import sizing
from sglang_mxfp8_hicache.tools.cli import main
from sglang_mxfp8_hicache.tools.sizing import SizingError, read_model
from testkit import ROOT, script

GPT_OSS_120B = ROOT / "test" / "data" / "gpt-oss-120b.config.json"
"""``openai/gpt-oss-120b``'s config.json as published, weight quantization included."""

SIZING_SETUPS = (
    "kv",
    "draft",
    "layer_first",
    "hybrid_swa",
    "mamba",
    "fp4_mx_block16",
    "nvfp4",
)
HICACHE = {"ratio": ("2.0", "0"), "size": ("0", "1")}
"""``--hicache-ratio 2`` or ``--hicache-size 1`` (GB), as (ratio, size)."""


def _case(setup: str, hicache: str) -> str:
    return ":".join((setup, *HICACHE[hicache]))


@pytest.fixture(scope="module")
def sglang_built() -> dict[str, dict]:
    """Every case's pools as SGLang's assembler builds them and as ``size``
    plans them, by case, from one process (``testkit/sizing_vs_sglang.py``)."""
    cases = [_case(s, h) for s in SIZING_SETUPS for h in HICACHE]
    done = subprocess.run(
        [sys.executable, script("sizing_vs_sglang"), *cases],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [
        json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")
    ]
    return {result["case"]: result for result in results}


@pytest.mark.parametrize("hicache", sorted(HICACHE))
@pytest.mark.parametrize("setup", SIZING_SETUPS)
def test_size_matches_the_pools_sglang_builds(sglang_built, setup, hicache):
    """Each host pool SGLang's assembler builds for the setup (a dense pool,
    packed drafts, the layer_first layout, full and SWA pools, a full pool
    beside Mamba state, both FP4 recipes),
    sized by ``--hicache-ratio 2`` or ``--hicache-size 1`` (shared over the
    pools by device bytes), has the bytes per token and tokens ``size`` plans."""
    result = sglang_built[_case(setup, hicache)]
    assert result["built"], result
    assert result["planned"] == result["built"]


def _config_dir(tmp_path: Path, config_class: str, arch: str, **fields) -> Path:
    """A model directory holding transformers' default config of the class,
    with ``fields`` set (as a real config.json has them)."""
    config = getattr(transformers, config_class)().to_dict()
    config.update(fields, architectures=[arch])
    path = tmp_path / arch
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_hybrid_swa_model_has_full_and_swa_pools():
    """gpt-oss-120b's published config: half its layers slide; the SWA pool has
    0.8 of the tokens. Its weights' ``mxfp4``, which SGLang knows only beside
    an accelerator, leaves the KV cache as it is."""
    model = read_model(GPT_OSS_120B, tp_size=4)
    assert [(p.name, p.layers, p.kv_heads) for p in model.pools] == [
        ("full", 18, 2),
        ("swa", 18, 2),
    ]
    assert model.pools[1].token_ratio == 0.8


@pytest.mark.parametrize(
    ("kind", "left"), [("full_attention", "full"), ("sliding_attention", "swa")]
)
def test_hybrid_swa_of_one_layer_kind_has_one_pool(tmp_path, kind, left):
    """gpt-oss with every layer of one kind: the other pool has no layers,
    and no host tier to plan (not a pool of seal bytes only)."""
    config = json.loads(GPT_OSS_120B.read_text())
    config["layer_types"] = [kind] * config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = read_model(path, tp_size=4)
    assert [(p.name, p.layers) for p in model.pools] == [(left, 36)]
    other = {"full": "swa", "swa": "full"}[left]
    assert model.source == f"GptOssForCausalLM (hybrid SWA: no {other} layers)"


def test_config_without_model_type_is_reported_under_its_own_path(tmp_path):
    """transformers names the folder it read, the copy's temp folder: the
    error names the user's file instead."""
    path = tmp_path / "no-type.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 256}))
    with pytest.raises(SizingError) as refused:
        read_model(path, tp_size=1)
    said = str(refused.value)
    assert said.startswith(f"{path}: SGLang's ModelConfig cannot read it"), said
    assert f"Unrecognized model in {path}" in said, said
    assert tempfile.gettempdir() not in said.replace(str(tmp_path), ""), said


def test_mamba_hybrid_has_only_full_attention_layers(tmp_path):
    """Qwen3-Next at 48 layers has 12 of full attention; the rest is Mamba
    state, reported beside the KV pool."""
    path = _config_dir(
        tmp_path,
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        full_attention_interval=4,
    )
    model = read_model(path / "config.json", tp_size=2)
    [pool] = model.pools
    assert (pool.name, pool.layers, pool.kv_heads) == ("kv", 12, 1)
    assert model.mamba_state_bytes > 0


def test_sglang_complaint_is_cut_between_words(tmp_path, capsys, monkeypatch):
    def complain(*_):
        raise ValueError("abcdefghij " * 50)

    monkeypatch.setattr(sizing, "_read_model_config", complain)
    path = tmp_path / "config.json"
    path.write_text("{}")
    code, _, err = run_size(["--config", str(path), "--device-tokens", "1"], capsys)
    said = err.split("(ValueError: ", 1)[1]
    assert code == 2 and said.endswith(" ...)\n"), err
    assert set(said.removesuffix(" ...)\n").split()) == {"abcdefghij"}, err


@pytest.mark.parametrize(
    "text, cut",
    [
        ("short", "short"),
        ("Unknown method: " + "x" * 400, "Unknown method: " + "x" * 284 + " ..."),
        ("y" * 400, "y" * 300 + " ..."),
    ],
)
def test_a_long_word_is_cut_not_dropped(text, cut):
    assert sizing.between_words(text, 300) == cut


def test_config_file_of_any_name_reads_as_its_directory(tmp_path):
    path = _config_dir(tmp_path, "GptOssConfig", "GptOssForCausalLM")
    renamed = tmp_path / "gpt-oss.json"
    renamed.write_bytes((path / "config.json").read_bytes())
    assert read_model(renamed, tp_size=2) == read_model(path, tp_size=2)


def test_dense_model_and_mla_refused(tmp_path):
    dense = _config_dir(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    [pool] = read_model(dense, tp_size=8).pools
    assert (pool.layers, pool.kv_heads, pool.head_dim) == (32, 4, 128)
    mla = _config_dir(tmp_path, "DeepseekV3Config", "DeepseekV3ForCausalLM")
    with pytest.raises(SizingError, match="an MLA model .*serves MHA pools only"):
        read_model(mla, tp_size=8)


def run_size(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(["size", *argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


DENSE = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--hicache-size", "1e30"], "--hicache-size: must be an integer >= 0"),
        (["--hicache-size", "0.5"], "--hicache-size: must be an integer >= 0"),
        (["--hicache-size", "1000000"], "an integer >= 0 and <= 70368, got"),
        (["--hicache-ratio", "1e30"], "a finite number >= 0 and <= 1000, got"),
        (["--device-tokens", str(1 << 41)], f"<= {1 << 40}"),
        (
            ["--device-tokens", str(1 << 40)],
            "74,309,394 GB of device pools per rank is more than any GPU holds",
        ),
        (["--swa-full-tokens-ratio", "1.5"], "a finite number > 0 and <= 1, got"),
        (["--page-size", "1000000000"], "an integer >= 1 and <= 65536, got"),
        (
            ["--kv-cache-dtype", "fp4_mx_block16", "--page-size", "4096"],
            "--device-tokens 1000 is less than one page of --page-size 4096",
        ),
    ],
    ids=[
        "size_1e30",
        "size_float",
        "size_huge",
        "ratio_huge",
        "tokens_huge",
        "device_bytes_huge",
        "swa",
        "page_size_huge",
        "page_over_device_tokens",
    ],
)
def test_absurd_values_are_one_line(capsys, flags, says):
    code, out, err = run_size([*DENSE, "--device-tokens", "1000", *flags], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and says in err, err


def test_mamba_hicache_size_needs_its_slots(tmp_path, capsys):
    """--hicache-size is shared with the Mamba pool by device bytes: without
    the Mamba slots there is nothing to share by, and the error says what to give."""
    path = _config_dir(
        tmp_path,
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        full_attention_interval=4,
    )
    argv = ["--config", str(path), "--device-tokens", "100000", "--hicache-size", "8"]
    code, _, err = run_size(argv, capsys)
    assert code == 2 and "give its device slots as --max-mamba-cache-size" in err
    code, out, _ = run_size([*argv, "--max-mamba-cache-size", "64", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["mamba_state_bytes"] > 0
    # The KV pool gets less than the whole budget: the Mamba pool shares it.
    assert plan["pools"][0]["host_bytes"] < 8e9


def test_mamba_slots_past_any_gpu_are_one_line(tmp_path, capsys):
    path = _config_dir(
        tmp_path, "Qwen3NextConfig", "Qwen3NextForCausalLM", full_attention_interval=4
    )
    argv = ["--config", str(path), "--device-tokens", "100000", "--hicache-size", "8"]
    code, out, err = run_size([*argv, "--max-mamba-cache-size", "10000000"], capsys)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1, err
    assert "GB of device pools per rank is more than any GPU holds" in err
    assert "--max-mamba-cache-size" in err


def test_small_host_tier_warns(capsys):
    """SGLang warns when a host pool is not larger than its device pool; so
    does ``size``, before the server is started."""
    code, out, _ = run_size(
        [*DENSE, "--device-tokens", "100000", "--hicache-ratio", "0.5"], capsys
    )
    assert code == 0
    assert (
        "warning: the kv host pool (50048 tokens) is not larger than its device" in out
    )
