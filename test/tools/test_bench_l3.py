"""``bench --l3``: its flags, its exit codes, and tiny real runs on the CPU.

The flags are checked before CUDA is looked for, as the L2 bench's are: one
line on stderr, exit 2. The real runs build both host pools with the kernel
emulations (``cpu_kernels``), apply the plugin's storage hook for the test only
(as test_storage does), and go through SGLang's real ``file`` and ``mooncake``
backends: the numbers must be there, and a get that brings back other bytes
must fail the run.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest
import torch

from sglang_mxfp8_hicache import storage
from sglang_mxfp8_hicache.tools import bench_l3, l3, results
from testkit import dict_l3_backend
from testkit.cli_runner import MASTER, run_cli

TINY = (1, 128, 2)
"""1 KV head x 128 x 2 layers: K and V of a page are 2 x 32 KiB of payload,
2 x 1 KiB of scales and a seal area up to 9 blocks of 4 KiB."""
TINY_PAGE = {"mxfp8": 2 * 9 * 4096, "payload": 2 * 32768}


def fake_report(
    put_ratio: float = 1.0, get_ratio: float = 1.0, one_page_ratio: float = 1.15
) -> results.Report:
    """A report of 1 and 64 pages; the 64-page cell's MXFP8 times are the
    ratios, the 1-page cell's ``one_page_ratio`` both ways."""

    def cell(pages: int, put: float, get: float) -> results.Cell:
        base = 1e-3 * pages
        return results.Cell(
            pages,
            {
                "put": {"mxfp8": [put * base] * 3, "payload": [base] * 3},
                "get": {"mxfp8": [get * base] * 3, "payload": [base] * 3},
            },
            {"mxfp8": 1056, "payload": 1024},
        )

    return results.Report(
        backend="file",
        store="/somewhere",
        geometry=(8, 128, 4),
        reps=3,
        warmup=1,
        format_tag="mxfp8v2-test",
        page_bytes={"mxfp8": 1056, "payload": 1024},
        cells=[
            cell(1, one_page_ratio, one_page_ratio),
            cell(64, put_ratio, get_ratio),
        ],
        meta={"sglang_version": "0.5.23", "device": "Fake GPU"},
    )


@pytest.fixture
def fake_run(monkeypatch) -> SimpleNamespace:
    """``bench --l3`` as on a CUDA GPU, without one: ``run`` records its
    arguments and returns ``fake.report``, or raises ``fake.error``."""
    fake = SimpleNamespace(calls=[], report=fake_report(), error=None)

    def run(backend, geometry, pages, **kwargs):
        fake.calls.append((backend, geometry, pages, kwargs))
        if fake.error is not None:
            raise fake.error
        return fake.report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_l3, "apply_plugin_hooks", lambda: None)
    monkeypatch.setattr(bench_l3, "run", run)
    return fake


def test_arguments_reach_run(fake_run, tmp_path, capsys):
    assert run_cli(["bench", "--l3", "file"], capsys)[0] == 0
    backend, geometry, pages, kwargs = fake_run.calls[-1]
    assert (backend, geometry, pages) == ("file", results.L3_GEOMETRY, results.L3_PAGES)
    assert (kwargs["reps"], kwargs["warmup"]) == (5, 1)
    assert kwargs["l3_dir"] is None and kwargs["l3_config"] is None
    argv = ["bench", "--l3", "mooncake", "--geometries", "4x64", "--pages", "2,8"]
    argv += ["--repeat", "3", "--warmup", "0", "--l3-config", MASTER]
    assert run_cli(argv, capsys)[0] == 0
    backend, geometry, pages, kwargs = fake_run.calls[-1]
    assert (backend, geometry, pages) == ("mooncake", (4, 64, 8), (2, 8))
    assert (kwargs["reps"], kwargs["warmup"]) == (3, 0)
    assert kwargs["l3_config"] == json.loads(MASTER)
    argv = ["bench", "--l3", "file", "--l3-dir", str(tmp_path)]
    assert run_cli(argv, capsys)[0] == 0
    assert fake_run.calls[-1][3]["l3_dir"] == str(tmp_path)


@pytest.mark.parametrize(
    "flags, ratios, code",
    [
        pytest.param([], (1.2, 1.0), 0, id="completed_with_a_miss"),
        pytest.param(["--check"], (1.05, 1.0), 0, id="check_at_the_goal"),
        pytest.param(["--check"], (1.0, 1.1), 1, id="check_get_missed"),
    ],
)
def test_table_and_exit_code(flags, ratios, code, fake_run, tmp_path, capsys):
    """The 1-page cell (1.15x) is under its goal of 1.2x; the 64-page one
    decides against 1.05x."""
    fake_run.report = fake_report(*ratios)
    out_file = tmp_path / "l3.json"
    argv = ["bench", "--l3", "file", *flags, "--json-out", str(out_file)]
    exit_code, out, err = run_cli(argv, capsys)
    assert exit_code == code, err
    lines = out.splitlines()
    assert lines[0].startswith("L3 file (/somewhere), 8x128x4")
    assert "MXFP8 put pages/s" in lines[1] and "bytes x" in lines[1]
    one, sixty_four = lines[3].split(), lines[4].split()
    assert one[0] == "1" and one[3] == "1.150" and one[-2:] == ["1.20", "yes"]
    # 64 pages in 64 ms: 1000 pages/s, 1.056 GB/s of MXFP8 pages at ratio 1.
    assert sixty_four[0] == "64" and sixty_four[-3:-1] == ["1.0312", "1.05"]
    assert sixty_four[3] == f"{ratios[0]:.3f}" and sixty_four[6] == f"{ratios[1]:.3f}"
    missed = max(ratios) > results.L3_GOAL_RATIO
    assert sixty_four[-1] == ("NO" if missed else "yes")
    assert ("Over the goal: 64 pages" in out) == missed
    data = json.loads(out_file.read_text())
    assert data["byte_ratio"] == 1056 / 1024 and data["meta"]["device"] == "Fake GPU"
    assert [c["met"] for c in data["cells"]] == [True, not missed]
    assert [c["goal"] for c in data["cells"]] == [1.2, 1.05]
    assert err == (
        "sglang-mxfp8-hicache bench: 1 of 4 cells miss their goal\n" if code else ""
    )


def test_a_small_batch_over_its_goal_fails_the_check(fake_run, capsys):
    fake_run.report = fake_report(one_page_ratio=1.3)
    exit_code, out, err = run_cli(["bench", "--l3", "file", "--check"], capsys)
    assert exit_code == 1
    assert "Over the goal: 1 pages put 1.300x, 1 pages get 1.300x" in out
    assert err == "sglang-mxfp8-hicache bench: 2 of 4 cells miss their goal\n"


@pytest.mark.parametrize(
    "error, code",
    [
        pytest.param(
            bench_l3.L3Unavailable("Mooncake cannot run here: x"), 2, id="unavailable"
        ),
        pytest.param(
            bench_l3.L3BenchError("mxfp8: 4 pages came back"), 1, id="wrong_bytes"
        ),
    ],
)
def test_failure_is_one_line(error, code, fake_run, capsys):
    fake_run.error = error
    exit_code, out, err = run_cli(["bench", "--l3", "mooncake"], capsys)
    assert (exit_code, out) == (code, "")
    assert len(err.splitlines()) == 1 and str(error) in err, err


def test_service_without_config_is_one_line(monkeypatch, capsys):
    """Mooncake and SeaweedFS are timed against a running service only, a
    dynamic class named by its config; said before any host pool is built
    (pools of GBs, pinned)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_l3, "apply_plugin_hooks", lambda: None)
    monkeypatch.setattr(bench_l3, "build_pools", pytest.fail)
    for backend in ("mooncake", "seaweedfs", "dynamic"):
        code, out, err = run_cli(["bench", "--l3", backend], capsys)
        assert (code, out) == (2, "")
        assert f"--l3 {backend} needs --l3-config" in err and len(err.splitlines()) == 1


# -- real runs on the CPU ------------------------------------------------------


@pytest.fixture
def storage_hooks(monkeypatch):
    """The plugin's storage hook, through HookRegistry's AROUND wrapper, for
    this test only (``apply_plugin_hooks`` patches the whole process)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    create = StorageBackendFactory.__dict__["create_backend"].__func__
    monkeypatch.setattr(
        StorageBackendFactory,
        "create_backend",
        classmethod(_wrap_fn(create, storage.guard_storage_backend, HookType.AROUND)),
    )


def tiny_run(backend: str, **kwargs) -> results.Report:
    return bench_l3.run(
        backend, TINY, (1, 2), reps=1, device="cpu", pin_memory=False, **kwargs
    )


def check_report(report: results.Report) -> None:
    assert [c.pages for c in report.cells] == [1, 2]
    assert report.page_bytes == TINY_PAGE
    assert report.byte_ratio == TINY_PAGE["mxfp8"] / TINY_PAGE["payload"]
    assert report.format_tag.startswith("mxfp8v4-l2h1d128p128")
    for cell in report.cells:
        for d in results.L3_DIRECTIONS:
            for pool in results.L3_POOLS:
                # one rep per 16 pages: 16 of 1 page, 8 of 2
                assert len(cell.seconds[d][pool]) == 16 // cell.pages
                assert cell.ms(d, pool) > 0 and cell.gb_per_s(d, pool) > 0
    data = json.loads(report.to_json())
    assert msgspec.json.decode(report.to_json(), type=results.Report) == report
    assert data["meta"]["sglang_version"] == "0.5.23" and data["geometry"][2] == 2
    assert len(data["cells"]) == 2 and data["cells"][0]["goal"] == 1.2


@pytest.mark.parametrize("backend", ["file", "hf3fs", "nixl"])
def test_local_run(cpu_kernels, storage_hooks, tmp_path, monkeypatch, backend):
    """Pages go to a directory of its own under --l3-dir, removed at the end;
    the env variable that would override HiCacheFile's directory does not, and
    the bench keeps its signal handlers (hf3fs installs its own)."""
    import signal

    monkeypatch.setenv(l3.FILE_DIR_ENV, str(tmp_path / "not-here"))
    handler = signal.getsignal(signal.SIGINT)
    report = tiny_run(backend, l3_dir=str(tmp_path))
    check_report(report)
    assert report.store.startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is handler


def test_seaweedfs_run(cpu_kernels, storage_hooks, seaweedfs):
    """Against the session's loopback gateway, as with --l3-config."""
    check_report(tiny_run("seaweedfs", l3_config=seaweedfs.extra_config()))


def test_mooncake_run(cpu_kernels, storage_hooks, mooncake):
    """Against a running master (the session's loopback one), as with
    --l3-config: what the run stored is removed, so the store's other
    objects are left alone and a second run's puts are not skipped."""
    for _ in range(2):
        check_report(tiny_run("mooncake", l3_config=mooncake.extra_config()))


@pytest.mark.parametrize("v1", [False, True], ids=["generic", "interface_v1"])
def test_dynamic_run(cpu_kernels, storage_hooks, v1):
    """A class SGLang loads by module path, as with --l3-config (here the
    tests' own ``dict_l3_backend``), through either page interface."""
    report = tiny_run("dynamic", l3_config=dict_l3_backend.extra_config(v1))
    check_report(report)
    assert report.store == "dynamic at testkit.dict_l3_backend"


def test_wrong_bytes_fail_the_run(cpu_kernels, storage_hooks, tmp_path, monkeypatch):
    """One scale byte of each MXFP8 page read back is changed: the run fails,
    naming the pool, and leaves no directory behind."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    read = HiCacheFile.get
    mxfp8_page = TINY_PAGE["mxfp8"]

    def corrupt(self, key, target_location, target_sizes=None):
        got = read(self, key, target_location, target_sizes)
        if got is not None and got.numel() * got.element_size() == mxfp8_page:
            got.view(torch.uint8)[-129] ^= 0xFF  # the last scale byte, before the seal
        return got

    monkeypatch.setattr(HiCacheFile, "get", corrupt)
    with pytest.raises(bench_l3.L3BenchError, match="^mxfp8: 1 pages came back"):
        tiny_run("file", l3_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
