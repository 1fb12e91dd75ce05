"""``sglang-mxfp8-hicache``: check the install, size the host tier, time transfers.

Bad input ends in one line on stderr and exit code 2, never a traceback
(argparse types per flag, ``sizing.SizingError``, :class:`UsageError`); so do an
unwritable output, Ctrl-C and SIGTERM (:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from sglang_mxfp8_hicache import __version__, settings
from sglang_mxfp8_hicache.errors import BlockScaledHiCacheConfigError as ConfigError
from sglang_mxfp8_hicache.geometry import FORMATS, MXFP8_SCALE_BLOCK
from sglang_mxfp8_hicache.refusals import SERVED_LAYOUTS
from sglang_mxfp8_hicache.tools import results, sizing

PROG = "sglang-mxfp8-hicache"
OK, WARN, FAIL, SKIPPED = "ok", "warn", "FAIL", "skipped"
BENCH_LAYERS = 8
"""Layers of a bench geometry written without them (``8x128``)."""


class UsageError(Exception):
    """Bad input found after parsing: one line on stderr, exit code 2."""


class BenchFailed(Exception):
    """L3 lost or changed pages: one line on stderr, exit code 1."""


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error in one line on stderr, exit 2: argparse's usage block
    would bury the line that says what is wrong (``--help`` has it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*headers).rstrip())
    print(line.format(*("-" * w for w in widths)).rstrip())
    for row in rows:
        print(line.format(*row).rstrip())


# -- check ----------------------------------------------------------------------


def _check_version() -> tuple[str, str]:
    from sglang_mxfp8_hicache.releases import SUPPORTED_SGLANG_VERSIONS, sglang_version

    found = sglang_version()
    if found in SUPPORTED_SGLANG_VERSIONS:
        return OK, f"sglang {found}"
    return FAIL, f"sglang {found}; supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}"


def _check_entry_point() -> tuple[str, str]:
    from importlib.metadata import entry_points

    values = {ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if "sglang_mxfp8_hicache.plugin:register" in values:
        return OK, "sglang.srt.plugins: mxfp8_hicache"
    return FAIL, (
        "entry point missing: reinstall the package into this environment, "
        "from its clone (pip install .) or its wheel"
    )


def print_dispatch() -> None:
    """As JSON, a :class:`results.Dispatch` of this process after ``load_plugins()``:
    the host pool class picked for each block-scaled format and bf16, the hooks."""
    import torch
    from sglang.srt.plugins import load_plugins

    from sglang_mxfp8_hicache import releases
    from sglang_mxfp8_hicache.hooks import hook_states
    from sglang_mxfp8_hicache.tools.pools import build_device_pool

    load_plugins()
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    shape = dict(head_num=2, head_dim=128, layer_num=1, pages=1, device="cpu")
    pools = {kind: build_device_pool(**shape, kv_cache_dtype=kind) for kind in FORMATS}
    pools["bf16"] = build_device_pool(**shape, payload_dtype=torch.bfloat16)
    chosen = {}
    for kind, pool in pools.items():
        selector_input = releases.host_pool_selector_input(pool)
        cls = hybrid_pool_assembler.get_mha_host_pool_cls(selector_input)
        chosen[kind] = f"{cls.__module__}.{cls.__qualname__}"
    found = results.Dispatch(chosen, tuple(hook_states()))
    print(msgspec.json.encode(found).decode())


def _fresh_process() -> results.Dispatch | str:
    """``print_dispatch``'s findings in a new process, or why there are none."""
    if settings.current().disable:
        return "SGLANG_MXFP8_HICACHE_DISABLE is set: SGLang keeps its own host pool"
    code = "from sglang_mxfp8_hicache.tools.cli import print_dispatch; print_dispatch()"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        return (done.stderr.strip() or f"exit {done.returncode}").splitlines()[-1]
    last = done.stdout.strip().splitlines()[-1]
    return msgspec.json.decode(last, type=results.Dispatch)


def _check_dispatch(found: results.Dispatch | str) -> tuple[str, str]:
    if isinstance(found, str):
        return FAIL, found
    ours = "sglang_mxfp8_hicache.host_pool.MHATokenToKVPoolMXFP8Host"
    if all(found.chosen[k] == ours for k in FORMATS) and found.chosen["bf16"] != ours:
        return OK, f"{', '.join(FORMATS)} -> ours, bf16 -> SGLang's, in a new process"
    return FAIL, f"chosen: {found.chosen}"


def _check_hooks(found: results.Dispatch | str) -> tuple[str, str]:
    """OK where every plugin hook is in force; else each missing one's target
    and cost: a warning, a failure where pages could restore wrong."""
    if isinstance(found, str):
        return FAIL, found
    missing = [hook for hook in found.hooks if not hook.in_force]
    if not missing:
        return OK, f"all {len(found.hooks)} in force in a new process"
    costs = "; ".join(
        f"{hook.target.rsplit('.', 1)[-1]} missing: {hook.if_missing}"
        for hook in missing
    )
    return (FAIL if any(hook.pages_wrong for hook in missing) else WARN), costs


def _check_sizing() -> tuple[str, str]:
    model = sizing.dense_model(layers=32, kv_heads=8, head_dim=128, tp_size=1)
    [pool] = sizing.host_plan(model, device_tokens=500_000).pools
    return OK, (
        f"Llama-3.1-8B, ratio 2: {pool.bytes_per_token} B/token "
        f"({pool.payload_bytes_per_token} payload, {pool.scale_bytes_per_token} "
        f"scales, {pool.seal_bytes_per_token} seal), {pool.host_tokens} host "
        f"tokens, {pool.host_bytes / 1e9:.2f} GB"
    )


def _check_round_trip() -> tuple[str, str]:
    """64 random pages of 8 layers out to our host pool and back into other
    device pages with the real JIT kernels, byte for byte."""
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: the JIT transfer kernels need one"
    from sglang_mxfp8_hicache.host_pool import MHATokenToKVPoolMXFP8Host as Ours
    from sglang_mxfp8_hicache.tools import pools

    pages = 64
    shape = dict(head_num=8, head_dim=128, layer_num=8, pages=2 * pages + 1)
    device_pool = pools.build_device_pool(**shape, device="cuda")
    host = pools.build_host_pool(
        device_pool, Ours, host_to_device_ratio=1.0, pin_memory=True
    )
    try:
        pools.round_trip(device_pool, host, pages=pages, seed=1)  # warm-up: JIT
        ok, found = pools.round_trip(device_pool, host, pages=pages, seed=2)
    finally:
        host.destroy()
    return (OK if ok else FAIL), f"8x128, 8 layers, {found}"


def _run_step(name: str, fn: Callable[[], tuple[str, str]]) -> results.Step:
    started = time.monotonic()
    try:
        status, detail = fn()
    except Exception as exc:  # a check reports, it does not crash
        status, detail = FAIL, f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started  # the GPU step compiles: say what is done
    print(f"{name}: {status} ({took:.0f} s)", file=sys.stderr, flush=True)
    return results.Step(name, status, detail)


def cmd_check(args: argparse.Namespace) -> int:
    settings.current()  # a bad variable: one line, before any step
    fresh = functools.cache(_fresh_process)  # one process for both of its steps
    checks = [
        ("sglang version", _check_version),
        ("plugin entry point", _check_entry_point),
        ("settings", lambda: (OK, settings.current().describe())),
        ("dispatch in a fresh process", lambda: _check_dispatch(fresh())),
        ("plugin hooks", lambda: _check_hooks(fresh())),
        ("host sizing (example)", _check_sizing),
        ("GPU round trip", _check_round_trip),
    ]
    steps = [_run_step(name, fn) for name, fn in checks]
    skipped = [s.name for s in steps if s.status == SKIPPED]
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(steps).decode(), indent=2))
    else:
        rows = [[s.name, s.status, s.detail] for s in steps]
        print_table(["step", "status", "detail"], rows)
        if skipped:
            print(f"\nNot run on this machine: {', '.join(skipped)}.")
    if any(s.status == FAIL for s in steps):
        return 1
    if args.require_gpu and skipped:
        print(f"--require-gpu: {', '.join(skipped)} did not run.", file=sys.stderr)
        return 1
    return 0


# -- size -----------------------------------------------------------------------


def _model(args: argparse.Namespace) -> sizing.ModelKV:
    """The model from --config or from the three flags, never a mix: a flag
    that quietly overrode one field of a config would size some other model."""
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads}
    flags["--head-dim"] = args.head_dim
    given = [flag for flag, value in flags.items() if value is not None]
    choice = f"give either --config or all of {', '.join(flags)}"
    if args.config is not None:
        if given:
            raise UsageError(f"--config with {', '.join(given)}: {choice}")
        ratio = args.swa_full_tokens_ratio or sizing.SWA_FULL_TOKENS_RATIO
        try:
            return sizing.read_model(
                args.config, tp_size=args.tp_size, swa_full_tokens_ratio=ratio
            )
        except sizing.SizingError as exc:
            raise UsageError(f"--config {exc}") from None
    if missing := [flag for flag in flags if flag not in given]:
        raise UsageError(f"no {', '.join(missing)}: {choice}")
    dims = dict(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim)
    return sizing.dense_model(**dims, tp_size=args.tp_size)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB ({n / 2**30:.3f} GiB)"


def cmd_size(args: argparse.Namespace) -> int:
    model = _model(args)
    if args.device_tokens < args.page_size:
        raise sizing.SizingError(
            f"--device-tokens {args.device_tokens} is less than one page of "
            f"--page-size {args.page_size}: SGLang rounds its pool down to whole "
            "pages and stops on none"
        )
    plan = sizing.host_plan(
        model,
        device_tokens=args.device_tokens,
        hicache_ratio=_given(args.hicache_ratio, sizing.HICACHE_RATIO),
        hicache_size_gb=args.hicache_size,
        fmt=FORMATS[args.kv_cache_dtype],
        page_size=args.page_size,
        tp_size=args.tp_size,
        ranks_per_node=min(args.tp_size, args.gpus_per_node),
        max_mamba_cache_size=args.max_mamba_cache_size,
        draft_layers=args.draft_layers,
        layout=args.hicache_mem_layout,
    )
    for note in _flags_that_do_not_apply(args, model):
        print(f"note: {note}", file=sys.stderr)
    budget, whose = _host_budget_per_rank(plan.ranks_per_node, args.host_memory_gb)
    plan = msgspec.structs.replace(
        plan, host_budget_per_rank=budget, host_budget_of=whose
    )
    if args.json:
        print(msgspec.json.encode(plan).decode())
    else:
        _print_plan(plan, args)
    return 0


def _print_plan(plan: sizing.HostPlan, args: argparse.Namespace) -> None:
    ratio = _given(args.hicache_ratio, sizing.HICACHE_RATIO)
    tier = (
        f"--hicache-size {args.hicache_size} GB per rank"
        if args.hicache_size > 0
        else f"--hicache-ratio {ratio} x {args.device_tokens} device tokens"
    )
    print(
        f"{plan.source}: TP {plan.tp_size}, --kv-cache-dtype {plan.kv_cache_dtype}, "
        f"page_size {plan.page_size}, {tier}"
    )
    headers = ["pool", "layers", "KV heads x dim", "device tokens"]
    headers += ["B/token (payload+scales+seals)", "host tokens", "host GB"]
    headers += ["payload-only host tokens"]
    rows = []
    for p in plan.pools:
        dims = f"{p.kv_heads} x {p.head_dim}"
        dims += f"/{p.v_head_dim}" if p.v_head_dim != p.head_dim else ""
        per_token = f"{p.bytes_per_token} ({p.payload_bytes_per_token}+"
        per_token += f"{p.scale_bytes_per_token}+{p.seal_bytes_per_token})"
        rows.append([p.name, p.layers, dims, p.device_tokens, per_token, p.host_tokens])
        rows[-1] += [f"{p.host_bytes / 1e9:.3f}", p.host_tokens_without_scales]
    print_table(headers, rows)
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
    budget = plan.host_budget_per_rank
    if budget is not None:
        print(f"SGLang's host budget per rank ({plan.host_budget_of}): {_gb(budget)}")
        if plan.host_bytes > budget:
            print(
                "warning: SGLang refuses a host pool over its budget when it allocates"
            )
    for warning in plan.warnings:
        print(f"warning: {warning}")


def _host_budget_per_rank(
    ranks: int, host_memory_gb: float | None
) -> tuple[int | None, str]:
    """SGLang's ``host_memory_budget_bytes`` per rank of ``ranks``, and whose: the
    server's (``--host-memory-gb``) or this machine's as SGLang reads it, no torch."""
    if host_memory_gb is not None:
        free, whose = int(host_memory_gb * 1e9), "the server's, by --host-memory-gb"
    else:
        import importlib.util

        # Run from its file: sglang/__init__.py imports torch (seconds).
        try:
            package = Path(importlib.util.find_spec("sglang").origin).parent
            path = package / "srt" / "mem_cache" / "host_memory.py"
            spec = importlib.util.spec_from_file_location("host_memory", path)
            host_memory = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(host_memory)
            free = host_memory.available_host_memory_bytes(allow_cgroup_fallback=True)
        except Exception:  # sizing still answers where SGLang cannot tell
            return None, ""
        whose = "this machine's; --host-memory-gb gives the server's"
    return max(free - sizing.HOST_MEMORY_RESERVE_BYTES, 0) // ranks, whose


def _flags_that_do_not_apply(
    args: argparse.Namespace, model: sizing.ModelKV
) -> list[str]:
    """One line per flag given that the model or the other flags leave unused."""
    unused = {
        "--swa-full-tokens-ratio": args.swa_full_tokens_ratio is not None
        and all(p.token_ratio == 1.0 for p in model.pools),
        "--max-mamba-cache-size": args.max_mamba_cache_size is not None
        and not (model.mamba_state_bytes and args.hicache_size > 0),
        "--hicache-ratio": args.hicache_ratio is not None and args.hicache_size > 0,
    }
    why = {
        "--swa-full-tokens-ratio": "the model has no sliding-window pool",
        "--max-mamba-cache-size": "it shares --hicache-size with a Mamba state pool",
        "--hicache-ratio": "--hicache-size sets the host tier",
    }
    return [f"{flag} is not used: {why[flag]}" for flag, yes in unused.items() if yes]


# -- bench ----------------------------------------------------------------------


def _refuse_mixed_flags(args: argparse.Namespace) -> None:
    """Flags of the other kind of run: each names what it needs."""
    l3 = args.l3
    l2_only = {"--ablations": args.ablations, "--setup": args.setup}
    l2_only["--beside"] = args.beside
    for flag, value in (l2_only | {"--drafts": args.drafts}).items():
        if l3 is not None and value:
            raise UsageError(f"{flag} is for the L2 bench, not with --l3")
    for flag, value, backends in (
        ("--l3-dir", args.l3_dir, ("file", "hf3fs", "nixl")),
        ("--l3-config", args.l3_config, ("mooncake", "seaweedfs", "dynamic")),
    ):
        which = f"--l3 {' or '.join(backends)}"
        if value is not None and l3 not in backends:
            need = f"is for {which}, not --l3 {l3}" if l3 else f"needs {which}"
            raise UsageError(f"{flag} {need}")
    if l3 is None and args.drafts is not None and "draft" not in _setup_names(args):
        raise UsageError("--drafts needs --setup draft")
    if l3 is not None and args.geometries is not None and len(args.geometries) != 1:
        raise UsageError(f"--l3 takes one geometry, got {len(args.geometries)}")
    config = args.l3_config
    if l3 == "mooncake" and config and "master_server_address" not in config:
        raise UsageError("--l3-config names no master_server_address (MooncakeStore's)")


def _refuse_unknown_names(args: argparse.Namespace) -> None:
    """A ``--setup``, ``--ablations`` or ``--beside`` name that ``results``
    does not list, refused before torch and SGLang are imported (seconds)."""
    for flag, kind, given, known in (
        ("--setup", "setup", _setup_names(args), results.BENCH_SETUPS),
        ("--ablations", "ablation", args.ablations, results.BENCH_ABLATIONS),
        ("--beside", "loop", args.beside, results.BESIDE_LOOPS),
    ):
        if unknown := sorted(set(given) - set(known)):
            raise UsageError(
                f"{flag}: unknown {kind}(s) {unknown}; known: {list(known)}"
            )


def _setup_names(args: argparse.Namespace) -> list[str]:
    return [name for group in args.setup or [("page_first",)] for name in group]


def _import_quietly(module: str) -> Any:
    """Imported only when needed (torch and SGLang take seconds), without the
    warnings SGLang's import gives about quantization kernels none of this uses."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(module)


def cmd_bench(args: argparse.Namespace) -> int:
    if (args.plot is None) != (args.plot_from is None):
        raise UsageError("--plot and --from go together")
    if args.plot is not None:
        bench = _import_quietly("sglang_mxfp8_hicache.tools.bench")
        try:
            bench.plot(args.plot_from, args.plot)
        except ValueError as exc:
            raise UsageError(f"--from {exc}") from None
        print(f"wrote {args.plot}")
        return 0
    _refuse_mixed_flags(args)
    _refuse_unknown_names(args)
    if args.l3 is not None:
        return _bench_l3(args)
    bench = _import_quietly("sglang_mxfp8_hicache.tools.bench")
    try:
        setups = bench.setups(_setup_names(args), args.drafts or bench.DEFAULT_DRAFTS)
    except ValueError as exc:
        raise UsageError(f"--setup: {exc}") from None
    import torch

    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (the JIT transfer kernels)")
    repeat = results.BENCH_REPEAT if args.repeat is None else args.repeat
    rows = bench.run(
        args.geometries or results.BENCH_GEOMETRIES,
        args.pages,
        classes=bench.host_classes(args.ablations),
        setups=setups,
        warmup=results.BENCH_WARMUP if args.warmup is None else args.warmup,
        repeat=repeat,
        beside=args.beside,
    )
    print(
        f"{torch.cuda.get_device_name()}, page_size {sizing.PAGE_SIZE}, "
        f"median of {repeat} runs (CUDA events)"
    )
    if args.beside:
        print("Beside a loop on the main stream: its slowdown, and the transfer's ms:")
        print_table(*bench.table(rows, beside=True))
    else:
        print_table(*bench.table(rows))
        print("\nLoads, until layer 0's work is done (what the forward pass waits on):")
        print_table(*bench.table(rows, layer0=True))
    if args.json_out:
        Path(args.json_out).write_bytes(bench.to_json(rows))
    missed = sum(not row.meets_goal() for row in rows)
    return _missed_goals(missed, len(rows)) if args.check and missed else 0


def _missed_goals(missed: int, cells: int) -> int:
    """``--check``: exit 1, saying how many cells missed their goal."""
    print(f"{PROG} bench: {missed} of {cells} cells miss their goal", file=sys.stderr)
    return 1


def _bench_l3(args: argparse.Namespace) -> int:
    """Host pools or a service that cannot be had is exit 2, pages that L3
    loses or changes exit 1."""
    bench_l3 = _import_quietly("sglang_mxfp8_hicache.tools.bench_l3")
    import torch

    if not torch.cuda.is_available():
        raise UsageError(
            "needs a CUDA GPU (the MXFP8 host pool builds only where its JIT "
            "transfer kernels run, for L3 too)"
        )
    try:
        bench_l3.apply_plugin_hooks()
        report = bench_l3.run(
            args.l3,
            args.geometries[0] if args.geometries else results.L3_GEOMETRY,
            args.pages,
            reps=results.L3_REPEAT if args.repeat is None else args.repeat,
            warmup=results.L3_WARMUP if args.warmup is None else args.warmup,
            l3_dir=args.l3_dir,
            l3_config=args.l3_config,
        )
    except bench_l3.L3Unavailable as exc:
        raise UsageError(str(exc)) from None
    except bench_l3.L3BenchError as exc:
        raise BenchFailed(f"L3 failed, no numbers: {exc}") from None
    print(bench_l3.describe(report))
    print_table(*bench_l3.table(report))
    if missed := report.missed():
        cells = ", ".join(f"{p} pages {d} {r:.3f}x" for p, d, r in missed)
        print(f"\nOver the goal: {cells}")
    if args.json_out:
        Path(args.json_out).write_bytes(report.to_json())
    with_goal = 2 * len(report.cells)
    return _missed_goals(len(missed), with_goal) if args.check and missed else 0


# -- argparse types: each flag is checked where it is parsed, so the error names it.


def checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], allowed: str):
    """``parse(text)`` if ``ok`` holds for it, else an error naming ``allowed``
    and the value."""

    def check(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return check


def number(parse: type, low: float, high: float = math.inf, *, above: bool = False):
    """Finite (``float`` takes ``nan`` and ``inf``), from ``low`` (above it with
    ``above``) to ``high``: past that a value is a typo, not a plan."""
    allowed = "an integer" if parse is int else "a finite number"
    allowed += f" {'>' if above else '>='} {low}"
    allowed += f" and <= {high}" if high < math.inf else ""
    return checked(
        parse,
        lambda v: math.isfinite(v) and low <= v <= high and not (above and v == low),
        allowed,
    )


positive_int, non_negative_int = number(int, 1), number(int, 0)
head_dim = checked(
    int,
    lambda v: v > 0 and v % sizing.SMALLEST_SCALE_BLOCK == 0,
    sizing.SCALED_HEAD_DIMS,
)
existing_dir = checked(str, lambda p: Path(p).is_dir(), "an existing directory")
existing_file = checked(str, lambda p: Path(p).is_file(), "an existing file")
name = checked(str.strip, bool, "a name")


def writable(path: str) -> bool:
    """Whether a file can be written at ``path``, tried by opening it (root
    passes ``os.access`` even in ``/proc``); a file made for the try is removed."""
    made = not Path(path).exists()
    try:
        Path(path).open("ab").close()
    except OSError:
        return False
    if made:
        Path(path).unlink()
    return True


json_out_path = checked(str, writable, "a file that can be written")
plot_path = checked(
    str,
    lambda p: Path(p).suffix.lower() in (".png", ".pdf", ".svg") and writable(p),
    "a .png, .pdf or .svg file that can be written",
)
json_object = checked(
    json.loads,
    lambda config: isinstance(config, dict),
    "a JSON object, as --hicache-storage-backend-extra-config",
)


def comma_list(item: Callable[[str], Any], allowed: str):
    """One or more comma-separated ``item``s."""
    return checked(lambda text: tuple(map(item, text.split(","))), bool, allowed)


def geometry(text: str) -> tuple[int, int, int]:
    """``HEADSxHEAD_DIM[xLAYERS]`` as ``(heads, head_dim, layers)``."""
    heads, dim, *layers = map(positive_int, text.split("x"))
    if len(layers) > 1 or dim % MXFP8_SCALE_BLOCK:
        raise ValueError(text)
    return heads, dim, layers[0] if layers else BENCH_LAYERS


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = OneLineErrorParser(
        prog=PROG,
        description="MXFP8 and FP4 KV scales in SGLang's hierarchical KV cache "
        "(HiCache):\ncheck the install, size the host tier, time the transfers.",
        formatter_class=raw,
        epilog=f"Run '{PROG} COMMAND --help' for the flags of a command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands"
    )
    count = dict(type=positive_int, metavar="N")
    switch = dict(action="store_true")

    def command(name: str, func, summary: str, text: str):
        cmd = sub.add_parser(name, formatter_class=raw, help=summary, description=text)
        cmd.set_defaults(func=func)

        def arg(*flags: str, **kwargs: Any) -> None:
            default = kwargs.get("default")
            if default not in (None, ()):  # shown as it is typed
                shown = "%(default)s"
                if type(default) is tuple:
                    shown = ",".join(map(str, default))
                kwargs["help"] += f" (default: {shown})"
            cmd.add_argument(*flags, **kwargs)

        return arg

    arg = command(
        "check",
        cmd_check,
        "is the plugin installed and chosen by SGLang; on CUDA, a byte-exact "
        "round trip with the real JIT kernels",
        "Verify the install: SGLang version, plugin entry point, settings, the\n"
        "host pool SGLang picks and the plugin hooks in force in a fresh process,\n"
        "sizing and, on a CUDA GPU, a round trip of random MXFP8 pages. Exit 1 if\n"
        "a step fails (--require-gpu: or a GPU step did not run), 2 on a bad setting.",
    )
    arg("--json", **switch, help="print the steps as JSON")
    arg("--require-gpu", **switch, help="exit 1 if a GPU step could not run")

    arg = command(
        "size",
        cmd_size,
        "host-tier bytes and tokens per rank and node, with and without the scales",
        "Each host pool SGLang builds for the model, per rank and per node, as\n"
        "SGLang's HostKVCache sizes it, with and without the scale bytes of\n"
        "--kv-cache-dtype. Give the model as --config, or as --layers,\n"
        "--kv-heads and --head-dim.",
    )
    arg("--kv-cache-dtype", choices=list(FORMATS), default="mxfp8", help="the format")
    pages = dict(type=number(int, 1, sizing.MAX_PAGE_SIZE), metavar="N")
    arg("--page-size", **pages, default=sizing.PAGE_SIZE, help="tokens per page")
    arg("--config", metavar="PATH", help="a model directory or any JSON config file")
    arg("--layers", **count, help="num_hidden_layers")
    arg("--kv-heads", **count, help="num_key_value_heads")
    arg("--head-dim", type=head_dim, metavar="N", help=sizing.SCALED_HEAD_DIMS)
    arg("--tp-size", **count, default=1, help="tensor parallel ranks")
    tokens = dict(type=number(int, 1, 1 << 40), metavar="N", required=True)
    arg("--device-tokens", **tokens, help="the device (full) pool's tokens")
    ratio = f"host tokens per device token ({sizing.HICACHE_RATIO})"
    arg("--hicache-ratio", type=number(float, 0, 1000), metavar="R", help=ratio)
    most_gb = sizing.MAX_NODE_HOST_BYTES // 10**9
    gb = dict(type=number(int, 0, most_gb), metavar="GB", default=0)
    arg("--hicache-size", **gb, help="host GB (1e9 B) per rank; 0: use the ratio")
    layouts = dict(choices=SERVED_LAYOUTS, default="page_first")
    arg("--hicache-mem-layout", **layouts, help="page_head: no seals in a page")
    swa = dict(type=number(float, 0, 1, above=True), metavar="R")
    swa["help"] = "hybrid SWA: SWA pool tokens per full pool token"
    swa["help"] += f" (default: {sizing.SWA_FULL_TOKENS_RATIO})"
    arg("--swa-full-tokens-ratio", **swa)
    arg("--max-mamba-cache-size", **count, help="Mamba slots (with --hicache-size)")
    drafts = dict(type=non_negative_int, metavar="N", default=0)
    arg("--draft-layers", **drafts, help="packed MTP/NextN draft layers")
    arg("--gpus-per-node", **count, default=8, help="ranks on one host")
    memory = dict(type=number(float, 0, sizing.MAX_NODE_HOST_BYTES / 1e9), metavar="GB")
    arg("--host-memory-gb", **memory, help="the server's free RAM (default: here)")
    arg("--json", **switch, help="print the plan as JSON")

    arg = command(
        "bench",
        cmd_bench,
        "time ours vs SGLang's MXFP8 host pool vs payload-only vs raw copy "
        "(CUDA); --l3: L3 put/get, MXFP8 vs payload-only pages",
        "Time backups and loads of several host pools side by side on one CUDA\n"
        "GPU (--check: exit 1 if a cell misses its goal). --setup: page_first;\n"
        "draft (--drafts packed one-layer MTP/NextN pools); layer_first; direct\n"
        "(page_first_direct, io direct); page_head; an FP4 recipe. A class that\n"
        "refuses a setup shows 'refused'.\n\n"
        "--l3 BACKEND: put and get of MXFP8 and of payload-only pages through\n"
        "that L3 backend, as SGLang's cache controller moves them. Goal: MXFP8\n"
        f"at most {results.L3_GOAL_RATIO}x payload-only from {results.L3_GOAL_FROM_PAGES} pages,\n"
        f"{results.L3_SMALL_BATCH_GOAL_RATIO}x below. Exit 1 if L3 loses or changes a page.",
    )
    shape = (
        f"HEADSxHEAD_DIM[xLAYERS],... with HEAD_DIM a multiple of {MXFP8_SCALE_BLOCK}"
    )
    shapes = dict(type=comma_list(geometry, shape), metavar="HxD[xL],...")
    geometries = ",".join("x".join(map(str, g)) for g in results.BENCH_GEOMETRIES)
    l3_geometry = "x".join(map(str, results.L3_GEOMETRY))
    of = f"(default: {geometries}; --l3: one, {l3_geometry})"
    arg("--geometries", **shapes, help=f"layers default to {BENCH_LAYERS} {of}")
    counts = comma_list(positive_int, "positive integers, comma separated")
    pages = dict(type=counts, metavar="N,...", default=results.BENCH_PAGES)
    arg("--pages", **pages, help="per transfer")
    names = dict(type=comma_list(name, "names, comma separated"), metavar="NAME,...")
    setups = f"{', '.join(results.BENCH_SETUPS)} (default: page_first)"
    arg("--setup", **names, action="append", help=setups)
    arg("--drafts", **count, help="--setup draft: draft pools (default: 1)")
    ablations = f"ours with one choice undone: {', '.join(results.BENCH_ABLATIONS)}"
    arg("--ablations", **names, default=(), help=ablations)
    loops = ", ".join(results.BESIDE_LOOPS)
    arg("--beside", **names, default=(), help=f"time beside a loop: {loops}")
    rounds = f"(default: {results.BENCH_WARMUP}; --l3: {results.L3_WARMUP})"
    arg("--warmup", type=non_negative_int, metavar="N", help=f"untimed rounds {rounds}")
    rounds = f"(default: {results.BENCH_REPEAT}; --l3: {results.L3_REPEAT})"
    arg("--repeat", **count, help=f"timed rounds, the median counts {rounds}")
    arg("--check", **switch, help="exit 1 if a cell misses its goal")
    arg("--json-out", type=json_out_path, metavar="PATH", help="write JSON here")
    arg("--plot", type=plot_path, metavar="PNG", help="draw --from's runs")
    files = comma_list(existing_file, "existing files, comma separated")
    arg("--from", dest="plot_from", type=files, metavar="JSON,...", help="for --plot")
    backends = results.L3_BACKENDS
    arg("--l3", choices=backends, metavar="BACKEND", help=", ".join(backends))
    where = "(default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else the temp dir)"
    arg("--l3-dir", type=existing_dir, metavar="DIR", help=f"file, hf3fs, nixl {where}")
    service = (
        "mooncake, seaweedfs: the extra config of a running service; dynamic: "
        "of the class (backend_name, module_path, class_name[, interface_v1])"
    )
    arg("--l3-config", type=json_object, metavar="JSON", help=service)
    return parser


ONE_LINE_ERRORS = (UsageError, sizing.SizingError, BenchFailed, ConfigError)
"""What ends a command in one line (a bad setting, a refused setup included)."""
WRITE_ERRORS = frozenset(
    (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
)
"""An output that cannot be written: a closed pipe, a full disk or quota."""


class Terminated(BaseException):
    """SIGTERM, raised as Ctrl-C raises ``KeyboardInterrupt`` (temp folders go,
    children end); not an ``Exception``, so that no step reports it and goes on."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> NoReturn:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drop_unwritten_output() -> None:
    """Points stdout at /dev/null: its last flush at exit fails no second time."""
    if sys.stdout is sys.__stdout__ and sys.stdout is not None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Runs a command: its exit code, or one line on stderr for bad input (2),
    lost pages (1), an output that cannot be written (1), Ctrl-C (130) or
    SIGTERM (143)."""
    args = build_parser().parse_args(argv)
    said = f"{PROG} {args.command}: error:"
    try:
        with _sigterm_raises():
            code = args.func(args)
            sys.stdout.flush()
        return code
    except ONE_LINE_ERRORS as exc:
        print(f"{said} {exc}", file=sys.stderr)
        return 1 if isinstance(exc, BenchFailed) else 2
    except OSError as exc:
        if exc.errno not in WRITE_ERRORS:
            raise
        if exc.filename is None:  # stdout: what it holds can go nowhere
            _drop_unwritten_output()
        where = exc.filename or "stdout"
        print(f"{said} cannot write to {where}: {exc.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print(f"{PROG} {args.command}: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
