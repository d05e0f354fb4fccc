"""A shard holding part of a table that only the shards ever hold is killed mid-run and restored from a
checkpoint streamed part by part; the run finishes and its accounting closes as an unfaulted run's.

`asyncps local` (real chief, shards, workers) with the recommendation model over 300,000 rows on two
shards: the chief makes no table (the shards make theirs from its row initializer), evaluates by rows,
checkpoints every 2 s into one file per whole tensor; ps-0 is SIGKILLed after the first checkpoint,
restarted by the launcher and restored by the chief (its part streamed from the files). The same with the
table keyed (a HashEmbedding over hashed ids: rows by key, fewer kept than there are ids, so the least
recently pushed give way), whose keys are restored with their rows.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.rundir import CheckpointNames, RunDir, RunSummary
from tests.test_chief_restart import finish, role_pid, start_local
from tests.test_cut_survives import wait_for

pytestmark = pytest.mark.slow

ROWS = 300_000
COMMON = ("--num-workers", "2", "--num-ps", "2", "--optimizer", "adagrad", "--learning-rate", "0.05", "--batch-size",
          "64", "--epochs", "50", "--checkpoint-every-s", "2", "--eval-every-s", "5", "--seed", "3")
RUNS = {
    "positional": (3000, ("--dataset", f"recsys:rows={ROWS}", "--model", f"recsys:rows={ROWS}")),
    # 300,000 hashed ids into a keyed table keeping 200,000 rows
    "keyed": (1500, ("--dataset", f"recsys:rows={ROWS},hashed=1", "--model", "recsys:rows=200000,keyed=1")),
}


@pytest.mark.parametrize("table", sorted(RUNS))
def test_a_killed_shard_holding_part_of_a_big_table_is_restored_and_the_run_finishes(tmp_path: Path,
                                                                                     table: str) -> None:
    run_dir = tmp_path / "run"
    updates, args = RUNS[table]
    proc = start_local(run_dir, *args, *COMMON, "--max-updates", str(updates))
    try:
        checkpoints = CheckpointDir(RunDir(run_dir).checkpoints)
        wait_for("a checkpoint", checkpoints.complete, proc, timeout_s=180)
        first = role_pid(run_dir, "ps", "0")
        os.kill(first, signal.SIGKILL)
        chief_log = RunDir(run_dir).log("chief")
        wait_for("the restore of ps-0", lambda: "shard 0 at" in chief_log.read_text()
                 and "restored from ckpt-" in chief_log.read_text(), proc, timeout_s=180)
        out = finish(proc, timeout_s=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = RunDir(run_dir).log("chief").read_text()
    assert "1 table(s) made by the shards" in log and "made whole in the chief" not in log, log[:4000]
    assert "abandoned" not in log and "Traceback" not in log, log[-4000:]
    latest = checkpoints.complete()[-1]
    assert CheckpointNames.tensors(latest).is_dir() and not CheckpointNames.arrays(latest).exists()
    keys = [p.name for p in CheckpointNames.tensors(latest).iterdir() if "keyed.keys" in p.name]
    assert len(keys) == (table == "keyed"), keys
    summary = RunSummary.load(run_dir)
    assert summary.updates_applied >= updates, out[-3000:]
    assert summary.data["tasks_done"] == summary.data["tasks_planned"] or summary.stop_reason, summary.data
    assert sum(c.rows_taken_back for c in summary.shards) >= 0
    for counts in summary.shards:  # as tests/test_chaos.py: every push row against the shard's own answers
        assert counts.answers == sum(counts.answers_by_worker.values()), counts
        assert all(n > 0 for n in counts.unreported.values()), f"rows the shard never answered: {counts}"
        assert counts.answers == counts.rows - counts.rows_taken_back + sum(counts.unreported.values()), counts
    assert summary.final_eval.accuracy > 0.55, summary.final_eval
    if table == "keyed":  # exported from the final checkpoint: the rows the table kept, by key
        import keras
        import numpy as np

        from asyncps.ml.datasets import load_dataset
        from asyncps.ml.sparse import KeyedTable

        exported = keras.models.load_model(RunDir(run_dir).exported_model)
        kept = exported.get_layer("id_embedding")
        assert isinstance(kept, KeyedTable) and 10_000 < kept.size <= 200_000, kept.size  # the keys trained
        data = load_dataset(f"recsys:rows={ROWS},hashed=1", 3)
        accuracy = float(np.mean(np.argmax(exported.predict(data.x_test, verbose=0), axis=1) == data.y_test))
        assert abs(accuracy - summary.final_eval.accuracy) < 0.02, (accuracy, summary.final_eval)
