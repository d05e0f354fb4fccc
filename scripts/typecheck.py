"""mypy --strict over every module of the project, each under the name it is imported by.

The role folders (ps/, worker/, chief/) install as asyncps.ps, asyncps.worker and asyncps.chief
through pyproject's package-dir table; mypy finds modules by folder names alone, so the sources are
named here from that table (scripts/pkglayout.py) and handed to mypy's build directly. Options come from
pyproject's [tool.mypy]. Usage: python scripts/typecheck.py   (exit 1 when mypy reports an error)
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pkglayout import ROOT, modules

CHECKED = ("asyncps", "benchmarks", "scripts")


def sources(root: Path = ROOT) -> list[BuildSource]:
    """Every checked module with its path (generated protobuf code is checked as imported, not listed)."""
    found = []
    for name, path in modules(root, skip=frozenset({"tests", "asyncps.pb"})):
        if name.split(".")[0] in CHECKED:
            # a script runs as itself and imports its neighbours by their bare names
            found.append(BuildSource(str(path.relative_to(root)), name.removeprefix("scripts.")))
    return found


def main() -> int:
    """Run mypy over sources(); print what it reports."""
    srcs = sources()
    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), *[s.path or "" for s in srcs[:1]]])
    result = build.build(srcs, options)
    for line in result.errors:
        print(line)
    errors = sum(": error:" in line for line in result.errors)
    if errors:
        print(f"Found {errors} error(s) in {len(srcs)} source files", file=sys.stderr)
        return 1
    print(f"Success: no issues found in {len(srcs)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
