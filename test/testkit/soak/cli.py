"""The soak's command line (``python test/soak.py``): its flags and the
combinations it refuses, one process per rank, the figures printed as JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import msgspec
import pytest
import torch

from testkit import script
from testkit.command import (
    dir_in_existing_parent,
    interrupt_on_sigterm,
    positive_float,
    positive_int,
)
from testkit.soak.driver import Soak
from testkit.soak.faults import FAULT_COUNTS, FAULTS, NODE_CLIENT_TTL_S
from testkit.soak.figures import SoakFigures
from testkit.soak.stacks import STACKS

RANK_STOP_S = 30.0
"""How long a rank told to stop may take to clean up before it is killed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's flags, with the combinations it refuses."""
    parser = _parser()
    args = parser.parse_args(argv)
    if reason := _refusal(args):
        parser.error(reason)
    return args


def _parser() -> argparse.ArgumentParser:
    package = sys.modules[__package__]
    parser = argparse.ArgumentParser(description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=positive_float, default=30.0)
    parser.add_argument(
        "--at-least",
        type=_floor,
        action="append",
        default=[],
        metavar="FIGURE=N",
        help="go on past --seconds until FIGURE (a count of the figures, or "
        "faults.KIND) is N on some rank, for at most --floor-grace seconds "
        "more: a busy machine's run still does what it is for (repeatable)",
    )
    parser.add_argument(
        "--floor-grace",
        type=float,
        default=240.0,
        help="seconds past --seconds that --at-least may take (default 240)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--write-policy",
        choices=("write_through", "write_back", "write_through_selective"),
        default="write_through",
    )
    parser.add_argument("--l3", choices=("file", "mooncake"), default=None)
    parser.add_argument(
        "--l3-config",
        help="--hicache-storage-backend-extra-config (mooncake: a running store; "
        "default: a loopback master and storage node for this run)",
    )
    parser.add_argument(
        "--flush-every", type=positive_int, default=40, help="steps, with --l3"
    )
    parser.add_argument("--stack", choices=tuple(STACKS), default="kv")
    parser.add_argument(
        "--kv-cache-dtype", choices=("mxfp8", "fp4_mx_block16"), default="mxfp8"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="ranks, one process each: one GPU each where there are as many, "
        "else every rank on the CPU (gloo, emulated kernels)",
    )
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", help=argparse.SUPPRESS)
    parser.add_argument("--core", choices=("python", "rust"), default=None)
    parser.add_argument(
        "--heads", type=positive_int, default=2, help="KV heads per rank (geometry)"
    )
    parser.add_argument(
        "--layout",
        choices=("page_first", "page_head"),
        default="page_first",
        help="--hicache-mem-layout (page_head, with --l3 mooncake and "
        '"tp_lcm_size": N in --l3-config, shares pages across TP sizes)',
    )
    parser.add_argument(
        "--l3-dir",
        type=dir_in_existing_parent,
        help="the L3 file store, kept; made if its parent exists (default: a "
        "fresh one, removed)",
    )
    parser.add_argument(
        "--no-l3-writes",
        action="store_true",
        help="store nothing: every L3 hit is another process's page",
    )
    parser.add_argument(
        "--faults",
        type=lambda text: tuple(kind for kind in text.split(",") if kind),
        default=(),
        help=f"comma separated, of {', '.join(FAULTS)}",
    )
    parser.add_argument(
        "--beside-sglang",
        action="store_true",
        help="SGLang's own MXFP8 host class beside ours on the same device pool, "
        "both hosts and the device compared after every backup and load",
    )
    parser.add_argument(
        "--beside-sglang-control",
        action="store_true",
        help="with --beside-sglang: a scale byte of SGLang's copy of each page "
        "flipped, which the comparison must catch",
    )
    parser.add_argument(
        "--payload-only",
        action="store_true",
        help="the control: SGLang's host pool moving the payload alone",
    )
    return parser


def _floor(text: str) -> tuple[str, int]:
    """``FIGURE=N`` of ``--at-least``: a count of :class:`SoakFigures` or
    ``faults.KIND``, and a whole number."""
    name, _, count = text.partition("=")
    counts = {
        field
        for field, kind in SoakFigures.__annotations__.items()
        if kind in ("int", int) and field not in ("seed", "tp_rank", "tp_size")
    }
    known = name in counts or (
        name.startswith("faults.") and name.split(".", 1)[1] in FAULT_COUNTS
    )
    if not known or not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: FIGURE=N, FIGURE one of {sorted(counts)} or faults.KIND"
        )
    return name, int(count)


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the soak refuses this combination of flags, if it does."""
    faults = set(args.faults)
    if unknown := faults - set(FAULTS):
        return f"--faults: unknown {sorted(unknown)}"
    if args.l3 is None and "backend_error" in faults:
        return "--faults backend_error needs --l3"
    if args.l3 != "file" and "file" in faults:
        return "--faults file needs --l3 file"
    if "node_restart" in faults and (args.l3 != "mooncake" or args.l3_config):
        return "--faults node_restart needs --l3 mooncake of this run's own"
    if args.stack == "hybrid_swa" and args.kv_cache_dtype != "mxfp8":
        return "--stack hybrid_swa is built over mxfp8 pools"
    if args.write_policy == "write_back" and args.l3 and "host_exhausted" in faults:
        return (
            "--write-policy write_back with --l3 and --faults host_exhausted: SGLang "
            "0.5.23's write-back eviction cannot free a node whose subtree holds "
            "an L3 write's host lock while the host pool is full, yet counts it "
            "as evictable, so an admitted prefill fails with 'Prefill out of "
            "memory' (test/sglang_write_back_oom.py reproduces it)"
        )
    if args.beside_sglang_control and not args.beside_sglang:
        return "--beside-sglang-control needs --beside-sglang"
    if args.beside_sglang and (
        args.stack != "kv"
        or args.kv_cache_dtype != "mxfp8"
        or args.payload_only
        or args.layout != "page_first"
    ):
        return (
            "--beside-sglang: SGLang's MXFP8 host class serves page_first MXFP8 "
            "pools without drafts: --stack kv, --kv-cache-dtype mxfp8, --layout "
            "page_first"
        )
    if args.tp < 1:
        return f"--tp {args.tp}: one rank or more"
    if not 0 <= args.rank < args.tp:
        return f"--rank {args.rank}: from 0 to --tp less one"
    if args.floor_grace < 0:
        return f"--floor-grace {args.floor_grace}: 0 or more"
    if args.tp > 1 and "node_restart" in faults:
        return (
            "--faults node_restart restarts the node of one process: run it with --tp 1"
        )
    if "rank_read_error" in faults and (args.tp < 2 or args.l3 is None):
        return "--faults rank_read_error fails one rank's L3 reads: it needs --tp 2 or more and --l3"
    if args.tp > 1 and "kernel_refused" in faults:
        return "--faults kernel_refused ends one rank: run it with --tp 1"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    interrupt_on_sigterm()
    if args.tp > 1 and args.init_file is None:
        return launch_ranks(args, argv if argv is not None else sys.argv[1:])
    device = rank_device(args)
    with pytest.MonkeyPatch.context() as monkeypatch:
        if device == "cpu":
            from testkit.kernel_emulation import install_stack_emulation

            install_stack_emulation(monkeypatch)
        with contextlib.ExitStack() as stack:
            fresh = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-l3-"))
            if args.init_file is None:  # one rank: its gloo store goes with the run
                work = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-"))
                args.init_file = os.path.join(work, "rendezvous")
            mooncake = None
            if args.l3 == "mooncake" and args.l3_config is None:
                from testkit.mooncake_loopback import MooncakeLoopback

                ttl = NODE_CLIENT_TTL_S if "node_restart" in args.faults else None
                mooncake = stack.enter_context(MooncakeLoopback(client_ttl_s=ttl))
                args.l3_config = json.dumps(mooncake.extra_config())
            soak = Soak(args, device, args.l3_dir or fresh, mooncake)
            try:
                figures = soak.run()
            finally:
                soak.close()
    print(msgspec.json.encode(figures).decode(), flush=True)


def rank_device(args: argparse.Namespace) -> str:
    """This rank's device: its own GPU where the machine has one per rank (the
    real kernels), else the CPU for every rank (gloo, emulated kernels)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= args.tp:
        torch.cuda.set_device(args.rank)
        return "cuda"
    return "cpu"


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> None:
    """``--tp`` processes of this script over one gloo rendezvous file and
    one L3 store (a directory for ``file``; for ``mooncake`` without
    ``--l3-config``, one loopback master and storage node for every rank);
    each prints its rank's figures, in rank order here."""
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-ranks-"))
        l3_dir = args.l3_dir or os.path.join(work, "l3")
        os.makedirs(l3_dir, exist_ok=True)  # only rank 0 would make it
        shared = ["--init-file", os.path.join(work, "rendezvous")]
        shared += [] if args.l3_dir else ["--l3-dir", l3_dir]
        if args.l3 == "mooncake" and args.l3_config is None:
            from testkit.mooncake_loopback import MooncakeLoopback

            mooncake = stack.enter_context(MooncakeLoopback())
            shared += ["--l3-config", json.dumps(mooncake.extra_config())]
        ranks = [
            subprocess.Popen(
                [sys.executable, script("soak"), *argv, "--rank", str(rank), *shared],
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(args.tp)
        ]
        outputs = []
        for rank in ranks:
            try:
                out, _ = rank.communicate(timeout=args.seconds + 600)
            except BaseException:  # a timeout, Ctrl-C or SIGTERM: every rank stops
                _stop(ranks)
                raise
            outputs.append(out)
    for out in outputs:
        print(out.strip().splitlines()[-1] if out.strip() else "", flush=True)
    if failed := [n for n, rank in enumerate(ranks) if rank.returncode]:
        sys.exit(f"rank(s) {failed} failed")


def _stop(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to every rank still running (each cleans up as after Ctrl-C),
    then SIGKILL to any that has not left within ``RANK_STOP_S``."""
    for rank in ranks:
        if rank.poll() is None:
            rank.terminate()
    for rank in ranks:
        try:
            rank.wait(timeout=RANK_STOP_S)
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
