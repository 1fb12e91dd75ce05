"""``sglang-mxfp8-hicache``: check the installation, size the host tier.

sglang-mxfp8-hicache check [--json]
sglang-mxfp8-hicache size --device-tokens N (--config config.json | --layers L
    --kv-heads H --head-dim D) [--tp-size T] [--hicache-ratio R | --hicache-size GB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from sglang_mxfp8_hicache.sizing import ModelGeometry, host_plan

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"
EXAMPLE_MODEL = ModelGeometry(layers=32, kv_heads=8, head_dim=128)  # Llama-3.1-8B
EXAMPLE_DEVICE_TOKENS = 500_000


@dataclass
class Step:
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

    chosen = mha.get_mha_host_pool_cls(device_buffer_info("mxfp8"))
    if chosen is MHATokenToKVPoolMXFP8Host:
        return (
            OK,
            "MHATokenToKVPoolMXFP8 -> sglang_mxfp8_hicache MHATokenToKVPoolMXFP8Host",
        )
    return FAIL, f"MHATokenToKVPoolMXFP8 -> {chosen.__module__}.{chosen.__qualname__}"


def _check_sizing() -> tuple[str, str]:
    plan = host_plan(EXAMPLE_MODEL, tp_size=1, device_tokens=EXAMPLE_DEVICE_TOKENS)
    return OK, (
        f"Llama-3.1-8B, ratio 2: {plan.bytes_per_token} B/token "
        f"({plan.scale_bytes_per_token} of scales), {plan.host_tokens} host tokens, "
        f"{plan.host_bytes / 1e9:.2f} GB"
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


def _check_e2e() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return SKIPPED, "no CUDA GPU here: SGLang's controller and kernels need one"
    from sglang_mxfp8_hicache.tools.e2e import SEQ_LENS, run_modes

    verdicts = run_modes()
    errors = {
        m: v["error"].splitlines()[-1] for m, v in verdicts.items() if "error" in v
    }
    if errors:
        return FAIL, f"errors: {errors}"
    ours, sglang, plain = verdicts["ours"], verdicts["sglang"], verdicts["plain"]
    exact = all(
        v["payload_restored"]
        and v["scales_restored"]
        and v["untouched_pages_kept"]
        and v["dequantized_max_diff"] == 0.0
        and (
            v["quantized_within_mxfp8_error"]
            or not v["write_path"].startswith("set_kv")
        )
        for v in (ours, sglang)
    )
    agree = ours["restored_sha256"] == sglang["restored_sha256"]
    control_caught = plain["payload_restored"] and not plain["scales_restored"]
    detail = (
        f"sequences {list(SEQ_LENS)} via {ours['write_path'].split(' (')[0]}; "
        f"ours/sglang max |dequant diff| {ours['dequantized_max_diff']}/"
        f"{sglang['dequantized_max_diff']}, bytes {'identical' if agree else 'DIFFER'}; "
        f"payload-only pool: scales lost, max diff {plain['dequantized_max_diff']:.3g}"
        if control_caught
        else "payload-only control did NOT lose scales"
    )
    return (OK if exact and agree and control_caught else FAIL), detail


def cmd_check(args: argparse.Namespace) -> int:
    steps = [
        _run_step("sglang version", _check_version),
        _run_step("plugin entry point", _check_entry_point),
        _run_step("hook in a fresh process", _check_fresh_process),
        _run_step("dispatch on MXFP8 pool", _check_dispatch),
        _run_step("host sizing (example)", _check_sizing),
        _run_step("GPU round trip", _check_round_trip),
    ]
    if args.e2e:
        steps.append(_run_step("e2e: SGLang controller", _check_e2e))
    if args.json:
        print(json.dumps([asdict(s) for s in steps], indent=2))
    else:
        print_table(
            ["step", "status", "detail"], [[s.name, s.status, s.detail] for s in steps]
        )
        skipped = [s.name for s in steps if s.status == SKIPPED]
        if skipped:
            print(f"\nNot run on this machine: {', '.join(skipped)}.")
    return 1 if any(s.status == FAIL for s in steps) else 0


def cmd_size(args: argparse.Namespace) -> int:
    if args.config:
        model = ModelGeometry.from_hf_config(args.config)
    elif None in (args.layers, args.kv_heads, args.head_dim):
        print(
            "size: give --config or all of --layers, --kv-heads, --head-dim",
            file=sys.stderr,
        )
        return 2
    else:
        model = ModelGeometry(
            layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim
        )
    plan = host_plan(
        model,
        tp_size=args.tp_size,
        device_tokens=args.device_tokens,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
    )
    if args.json:
        print(
            json.dumps(
                {
                    **asdict(plan),
                    "bytes_per_token": plan.bytes_per_token,
                    "host_bytes": plan.host_bytes,
                    "host_bytes_without_scales": plan.host_bytes_without_scales,
                }
            )
        )
        return 0
    sizing = (
        f"--hicache-size {args.hicache_size} GB"
        if args.hicache_size > 0
        else f"--hicache-ratio {args.hicache_ratio} x {args.device_tokens} device tokens"
    )
    print(
        f"per rank: {model.layers} layers, {plan.kv_heads_per_rank} KV heads x "
        f"{model.head_dim} (TP {args.tp_size}), page_size 128, {sizing}"
    )
    print_table(
        ["", "bytes/token", "host tokens", "host GB"],
        [
            [
                "fp8 payload only",
                str(plan.payload_bytes_per_token),
                str(plan.host_tokens_without_scales),
                f"{plan.host_bytes_without_scales / 1e9:.3f}",
            ],
            [
                "MXFP8 with scales",
                str(plan.bytes_per_token),
                str(plan.host_tokens),
                f"{plan.host_bytes / 1e9:.3f}",
            ],
        ],
    )
    print(
        f"scales: {plan.scale_bytes_per_token} B/token "
        f"({100 * plan.scale_bytes_per_token / plan.payload_bytes_per_token:.3f} % of the payload)"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from sglang_mxfp8_hicache.tools import bench

    geometries = tuple(
        tuple(int(x) for x in g.split("x")) for g in args.geometries.split(",")
    )
    pages = tuple(int(p) for p in args.pages.split(","))
    ablations = tuple(name for name in args.ablations.split(",") if name)
    unknown = sorted(set(ablations) - set(bench.ABLATIONS))
    if unknown:
        print(
            f"bench: unknown ablation(s) {unknown}; known: {sorted(bench.ABLATIONS)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (the JIT transfer kernels)", file=sys.stderr)
        return 2
    rows = bench.run(
        geometries,
        pages,
        classes=bench.host_classes(ablations),
        warmup=args.warmup,
        repeat=args.repeat,
    )
    print(
        f"{torch.cuda.get_device_name()}, {bench.LAYERS} layers, page_size 128, "
        f"median of {args.repeat} runs (CUDA events)"
    )
    print_table(*bench.table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(bench.to_json(rows))
    return 0 if all(r.meets_goal() for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-mxfp8-hicache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser(
        "check", help="verify the plugin, dispatch, sizing and (on CUDA) a round trip"
    )
    check.add_argument("--json", action="store_true")
    check.add_argument(
        "--e2e",
        action="store_true",
        help="also run real MXFP8 KV through SGLang's HiCache controller (GPU)",
    )
    check.set_defaults(func=cmd_check)

    size = sub.add_parser("size", help="host-tier bytes and tokens per rank")
    size.add_argument("--config", help="a Hugging Face config.json")
    size.add_argument("--layers", type=int)
    size.add_argument("--kv-heads", type=int)
    size.add_argument("--head-dim", type=int)
    size.add_argument("--tp-size", type=int, default=1)
    size.add_argument(
        "--device-tokens",
        type=int,
        required=True,
        help="the device KV pool's token count (max_total_num_tokens)",
    )
    size.add_argument("--hicache-ratio", type=float, default=2.0)
    size.add_argument(
        "--hicache-size", type=float, default=0.0, help="GB; overrides the ratio"
    )
    size.add_argument("--json", action="store_true")
    size.set_defaults(func=cmd_size)

    bench = sub.add_parser(
        "bench",
        help="time ours vs SGLang's MXFP8 host pool vs payload-only vs raw copy",
    )
    bench.add_argument(
        "--geometries",
        default="1x128,8x128,32x128",
        help="KV heads x head_dim, comma separated",
    )
    bench.add_argument("--pages", default="1,4,16,64,256,1024")
    bench.add_argument(
        "--ablations",
        default="",
        help="extra columns, ours with one choice undone: "
        "stock (SGLang's kernel instead of ours), layer_workers, v1, rows128",
    )
    bench.add_argument("--warmup", type=int, default=3)
    bench.add_argument("--repeat", type=int, default=20)
    bench.add_argument("--json-out", help="write the rows as JSON here")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
