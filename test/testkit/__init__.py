"""What only the tests use: the kernel emulations, the end-to-end harness, the
soak, in-test L3 backends and the loopback services, imported as ``testkit.X``
(pytest puts ``test/`` on the import path: ``pythonpath`` in pyproject.toml).

Each module that runs as a process has a launcher at ``test/X.py`` that a
person runs (``python test/soak.py --help``) and the tests spawn: running a
file puts its folder, ``test/``, on the import path, so the launcher imports
``testkit.X`` with no path edits.
"""

from __future__ import annotations

from pathlib import Path

TEST_DIR = Path(__file__).resolve().parent.parent
ROOT = TEST_DIR.parent
"""The clone: ``docs/``, ``README.md``, ``python/``."""


def script(name: str) -> str:
    """The launcher ``test/NAME.py`` of ``testkit.NAME``, to run in a fresh process."""
    return str(TEST_DIR / f"{name}.py")
