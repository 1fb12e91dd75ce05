"""``test/hit.py`` without a GPU: its flags reach the run, the table and the
JSON carry each cell's goals, ``--check`` exits 1 on a miss, a bad flag is
refused before anything runs (the GPU run: ``test_hit_times_every_column_layer_by_layer``)."""

from __future__ import annotations

import json

import pytest
import torch

from testkit import hit
from testkit.hit import HitRow


class _Calls(list):
    rows: list


@pytest.fixture
def fake_run(monkeypatch) -> _Calls:
    """``hit.run`` as on a CUDA GPU: records its arguments, returns ``rows``."""
    calls = _Calls()

    def run(geometries, pages, tokens, *, classes, warmup, repeat, beside):
        calls.append((geometries, pages, tokens, sorted(classes), repeat, beside))
        return calls.rows

    calls.rows = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    monkeypatch.setattr(hit.bench, "host_classes", dict.fromkeys)
    monkeypatch.setattr(hit, "run", run)
    return calls


def _hit_row(ours: float, **others: float) -> HitRow:
    ttft = {"ours": ours, **others}
    waits = {name: [0.5, 0.25] for name in ttft}
    return HitRow(8, 128, 2, 16, 64, ttft, waits, dict.fromkeys(ttft, 0.1))


def test_hit_arguments_reach_run(fake_run, tmp_path, capsys):
    out_file = tmp_path / "hit.json"
    fake_run.rows = [_hit_row(1.04, raw=1.0, sglang=1.2, payload=1.1, device=0.9)]
    assert hit.main(["--ablations", "sm", "--json-out", str(out_file)]) == 0
    defaults = hit.HIT_GEOMETRIES, hit.HIT_PAGES, hit.HIT_TOKENS, ["sm"]
    assert fake_run == [(*defaults, hit.BENCH_REPEAT, ())]
    assert "Fake GPU" in capsys.readouterr().out
    written = json.loads(out_file.read_text())
    assert written["device"] == "Fake GPU" and written["rows"][0]["missed"] == []
    assert written["rows"][0]["ours_over"]["raw"] == pytest.approx(1.04)
    argv = ["--geometries", "1x128x80", "--pages", "4", "--tokens", "64"]
    assert hit.main([*argv, "--beside", "decode"]) == 0
    assert fake_run[-1][:3] == (((1, 128, 80),), (4,), (64,))
    assert fake_run[-1][-1] == ("decode",)


@pytest.mark.parametrize(
    "ours, missed",
    [
        (1.05, []),
        (1.06, ["raw<=1.05"]),
        (1.25, ["raw<=1.05", "sglang<=1.0", "payload<=1.0"]),
    ],
)
def test_hit_goals(ours, missed):
    row = _hit_row(ours, raw=1.0, sglang=1.2, payload=1.1, device=0.9)
    assert row.missed() == missed
    assert _hit_row(ours).missed() == []  # nothing to compare with
    headers, [cells] = hit.table([row])
    assert dict(zip(headers, cells, strict=True))["ours/raw"] == f"{ours:.3f}"


def test_hit_check_exits_1_on_a_miss(fake_run, capsys):
    fake_run.rows = [_hit_row(1.0, raw=1.0), _hit_row(1.2, raw=1.0)]
    assert hit.main(["--check"]) == 1
    assert hit.main([]) == 0


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--tokens", "0"], "--tokens"),
        (["--ablations", "nope"], "--ablations: unknown ['nope']"),
        (["--beside", "gemm"], "--beside: unknown ['gemm']"),
        (["--geometries", "8x100x2"], "--geometries"),
    ],
)
def test_hit_refuses_a_bad_flag(capsys, argv, said):
    with pytest.raises(SystemExit) as stopped:
        hit.main(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_hit_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hit.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
