"""`asyncps experiment SPEC`: the command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from asyncps.tools.experiment.grid import format_value
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.experiment.sweep import TUNE_DIR, SweepInterrupted, finished, run_sweep
from asyncps.tools.experiment.tables import RESULTS_CSV, RESULTS_MD
from asyncps.tools.experiment.tune import at_edge, edge_note, key_label


def cmd_experiment(args: Any) -> int:
    """asyncps experiment SPEC [--out DIR] [--dry-run]: run the sweep, print the check; 1 on FAIL."""
    spec_path = Path(args.spec)
    spec = load_spec(spec_path, reduced=bool(getattr(args, "reduced", False)))
    out = Path(args.out) if args.out else Path("runs") / spec.name
    points = spec.points()
    if args.dry_run:
        for p in spec.tune_points():
            state = "done" if finished(out / TUNE_DIR / p.slug) else "to run"
            print(f"{TUNE_DIR}/{p.slug}: {p.label} ({state})")
        for p in points:
            state = "done" if finished(out / p.slug) else "to run"
            print(f"{p.slug}: {p.label} ({state})")
        return 0
    tuning = f" after {len(spec.tune_points())} tuning runs ({spec.tune.describe()})" if spec.tune else ""
    print(f"asyncps experiment {spec.name}: {len(points)} points{tuning} -> {out}", flush=True)
    try:
        sweep = run_sweep(spec, out)
    except (SweepInterrupted, KeyboardInterrupt) as exc:
        where = f" at {exc}" if str(exc) else ""
        print(f"interrupted{where}; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"results: {out / RESULTS_CSV}, {out / RESULTS_MD} ({sweep.sweep_s:.0f}s)")
    if spec.tune is not None:
        for choice in sweep.choices:
            edge = " (the grid's edge)" if at_edge(spec.tune, choice) else ""
            print(f"tuned {key_label(choice.key)}: {spec.tune.parameter}={format_value(choice.value)}{edge}")
        note = edge_note(spec.tune, sweep.choices)
        if note:
            print(f"note: {note}")
    for outcome in sweep.outcomes:
        print(outcome.describe())
    failed = [r.point.label for r in sweep.results if r.status == "failed"]
    if failed:
        print(f"FAIL  points failed: {', '.join(failed)}")
    if sweep.outcomes or failed:
        print(f"check: {'PASS' if sweep.passed else 'FAIL'}")
    return 0 if sweep.passed else 1


def add_arguments(p: Any) -> None:
    """The `asyncps experiment` arguments."""
    p.add_argument("spec", help="YAML or TOML experiment spec (see experiments/)")
    p.add_argument("--out", default="", help="sweep directory (default: runs/<spec name>); finished points are kept")
    p.add_argument("--dry-run", action="store_true", help="list the points and whether they are done; run nothing")
    p.add_argument("--reduced", action="store_true",
                   help="run the spec's reduced version (its `reduced` section: fewer points, shorter runs; CI)")
