"""The shipped experiments as evidence: their shape (seeds, shards, a reduced version), the pieces
that turn sweeps into checked tables, and (slow) the reduced E1-E5 run for real, PASS required."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncps.tools.experiment import Bound, Row, load_spec, parse_spec
from asyncps.tools.experiment.doc import update_document
from asyncps.tools.experiment.metrics import METRICS
from asyncps.tools.experiment.tables import RESULTS_CSV, group_by_setting, seed_table

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "experiments").glob("e[1-5]_*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_shipped_spec_has_three_seeds_two_shard_counts_and_a_reduced_version(path: Path) -> None:
    spec = load_spec(path)
    assert len(spec.grid["seed"]) >= 3 and spec.grid["num_ps"] == [1, 2]
    reduced = load_spec(path, reduced=True)
    assert reduced.name == spec.name + "_reduced" and reduced.checks == spec.checks
    assert 0 < len(reduced.points()) < len(spec.points())


def test_reduced_replaces_axes_and_base_fields_only() -> None:
    data = {"name": "x", "base": {"model": "logreg", "max_updates": 100},
            "grid": {"seed": [0, 1, 2], "num_workers": [1, 2]},
            "reduced": {"base": {"max_updates": 10}, "grid": {"seed": [0]}}}
    small = parse_spec(data, reduced=True)
    assert small.base == {"model": "logreg", "max_updates": 10}
    assert small.grid == {"seed": [0], "num_workers": [1, 2]}
    assert parse_spec(data).grid["seed"] == [0, 1, 2]


def test_bound_check_fails_above_the_bound_and_on_missing_values() -> None:
    check = Bound(name="lead", metric="clock_lead", where={}, why="", expected="staleness_bound", op="<=")
    rows = [Row("s=1", {"staleness_bound": 1}, {"clock_lead": 1.0}),
            Row("s=2", {"staleness_bound": 2}, {"clock_lead": 0.0})]
    assert check.evaluate(rows).passed
    assert not check.evaluate([*rows, Row("s=0", {"staleness_bound": 0}, {"clock_lead": 1.0})]).passed
    assert not check.evaluate([Row("s=0", {"staleness_bound": 0}, {"clock_lead": math.nan})]).passed


def test_seed_table_shows_mean_and_spread_per_setting() -> None:
    metrics = [dict.fromkeys(METRICS, math.nan) for _ in range(3)]
    for m, value in zip(metrics, (1.0, 2.0, 3.0), strict=True):
        m["staleness_mean"] = value
    groups = group_by_setting([({"seed": i, "num_ps": 1}, m) for i, m in enumerate(metrics)])
    assert [label for label, _ in groups] == ["num_ps=1"]
    table = seed_table(groups)
    assert "| num_ps=1 | 3 | 2.00 ± 1.00 |" in table and "updates/s" not in table


def test_document_tables_are_regenerated_from_the_results(tmp_path: Path) -> None:
    specs, runs = tmp_path / "specs", tmp_path / "runs"
    specs.mkdir()
    (specs / "tiny.yaml").write_text("""
name: tiny
base: {model: logreg, max_updates: 10}
grid: {seed: [0, 1], num_workers: [2]}
check:
  - {kind: approx, metric: staleness_mean, expected: num_workers - 1, abs_tol: 0.5}
""")
    out = runs / "tiny"
    out.mkdir(parents=True)
    with open(out / RESULTS_CSV, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["point", "label", "seed", "num_workers", "status", *METRICS])
        for seed, staleness in ((0, 1.2), (1, 0.8)):
            values = dict.fromkeys(METRICS, "") | {"staleness_mean": str(staleness)}
            writer.writerow([f"0{seed}-seed={seed}_num_workers=2", f"seed={seed}, num_workers=2", seed, 2, "ran",
                             *(values[m] for m in METRICS)])
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- experiment table: tiny -->\nold, by hand\n<!-- end experiment table -->\nend\n")
    assert update_document(doc, specs, runs) == ["tiny"]
    text = doc.read_text()
    assert "old, by hand" not in text and "| num_workers=2 | 2 | 1.00 ± 0.28 |" in text
    assert "Check: **PASS**" in text and text.startswith("intro\n") and text.endswith("end\n")


@pytest.mark.slow
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_reduced_experiment_passes(tmp_path: Path, path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "experiment", str(path), "--reduced",
                             "--out", str(tmp_path / "sweep")], cwd=ROOT, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0 and "check: PASS" in result.stdout, result.stdout + result.stderr
