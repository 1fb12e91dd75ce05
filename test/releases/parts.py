"""Several checks of one release in one process: each SGLang import costs a
process 10-20 s on the CI machine's 2 cores, and a release's checks that need
the same process state (the plugin on, or off) need not pay it each.

    python test/releases/parts.py < [{"name": ..., "code": ...}, ...]

Runs each part's ``code`` in order, in a namespace of its own, with its stdout
captured; prints one line per part, ``PART {"name", "stdout", "error"}``
(``error``: the part's traceback, or null), so one part that fails fails only
the test that reads it. ``conftest.release_parts`` builds the parts and reads
the lines.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback

PREFIX = "PART "
"""Starts each part's line: NIXL and SGLang also write to stdout, below Python."""


def main() -> None:
    for part in json.load(sys.stdin):
        out = io.StringIO()
        error = None
        try:
            with contextlib.redirect_stdout(out):
                exec(
                    compile(part["code"], part["name"], "exec"),
                    {"__name__": part["name"]},
                )
        except BaseException:  # a part's SystemExit is its failure, not the run's
            error = traceback.format_exc()
        line = {"name": part["name"], "stdout": out.getvalue(), "error": error}
        print(PREFIX + json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
