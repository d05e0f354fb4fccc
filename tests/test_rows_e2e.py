"""Tables read by rows on a local cluster (real shard, chief and worker processes, every lean channel):
the recommendation model trains, each step moves its rows and not its table, and every push measures
its rows' staleness."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncps.rundir import PushRow, RunDir, RunSummary, iter_rows
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow

ROWS, DIM, BATCH, FEATURES = 200_000, 32, 64, 8
TABLE_BYTES = ROWS * DIM * 4  # 25.6 MB: what each pull moved before rows were read by id
# a step's rows at most: every id of its batch distinct, each row with its clock (int64)
MOST_ROW_BYTES = BATCH * FEATURES * (DIM * 4 + 8)
DENSE_BYTES = (FEATURES * DIM * 64 + 64 + 64 * 2 + 2) * 4  # the head, pulled whole when newer


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_table_read_by_rows_trains_moving_only_the_rows_each_step_touches(tmp_path: Path, transport: str) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--dataset", f"recsys:rows={ROWS}",
                      "--model", f"recsys:rows={ROWS},dim={DIM}", "--num-workers", "2", "--num-ps", "2",
                      "--optimizer", "adagrad", "--learning-rate", "0.05", "--batch-size", str(BATCH),
                      "--epochs", "2", "--transport", transport, "--seed", "3", "--eval-every-s", "1000", "--quiet"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = RunSummary.from_json(RunDir(run_dir).summary.read_text())
    assert summary.final_eval.accuracy > 0.6, summary.final_eval
    pushes = list(iter_rows(RunDir(run_dir).pushes, PushRow))
    steps = max(1, len({(p.worker, p.step) for p in pushes}))
    # the chief's evaluations read the rows the test set looks up, never the table (chief/evaluator.py)
    per_step = sum(s.bytes_pulled for s in summary.shards) / steps
    # the bound: <= 2x the rows a step touches, plus the dense head
    assert per_step <= 2 * MOST_ROW_BYTES + DENSE_BYTES, per_step
    assert per_step < TABLE_BYTES / 20, f"{per_step:.0f} bytes pulled per step: the table moved whole"
    measured = [p for p in pushes if p.rows > 0]
    assert len(measured) >= len(pushes) // 2, "pushes without per-row staleness"
    assert summary.row_staleness is not None and summary.row_staleness.rows == sum(p.rows for p in measured)
    # two workers over one table: some rows were updated by the other worker between a read and its push
    assert summary.row_staleness.max >= 1



def test_a_worker_row_cache_serves_hot_rows_and_their_staleness_is_measured(tmp_path: Path) -> None:
    """--row-cache-staleness: the Zipf-hot rows come from the workers' caches (hits reported per worker in
    summary.json), the run still trains, and the rows pushed carry the clocks they were read at."""
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--dataset", f"recsys:rows={ROWS}",
                      "--model", f"recsys:rows={ROWS},dim={DIM}", "--num-workers", "2", "--num-ps", "2",
                      "--optimizer", "adagrad", "--learning-rate", "0.05", "--batch-size", str(BATCH),
                      "--epochs", "2", "--transport", "tcp", "--seed", "3", "--eval-every-s", "1000",
                      "--row-cache-staleness", "4", "--quiet"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = RunSummary.from_json(RunDir(run_dir).summary.read_text())
    assert summary.final_eval.accuracy > 0.6, summary.final_eval
    cache = summary.row_cache
    assert cache["hits"] > 0 and 0 < cache["hit_rate"] < 1, cache
    assert cache["bytes_saved"] == cache["hits"] * (DIM * 4 + 16), cache
    assert set(cache["by_worker"]) == {"0", "1"}, cache
    # a cached row's push counts the versions it spent in the cache: staleness beyond one round trip
    assert summary.row_staleness is not None and summary.row_staleness.max >= 2
