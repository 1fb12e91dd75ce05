"""``sglang-mxfp8-hicache``: check the install, size the host tier, time transfers.

- ``check [--json] [--e2e] [--require-gpu]``: plugin, hook and dispatch, sizing
  and, on CUDA, a round trip (``--e2e``: real MXFP8 KV through SGLang's HiCache
  controller);
- ``size``: each host pool SGLang builds for the model (read through its
  ``ModelConfig``), per rank and per node, with and without the scales;
- ``bench [--check] [--setup NAME,...]``: host pool transfer times on one
  CUDA GPU; ``bench --plot PNG --from JSON,...``: the plot of earlier runs;
  ``bench --l3 file|hf3fs|nixl|mooncake|seaweedfs``: L3 put and get of MXFP8
  pages against payload-only pages (``tools/bench_l3.py``).

``--help`` lists the commands from their parsers. Bad input ends in one line on
stderr and exit code 2, never a traceback: argparse types check each flag where
it is parsed, :class:`~sglang_mxfp8_hicache.sizing.SizingError` reports a
config.json or a geometry, :class:`UsageError` the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import msgspec

from sglang_mxfp8_hicache import __version__
from sglang_mxfp8_hicache.geometry import FORMATS, MXFP8_SCALE_BLOCK
from sglang_mxfp8_hicache.sizing import (
    PAGE_SIZE,
    SCALED_HEAD_DIMS,
    SMALLEST_SCALE_BLOCK,
    SWA_FULL_TOKENS_RATIO,
    HostPlan,
    ModelKV,
    SizingError,
    dense_model,
    host_plan,
    read_model,
)

PROG = "sglang-mxfp8-hicache"
OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"
EXAMPLE_MODEL = dict(layers=32, kv_heads=8, head_dim=128)  # Llama-3.1-8B
MAX_HICACHE_SIZE_GB = 1_000_000
"""A petabyte of host memory per rank: larger is a typo, not a plan."""
MAX_DEVICE_TOKENS = 1 << 40
MAX_HICACHE_RATIO = 1000
EXAMPLE_DEVICE_TOKENS = 500_000
BENCH_LAYERS = 8
BENCH_SETUPS = (
    "page_first",
    "draft",
    "layer_first",
    "direct",
    "page_head",
    *(f.name for f in FORMATS.values() if f.payload_bits == 4),
)
"""``bench.SETUPS``, named here so that ``--help`` does not import torch
(``test_cli`` checks that they agree)."""
"""Layers of a bench geometry written without them (``8x128``), as in bench.py."""
L2_WARMUP, L2_REPEAT = 3, 20
L3_WARMUP, L3_REPEAT = 1, 5
"""Rounds of ``bench`` and of ``bench --l3`` (an L3 round of 1024 pages moves
GBs through a file system or a network, an L2 round takes milliseconds)."""


class UsageError(Exception):
    """Bad input found after parsing; :func:`main` reports it as argparse reports a
    bad flag: one line on stderr, exit code 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a usage error in one line on stderr, exit 2.

    argparse prints the usage block first, which buries the line that says what
    is wrong, and scripts reading stderr get two lines; ``--help`` has the usage.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class Step(msgspec.Struct, frozen=True):
    """One step of ``check``, as its table row and its ``--json`` entry."""

    name: str
    status: str
    detail: str


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [
        max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))
    ]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*headers).rstrip())
    print(line.format(*("-" * w for w in widths)).rstrip())
    for row in rows:
        print(line.format(*row).rstrip())


def _run_step(name: str, fn: Callable[[], tuple[str, str]]) -> Step:
    try:
        status, detail = fn()
    except Exception as exc:  # a check reports, it does not crash
        status, detail = FAIL, f"{type(exc).__name__}: {exc}"
    return Step(name, status, detail)


def _check_version() -> tuple[str, str]:
    from sglang_mxfp8_hicache.plugin import SUPPORTED_SGLANG_VERSIONS, sglang_version

    found = sglang_version()
    if found in SUPPORTED_SGLANG_VERSIONS:
        return OK, f"sglang {found}"
    return FAIL, f"sglang {found}; supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}"


def _check_fresh_process() -> tuple[str, str]:
    from sglang_mxfp8_hicache.plugin import DISABLE_ENV, is_disabled

    if is_disabled():
        return FAIL, f"{DISABLE_ENV} is set: SGLang keeps its own host pool"
    done = subprocess.run(
        [sys.executable, "-m", "sglang_mxfp8_hicache.tools.probe"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode:
        return FAIL, done.stderr.strip().splitlines()[-1]
    chosen = json.loads(done.stdout.strip().splitlines()[-1])
    ours = chosen["mxfp8/assembler"].endswith(
        "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
    )
    others = chosen["bf16/assembler"].startswith("sglang.")
    if ours and others:
        return OK, "load_plugins() hooks get_mha_host_pool_cls in a new process"
    return FAIL, f"chosen: {chosen}"


def _check_entry_point() -> tuple[str, str]:
    from importlib.metadata import entry_points

    values = {ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if "sglang_mxfp8_hicache.plugin:register" in values:
        return OK, "sglang.srt.plugins: mxfp8_hicache"
    return FAIL, "entry point missing: reinstall with pip install sglang-mxfp8-hicache"


def _check_dispatch() -> tuple[str, str]:
    from sglang.srt.plugins import load_plugins

    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
    from sglang_mxfp8_hicache.tools.probe import device_buffer_info

    load_plugins()
    from sglang.srt.mem_cache.pool_host import mha

    chosen = {
        kind: mha.get_mha_host_pool_cls(device_buffer_info(kind)) for kind in FORMATS
    }
    if all(cls is MHATokenToKVPoolMXFP8Host for cls in chosen.values()):
        return (
            OK,
            f"{', '.join(chosen)} device pools -> {MHATokenToKVPoolMXFP8Host.__name__}",
        )
    return FAIL, ", ".join(
        f"{kind} -> {cls.__module__}.{cls.__qualname__}" for kind, cls in chosen.items()
    )


def _check_sizing() -> tuple[str, str]:
    model = dense_model(**EXAMPLE_MODEL, tp_size=1)
    [pool] = host_plan(model, device_tokens=EXAMPLE_DEVICE_TOKENS).pools
    return OK, (
        f"Llama-3.1-8B, ratio 2: {pool.bytes_per_token} B/token "
        f"({pool.scale_bytes_per_token} of scales), {pool.host_tokens} host tokens, "
        f"{pool.host_bytes / 1e9:.2f} GB"
    )


def _check_round_trip() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: the JIT transfer kernels need one"
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host
    from sglang_mxfp8_hicache.tools.selfcheck import (
        build_device_pool,
        build_host_pool,
        round_trip,
    )

    pages = 64
    device_pool = build_device_pool(
        head_num=8, head_dim=128, layer_num=8, pages=2 * pages + 1, device="cuda"
    )
    host = build_host_pool(
        device_pool,
        MHATokenToKVPoolMXFP8Host,
        host_to_device_ratio=1.0,
        pin_memory=True,
    )
    try:
        round_trip(device_pool, host, pages=pages, seed=1)  # warm-up: JIT compiles
        result = round_trip(device_pool, host, pages=pages, seed=2)
    finally:
        host.destroy()
    gb = result.bytes_per_direction / 1e9
    detail = (
        f"8x128, 8 layers, {pages} pages: backup {gb / result.backup_seconds:.1f} GB/s, "
        f"load {gb / result.load_seconds:.1f} GB/s; payload "
        f"{'exact' if result.payload_restored else 'DIFFERS'}, scales "
        f"{'exact' if result.scales_restored else 'DIFFER'}, untouched pages "
        f"{'kept' if result.host_untouched and result.device_untouched else 'CHANGED'}"
    )
    return (OK if result.ok else FAIL), detail


def _e2e_progress(line: str) -> None:
    """An e2e step's processes, each as it ends: a step takes minutes."""
    print(f"  {line}", file=sys.stderr, flush=True)


def _check_e2e() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: SGLang's controller and kernels need one"
    from sglang_mxfp8_hicache.tools.e2e import SEQ_LENS, run_modes

    verdicts = run_modes(progress=_e2e_progress)
    errors = {
        m: v.error.splitlines()[-1] for m, v in verdicts.items() if v.error is not None
    }
    if errors:
        return FAIL, f"errors: {errors}"
    ours, sglang, plain = verdicts["ours"], verdicts["sglang"], verdicts["plain"]
    exact = ours.restored_exactly and sglang.restored_exactly
    agree = ours.restored_sha256 == sglang.restored_sha256
    control_caught = plain.payload_restored and not plain.scales_restored
    detail = (
        f"sequences {list(SEQ_LENS)} via {ours.write_path.split(' (')[0]}; "
        f"ours/sglang max |dequant diff| {ours.dequantized_max_diff}/"
        f"{sglang.dequantized_max_diff}, bytes {'identical' if agree else 'DIFFER'}; "
        f"payload-only pool: scales lost, max diff {plain.dequantized_max_diff:.3g}"
        if control_caught
        else "payload-only control did NOT lose scales"
    )
    return (OK if exact and agree and control_caught else FAIL), detail


def _check_e2e_fp4() -> tuple[str, str]:
    """fp4_mx_block16 through the controller: real FP4 from set_kv_buffer (its
    quantizer is torch code, so it runs off Blackwell), dequantized difference
    0, and the payload-only control loses the scales (SGLang's own class
    refuses the pool)."""
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: SGLang's controller and kernels need one"
    from sglang_mxfp8_hicache.tools.e2e import run_modes

    setup = "fp4_mx_block16"
    verdicts = run_modes(
        modes=("ours", "plain"), setups=(setup,), progress=_e2e_progress
    )
    ours, plain = verdicts.get(f"{setup}:ours"), verdicts.get(f"{setup}:plain")
    for v in (ours, plain):
        if v is None or v.error is not None:
            said = "no verdict" if v is None else v.error.splitlines()[-1]
            return FAIL, f"error: {said}"
    # Written by set_kv_buffer, not the random-bytes fallback.
    exact = ours.write_path.startswith("set_kv_buffer") and ours.restored_exactly
    caught = plain.payload_restored and not plain.scales_restored
    detail = (
        f"{setup} via set_kv_buffer: max |dequant diff| "
        f"{ours.dequantized_max_diff}; payload-only pool: scales lost, max diff "
        f"{plain.dequantized_max_diff:.3g}"
        if caught
        else "payload-only control did NOT lose scales"
    )
    return (OK if exact and caught else FAIL), detail


def _check_e2e_l3() -> tuple[str, str]:
    """L2 -> L3 -> L2 -> device through the controller, on file and (where it
    runs) on a Mooncake master and storage node started on loopback."""
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: SGLang's controller and kernels need one"
    from sglang_mxfp8_hicache.tools.e2e import run_modes
    from sglang_mxfp8_hicache.tools.mooncake_loopback import (
        MooncakeLoopback,
        mooncake_available,
    )

    verdicts = run_modes(modes=(), l3=("file",), progress=_e2e_progress)
    mooncake_missing = mooncake_available()
    if mooncake_missing is None:
        with MooncakeLoopback() as service:
            verdicts |= run_modes(
                modes=(),
                l3=("mooncake",),
                l3_config=service.extra_config(),
                progress=_e2e_progress,
            )
    details, ok = [], True
    for key, v in verdicts.items():
        l3 = v.l3
        if l3 is None:
            ok = False
            details.append(f"{key}: {(v.error or 'no verdict').splitlines()[-1]}")
            continue
        exact = bool(
            l3.payload_restored
            and l3.scales_restored
            and l3.untouched_pages_kept
            and l3.dequantized_max_diff == 0.0
            and l3.fetched_tokens == l3.pages * 128
            and l3.refusal_left_controller_clean
        )
        ok &= exact
        details.append(
            f"{l3.backend}: {l3.pages} pages out of L2 and back, "
            f"{'exact' if exact else 'NOT EXACT'}"
        )
    if mooncake_missing is not None:
        details.append(f"mooncake not run ({mooncake_missing})")
    return (OK if ok else FAIL), "; ".join(details)


def cmd_check(args: argparse.Namespace) -> int:
    checks = [
        ("sglang version", _check_version),
        ("plugin entry point", _check_entry_point),
        ("hook in a fresh process", _check_fresh_process),
        ("dispatch on scaled pools", _check_dispatch),
        ("host sizing (example)", _check_sizing),
        ("GPU round trip", _check_round_trip),
    ]
    if args.e2e:
        checks += [
            ("e2e: SGLang controller", _check_e2e),
            ("e2e: fp4_mx_block16", _check_e2e_fp4),
            ("e2e: L3 storage", _check_e2e_l3),
        ]
    steps = []
    for name, fn in checks:
        # The e2e steps take minutes: say what has finished as it does.
        started = time.monotonic()
        steps.append(_run_step(name, fn))
        took = time.monotonic() - started
        print(f"{name}: {steps[-1].status} ({took:.0f} s)", file=sys.stderr, flush=True)
    skipped = [s.name for s in steps if s.status == SKIPPED]
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(steps).decode(), indent=2))
    else:
        print_table(
            ["step", "status", "detail"], [[s.name, s.status, s.detail] for s in steps]
        )
        if skipped:
            print(f"\nNot run on this machine: {', '.join(skipped)}.")
    if any(s.status == FAIL for s in steps):
        return 1
    if args.require_gpu and skipped:
        print(f"--require-gpu: {', '.join(skipped)} did not run.", file=sys.stderr)
        return 1
    return 0


def _model(args: argparse.Namespace) -> ModelKV:
    """The model from --config or from the three flags, never a mix: a flag
    that quietly overrode one field of a config would size some other model."""
    flags = {
        "--layers": args.layers,
        "--kv-heads": args.kv_heads,
        "--head-dim": args.head_dim,
    }
    given = [flag for flag, value in flags.items() if value is not None]
    choice = f"give either --config or all of {', '.join(flags)}"
    if args.config is not None:
        if given:
            raise UsageError(f"--config with {', '.join(given)}: {choice}")
        try:
            return read_model(
                args.config,
                tp_size=args.tp_size,
                swa_full_tokens_ratio=args.swa_full_tokens_ratio,
            )
        except SizingError as exc:
            raise UsageError(f"--config {exc}") from None
    missing = [flag for flag in flags if flag not in given]
    if missing:
        raise UsageError(f"no {', '.join(missing)}: {choice}")
    return dense_model(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        tp_size=args.tp_size,
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB ({n / 2**30:.3f} GiB)"


def cmd_size(args: argparse.Namespace) -> int:
    plan = host_plan(
        _model(args),
        device_tokens=args.device_tokens,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        fmt=FORMATS[args.kv_cache_dtype],
        page_size=args.page_size,
        tp_size=args.tp_size,
        ranks_per_node=min(args.tp_size, args.gpus_per_node),
        max_mamba_cache_size=args.max_mamba_cache_size,
        draft_layers=args.draft_layers,
    )
    if args.json:
        print(msgspec.json.encode(plan).decode())
        return 0
    _print_plan(plan, args)
    return 0


def _print_plan(plan: HostPlan, args: argparse.Namespace) -> None:
    sizing = (
        f"--hicache-size {args.hicache_size} GB per rank"
        if args.hicache_size > 0
        else f"--hicache-ratio {args.hicache_ratio} x {args.device_tokens} device tokens"
    )
    print(
        f"{plan.source}: TP {plan.tp_size}, --kv-cache-dtype {plan.kv_cache_dtype}, "
        f"page_size {plan.page_size}, {sizing}"
    )
    print_table(
        [
            "pool",
            "layers",
            "KV heads x dim",
            "device tokens",
            "B/token (payload+scales+seals)",
            "host tokens",
            "host GB",
            "payload-only host tokens",
        ],
        [
            [
                p.name,
                str(p.layers),
                f"{p.kv_heads} x {p.head_dim}"
                + (f"/{p.v_head_dim}" if p.v_head_dim != p.head_dim else ""),
                str(p.device_tokens),
                f"{p.bytes_per_token} ({p.payload_bytes_per_token}+"
                f"{p.scale_bytes_per_token}+{p.seal_bytes_per_token})",
                str(p.host_tokens),
                f"{p.host_bytes / 1e9:.3f}",
                str(p.host_tokens_without_scales),
            ]
            for p in plan.pools
        ],
    )
    print(f"host tier per rank: {_gb(plan.host_bytes)}")
    ranks = f"{plan.ranks_per_node} rank{'s' if plan.ranks_per_node > 1 else ''}"
    print(
        f"per node ({ranks}, --gpus-per-node {args.gpus_per_node}): "
        f"{_gb(plan.host_bytes_per_node)}"
    )
    if plan.mamba_state_bytes:
        print(
            f"Mamba state: {plan.mamba_state_bytes} B per request slot per rank, "
            "in SGLang's own Mamba host pool beside these"
        )
    available = _available_host_bytes()
    if available is not None and plan.host_bytes_per_node > available:
        print(
            f"warning: a node's host tier is more than this machine's available "
            f"memory ({_gb(available)}); SGLang refuses a host pool that does "
            "not fit when it allocates"
        )
    for warning in plan.warnings:
        print(f"warning: {warning}")


def _available_host_bytes() -> int | None:
    """What SGLang would find free on this machine (``available_host_memory_bytes``)."""
    try:
        from sglang.srt.mem_cache.host_memory import available_host_memory_bytes

        return int(available_host_memory_bytes())
    except Exception:  # sizing still answers where SGLang cannot tell
        return None


def cmd_bench(args: argparse.Namespace) -> int:
    if (args.plot is None) != (args.plot_from is None):
        raise UsageError("--plot and --from go together")
    if args.plot is not None:
        from sglang_mxfp8_hicache.tools.bench import plot

        plot(args.plot_from, args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.l3 is not None:
        return cmd_bench_l3(args)
    for flag, value, needs in (
        ("--l3-dir", args.l3_dir, "--l3 file, hf3fs or nixl"),
        ("--mooncake-config", args.mooncake_config, "--l3 mooncake"),
    ):
        if value is not None:
            raise UsageError(f"{flag} needs {needs}")
    warmup = L2_WARMUP if args.warmup is None else args.warmup
    repeat = L2_REPEAT if args.repeat is None else args.repeat
    # bench imports torch and SGLang (seconds): only a bench run pays for that.
    import torch

    with warnings.catch_warnings():
        # Without CUDA, SGLang's import warns about quantization kernels the bench
        # never uses; the line that says why it stops should stand alone.
        warnings.simplefilter("ignore", UserWarning)
        from sglang_mxfp8_hicache.tools import bench

    unknown = sorted(set(args.ablations) - set(bench.ABLATIONS))
    if unknown:
        raise UsageError(
            f"--ablations: unknown ablation(s) {unknown}; known: {sorted(bench.ABLATIONS)}"
        )
    names = [name for group in args.setup or [("page_first",)] for name in group]
    if args.drafts is not None and "draft" not in names:
        raise UsageError("--drafts needs --setup draft")
    try:
        setups = bench.setups(names, args.drafts or bench.DEFAULT_DRAFTS)
    except ValueError as exc:
        raise UsageError(f"--setup: {exc}") from None
    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (the JIT transfer kernels)")
    rows = bench.run(
        args.geometries or bench.GEOMETRIES,
        args.pages or bench.PAGES,
        classes=bench.host_classes(args.ablations),
        setups=setups,
        warmup=warmup,
        repeat=repeat,
    )
    print(
        f"{torch.cuda.get_device_name()}, page_size {PAGE_SIZE}, "
        f"median of {repeat} runs (CUDA events)"
    )
    print_table(*bench.table(rows))
    print("\nLoads, until layer 0's work is done (what the forward pass waits on):")
    print_table(*bench.layer0_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(bench.to_json(rows))
    missed = sum(not row.meets_goal() for row in rows)
    if args.check and missed:
        print(
            f"{PROG} bench: {missed} of {len(rows)} cells miss their goal",
            file=sys.stderr,
        )
        return 1
    return 0


class BenchFailed(Exception):
    """The benchmark ran and L3 lost or changed pages: :func:`main` reports it in
    one line on stderr, exit code 1 (the numbers of such a run mean nothing)."""


def cmd_bench_l3(args: argparse.Namespace) -> int:
    """``bench --l3``: every flag is checked before CUDA is looked for, as for
    the L2 bench; a Mooncake or a host pool that cannot be had is exit 2, pages
    that L3 loses or changes exit 1."""
    if args.ablations:
        raise UsageError("--ablations undo choices of the L2 transfers; not with --l3")
    if args.setup is not None or args.drafts is not None:
        raise UsageError("--setup and --drafts build L2 host pools; not with --l3")
    if args.geometries is not None and len(args.geometries) != 1:
        raise UsageError(
            f"--l3 takes one geometry, got {len(args.geometries)} in --geometries"
        )
    if args.l3_dir is not None and args.l3 == "mooncake":
        raise UsageError("--l3-dir is for --l3 file, hf3fs or nixl, not --l3 mooncake")
    if args.mooncake_config is not None and args.l3 != "mooncake":
        raise UsageError(f"--mooncake-config is for --l3 mooncake, not --l3 {args.l3}")
    warmup = L3_WARMUP if args.warmup is None else args.warmup
    repeat = L3_REPEAT if args.repeat is None else args.repeat
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from sglang_mxfp8_hicache.tools import bench_l3

    if not torch.cuda.is_available():
        raise UsageError(
            "needs a CUDA GPU (the MXFP8 host pool builds only where its JIT "
            "transfer kernels run, for L3 too)"
        )
    try:
        bench_l3.apply_plugin_hooks()
        report = bench_l3.run(
            args.l3,
            args.geometries[0] if args.geometries else bench_l3.GEOMETRY,
            args.pages or bench_l3.PAGES,
            reps=repeat,
            warmup=warmup,
            l3_dir=args.l3_dir,
            mooncake_config=args.mooncake_config,
        )
    except bench_l3.L3Unavailable as exc:
        raise UsageError(str(exc)) from None
    except bench_l3.L3BenchError as exc:
        raise BenchFailed(f"L3 failed, no numbers: {exc}") from None
    print(bench_l3.describe(report))
    print_table(*bench_l3.table(report))
    missed = report.missed()
    if missed:
        cells = ", ".join(f"{p} pages {d} {r:.3f}x" for p, d, r in missed)
        print(
            f"\nOver {bench_l3.GOAL_RATIO}x payload-only from "
            f"{bench_l3.GOAL_FROM_PAGES} pages: {cells}"
        )
    if args.json_out:
        Path(args.json_out).write_text(report.to_json())
    with_goal = 2 * sum(cell.has_goal for cell in report.cells)
    if args.check and missed:
        print(
            f"{PROG} bench: {len(missed)} of {with_goal} cells miss their goal",
            file=sys.stderr,
        )
        return 1
    return 0


# argparse types: each flag is checked where it is parsed, so the error names it.


def _int(text: str, allowed: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _int(text, "a positive integer", 1)


def non_negative_int(text: str) -> int:
    return _int(text, "an integer >= 0", 0)


def mxfp8_head_dim(text: str) -> int:
    """MXFP8 keeps one scale byte per 32 elements of a head."""
    allowed = f"a positive multiple of {MXFP8_SCALE_BLOCK} for MXFP8"
    head_dim = _int(text, allowed, 1)
    if head_dim % MXFP8_SCALE_BLOCK:
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
    return head_dim


def scaled_head_dim(text: str) -> int:
    """Whole scale blocks of the smallest format's block; ``size`` checks the
    chosen format's own."""
    head_dim = _int(text, SCALED_HEAD_DIMS, 1)
    if head_dim % SMALLEST_SCALE_BLOCK:
        raise argparse.ArgumentTypeError(f"must be {SCALED_HEAD_DIMS}, got {text}")
    return head_dim


def finite_non_negative(text: str) -> float:
    """``float()`` takes ``nan`` and ``inf``, which would size nothing or overflow."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _at_most(value: float, bound: float, unit: str, text: str):
    """``value``, parsed from ``text``, unless it is past ``bound``: larger is a
    typo, not a plan."""
    if value > bound:
        raise argparse.ArgumentTypeError(f"must be at most {bound} {unit}, got {text}")
    return value


def device_token_count(text: str) -> int:
    return _at_most(positive_int(text), MAX_DEVICE_TOKENS, "tokens", text)


def hicache_size_gb(text: str) -> int:
    """SGLang's --hicache-size is an integer number of GB."""
    return _at_most(non_negative_int(text), MAX_HICACHE_SIZE_GB, "GB per rank", text)


def hicache_ratio(text: str) -> float:
    return _at_most(
        finite_non_negative(text),
        MAX_HICACHE_RATIO,
        "host tokens per device token",
        text,
    )


def unit_fraction(text: str) -> float:
    value = finite_non_negative(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def page_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(positive_int(item) for item in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be positive integers, comma separated, got {text!r}"
        ) from None


def geometries(text: str) -> tuple[tuple[int, int, int], ...]:
    """``HEADSxHEAD_DIM[xLAYERS],...`` as ``(heads, head_dim, layers)`` tuples."""
    parsed = []
    for item in text.split(","):
        parts = item.strip().split("x")
        try:
            if len(parts) not in (2, 3):
                raise argparse.ArgumentTypeError
            heads, head_dim = positive_int(parts[0]), mxfp8_head_dim(parts[1])
            layers = positive_int(parts[2]) if len(parts) == 3 else BENCH_LAYERS
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                "must be HEADSxHEAD_DIM[xLAYERS], comma separated, of positive "
                f"integers with HEAD_DIM a multiple of {MXFP8_SCALE_BLOCK} "
                f"(e.g. 8x128,8x128x80), got {item!r}"
            ) from None
        parsed.append((heads, head_dim, layers))
    return tuple(parsed)


def l3_backend(text: str) -> str:
    from sglang_mxfp8_hicache.tools.bench_l3 import BACKENDS

    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"must be {' or '.join(BACKENDS)} (the L3 backends bench --l3 times), "
            f"got {text!r}"
        )
    return text


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"must be an existing directory, got {text}")
    return text


def mooncake_config(text: str) -> dict:
    """What a server takes as ``--hicache-storage-backend-extra-config``."""
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(
            "must be a JSON object, as --hicache-storage-backend-extra-config "
            f'(e.g. \'{{"master_server_address": "10.0.0.1:50051"}}\'), got {text!r}'
        )
    if "master_server_address" not in config and "client_server_address" not in config:
        raise argparse.ArgumentTypeError(
            "names no master_server_address (nor client_server_address), which "
            f"SGLang's MooncakeStore needs, in {text!r}"
        )
    return config


def ablation_names(text: str) -> tuple[str, ...]:
    """Names only: bench.ABLATIONS, which knows them, imports torch and SGLang."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def setup_names(text: str) -> tuple[str, ...]:
    """Names only, as for ablations: bench.SETUPS knows them."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"must name a setup, got {text!r}")
    return names


def existing_files(text: str) -> tuple[str, ...]:
    paths = tuple(item for item in text.split(",") if item)
    missing = [path for path in paths if not Path(path).is_file()]
    if not paths or missing:
        raise argparse.ArgumentTypeError(
            f"must be existing files, comma separated; not found: {missing or text!r}"
        )
    return paths


def json_out_path(text: str) -> str:
    """Checked before a benchmark of minutes, not when its results are written."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"must be a file in an existing directory, got {text}"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=PROG,
        description="MXFP8 KV scales in SGLang's hierarchical KV cache (HiCache):\n"
        "check the install, size the host tier, time the transfers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Run '{PROG} COMMAND --help' for the flags of a command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands"
    )
    # Descriptions keep their line breaks: argparse would split --kv-heads.
    raw = argparse.RawDescriptionHelpFormatter

    check = sub.add_parser(
        "check",
        formatter_class=raw,
        help="is the plugin installed and chosen by SGLang; on CUDA, a round trip "
        "(--e2e: also through SGLang's HiCache controller)",
        description="Verify the install: SGLang version, plugin entry point and hook,\n"
        "dispatch on MXFP8 and FP4 pools, sizing and, on a CUDA GPU, a round trip.\n"
        "Each step reports on stderr as it ends (--e2e: each of its processes\n"
        "too). Exit 1 if a step fails (--require-gpu: or a GPU step did not run).",
    )
    check.add_argument("--json", action="store_true", help="print the steps as JSON")
    check.add_argument(
        "--e2e",
        action="store_true",
        help="also run real MXFP8 and fp4_mx_block16 KV through SGLang's HiCache "
        "controller, and L3 storage (GPU; minutes)",
    )
    check.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit 1 if a GPU step could not run (CI on GPU machines)",
    )
    check.set_defaults(func=cmd_check)

    size = sub.add_parser(
        "size",
        formatter_class=raw,
        help="host-tier bytes and tokens per rank, with and without the scales",
        description="Host-tier size per rank as SGLang's HostKVCache computes it,\n"
        "with and without the scale bytes of --kv-cache-dtype. Give the model as\n"
        "--config, or as --layers, --kv-heads and --head-dim.",
    )
    size.add_argument(
        "--kv-cache-dtype",
        choices=list(FORMATS),
        default="mxfp8",
        help="the block-scaled format (default: %(default)s)",
    )
    size.add_argument(
        "--page-size",
        type=positive_int,
        metavar="N",
        default=PAGE_SIZE,
        help=f"tokens per page; mxfp8 needs {PAGE_SIZE} (default: %(default)s)",
    )
    size.add_argument(
        "--config",
        metavar="PATH",
        help="the model's directory or its config.json, read through SGLang's "
        "ModelConfig (hybrid SWA and Mamba models get SGLang's pools)",
    )
    size.add_argument(
        "--layers", type=positive_int, metavar="N", help="num_hidden_layers"
    )
    size.add_argument(
        "--kv-heads", type=positive_int, metavar="N", help="num_key_value_heads"
    )
    size.add_argument(
        "--head-dim",
        type=scaled_head_dim,
        metavar="N",
        help=SCALED_HEAD_DIMS,
    )
    size.add_argument(
        "--tp-size",
        type=positive_int,
        metavar="N",
        default=1,
        help="tensor parallel ranks; must divide the KV heads or be a multiple of "
        "them (default: %(default)s)",
    )
    size.add_argument(
        "--device-tokens",
        type=device_token_count,
        metavar="N",
        required=True,
        help="the device KV pool's token count (max_total_num_tokens; of the "
        "full pool for hybrid models)",
    )
    size.add_argument(
        "--hicache-ratio",
        type=hicache_ratio,
        metavar="R",
        default=2.0,
        help="host tokens per device token (default: %(default)s)",
    )
    size.add_argument(
        "--hicache-size",
        type=hicache_size_gb,
        metavar="GB",
        default=0,
        help="host GB (1e9 B) per rank, an integer as SGLang's flag; overrides "
        "the ratio unless 0 (default: %(default)s)",
    )
    size.add_argument(
        "--swa-full-tokens-ratio",
        type=unit_fraction,
        metavar="R",
        default=SWA_FULL_TOKENS_RATIO,
        help="hybrid SWA models: SWA pool tokens per full pool token, as SGLang's "
        "flag (default: %(default)s)",
    )
    size.add_argument(
        "--max-mamba-cache-size",
        type=positive_int,
        metavar="N",
        help="Mamba hybrids with --hicache-size: the device Mamba slots, which "
        "share the host budget (default: none)",
    )
    size.add_argument(
        "--draft-layers",
        type=non_negative_int,
        metavar="N",
        default=0,
        help="packed MTP/NextN draft layers (--speculative-algorithm NEXTN or "
        "EAGLE on an MTP model), carried in the target's host pages "
        "(default: %(default)s)",
    )
    size.add_argument(
        "--gpus-per-node",
        type=positive_int,
        metavar="N",
        default=8,
        help="ranks on one host, for the per-node total (default: %(default)s)",
    )
    size.add_argument("--json", action="store_true", help="print the plan as JSON")
    size.set_defaults(func=cmd_size)

    bench = sub.add_parser(
        "bench",
        formatter_class=raw,
        help="time ours vs SGLang's MXFP8 host pool vs payload-only vs raw copy "
        "(CUDA); --l3: L3 put/get, MXFP8 vs payload-only pages",
        description="Time backups and loads of several host pools side by side on\n"
        "one CUDA GPU. Exit 0 when the benchmark completed; with --check,\n"
        "exit 1 if a cell misses its goal.\n\n"
        f"--setup {','.join(BENCH_SETUPS)}: the host pools of\n"
        "each setup in turn: page_first (default); draft, with --drafts packed\n"
        "one-layer MTP/NextN draft pools, each loaded right after the target\n"
        "layer of its depth; layer_first; direct (page_first_direct with\n"
        "--hicache-io-backend direct); page_head (heads-major pages); an FP4\n"
        "recipe's pools. A class that refuses a setup (SGLang's MXFP8 class:\n"
        "page_first only) shows 'refused'.\n\n"
        "--l3 file|hf3fs|nixl|mooncake|seaweedfs: put and get of MXFP8 pages\n"
        "and of the same model's payload-only pages through that L3 backend,\n"
        "as SGLang's cache controller moves them, for one geometry. Goal:\n"
        "MXFP8 at most 1.05x payload-only time from 64 pages (--check: exit 1\n"
        "if not). Exit 1 also if L3 loses or changes a page.",
    )
    bench.add_argument(
        "--geometries",
        type=geometries,
        metavar="HxD[xL],...",
        help="HEADSxHEAD_DIM[xLAYERS], comma separated; layers default to "
        f"{BENCH_LAYERS} (default: bench.GEOMETRIES; --l3: exactly one, default "
        "bench_l3.GEOMETRY)",
    )
    bench.add_argument(
        "--pages",
        type=page_counts,
        metavar="N,...",
        help="pages per transfer, comma separated (default: bench.PAGES)",
    )
    bench.add_argument(
        "--ablations",
        type=ablation_names,
        metavar="NAME,...",
        default=(),
        help="extra columns: ours with one design choice undone, by the names in "
        "tools/ablations.py (default: none)",
    )
    bench.add_argument(
        "--setup",
        type=setup_names,
        action="append",
        metavar="NAME,...",
        help=f"host pool setups, comma separated or repeated: {', '.join(BENCH_SETUPS)} "
        "(default: page_first)",
    )
    bench.add_argument(
        "--drafts",
        type=positive_int,
        metavar="N",
        help="--setup draft: packed one-layer draft pools (default: "
        "bench.DEFAULT_DRAFTS)",
    )
    bench.add_argument(
        "--warmup",
        type=non_negative_int,
        metavar="N",
        help=f"untimed rounds (default: {L2_WARMUP}; --l3: {L3_WARMUP})",
    )
    bench.add_argument(
        "--repeat",
        type=positive_int,
        metavar="N",
        help="timed rounds, of which the median counts (default: "
        f"{L2_REPEAT}; --l3: {L3_REPEAT})",
    )
    bench.add_argument(
        "--json-out",
        type=json_out_path,
        metavar="PATH",
        help="write the rows as JSON here",
    )
    bench.add_argument(
        "--plot",
        type=json_out_path,
        metavar="PNG",
        help="draw ours / payload-only and ours / raw copy against pages from "
        "--from's JSON files instead of timing (needs matplotlib, no GPU)",
    )
    bench.add_argument(
        "--from",
        dest="plot_from",
        type=existing_files,
        metavar="JSON,...",
        help="--plot: the --json-out files of earlier runs, comma separated",
    )
    bench.add_argument(
        "--check", action="store_true", help="exit 1 if a cell misses its goal (CI)"
    )
    bench.add_argument(
        "--l3",
        type=l3_backend,
        metavar="BACKEND",
        help="time L3 instead: file, hf3fs, nixl, mooncake or seaweedfs",
    )
    bench.add_argument(
        "--l3-dir",
        type=existing_dir,
        metavar="DIR",
        help="--l3 file, hf3fs, nixl: where the bench makes its own directory, removed at the "
        "end (default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else the system "
        "temp dir)",
    )
    bench.add_argument(
        "--mooncake-config",
        type=mooncake_config,
        metavar="JSON",
        help="--l3 mooncake: the --hicache-storage-backend-extra-config of a "
        "running master (default: start a master and storage node on loopback)",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, SizingError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BenchFailed as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
