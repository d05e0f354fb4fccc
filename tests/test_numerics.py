"""check_numerics for asynchronous training (issue 24, item 1): a step with a NaN/Inf loss or gradient
is skipped and counted, a shard's refusal of one does not kill the worker, and a run whose every live
worker diverged ends as diverged, with its summary and its own exit status. Issue 36: so does a run that
stopped otherwise (its data ran out) with a non-finite final loss or most of its examples skipped; a run
that skipped a few steps and recovered ends as trained."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.guard import MAX_NONFINITE_SHARE, NonfiniteStreak, NonfiniteTally, RunGuard, final_verdict
from asyncps.chief.lifecycle import EXIT_DIVERGED, EXIT_NO_WORKERS, FINAL_EXIT_CODES
from asyncps.chief.recorder import Recorder
from asyncps.worker.trainer import Batch, Telemetry, Trainer, nonfinite_detail

from asyncps.delays import StepDelay
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import ps_pb2
from asyncps.rundir import RunDir
from asyncps.transport import ShardPush
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import PushOutcome
from tests.nonfinite_data import POISONED
from tests.test_local_cluster import run_cli

TESTS = Path(__file__).parent


class FakeClient:
    """Two shards; records what is pushed."""

    def __init__(self) -> None:
        self.values = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}
        self.versions = [4, 7]
        self.incarnations = [1, 1]
        self.pushed: list[int] = []
        self.row_cache = None  # ModelClient.row_cache: no tables read by rows here

    def pull(self) -> list[int]:
        return self.versions

    def push_pull(self, grads: object, step: int, loss: float, read_wait_s: float, base: list[int],
                  incarnations: object, rows: object = None) -> list[ShardPush]:
        self.pushed.append(step)
        return [ShardPush(s, PushOutcome(True, 0, v + 1, 0.1), v + 1) for s, v in enumerate(base)]


class Batches:
    def __init__(self, n: int) -> None:
        self.left = n

    def next_batch(self, stop: threading.Event, wait: bool = True) -> Batch | None:
        self.left -= 1
        return Batch(np.zeros((2, 3), np.float32), np.zeros(2, np.int64)) if self.left >= 0 else None


def test_the_check_names_the_loss_and_the_first_offending_variable() -> None:
    finite = [np.ones(3, np.float32), SparseRows(np.array([0]), np.ones((1, 2), np.float32))]
    assert nonfinite_detail(0.5, ["w", "emb"], finite) is None
    bad = [np.array([1.0, np.inf, 0.0], np.float32), SparseRows(np.array([0]), np.full((1, 2), np.nan, np.float32))]
    assert nonfinite_detail(0.5, ["w", "emb"], bad) == "loss 0.5; first non-finite gradient: w"
    assert nonfinite_detail(float("nan"), ["w", "emb"], finite) == "loss nan; every gradient finite"
    big = np.full(4, 3e38, np.float32)  # its sum overflows; every element is finite
    assert nonfinite_detail(1.0, ["w"], [big]) is None


def test_a_non_finite_step_is_not_pushed_but_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeClient()
    losses = iter([float("nan"), 0.5, float("nan"), 0.3])  # the first call traces, untimed

    def grad_fn(values: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                fed: object = (), w: object = None) -> tuple[float, list[np.ndarray]]:
        loss = next(losses, 0.3)
        grads = [np.full(3, np.nan if loss != loss else 1.0, np.float32), np.ones(1, np.float32)]
        return loss, list(grads)

    telemetry = Telemetry()
    no_delay = StepDelay.for_worker(0, "none", "", "", 0.0, 0)
    trainer = Trainer(client, ["w", "b"], grad_fn, Batches(3), no_delay, telemetry)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        trainer.run(threading.Event())
    assert trainer.step == 3 and trainer.nonfinite_steps == 1
    assert client.pushed == [0, 2]  # the second step (1 when pushed, 0-based) was skipped: never pushed
    pushes, steps = telemetry.drain()
    skipped = [p for p in pushes if p.step == 2]
    assert [(p.shard, p.accepted, p.drop, p.base_version) for p in skipped] == [
        (0, False, ps_pb2.DROP_NONFINITE, 4), (1, False, ps_pb2.DROP_NONFINITE, 7)]
    assert "first non-finite gradient: w" in skipped[0].drop_detail
    assert [s.step for s in steps] == [1, 2, 3]  # its examples are accounted for like any step's
    assert "step 2 not applied: non-finite (loss nan; first non-finite gradient: w)" in caplog.text




def test_the_recorder_counts_non_finite_steps_and_each_workers_streak(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)

    def nonfinite(step: int, shard: int) -> cpb.PushRecord:
        return cpb.PushRecord(step=step, shard=shard, accepted=False, drop=ps_pb2.DROP_NONFINITE,
                              loss=float("nan"))

    recorder.add(0, [cpb.PushRecord(step=1, shard=0, accepted=True, staleness=2), nonfinite(2, 0), nonfinite(3, 0)],
                 [cpb.StepTiming(step=s, examples=8) for s in (1, 2, 3)])
    recorder.add(1, [nonfinite(1, 0), cpb.PushRecord(step=2, shard=0, accepted=True)],
                 [cpb.StepTiming(step=s, examples=8) for s in (1, 2)])
    recorder.close()
    assert recorder.example_outcomes()["examples_nonfinite"] == 24
    assert recorder.example_outcomes()["examples_applied"] == 16
    assert recorder.dropped() == {"nonfinite": 3}
    streaks = recorder.nonfinite_streaks()
    assert set(streaks) == {0} and (streaks[0].steps, streaks[0].last_step) == (2, 3)
    assert recorder.snapshot()[0] == {2: 1, 0: 1}  # a skipped step has no staleness
    again = Recorder(tmp_path, append=True)  # a restarted chief reads the same from the files
    assert again.example_outcomes() == recorder.example_outcomes() and again.dropped() == recorder.dropped()
    assert again.nonfinite_streaks()[0].steps == 2
    assert recorder.nonfinite() == again.nonfinite() == NonfiniteTally(3, 24, "worker 0 step 2: loss nan")
    again.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_run_diverged_only_when_every_live_worker_had_k_non_finite_steps_in_a_row() -> None:
    guard = RunGuard(max_nonfinite_steps=5, no_workers_grace_s=30.0, clock=Clock())
    streaks = {0: NonfiniteStreak(5, 40, float("nan")), 1: NonfiniteStreak(4, 38, float("inf"))}
    assert guard.check([0, 1], streaks) is None
    assert guard.check([0, 1], {**streaks, 1: NonfiniteStreak(7, 44, float("inf"))}) is not None
    verdict = guard.check([0], streaks)  # worker 1 is dead: every live worker diverged
    assert verdict is not None and verdict.exit_code == EXIT_DIVERGED == 5
    assert verdict.reason == ("diverged: every live worker (1) had 5 consecutive steps with a non-finite loss or "
                              "gradient; last loss nan at step 40 of worker 0")
    assert RunGuard(0, 30.0, clock=Clock()).check([0], streaks) is None  # 0: never


def test_no_live_worker_for_the_grace_period_ends_the_run_never_sooner() -> None:
    clock = Clock()
    guard = RunGuard(max_nonfinite_steps=5, no_workers_grace_s=30.0, start_allowance_s=0.0, clock=clock)
    clock.now += 29.0  # the chief's start counts: workers may still be starting
    assert guard.check([], {}) is None
    clock.now += 2.0
    verdict = guard.check([], {})
    assert verdict is not None and verdict.exit_code == EXIT_NO_WORKERS == 6 and "no worker alive for 31 s" in \
        verdict.reason
    guard = RunGuard(max_nonfinite_steps=5, no_workers_grace_s=30.0, start_allowance_s=300.0, clock=clock)
    clock.now += 299.0  # no worker ever registered: the start barrier's limit first
    assert guard.check([], {}) is None
    clock.now += 2.0
    assert guard.check([], {}) is not None
    guard = RunGuard(max_nonfinite_steps=5, no_workers_grace_s=30.0, start_allowance_s=300.0, clock=clock)
    clock.now += 25.0
    assert guard.check([1], {}) is None  # alive at 25 s: the grace starts again from here
    clock.now += 29.0
    assert guard.check([], {}) is None
    clock.now += 2.0
    assert guard.check([], {}) is not None
    assert {EXIT_DIVERGED, EXIT_NO_WORKERS} <= FINAL_EXIT_CODES  # launchers do not restart such a chief


@pytest.mark.slow
def test_a_diverging_run_ends_as_diverged_with_its_summary(tmp_path: Path) -> None:
    """logreg with a learning rate of 1e38: the logits overflow within a few steps; every worker's
    steps become non-finite, are skipped and counted, and the chief ends the run (exit 5)."""
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--num-workers", "2", "--num-ps", "2", "--model", "logreg",
                      "--learning-rate", "1e38", "--max-nonfinite-steps", "5", "--epochs", "50", "--eval-every-s", "30",
                      "--quiet"])
    assert result.returncode == EXIT_DIVERGED, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["stop_reason"].startswith("diverged: every live worker (2) had 5 consecutive steps"), summary
    assert "last loss nan at step" in summary["stop_reason"] or "last loss inf" in summary["stop_reason"]
    assert summary["dropped_by_reason"]["nonfinite"] >= 2 * 5 * 2  # per shard, per worker, K in a row
    assert summary["data"]["examples_nonfinite"] > 0
    worker_log = RunDir(run_dir).log("worker-0").read_text()
    assert "not applied: non-finite (loss" in worker_log and "Traceback" not in worker_log
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "diverged" in chief_log and "exiting 5" in chief_log


def test_a_run_ends_as_diverged_when_its_final_loss_is_not_finite_or_most_examples_were_skipped() -> None:
    few = NonfiniteTally(3, 96, "worker 0 step 7: loss nan; first non-finite gradient: w")
    assert final_verdict(0.3, NonfiniteTally(), 5000) is None  # healthy
    assert final_verdict(0.3, few, 5000) is None  # a spike the run recovered from
    assert final_verdict(0.3, NonfiniteTally(80, int(5000 * MAX_NONFINITE_SHARE), ""), 5000) is None  # at the share
    verdict = final_verdict(float("nan"), few, 5000)
    assert verdict is not None and (verdict.exit_code, verdict.outcome) == (EXIT_DIVERGED, "diverged")
    assert verdict.reason == ("diverged: the final evaluation's loss is nan; 3 non-finite step(s) skipped "
                              "(96 examples); first: worker 0 step 7: loss nan; first non-finite gradient: w")
    inf = final_verdict(float("inf"), NonfiniteTally(), 0)  # no step skipped, none trained: the loss decides
    assert inf is not None and inf.reason.startswith("diverged: the final evaluation's loss is inf; 0 non-finite")
    most = final_verdict(0.3, NonfiniteTally(120, 4000, ""), 5000)
    assert most is not None and most.reason == ("diverged: 80.0% of the examples trained were in non-finite steps "
                                                "(more than 50%); 120 non-finite step(s) skipped (4000 examples)")


@pytest.mark.slow
def test_a_run_whose_data_runs_out_while_every_step_is_non_finite_ends_as_diverged(tmp_path: Path) -> None:
    """Issue 36's run: after two updates every step is non-finite, the data runs out before the workers'
    streaks end the run, the final loss is NaN: exit 5, said on the screen and in summary.json."""
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--learning-rate", "1e30", "--epochs", "3",
                      "--num-workers", "2", "--num-ps", "2",
                      "--max-nonfinite-steps", "100000"])  # the streak rule off: the data runs out first
    assert result.returncode == EXIT_DIVERGED, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["stop_reason"] == "reached 3 epochs (every data task done)"
    assert summary["outcome"] == "diverged" and summary["nonfinite_steps"] > 0, summary
    assert summary["verdict"].startswith("diverged: the final evaluation's loss is nan; "
                                         f"{summary['nonfinite_steps']} non-finite step(s) skipped "
                                         f"({summary['data']['examples_nonfinite']} examples); first: worker ")
    assert "first non-finite gradient: " in summary["verdict"]
    assert f"asyncps local: ERROR: the run did not train: {summary['verdict']}" in result.stderr
    assert f", {summary['nonfinite_steps']} non-finite steps skipped" in result.stdout
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert f"run ended: {summary['verdict']}; exiting 5" in chief_log
    # a NaN model is no result: none is exported where a trained one would be
    assert "no model exported: the run diverged" in chief_log
    assert not RunDir(run_dir).exported_model.exists()


@pytest.mark.slow
def test_a_run_with_a_few_non_finite_steps_still_ends_as_trained(tmp_path: Path) -> None:
    """A few training examples are NaN (tests/nonfinite_data.py): the steps whose batch holds one are
    skipped, every other step trains; the run ends as trained (exit 0) and its last line counts them."""
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--user-path", str(TESTS), "--dataset",
                      "nonfinite_data:load", "--epochs", "3", "--num-workers", "2", "--num-ps", "2", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["outcome"] == "finished" and "verdict" not in summary, summary
    assert 0 < summary["nonfinite_steps"] <= 3 * POISONED, summary  # one batch per poisoned example and epoch
    assert summary["final_eval"]["accuracy"] >= 0.8
    assert f", {summary['nonfinite_steps']} non-finite steps skipped" in result.stdout
    assert f"run complete: {run_dir} ({summary['nonfinite_steps']} non-finite step(s) skipped" in \
        RunDir(run_dir).log("chief").read_text()


@pytest.mark.slow
def test_train_raises_run_diverged_with_the_verdict(tmp_path: Path) -> None:
    """asyncps.train on the same diverging run: RunDiverged, a TrainingFailed that carries the summary."""
    import asyncps
    from asyncps.tools.api import RunDiverged

    with pytest.raises(RunDiverged, match="diverged: the final evaluation's loss is nan") as raised:
        asyncps.train(run_dir=tmp_path / "run", learning_rate=1e30, epochs=3, num_workers=2, num_ps=2,
                      max_nonfinite_steps=100_000)  # the streak rule off, as above: the data runs out first
    assert isinstance(raised.value, asyncps.TrainingFailed) and raised.value.summary.diverged
    assert raised.value.summary.nonfinite_steps > 0
