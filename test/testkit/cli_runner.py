"""The CLI in the tests' own process: ``run_cli`` and a Mooncake config."""

from __future__ import annotations

from sglang_mxfp8_hicache.tools.cli import main

MASTER = '{"master_server_address": "127.0.0.1:50051"}'
"""An ``--l3-config`` naming a Mooncake master (nothing listens there)."""


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main`` in this process: the exit code, argparse's included, and the output."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
