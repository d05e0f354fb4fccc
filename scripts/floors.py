"""Print the shard's dependencies pinned at their floors (pyproject.toml's `>=`), for `make test-floors`.

The shard set (numpy, grpcio, protobuf) is what the slim shard image installs
and what the checked-in generated code runs on; installing exactly the floors and running the shard's
tests shows the floors are true, not hopeful.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SHARD_SET = ("numpy", "grpcio", "protobuf")


def floors(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`name==floor` for each package of the shard set, from the project's dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", dep.split(";")[0].strip())
        if match and match.group(1).lower() in SHARD_SET:
            pins[match.group(1).lower()] = f"{match.group(1)}=={match.group(2)}"
    missing = [name for name in SHARD_SET if name not in pins]
    if missing:
        raise SystemExit(f"pyproject.toml gives no '>=' floor for {', '.join(missing)}")
    return [pins[name] for name in SHARD_SET]


if __name__ == "__main__":
    print(" ".join(floors()))
    sys.exit(0)
