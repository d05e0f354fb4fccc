"""Regenerate a document's experiment tables from the sweeps' results: never written by hand.

A document marks each table with

    <!-- experiment table: e1_staleness_vs_workers -->
    ...
    <!-- end experiment table -->

and `python -m asyncps.tools.experiment.doc docs/teaching.md` replaces everything between the marks
with the table of that sweep (one row per setting, mean ± standard deviation over its seeds, read
from RUNS/NAME/results.csv; the spec is SPECS/NAME.yaml) and each check's verdict, evaluated again on
those numbers. `--reduced` reads the reduced sweeps (RUNS/NAME_reduced, see `asyncps experiment
--reduced`); a mark `<!-- experiment table: NAME full -->` (or `reduced`) fixes which one its
block shows, whatever the flag (a document may show reduced CI sweeps beside a full one).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncps.tools.experiment.checks import Row, evaluate_checks
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.experiment.tables import group_by_setting, read_results, seed_table

BLOCK = re.compile(r"<!-- experiment table: (\S+)(?: (full|reduced))? -->\n.*?<!-- end experiment table -->", re.S)


def experiment_block(name: str, specs: Path, runs: Path, reduced: bool = False, mode: str = "") -> str:
    """The marked block of one sweep: how it was made, its table over seeds and its checks' verdicts
    (`mode`: the mark's own `full` or `reduced`, kept in the block it writes)."""
    if mode:
        reduced = mode == "reduced"
    mark = f"<!-- experiment table: {name}{' ' + mode if mode else ''} -->"
    spec_path = specs / f"{name}.yaml"
    spec = load_spec(spec_path, reduced=reduced)
    out = runs / spec.name
    records = read_results(out)
    command = f"asyncps experiment {spec_path}{' --reduced' if reduced else ''} --out {out}"
    if not records:  # said in the document, not invented
        print(f"warning: no {out}/results.csv; run `{command}`", file=sys.stderr)
        return (f"{mark}\nNo results yet: `{command}`, then "
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
    lines = [mark,
             f"Generated from `{out}` (`{command}`) by `python -m asyncps.tools.experiment.doc"
             f"{' --reduced' if reduced else ''}`; {len(rows)} runs{_run_time(rows)}.", "",
             seed_table(group_by_setting(labelled)).rstrip("\n"), "",
             f"Check: **{'PASS' if passed else 'FAIL'}**"]
    lines += [f"- {'PASS' if o.passed else 'FAIL'} {o.name}: {o.detail}" for o in outcomes]
    if missing:
        lines.append(f"- FAIL points missing or failed: {', '.join(missing)}")
    lines.append("<!-- end experiment table -->")
    return "\n".join(lines)


def _run_time(rows: list[Row]) -> str:
    """`, 95 s in all` from the points' run_s (start-up included; points resumed have none)."""
    times = [row.metrics.get("run_s", math.nan) for row in rows]
    if not times or any(math.isnan(t) for t in times):
        return ""
    return f", {sum(times):.0f} s in all (point s: each point's wall time, start-up included)"


def update_document(doc: Path, specs: Path, runs: Path, reduced: bool = False,
                    only: Sequence[str] = ()) -> list[str]:
    """Replace every marked block of `doc` (with `only`: the blocks of those sweeps, the others kept as
    they are); the names of the sweeps regenerated."""
    text = doc.read_text()
    marks = [mark for mark in BLOCK.findall(text) if not only or mark[0] in only]
    unknown = sorted(set(only) - {name for name, _ in marks})
    if unknown:
        raise ExperimentError(f"{doc} has no experiment table of {', '.join(unknown)}")
    blocks = {mark: experiment_block(mark[0], specs, runs, reduced, mark[1]) for mark in marks}
    doc.write_text(BLOCK.sub(lambda m: blocks.get((m[1], m[2] or ""), m[0]), text))
    return [name for name, _ in marks]


def main(argv: Sequence[str] | None = None) -> int:
    """python -m asyncps.tools.experiment.doc DOC [--specs DIR] [--runs DIR] [--reduced]."""
    p = argparse.ArgumentParser(prog="python -m asyncps.tools.experiment.doc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("doc", help="the markdown document to update in place (e.g. docs/teaching.md)")
    p.add_argument("--specs", default="experiments", help="where the specs are (NAME.yaml)")
    p.add_argument("--runs", default="runs", help="where the sweeps are (NAME/results.csv)")
    p.add_argument("--reduced", action="store_true", help="the reduced sweeps (NAME_reduced)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="regenerate only this sweep's tables (repeatable); the others are left as they are")
    args = p.parse_args(argv)
    try:
        names = update_document(Path(args.doc), Path(args.specs), Path(args.runs), args.reduced, args.only)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.doc}: {len(names)} experiment table(s) regenerated: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
