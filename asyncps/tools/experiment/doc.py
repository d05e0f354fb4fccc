"""Regenerate a document's experiment tables from the sweeps' results: never written by hand.

A document marks each table with

    <!-- experiment table: e1_staleness_vs_workers -->
    ...
    <!-- end experiment table -->

and `python -m asyncps.tools.experiment.doc docs/teaching.md` replaces everything between the marks
with the table of that sweep (one row per setting, mean ± standard deviation over its seeds, read
from RUNS/NAME/results.csv; the spec is SPECS/NAME.yaml) and each check's verdict, evaluated again on
those numbers. `--reduced` reads the reduced sweeps (RUNS/NAME_reduced, see `asyncps experiment
--reduced`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncps.tools.experiment.checks import Row, evaluate_checks
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.experiment.tables import group_by_setting, read_results, seed_table

BLOCK = re.compile(r"<!-- experiment table: (\S+) -->\n.*?<!-- end experiment table -->", re.S)


def experiment_block(name: str, specs: Path, runs: Path, reduced: bool = False) -> str:
    """The marked block of one sweep: how it was made, its table over seeds and its checks' verdicts."""
    spec_path = specs / f"{name}.yaml"
    spec = load_spec(spec_path, reduced=reduced)
    out = runs / spec.name
    records = read_results(out)
    command = f"asyncps experiment {spec_path}{' --reduced' if reduced else ''} --out {out}"
    if not records:  # said in the document, not invented
        print(f"warning: no {out}/results.csv; run `{command}`", file=sys.stderr)
        return (f"<!-- experiment table: {name} -->\nNo results yet: `{command}`, then "
                "`python -m asyncps.tools.experiment.doc`.\n<!-- end experiment table -->")
    rows, labelled, missing = [], [], []
    for point in spec.points():
        record = records.get(point.slug)
        if record is None or record.status == "failed":
            missing.append(point.label)
            continue
        rows.append(Row(point.label, point.settings(), record.metrics))
        labelled.append((point.axes, record.metrics))
    outcomes = evaluate_checks(spec.checks, rows)
    passed = not missing and all(o.passed for o in outcomes)
    lines = [f"<!-- experiment table: {name} -->",
             f"Generated from `{out}` (`{command}`) by `python -m asyncps.tools.experiment.doc"
             f"{' --reduced' if reduced else ''}`; {len(rows)} runs.", "",
             seed_table(group_by_setting(labelled)).rstrip("\n"), "",
             f"Check: **{'PASS' if passed else 'FAIL'}**"]
    lines += [f"- {'PASS' if o.passed else 'FAIL'} {o.name}: {o.detail}" for o in outcomes]
    if missing:
        lines.append(f"- FAIL points missing or failed: {', '.join(missing)}")
    lines.append("<!-- end experiment table -->")
    return "\n".join(lines)


def update_document(doc: Path, specs: Path, runs: Path, reduced: bool = False) -> list[str]:
    """Replace every marked block of `doc`; the names of the sweeps it holds."""
    text = doc.read_text()
    names = BLOCK.findall(text)
    blocks = {name: experiment_block(name, specs, runs, reduced) for name in names}
    doc.write_text(BLOCK.sub(lambda m: blocks[m[1]], text))
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """python -m asyncps.tools.experiment.doc DOC [--specs DIR] [--runs DIR] [--reduced]."""
    p = argparse.ArgumentParser(prog="python -m asyncps.tools.experiment.doc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("doc", help="the markdown document to update in place (e.g. docs/teaching.md)")
    p.add_argument("--specs", default="experiments", help="where the specs are (NAME.yaml)")
    p.add_argument("--runs", default="runs", help="where the sweeps are (NAME/results.csv)")
    p.add_argument("--reduced", action="store_true", help="the reduced sweeps (NAME_reduced)")
    args = p.parse_args(argv)
    try:
        names = update_document(Path(args.doc), Path(args.specs), Path(args.runs), args.reduced)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.doc}: {len(names)} experiment table(s) regenerated: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
