"""What every script in ``test/`` shares as a command: argparse types that
refuse a bad value in one line naming its flag (exit 2), before any work or
heavy import, and SIGTERM taken as Ctrl-C.

Light on purpose: a script imports this, parses its flags, and only then
imports torch or SGLang.
"""

from __future__ import annotations

import argparse
import os
import signal
from types import FrameType


def interrupt_on_sigterm() -> None:
    """SIGTERM raises ``KeyboardInterrupt`` in the main thread, as Ctrl-C does,
    so that a script cleans up the same way after either."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def positive_int(text: str) -> int:
    """A whole number above 0."""
    return _at_least(text, 1)


def positive_float(text: str) -> float:
    """A number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: above 0")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated whole numbers, each above 0."""
    return [_at_least(item, 1) for item in text.split(",")]


def whole_numbers(text: str) -> list[int]:
    """Comma-separated whole numbers, each 0 or more."""
    return [_at_least(item, 0) for item in text.split(",")]


def _at_least(text: str, floor: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < floor:
        raise argparse.ArgumentTypeError(f"{value}: {floor} or more")
    return value


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
