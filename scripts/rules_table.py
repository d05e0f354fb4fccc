"""Write the README's table of optimizers, staleness policies and modes from the registries
(or, with --check, fail if the README's copy is stale)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncps.rules import README_BEGIN, README_END, rules_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def with_table(text: str) -> str:
    """The README text with the block between the markers replaced by the current tables."""
    before, begin, rest = text.partition(README_BEGIN)
    _, end, after = rest.partition(README_END)
    if not begin or not end:
        raise SystemExit(f"{README}: the markers {README_BEGIN!r} ... {README_END!r} are missing")
    return f"{before}{README_BEGIN}\n{rules_markdown()}\n{README_END}{after}"


def main() -> int:
    """Rewrite the README block, or compare it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if README.md's table is stale")
    args = parser.parse_args()
    text = README.read_text()
    wanted = with_table(text)
    if args.check:
        if wanted != text:
            print("README.md's rules table is stale: run scripts/rules_table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
