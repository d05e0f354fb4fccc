"""Write the table of optimizers, staleness policies and modes in docs/experiments.md from the
registries (or, with --check, fail if the page's copy is stale)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncps.rules import RULES_TABLE_BEGIN, RULES_TABLE_END, rules_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "experiments.md"


def with_table(text: str) -> str:
    """The page's text with the block between the markers replaced by the current tables."""
    before, begin, rest = text.partition(RULES_TABLE_BEGIN)
    _, end, after = rest.partition(RULES_TABLE_END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: the markers {RULES_TABLE_BEGIN!r} ... {RULES_TABLE_END!r} are missing")
    return f"{before}{RULES_TABLE_BEGIN}\n{rules_markdown()}\n{RULES_TABLE_END}{after}"


def main() -> int:
    """Rewrite the page's block, or compare it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if docs/experiments.md's table is stale")
    args = parser.parse_args()
    text = DOC.read_text()
    wanted = with_table(text)
    if args.check:
        if wanted != text:
            print("docs/experiments.md's rules table is stale: run scripts/rules_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
