"""What every script in ``test/`` shares as a command: argparse types that
refuse a bad value in one line naming its flag (exit 2), before any work or
heavy import (the numbers are the CLI's own types), and SIGTERM taken as
Ctrl-C.

Light on purpose: a script imports this, parses its flags, and only then
imports torch or SGLang.
"""

from __future__ import annotations

import argparse
import os
import signal
from types import FrameType

from sglang_mxfp8_hicache.tools.cli import (
    comma_list,
    non_negative_int,
    number,
    positive_int,
)


def interrupt_on_sigterm() -> None:
    """SIGTERM raises ``KeyboardInterrupt`` in the main thread, as Ctrl-C does,
    so that a script cleans up the same way after either."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


positive_float = number(float, 0, above=True)
positive_ints = comma_list(positive_int, "whole numbers above 0, comma separated")
whole_numbers = comma_list(non_negative_int, "whole numbers, comma separated")


def existing_dir(text: str) -> str:
    """A folder that exists and this process may write into."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def dir_in_existing_parent(text: str) -> str:
    """A folder that exists, or one a script may create: its parent exists and
    is writable. The script creates that one folder, never its parents."""
    if os.path.isdir(text):
        return existing_dir(text)
    if os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text}: not a folder")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: its parent {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not writable")
    return text
