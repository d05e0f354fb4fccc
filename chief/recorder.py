"""The run's records: push records and step timings (pushes.csv, timeline.csv), staleness
statistics, evaluations (eval.csv, TensorBoard) and the final summary.json."""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.chief.guard import NonfiniteStreak, NonfiniteTally, Verdict
from asyncps.chief.progress import Progress
from asyncps.chief.steady import SteadyStaleness
from asyncps.chief.tasks import TaskLedger

from asyncps.config import RunConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rules.drops import DropReason
from asyncps.rundir import (
    INTERRUPTED,
    EvalRow,
    FinalEval,
    Provenance,
    PushRow,
    RestoreRow,
    Rollbacks,
    RowWriter,
    RunDir,
    RunSummary,
    ShardCounters,
    StalenessSummary,
    StepRow,
    iter_rows,
)
from asyncps.rundir.clocklead import push_clock_lead
from asyncps.rundir.summary import RowStalenessSummary
from asyncps.wire.proto import drop_from_wire

log = logging.getLogger("asyncps.chief")

if TYPE_CHECKING:
    from asyncps.chief.evaluator import Evaluator

    from asyncps.ml.datasets import Dataset

_OUTCOMES = ("applied", "dropped", "partially_applied", "not_pushed", "nonfinite", "rolled_back")
_NONFINITE = DropReason.NONFINITE.value


def _outcome(pushes: list[tuple[bool, str]]) -> str:
    """What became of one step's gradient, from its pushes' (accepted, drop reason) on the shards."""
    if not pushes:
        return "not_pushed"  # it touched no shard (a sparse gradient with no rows)
    accepted = [a for a, _ in pushes]
    if all(accepted):
        return "applied"
    if any(accepted):
        return "partially_applied"
    # a non-finite loss or gradient: skipped by the worker (or refused by every shard)
    return "nonfinite" if all(drop == _NONFINITE for _, drop in pushes) else "dropped"



class RowStalenessTally:
    """Per-row staleness over the pushes recorded (pushes.csv's row columns), for summary.json."""

    def __init__(self) -> None:
        self.rows = 0
        self.total = 0.0
        self.worst: collections.Counter[int] = collections.Counter()
        self.dropped = self.hot_rows = 0
        self.hot_total = 0.0

    def add(self, row: PushRow) -> None:
        """Count one push's rows (none measured: nothing)."""
        if row.rows <= 0:
            return
        self.rows += row.rows
        self.total += row.row_staleness_mean * row.rows
        self.worst[row.row_staleness_max] += 1
        self.dropped += row.rows_dropped
        self.hot_rows += row.hot_rows
        self.hot_total += row.hot_row_staleness_mean * row.hot_rows

    def summary(self) -> RowStalenessSummary | None:
        """The run's per-row staleness (None: no push measured any)."""
        if not self.rows:
            return None
        return RowStalenessSummary.of(self.rows, self.total, self.worst, self.dropped, self.hot_rows, self.hot_total)

class Recorder:
    """Appends telemetry to pushes.csv and timeline.csv and keeps running statistics.

    A resumed run (`append`) continues the same files, and its statistics start from what the
    files already hold, so summary.json covers the whole run across chief restarts. Every
    report is flushed before the worker hears the answer: a killed chief loses no reported row.
    """

    def __init__(self, run_dir: Path, append: bool = False, planned_workers: int = 0) -> None:
        self._lock = threading.Lock()
        self.steady = SteadyStaleness(planned_workers)
        self.staleness: collections.Counter[int] = collections.Counter()
        self.row_staleness = RowStalenessTally()
        self.recent_staleness: collections.deque[int] = collections.deque(maxlen=4096)
        self.dropped_reasons: collections.Counter[str] = collections.Counter()
        self.examples = 0
        self.busy_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.wait_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        # per worker: rows its steps needed, rows its row cache served, bytes that cache kept off the wire
        self.row_cache: collections.defaultdict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.pushes_recorded = 0
        self.last_loss = float("nan")
        self._applied: list[PushRow] = []  # for the clock lead measured from the pushes themselves
        self._answered: list[PushRow] = []  # rows a shard numbered (seq): against the shards' answers
        self._rows_by_shard: collections.Counter[int] = collections.Counter()
        # examples by what became of their gradient: applied on every shard it was pushed to,
        # dropped on every one, or applied on some and dropped on others (as the pushes said;
        # example_outcomes moves the steps a shard restore rolled back to "rolled_back")
        self.examples_by_outcome: collections.Counter[str] = collections.Counter()
        self._step_outcomes: dict[tuple[int, int], tuple[str, int]] = {}  # (worker, step) -> (outcome, examples)
        self._run_dir = run_dir
        self._streaks: dict[int, NonfiniteStreak] = {}  # per worker index: its consecutive non-finite steps
        self._nonfinite = NonfiniteTally()  # every step skipped as non-finite, and the first
        if append:
            self._reload(run_dir)
        self._pushes = RowWriter(RunDir(run_dir).pushes, PushRow, append=append)
        self._steps = RowWriter(RunDir(run_dir).timeline, StepRow, append=append)

    def _reload(self, run_dir: Path) -> None:
        """The statistics of the rows earlier chiefs of this run wrote."""
        pushes: collections.defaultdict[tuple[int, int], list[tuple[bool, str]]] = collections.defaultdict(list)
        losses: dict[tuple[int, int], float] = {}
        details: dict[tuple[int, int], str] = {}
        for p in iter_rows(RunDir(run_dir).pushes, PushRow):
            self._count_push(p.staleness, p.drop_reason, p.loss)
            pushes[(p.worker, p.step)].append((p.accepted, p.drop_reason))
            losses[(p.worker, p.step)] = p.loss
            details.setdefault((p.worker, p.step), p.drop_detail)
            if p.accepted:
                self._applied.append(p)
            self._keep_row(p)
        for s in iter_rows(RunDir(run_dir).timeline, StepRow):
            key = (s.worker, s.step)
            self._count_outcome(s.worker, s.step, _outcome(pushes.get(key, [])), losses.get(key, math.nan),
                                s.examples, details.get(key, ""))
            self._count_step(s.worker, s.pull_s + s.compute_s + s.push_s, s.wait_s, s.examples)

    def _count_outcome(self, worker: int, step: int, outcome: str, loss: float, examples: int,
                       detail: str = "") -> None:
        self.examples_by_outcome[outcome] += examples
        if outcome in ("applied", "partially_applied"):  # a restore can roll back what was applied
            self._step_outcomes[(worker, step)] = (outcome, examples)
        if outcome == "nonfinite":
            before = self._streaks.get(worker)
            self._streaks[worker] = NonfiniteStreak((before.steps if before else 0) + 1, step, loss)
            tally = self._nonfinite
            first = tally.first or f"worker {worker} step {step}: {detail or f'loss {loss:g}'}"
            self._nonfinite = NonfiniteTally(tally.steps + 1, tally.examples + examples, first)
        else:
            self._streaks.pop(worker, None)

    def _count_push(self, staleness: int, drop: str, loss: float) -> None:
        self.last_loss = loss
        self.pushes_recorded += 1
        if drop == _NONFINITE:  # never reached a shard's versions: no staleness to count
            self.dropped_reasons[drop] += 1
            return
        self.staleness[staleness] += 1
        self.recent_staleness.append(staleness)
        if drop:
            self.dropped_reasons[drop] += 1

    def _count_step(self, worker: int, busy_s: float, wait_s: float, examples: int) -> None:
        self.examples += examples
        self.busy_s[worker] += busy_s
        self.wait_s[worker] += wait_s

    def add(self, worker: int, pushes: Sequence[cpb.PushRecord], steps: Sequence[cpb.StepTiming]) -> None:
        """Record one report from a worker."""
        with self._lock:
            for p in pushes:
                drop = drop_from_wire(p.drop)
                kind = drop.value if drop is not None else ""
                row = PushRow(p.wall_time, worker, p.shard, p.step, p.base_version, p.version, p.staleness,
                              p.accepted, kind, p.effective_lr, p.loss, p.drop_detail, p.local_steps or 1,
                              p.incarnation, p.seq, p.rows, p.row_staleness_mean, p.row_staleness_p95,
                              p.row_staleness_max, p.rows_dropped, p.hot_rows, p.hot_row_staleness_mean)
                self.row_staleness.add(row)
                self._pushes.write(row)
                if row.accepted:
                    self._applied.append(row)
                self._keep_row(row)
                self._count_push(p.staleness, kind, p.loss)
                if kind != _NONFINITE:
                    self.steady.add(worker, p.shard, p.wall_time, p.base_version, p.staleness)
            outcomes: collections.defaultdict[int, list[tuple[bool, str]]] = collections.defaultdict(list)
            losses: dict[int, float] = {}
            details: dict[int, str] = {}
            for p in pushes:  # a step's push records come in the same report as its timing
                drop = drop_from_wire(p.drop)
                outcomes[p.step].append((p.accepted, drop.value if drop is not None else ""))
                losses[p.step] = p.loss
                details.setdefault(p.step, p.drop_detail)
            for s in steps:
                self._count_outcome(worker, s.step, _outcome(outcomes.get(s.step, [])), losses.get(s.step, math.nan),
                                    s.examples, details.get(s.step, ""))
                self._steps.write(StepRow(worker, s.step, s.start, s.pull_s, s.compute_s, s.push_s, s.wait_s,
                                          s.examples))
                self._count_step(worker, s.pull_s + s.compute_s + s.push_s, s.wait_s, s.examples)
                if s.rows:
                    self.row_cache[worker].update(rows=s.rows, hits=s.rows_cached, bytes_saved=s.row_bytes_saved)
            # readers (asyncps report on a running or crashed run) see every report
            self._pushes.flush()
            self._steps.flush()

    def sizes(self) -> dict[str, int]:
        """The sizes of the files a report's rows go to (pushes.csv, timeline.csv), by file name, every row
        written so far flushed: where a report's rows begin (asyncps.chief.reportlog)."""
        with self._lock:
            return {w.path.name: w.size() for w in (self._pushes, self._steps)}

    def example_outcomes(self) -> dict[str, int]:
        """Examples whose gradients were applied, dropped, partially applied, not pushed, not finite,
        or rolled back (summary.json's data): a step with a push that a shard restore rolled back
        (restores.csv) counts as rolled back, whatever its other pushes did."""
        with self._lock:
            counts = collections.Counter(self.examples_by_outcome)
            for key in self._rolled_back_steps():
                outcome, examples = self._step_outcomes.get(key, ("", 0))
                if outcome:
                    counts[outcome] -= examples
                    counts["rolled_back"] += examples
            return {f"examples_{kind}": counts[kind] for kind in _OUTCOMES}

    def _keep_row(self, row: PushRow) -> None:
        self._rows_by_shard[row.shard] += 1
        if row.seq > 0:
            self._answered.append(row)

    def push_accounting(self, answers: Sequence[int], answers_by_worker: Sequence[Mapping[int, int]],
                        ) -> list[dict[str, Any]]:
        """Per shard, pushes.csv against the shard's own count of its answers (asyncps.ps.store.Answers):
        its rows, those whose answer a restore took back, and per worker index the answers of the final
        state that no row reports (answers - rows kept; pushes of workers killed before their report).
        Rows of a worker's skipped step (not finite) were never answered and are not in the count."""
        with self._lock:
            rollbacks = self._rollbacks()
            taken_back: collections.Counter[int] = collections.Counter()
            kept: collections.defaultdict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
            for row in self._answered:
                if rollbacks.taken_back(row):
                    taken_back[row.shard] += 1
                else:
                    kept[row.shard][row.worker] += 1
            rows = dict(self._rows_by_shard)
        out = []
        for shard, (total, by_worker) in enumerate(zip(answers, answers_by_worker, strict=True)):
            workers = sorted(set(by_worker) | set(kept[shard]))
            out.append({"answers": total, "answers_by_worker": {str(w): n for w, n in sorted(by_worker.items())},
                        "rows": rows.get(shard, 0), "rows_taken_back": taken_back[shard],
                        "unreported": {str(w): by_worker.get(w, 0) - kept[shard][w] for w in workers
                                       if by_worker.get(w, 0) != kept[shard][w]}})
        return out

    def rolled_back_by_shard(self) -> dict[int, int]:
        """Per shard: the accepted pushes a restore of it rolled back (from pushes.csv and restores.csv)."""
        with self._lock:
            rollbacks = self._rollbacks()
            return dict(collections.Counter(p.shard for p in self._applied if rollbacks.rolled_back(p)))

    def _rolled_back_steps(self) -> set[tuple[int, int]]:
        rollbacks = self._rollbacks()
        if not len(rollbacks):
            return set()
        return {(p.worker, p.step) for p in self._applied if rollbacks.rolled_back(p)}

    def _rollbacks(self) -> Rollbacks:
        return Rollbacks(iter_rows(RunDir(self._run_dir).restores, RestoreRow))

    def nonfinite_streaks(self) -> dict[int, NonfiniteStreak]:
        """Per worker index whose latest steps were non-finite: how many in a row, and the last one."""
        with self._lock:
            return dict(self._streaks)

    def nonfinite(self) -> NonfiniteTally:
        """The steps skipped as non-finite so far (the files of earlier chiefs of the run included)."""
        with self._lock:
            return self._nonfinite

    def snapshot(self) -> tuple[dict[int, int], list[int], int, float]:
        """(staleness histogram, recent staleness values, examples seen, last worker loss)."""
        with self._lock:
            return dict(self.staleness), list(self.recent_staleness), self.examples, self.last_loss

    def dropped(self) -> dict[str, int]:
        """Pushes the workers reported dropped so far, by reason."""
        with self._lock:
            return dict(self.dropped_reasons)

    def idle_fractions(self) -> dict[int, float]:
        """Per worker: the share of its step time spent held back by the consistency model."""
        with self._lock:
            return {w: self.wait_s[w] / (self.busy_s[w] + self.wait_s[w])
                    for w in sorted(self.busy_s) if self.busy_s[w] + self.wait_s[w] > 0}

    def row_cache_summary(self) -> dict[str, Any]:
        """The workers' row caches (summary.json's row_cache; empty without one): rows needed, hits, hit
        rate and bytes not pulled, in all and per worker index (counted from this chief's reports)."""
        with self._lock:
            per = {w: dict(c) for w, c in sorted(self.row_cache.items())}
        if not per:
            return {}

        def entry(c: Mapping[str, int]) -> dict[str, Any]:
            return {**c, "hit_rate": c["hits"] / c["rows"] if c["rows"] else 0.0}

        total = {k: sum(c[k] for c in per.values()) for k in ("rows", "hits", "bytes_saved")}
        return {**entry(total), "by_worker": {str(w): entry(c) for w, c in per.items()}}

    def measured_clock_lead(self) -> int:
        """The largest clock lead with which a worker read, measured from the recorded pushes
        (asyncps.rundir.clocklead), not from the shards' own clocks."""
        with self._lock:
            rows = list(self._applied)
        return push_clock_lead(rows)

    def close(self) -> None:
        """Flush and close the CSV files."""
        with self._lock:
            self._pushes.close()
            self._steps.close()


def tensorboard_installed() -> bool:
    """Whether tf.summary can write: TensorFlow 2.20 stopped depending on tensorboard, so a TensorFlow the
    user installed without asyncps' `tf`/`cpu` extra may come without it."""
    return importlib.util.find_spec("tensorboard") is not None


class EvalLog:
    """Appends every evaluation to eval.csv and to the TensorBoard event files (run_dir/tb); without
    tensorboard installed, to eval.csv alone (said once at start)."""

    def __init__(self, run_dir: Path, recorder: Recorder, append: bool = False, run: RunConfig | None = None) -> None:
        import tensorflow as tf

        self._recorder = recorder
        self._writer: Any = None
        if tensorboard_installed():
            self._writer = tf.summary.create_file_writer(str(RunDir(run_dir).tensorboard))
        else:
            log.warning("no TensorBoard event files: tensorboard is not installed (pip install tensorboard, "
                        "or asyncps[tf] / asyncps[cpu]); evaluations go to eval.csv and summary.json")
        self._file = RowWriter(RunDir(run_dir).evals, EvalRow, append=append)
        self.history: list[tuple[float, int, float, float]] = []
        if run is not None and self._writer is not None:
            write_hparams(self._writer, run)

    def add(self, elapsed: float, updates: int, versions: Sequence[int], loss: float, accuracy: float,
            updates_per_s: float, metrics: Mapping[str, float] | None = None) -> None:
        """Record one evaluation (with the training rate and recent staleness beside it in TensorBoard);
        accuracy NaN (not a classification task) is left out of TensorBoard, the task's metrics go in."""
        self._file.write(EvalRow(time.time(), elapsed, updates, tuple(versions), loss, accuracy))
        self._file.flush()
        self.history.append((elapsed, updates, loss, accuracy))
        if self._writer is None:
            return
        import tensorflow as tf

        _, recent, _, worker_loss = self._recorder.snapshot()
        dropped = self._recorder.dropped()
        idle = self._recorder.idle_fractions()
        with self._writer.as_default(step=updates):
            tf.summary.scalar("eval/loss", loss)
            if not math.isnan(accuracy):
                tf.summary.scalar("eval/accuracy", accuracy)
            for name, value in (metrics or {}).items():
                tf.summary.scalar(f"eval/{name}", value)
            tf.summary.scalar("train/updates_per_s", updates_per_s)
            tf.summary.scalar("train/worker_loss", worker_loss)
            tf.summary.scalar("train/dropped_pushes", sum(dropped.values()))
            for reason, count in sorted(dropped.items()):
                tf.summary.scalar(f"dropped/{reason}", count)
            if idle:
                tf.summary.scalar("train/idle_fraction", sum(idle.values()) / len(idle))
                for worker, fraction in idle.items():
                    tf.summary.scalar(f"idle_fraction/worker_{worker}", fraction)
            if recent:
                tf.summary.histogram("train/staleness", recent)
                tf.summary.scalar("train/mean_staleness", sum(recent) / len(recent))
        self._writer.flush()

    def close(self) -> None:
        """Close eval.csv and the TensorBoard writer."""
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def hparams_of(run: RunConfig) -> dict[str, bool | int | float | str]:
    """The run's settings as TensorBoard hyperparameters (scalars as they are, the rest as JSON text)."""
    values: dict[str, bool | int | float | str] = {}
    for name, value in json.loads(run.to_json()).items():
        values[name] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value, sort_keys=True)
    return values


def write_hparams(writer: Any, run: RunConfig) -> None:
    """The run's hyperparameters for TensorBoard's HParams dashboard, and as a text table (TEXT tab)."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp

    values = hparams_of(run)
    table = "| setting | value |\n|---|---|\n" + "".join(f"| {k} | `{v}` |\n" for k, v in sorted(values.items()))
    with writer.as_default(step=0):
        hp.hparams(values)
        tf.summary.text("run/config", table)
    writer.flush()


def write_summary(run_dir: Path, final: tuple[float, float], wall_s: float, p: Progress, recorder: Recorder,
                  run: RunConfig, num_ps: int, data: Dataset, stop_reason: str | None, ledger: TaskLedger,
                  evaluator: Evaluator, start: dict[str, Any] | None = None,
                  provenance: Provenance | None = None, verdict: Verdict | None = None,
                  checkpoints_failed: int = 0) -> None:
    """summary.json: the run's outcome (with the final training loss where the optimum is known); `verdict`:
    why it did not end as trained (diverged, no worker alive), None when it did."""
    histogram, _, examples, _ = recorder.snapshot()
    rolled_back = recorder.rolled_back_by_shard()
    accounting = (recorder.push_accounting(p.answers, p.answers_by_worker) if len(p.answers) == len(p.versions)
                  else [{} for _ in p.versions])
    train_loss: float | None = None
    gap: float | None = None
    metrics = dict(evaluator.last_metrics)  # of the final evaluation, on the test set
    if data.optimal_loss is not None:
        train_loss, _ = evaluator.evaluate(data.x_train, data.y_train)
        gap = train_loss - data.optimal_loss
    RunSummary(
        updates_applied=p.updates,
        updates_dropped=round(sum(p.dropped) / len(p.dropped)) if p.dropped else 0,
        staleness=StalenessSummary.of(histogram),
        throughput_updates_per_s=p.updates / wall_s if wall_s > 0 else 0.0,
        final_eval=FinalEval(loss=final[0], accuracy=final[1]),
        wall_s=wall_s,
        mode=run.mode,
        staleness_policy=run.staleness_policy,
        workers=run.num_workers,
        ps_shards=num_ps,
        model=run.model,
        dataset=run.dataset,
        epochs=examples / max(1, len(data.x_train)),
        stop_reason=stop_reason,
        pushes_recorded=recorder.pushes_recorded,
        data={**ledger.summary(), **recorder.example_outcomes(), "pushes_rolled_back": sum(rolled_back.values())},
        # the shards count what they drop; a non-finite step is dropped by its worker (or refused by a shard)
        dropped_by_reason={**p.dropped_by_reason,
                           **{k: v for k, v in recorder.dropped().items() if k == _NONFINITE}},
        idle_fraction=recorder.idle_fractions(),
        max_clock_lead=p.max_clock_lead,
        measured_clock_lead=recorder.measured_clock_lead(),
        reads_refused=dict(p.reads_refused),
        backup_workers=run.backup_workers,
        staleness_bound=run.staleness_bound,
        shards=tuple(ShardCounters(version=v, accepted=a, dropped=d, bytes_pushed=pushed, bytes_pulled=pulled,
                                   bytes_by_transport=by, rolled_back=rolled_back.get(i, 0), **counted)
                     for i, (v, a, d, pushed, pulled, by, counted) in enumerate(zip(
                         p.versions, p.accepted, p.dropped, p.bytes_pushed, p.bytes_pulled, p.bytes_by_transport,
                         accounting, strict=True))),
        final_train_loss=train_loss,
        optimality_gap=gap,
        staleness_steady=StalenessSummary.of(recorder.steady.snapshot()),
        row_staleness=recorder.row_staleness.summary(),
        row_cache=recorder.row_cache_summary(),
        start={**(start or {}), "late_workers": recorder.steady.late_workers(run.num_workers)},
        metrics=metrics,
        provenance=provenance,
        outcome=verdict.outcome if verdict is not None else "interrupted" if stop_reason == INTERRUPTED else "finished",
        verdict=verdict.reason if verdict is not None else None,
        nonfinite_steps=recorder.nonfinite().steps,
        checkpoints_failed=checkpoints_failed,
    ).save(run_dir)
