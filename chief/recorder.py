"""The run's records: push records and step timings (pushes.csv, timeline.csv), staleness
statistics, evaluations (eval.csv, TensorBoard) and the final summary.json."""

from __future__ import annotations

import collections
import csv
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from asyncps.chief.progress import Progress
from asyncps.chief.tasks import TaskLedger
from asyncps.config import RunConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rundir import write_json
from asyncps.wire import drop_from_wire

if TYPE_CHECKING:
    from asyncps.chief.evaluator import Evaluator
    from asyncps.datasets import Dataset

PUSH_COLUMNS = ["wall_time", "worker", "shard", "step", "base_version", "version", "staleness",
                "accepted", "drop_reason", "effective_lr", "loss", "drop_detail"]
STEP_COLUMNS = ["worker", "step", "start", "pull_s", "compute_s", "push_s", "wait_s", "examples"]
EVAL_COLUMNS = "wall_time,elapsed_s,updates,shard_versions,loss,accuracy\n"


def staleness_summary(histogram: dict[int, int]) -> dict[str, Any]:
    """mean, p50, p95, max and the histogram of integer staleness counts."""
    total = sum(histogram.values())
    if total == 0:
        return {"mean": 0.0, "p50": 0, "p95": 0, "max": 0, "count": 0, "histogram": {}}
    keys = sorted(histogram)

    def quantile(q: float) -> int:
        target, seen = q * total, 0
        for k in keys:
            seen += histogram[k]
            if seen >= target:
                return k
        return keys[-1]

    return {
        "mean": sum(k * c for k, c in histogram.items()) / total,
        "p50": quantile(0.5),
        "p95": quantile(0.95),
        "max": keys[-1],
        "count": total,
        "histogram": {str(k): histogram[k] for k in keys},
    }


class Recorder:
    """Appends telemetry to pushes.csv and timeline.csv and keeps running statistics."""

    def __init__(self, run_dir: Path, append: bool = False) -> None:
        self._lock = threading.Lock()
        pushes, steps = run_dir / "pushes.csv", run_dir / "timeline.csv"
        # a resumed run continues the same files
        new_pushes, new_steps = not (append and pushes.exists()), not (append and steps.exists())
        self._push_file: IO[str] = open(pushes, "w" if new_pushes else "a", newline="")  # noqa: SIM115
        self._step_file: IO[str] = open(steps, "w" if new_steps else "a", newline="")  # noqa: SIM115
        self._pushes = csv.writer(self._push_file)
        self._steps = csv.writer(self._step_file)
        if new_pushes:
            self._pushes.writerow(PUSH_COLUMNS)
        if new_steps:
            self._steps.writerow(STEP_COLUMNS)
        self.staleness: collections.Counter[int] = collections.Counter()
        self.recent_staleness: collections.deque[int] = collections.deque(maxlen=4096)
        self.dropped_reasons: collections.Counter[str] = collections.Counter()
        self.examples = 0
        self.busy_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.wait_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.pushes_recorded = 0
        self.last_loss = float("nan")

    def add(self, worker: int, pushes: Sequence[cpb.PushRecord], steps: Sequence[cpb.StepTiming]) -> None:
        """Record one report from a worker."""
        with self._lock:
            for p in pushes:
                drop = drop_from_wire(p.drop)
                kind = drop.value if drop is not None else ""
                self._pushes.writerow([f"{p.wall_time:.6f}", worker, p.shard, p.step, p.base_version,
                                       p.version, p.staleness, int(p.accepted), kind,
                                       f"{p.effective_lr:.6g}", f"{p.loss:.6g}", p.drop_detail])
                self.staleness[p.staleness] += 1
                self.recent_staleness.append(p.staleness)
                if drop is not None:
                    self.dropped_reasons[drop.value] += 1
                self.last_loss = p.loss
            for s in steps:
                self._steps.writerow([worker, s.step, f"{s.start:.6f}", f"{s.pull_s:.6f}",
                                      f"{s.compute_s:.6f}", f"{s.push_s:.6f}", f"{s.wait_s:.6f}",
                                      s.examples])
                self.examples += s.examples
                self.busy_s[worker] += s.pull_s + s.compute_s + s.push_s
                self.wait_s[worker] += s.wait_s
            self.pushes_recorded += len(pushes)

    def snapshot(self) -> tuple[dict[int, int], list[int], int, float]:
        """(staleness histogram, recent staleness values, examples seen, last worker loss)."""
        with self._lock:
            return dict(self.staleness), list(self.recent_staleness), self.examples, self.last_loss

    def idle_fractions(self) -> dict[str, float]:
        """Per worker: the share of its step time spent held back by the consistency model."""
        with self._lock:
            return {str(w): self.wait_s[w] / (self.busy_s[w] + self.wait_s[w])
                    for w in sorted(self.busy_s) if self.busy_s[w] + self.wait_s[w] > 0}

    def close(self) -> None:
        """Flush and close the CSV files."""
        with self._lock:
            self._push_file.close()
            self._step_file.close()


class EvalLog:
    """Appends every evaluation to eval.csv and to the TensorBoard event files (run_dir/tb)."""

    def __init__(self, run_dir: Path, recorder: Recorder, append: bool = False) -> None:
        import tensorflow as tf

        self._recorder = recorder
        self._writer = tf.summary.create_file_writer(str(run_dir / "tb"))
        eval_path = run_dir / "eval.csv"
        continuing = append and eval_path.exists()
        self._file: IO[str] = open(eval_path, "a" if continuing else "w")  # noqa: SIM115
        if not continuing:
            self._file.write(EVAL_COLUMNS)
        self.history: list[tuple[float, int, float, float]] = []

    def add(self, elapsed: float, updates: int, versions: Sequence[int], loss: float, accuracy: float,
            updates_per_s: float) -> None:
        """Record one evaluation (with the training rate and recent staleness beside it in TensorBoard)."""
        self._file.write(f"{time.time():.3f},{elapsed:.3f},{updates},{'|'.join(map(str, versions))},"
                         f"{loss:.6f},{accuracy:.6f}\n")
        self._file.flush()
        self.history.append((elapsed, updates, loss, accuracy))
        import tensorflow as tf

        _, recent, _, _ = self._recorder.snapshot()
        with self._writer.as_default(step=updates):
            tf.summary.scalar("eval/loss", loss)
            tf.summary.scalar("eval/accuracy", accuracy)
            tf.summary.scalar("train/updates_per_s", updates_per_s)
            if recent:
                tf.summary.histogram("train/staleness", recent)
                tf.summary.scalar("train/mean_staleness", sum(recent) / len(recent))
        self._writer.flush()

    def close(self) -> None:
        """Close eval.csv and the TensorBoard writer."""
        self._file.close()
        self._writer.close()


def write_summary(path: Path, final: tuple[float, float], wall_s: float, p: Progress, recorder: Recorder,
                  run: RunConfig, num_ps: int, data: Dataset, stop_reason: str | None, ledger: TaskLedger,
                  evaluator: Evaluator) -> None:
    """summary.json: the run's outcome (with the final training loss where the optimum is known)."""
    histogram, _, examples, _ = recorder.snapshot()
    summary: dict[str, Any] = {
        "updates_applied": p.updates,
        "updates_dropped": round(sum(p.dropped) / len(p.dropped)) if p.dropped else 0,
        "staleness": staleness_summary(histogram),
        "throughput_updates_per_s": p.updates / wall_s if wall_s > 0 else 0.0,
        "final_eval": {"loss": final[0], "accuracy": final[1]},
        "wall_s": wall_s,
        "mode": run.mode,
        "staleness_policy": run.staleness_policy,
        "workers": run.num_workers,
        "ps_shards": num_ps,
        "model": run.model,
        "dataset": run.dataset,
        "epochs": examples / max(1, len(data.x_train)),
        "stop_reason": stop_reason,
        "pushes_recorded": recorder.pushes_recorded,
        "data": ledger.summary(),
        "dropped_by_reason": p.dropped_by_reason,
        "idle_fraction": recorder.idle_fractions(),
        "max_clock_lead": p.max_clock_lead,
        "backup_workers": run.backup_workers,
        "staleness_bound": run.staleness_bound,
        "shards": [{"version": v, "accepted": a, "dropped": d}
                   for v, a, d in zip(p.versions, p.accepted, p.dropped, strict=True)],
    }
    if data.optimal_loss is not None:
        train_loss, _ = evaluator.evaluate(data.x_train, data.y_train)
        summary["final_train_loss"] = train_loss
        summary["optimality_gap"] = train_loss - data.optimal_loss
    write_json(path, summary)
