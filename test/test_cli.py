from __future__ import annotations

import json
import subprocess
import sys

import torch

from sglang_mxfp8_hicache.tools.cli import main


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
    assert "1 KV heads x 128 (TP 8)" in out
    # 100e9 // 21120 = 4734848 -> 36991 pages + 1 padding; payload only: // 20480.
    assert "21120" in out and str(36992 * 128) in out
    assert "20480" in out and str((100_000_000_000 // 20480 // 128 + 1) * 128) in out


def test_size_from_hf_config(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 64,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "hidden_size": 5120,
                "head_dim": 128,
            }
        )
    )
    assert (
        main(
            [
                "size",
                "--config",
                str(config),
                "--device-tokens",
                "1000",
                "--hicache-ratio",
                "2",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["bytes_per_token"] == 131072 + 4096
    assert plan["host_tokens"] == (2000 // 128 + 1) * 128


def test_size_needs_a_geometry(capsys):
    assert main(["size", "--layers", "2", "--device-tokens", "10"]) == 2
    assert "--config" in capsys.readouterr().err


def test_bench_refuses_unknown_ablation(capsys):
    assert main(["bench", "--ablations", "rows128,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown ablation(s) ['nope']" in err and "stock" in err


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
    for name, step in steps.items():
        if name == "GPU round trip" and not torch.cuda.is_available():
            assert step["status"] == "skipped" and "no CUDA" in step["detail"]
        else:
            assert step["status"] == "ok", step
