"""Fits a GPU bundle with NIXL into the device tool's 64 MiB carry.

    DEVICE_WHEELS_EXTRA=test/gpu-extra-requirements.txt \
        bash ../shared/gpu/make-bundle.sh [VERSION] [DIR]
    python test/gpu_bundle_fit.py [DIR]          # DIR: .gpu by default

The ``nixl-cu13`` wheel carries ``nixl_ep_cu13/``, expert-parallel kernels
the NIXL POSIX file plugin (the only NIXL backend the tests run) never loads;
without them the wheel is a third of its size. Each ``nixl_cu*`` wheel under
``DIR/whl`` is rewritten without its ``nixl_ep_*`` packages, their lines
dropped from the wheel's RECORD so pip installs it as it is. Prints the
bundle's size before and after.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

LEFT_OUT = "nixl_ep_"


def _bundle_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def strip_wheel(wheel: Path) -> int:
    """Rewrites ``wheel`` without its ``nixl_ep_*`` packages; the entries dropped."""
    kept = wheel.with_suffix(".tmp")
    dropped = 0
    with (
        zipfile.ZipFile(wheel) as src,
        zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for item in src.infolist():
            if item.filename.startswith(LEFT_OUT):
                dropped += 1
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines(keepends=True)
                data = "".join(r for r in rows if not r.startswith(LEFT_OUT)).encode()
            dst.writestr(item, data)
    os.replace(kept, wheel)
    return dropped


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu")
    before = _bundle_bytes(root)
    for wheel in sorted((root / "whl").glob("nixl_cu*.whl")):
        print(f"{wheel.name}: {strip_wheel(wheel)} entries of {LEFT_OUT}* left out")
    print(f"{root}: {before / 2**20:.0f} MiB -> {_bundle_bytes(root) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
