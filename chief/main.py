"""Chief process: the composition of its parts, wired together by the control loop.

Parts, one job each: membership (registration, heartbeats, the live set pushed to the shards),
tasks (the data task ledger), checkpointer (initialize/restore shards, consistent checkpoints),
evaluator (scheduled evaluations), recorder (pushes, timeline, eval log, summary.json), progress
(shard counters, training time), lifecycle (run directory, server, stop condition, shutdown).

A chief started on a run directory with a manifest resumes that run (chief restart = resume): the
live shards, the data ledger's journal, the CSV files and the training clock all continue.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from asyncps.chief.checkpointer import LIVE, RESTORED, Checkpointer, ShardStateError
from asyncps.chief.config import ChiefConfig
from asyncps.chief.evaluator import Evaluation, Evaluator
from asyncps.chief.guard import RunGuard, Verdict, final_verdict
from asyncps.chief.ledgerlog import LedgerLog, replay
from asyncps.chief.lifecycle import (
    EXIT_DIVERGED,
    EXIT_HANDED_OVER,
    EXIT_SHARD_STATE,
    EXIT_UNREACHABLE,
    Lifecycle,
    check_resume,
    export_model,
    prepare_run_dir,
)
from asyncps.chief.membership import LiveSet, Membership
from asyncps.chief.metrics import MetricsServer, RunMetrics
from asyncps.chief.progress import Progress, ShardPoller, TrainClock
from asyncps.chief.recorder import EvalLog, Recorder, write_summary
from asyncps.chief.reportlog import ReportLog, drop_torn_report
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.chief.startgate import START_TIMEOUT_S, StartGate
from asyncps.chief.tasks import TaskLedger

from asyncps.errors import AsyncpsError, Unreachable
from asyncps.ml.stopat import parse_early_stop, parse_stop_at
from asyncps.ml.tfutil import limit_threads, quiet_tensorflow
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.procenv import freeze_heap
from asyncps.rundir import ChiefLock, Provenance, RunDir, RunManifest, StalenessSummary, write_port_file
from asyncps.wire.codec import Array

if TYPE_CHECKING:
    from asyncps.config import RunConfig
    from asyncps.ml.datasets import Dataset
    from asyncps.ml.task import Task
    from asyncps.placement import Placement
    from asyncps.rules.initializers import RowInit
    from asyncps.transport import ModelClient

__all__ = ["Chief", "ChiefConfig", "run_chief"]

log = logging.getLogger("asyncps.chief")

T = TypeVar("T")

# A cut (checkpoint, evaluation) that fails while a shard died or restarted empty is tried this many
# times, the shards polled (and an empty one restored) between tries, then abandoned.
CUT_TRIES = 3

#: The most bytes of tables the chief makes whole at the end of a run to export the model (model.keras: a
#: 512 MB table took the chief to 3.7 GB);
#: larger tables are exported from a checkpoint by `asyncps export`, in its own process.
EXPORT_TABLE_BYTES = 1 << 28

#: Examples per evaluation batch (a table's local rows in the chief hold this many examples' ids).
EVAL_BATCH = 1024


@dataclass(frozen=True)
class ModelParts:
    """The dataset, the Keras model with its evaluator, and the model's placement over the shards:
    `initial_values` of every variable the chief sends, `tables` the row initializer of every table the
    shards make themselves (asyncps.rules.initializers; never made in the chief)."""

    data: Dataset
    keras: Any
    evaluator: Evaluator
    initial_values: dict[str, Array]
    placement: Placement
    client: ModelClient
    tables: dict[str, RowInit] = dataclasses.field(default_factory=dict)
    state: tuple[str, ...] = ()  # the parts that are non-trainable state (UpdateRuleConfig.state)


def build_model_parts(config: ChiefConfig) -> ModelParts:
    """Load the dataset, build the model (its tables read by rows: never made here when the shards can
    make them, asyncps.runmodel.build_chief_model), place it over the shards and connect to them."""
    run = config.run
    quiet_tensorflow()
    limit_threads(run.tf_threads)
    from asyncps.placement import VariableSpec, place
    from asyncps.runmodel import build_chief_model
    from asyncps.transport import connect_model

    data, model, sparse, made = build_chief_model(run, EVAL_BATCH)
    evaluator = Evaluator(model, resolve_run_task(run, data, model), EVAL_BATCH, sparse)
    initial_values = {**evaluator.values(), **made}
    tables = {t.variable: t.init for t in sparse.tables if t.init is not None} if sparse is not None else {}
    started = time.monotonic()
    evaluator.warm_up(data.x_test, data.y_test)
    log.info("evaluation traced in %.2fs", time.monotonic() - started)
    from asyncps.ml.models import shard_variables, state_variables

    specs = sparse.specs() if sparse is not None else [
        VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in shard_variables(model)]
    placement = place(specs, len(config.ps), run.slice_threshold_bytes)
    held = {v.path for v in state_variables(model, sparse.fed if sparse is not None else ())}
    if held and (sparse is not None or run.local_steps > 1):
        raise ValueError("a model with non-trainable state on the shards (BatchNormalization's statistics) trains "
                         "with neither local_steps > 1 nor tables read by rows")
    state = tuple(sorted(p.name for shard in range(len(config.ps)) for p in placement.parts_on(shard)
                         if p.variable in held))
    # the chief restores a shard that restarted empty: its reads fail at once there instead of waiting
    client = connect_model("chief", list(config.ps), placement, run.rpc_deadline_s, run.chunk_bytes, config.security,
                           ride_restarts=False, row_variables=[t.variable for t in sparse.tables] if sparse else ())
    log.info("model %s: %d variables, %d parameters; bytes per shard %s; %d table(s) made by the shards", run.model,
             len(specs), sum(math.prod(s.shape) for s in specs), placement.shard_bytes(), len(tables))
    return ModelParts(data, model, evaluator, initial_values, placement, client, tables, state)


def resolve_run_task(run: RunConfig, data: Dataset, model: Any) -> Task:
    """The run's loss, metrics and accuracy for the built model (asyncps.ml.task), checked on two test
    examples; one WARNING when a softmax/sigmoid output meets a loss of logits; the task logged."""
    from asyncps.ml.task import check_loss, logits_mismatch, resolve_task

    task = resolve_task(run.loss, run.eval_metrics, model, data.y_test)
    check_loss(task, model, data.x_test, data.y_test)
    mismatch = logits_mismatch(model, task)
    if mismatch is not None:
        log.warning("%s", mismatch)
    check_stop_at(run, task)
    accuracy = {"argmax": "argmax of the outputs against the class ids",
                None: "not measured (not a classification task)"}.get(task.accuracy, f"the metric {task.accuracy}")
    log.info("loss %s; metrics %s; accuracy: %s", task.loss_name, ", ".join(task.metrics) or "none", accuracy)
    return task


def check_stop_at(run: RunConfig, task: Task) -> None:
    """A ValueError naming what the evaluation reports when --stop-at names a metric it does not."""
    stop_at = parse_stop_at(run.stop_at)
    reported = ["loss", *(["accuracy"] if task.accuracy is not None else []), *task.metrics]
    if stop_at is not None and stop_at.metric not in reported:
        raise ValueError(f"--stop-at {stop_at.describe()}: this run's evaluation reports no {stop_at.metric} "
                         f"(it reports {', '.join(dict.fromkeys(reported))})")
    early = parse_early_stop(run.early_stop)
    if early is not None and early.metric not in reported:
        raise ValueError(f"--early-stop {run.early_stop}: this run's evaluation reports no {early.metric} "
                         f"(it reports {', '.join(dict.fromkeys(reported))})")


class Chief:
    """Owns the run: wires the parts together and runs the control loop."""

    def __init__(self, config: ChiefConfig, interrupt: threading.Event, model: ModelParts, progress: Progress,
                 membership: Membership, ledger: TaskLedger, checkpointer: Checkpointer, recorder: Recorder,
                 eval_log: EvalLog, manifest: RunManifest | None = None, reports: ReportLog | None = None,
                 handover: threading.Event | None = None, provenance: Provenance | None = None) -> None:
        self.config = config
        self.provenance = provenance  # the versions, host and commit config.json recorded; summary.json too
        self.run = config.run
        self.interrupt = interrupt
        # set (SIGTERM with --on-sigterm handover): exit now and leave the run to the next chief
        self.handover = handover or threading.Event()
        self.model = model
        self.progress = progress
        self.membership = membership
        self.ledger = ledger
        self.checkpointer = checkpointer
        self.recorder = recorder
        self.eval_log = eval_log
        self.reports = reports or ReportLog()  # the worker reports recorded, each once
        self.manifest = manifest or RunManifest.new()
        self.clock = TrainClock(self.manifest.elapsed_s)
        checkpointer.failed = self.manifest.checkpoints_failed  # counted over every chief of the run
        self.started = time.monotonic()
        self.failure: str | None = None  # why the run cannot go on (the shards' state is lost)
        self.unreachable: str | None = None  # a shard stayed unreachable: the run stops, for a restarted chief
        # diverged or without workers: the run ends with its summary and this verdict's exit status
        self.guard = RunGuard(self.run.max_nonfinite_steps, self.run.no_workers_grace_s(), START_TIMEOUT_S)
        self.verdict: Verdict | None = None
        self._manifest_saved = 0.0
        self._orphans_checked = False
        self.live_set = LiveSet(membership, model.client.shards, ledger.workers_with_work)
        self.poller = ShardPoller(model.client.shards, config.ps, self.run.rpc_deadline_s, progress,
                                  self._recover_shard)
        self.evaluation = Evaluation(model.evaluator, model.client, model.data, self.run.eval_every_s, progress,
                                     self.clock, eval_log,
                                     RunDir(config.run_dir).eval_weights if self.run.eval_weights else None)
        self.lifecycle = Lifecycle(config, interrupt, progress, self.clock, ledger, model.client)
        # a restarted chief's workers started long ago (they never wait again): its gate is open
        self.gate = StartGate(self.run.num_workers, self.run.start_barrier and self.manifest.chief_starts <= 1,
                              membership.index_of)

    def _recover_shard(self, shard: int) -> None:
        """Restore a restarted shard, then give it the live set it lost (sync quorum, SSP waits)."""
        self.checkpointer.recover_shard(shard)
        self.live_set.restored(shard)

    # -- status ---------------------------------------------------------------------------
    def status(self) -> cpb.ClusterStatus:
        """The run's progress for GetStatus."""
        histogram, _, examples, loss = self.recorder.snapshot()
        stale = StalenessSummary.of(histogram)
        p = self.progress
        with p.lock:
            updates = p.updates
            status = cpb.ClusterStatus(
                updates=updates, updates_per_s=p.updates_per_s, mean_staleness=stale.mean,
                workers_alive=len(self.membership.live_workers()), eval_loss=p.eval_loss,
                eval_accuracy=p.eval_accuracy, eval_version=p.eval_updates, worker_loss=loss,
                done=p.done, elapsed_s=self.clock.elapsed(), workers_planned=self.membership.num_workers,
                stop_reason=self.membership.stop_reason or "",
                epochs=(examples + self.checkpointer.examples_offset) / max(1, len(self.model.data.x_train)),
                eval_metrics=p.eval_metrics,
            )
        status.fraction_done = 1.0 if status.done else self.lifecycle.fraction_done(updates)
        return status

    def metrics(self) -> RunMetrics:
        """The run's metrics for the Prometheus endpoint."""
        status = self.status()
        histogram, _, _, _ = self.recorder.snapshot()
        with self.progress.lock:
            drops = dict(self.progress.dropped_by_reason)
        return RunMetrics(updates=status.updates, updates_per_s=status.updates_per_s, dropped_by_reason=drops,
                          staleness=histogram, live_workers=status.workers_alive,
                          planned_workers=status.workers_planned, eval_loss=status.eval_loss,
                          eval_accuracy=status.eval_accuracy, epochs=status.epochs,
                          fraction_done=status.fraction_done)

    # -- the run --------------------------------------------------------------------------
    def serve(self) -> int:
        """Run to completion; return the process exit code."""
        # set up (TensorFlow, the model, the data): later collections skip them. Before the server starts,
        # so the full collection this takes never delays the control loop (checkpoints) of a running run
        freeze_heap()
        servicer = CoordinatorServicer(self.membership, self.recorder, self.config.ps, self.run.to_json(),
                                       self.status, self.ledger, self.gate, self.reports)
        self.lifecycle.start(servicer)
        metrics = None
        if self.config.metrics_port >= 0:
            metrics = MetricsServer(self.config.host, self.config.metrics_port, self.metrics, self.config.security)
            write_port_file(self.config.metrics_port_file, metrics.port)
        handed_over = False
        finished = False  # the run reached its end and its summary is written
        gave_up: str | None = None  # why the run cannot go on (the shards are told so)
        try:
            self._control_loop()
            if self.handover.is_set():
                handed_over = True
                log.warning("SIGTERM (--on-sigterm handover): leaving the shards and the workers to the next chief "
                            "of run %s; exiting %d", self.manifest.run_id, EXIT_HANDED_OVER)
                return EXIT_HANDED_OVER
            if self.unreachable is not None:  # a supervisor may bring it back: a restarted chief resumes then
                raise RuntimeError(f"stopping before the run's end: {self.unreachable}")
            self._final_poll()
            if self.failure is not None:
                log.error("run stopped: %s", self.failure)
                gave_up = self.failure
                return EXIT_SHARD_STATE
            if self.run.checkpoint_every_updates or self.run.checkpoint_every_s:
                self._checkpoint()
            final = self._at_cut("final evaluation", self.evaluation.evaluate)
            if final is None:  # the shards could not be read: a chief restarted on them finishes the run
                raise RuntimeError("the final evaluation failed: no summary written (see above)")
            self.verdict = self._end_verdict(final[0])
            self._write_summary(final)
            finished = True
            if self.config.export and self.verdict is not None and self.verdict.exit_code == EXIT_DIVERGED:
                log.warning("no model exported: the run diverged (its values are not finite); the run directory's "
                            "earlier checkpoints (not the last) hold earlier values")
            elif self.config.export:
                self._export()
            if self.verdict is not None:
                gave_up = self.verdict.reason
                log.error("run ended: %s; exiting %d", self.verdict.reason, self.verdict.exit_code)
                return self.verdict.exit_code
        finally:
            self.gate.cancel()
            with self.progress.lock:
                self.progress.done = not handed_over
            self.eval_log.close()
            self.recorder.close()
            if not (handed_over or finished or gave_up):
                log.error("the chief stops before the run's end: the shards keep their state for the next chief")
            self.lifecycle.shutdown(keep_shards=handed_over or not (finished or gave_up),
                                    reason=f"the chief gave up: {gave_up}" if gave_up else "training finished")
            if metrics is not None:
                metrics.close()
        nonfinite = self.recorder.nonfinite()
        log.info("run complete: %s%s", self.config.run_dir, f" ({nonfinite.describe()})" if nonfinite.steps else "")
        return 0

    def _end_verdict(self, final_loss: float) -> Verdict | None:
        """The verdict the run ends with: the control loop's (a diverged one with the steps skipped as
        non-finite), else the end-of-run rule's (asyncps.chief.guard.final_verdict), else None (trained)."""
        nonfinite = self.recorder.nonfinite()
        if self.verdict is None:
            return final_verdict(final_loss, nonfinite, self.recorder.snapshot()[2])
        if self.verdict.exit_code == EXIT_DIVERGED:
            return dataclasses.replace(self.verdict, reason=f"{self.verdict.reason}; {nonfinite.describe()}")
        return self.verdict

    def _control_loop(self) -> None:
        stop_at: float | None = None
        while True:
            self.interrupt.wait(0.2)
            if self.handover.is_set():  # no stop for the workers: they register again with the next chief
                self._save_manifest(force=True)
                return
            for member in self.membership.reap():
                requeued = self.ledger.requeue(member.worker_id)
                if member.replaced_by:
                    log.warning("worker %d registered again (%s replaces %s); %d data task(s) of the previous "
                                "incarnation re-queued", member.index, member.replaced_by, member.worker_id, requeued)
                else:
                    log.warning("worker %d (%s) missed heartbeats for %.0fs: declared dead; %d data task(s) "
                                "re-queued", member.index, member.worker_id, self.run.heartbeat_timeout_s, requeued)
            self._requeue_orphans()
            self._poll(sync_live_set=True)
            self.clock.observe(self.progress.updates)
            self._save_manifest()
            if stop_at is None:
                reason = self.lifecycle.stop_reason()
                if reason is None:
                    self.verdict = self.guard.check((m.index for m in self.membership.live_workers()),
                                                    self.recorder.nonfinite_streaks())
                    reason = self.verdict.reason if self.verdict is not None else None
                if reason is not None:
                    log.info("stopping: %s", reason)
                    self.membership.request_stop(reason)
                    self.gate.cancel()
                    stop_at = time.monotonic()
                elif self.checkpointer.due(self.clock.started):
                    self._checkpoint()
                elif self.evaluation.due():
                    self._at_cut("evaluation", self.evaluation.scheduled)
            elif self.membership.all_done() or time.monotonic() - stop_at > self.config.stop_grace_s:
                self.clock.stop()
                self._save_manifest(force=True)
                return

    def _poll(self, sync_live_set: bool = False) -> bool:
        """One round of the shards' counters (first the live set, with `sync_live_set`), restoring a shard
        that restarted empty; False (the run asked to stop, and why) when a shard stayed unreachable or
        its state is lost with nothing to restore."""
        try:
            if sync_live_set:
                self.live_set.sync()
            self.poller.poll()
            return True
        except Unreachable as exc:
            log.error("%s", exc)
            self.unreachable = f"shard unreachable: {exc}"
            self.membership.request_stop(self.unreachable)
        except ShardStateError as exc:
            if self.failure is None:
                log.error("%s", exc)
                self.failure = str(exc)
                self.membership.request_stop(f"shard state lost: {exc}")
        return False

    def _at_cut(self, what: str, take: Callable[[], T]) -> T | None:
        """Take a cut (a checkpoint, an evaluation) that survives a shard's death: when it fails (a shard
        died, or restarted empty, while the cut held it), the shards are polled, which restores a shard
        that came back empty, and the cut is tried again, CUT_TRIES times in all; then it is abandoned
        (None, logged), never the run."""
        for attempt in range(1, CUT_TRIES + 1):
            try:
                return take()
            except AsyncpsError as exc:  # a shard's answer, or Unreachable
                log.warning("%s: the cut failed (attempt %d of %d): %s", what, attempt, CUT_TRIES, exc)
                if not self._poll():
                    break
        log.error("%s abandoned: the cut failed %s; the run goes on", what,
                  "and the shards could not be brought back" if self.failure or self.membership.stop_reason
                  else f"{CUT_TRIES} times")
        return None

    def _final_poll(self) -> None:
        """The shards' counters once every worker is done (a last push may land after the loop's poll)."""
        try:
            self.poller.poll()
        except (Unreachable, ShardStateError) as exc:
            log.warning("final poll of the shards: %s", exc)

    def _requeue_orphans(self) -> None:
        """After a chief restart: tasks in flight with workers that never came back to this chief
        (within a heartbeat timeout) go back to pending, as a dead worker's would."""
        if self._orphans_checked or time.monotonic() - self.started < self.run.heartbeat_timeout_s:
            return
        self._orphans_checked = True
        for holder in sorted(self.ledger.holders() - self.membership.worker_ids()):
            requeued = self.ledger.requeue(holder)
            log.warning("%s held %d data task(s) before the chief restarted and did not come back: re-queued",
                        holder, requeued)

    def _save_manifest(self, force: bool = False) -> None:
        """Keep manifest.json's training time current (about once a second)."""
        now = time.monotonic()
        if force or now - self._manifest_saved >= 1.0:
            self.manifest = dataclasses.replace(self.manifest, elapsed_s=self.clock.elapsed(),
                                                checkpoints_failed=self.checkpointer.failed)
            self.manifest.save(self.config.run_dir)
            self._manifest_saved = now

    def _checkpoint(self) -> None:
        failed = self.checkpointer.failed
        self._at_cut("checkpoint", lambda: self.checkpointer.checkpoint(lambda: self.recorder.snapshot()[2]))
        if self.checkpointer.failed != failed:  # the count outlives this chief (manifest.json)
            self._save_manifest(force=True)

    def _export(self) -> None:
        """The final model into the run directory: a whole Keras model, so its tables are pulled whole
        into a model built whole (what export is for: the only time the chief holds a table)."""
        sparse = self.model.evaluator.sparse
        if sparse is None:
            export_model(self.model.keras, self.config)
            return
        table_bytes = sum(math.prod(t.shape) * np.dtype(t.dtype).itemsize for t in sparse.tables)
        if table_bytes > EXPORT_TABLE_BYTES:
            log.warning("no model.keras: the tables (%.0f MB) only the shards hold are larger than the %d MB the "
                        "chief makes whole to export them; `asyncps export` writes the model from a checkpoint",
                        table_bytes / 1e6, EXPORT_TABLE_BYTES >> 20)
            return
        from asyncps.runmodel import build_run_model
        from asyncps.transport import connect_model

        keyed = [t.layer for t in sparse.tables if t.keyed]
        if keyed:  # the rows a keyed table kept, by key, are in the run's last checkpoint (taken at its end)
            ckpt = self.checkpointer.checkpoints.latest()
            if ckpt is None:
                log.warning("no model.keras: the HashEmbedding tables %s live on the shards by key, and with "
                            "checkpoints off there is none to export them from", keyed)
                return
            from asyncps.ml.sparse import with_kept_rows

            _, whole = build_run_model(self.run)
            log.info("export: the HashEmbedding tables %s as the rows they kept, from %s", keyed, ckpt.path.name)
            export_model(with_kept_rows(whole, ckpt.values, ckpt.policy_state), self.config)
            return

        log.info("export: the tables (%.1f MB) are pulled whole into the chief", table_bytes / 1e6)
        _, whole = build_run_model(self.run)
        client = connect_model("chief", list(self.config.ps), self.model.placement, self.run.rpc_deadline_s,
                               self.run.chunk_bytes, self.config.security, ride_restarts=False)
        try:
            client.pull()
            from asyncps.ml.models import shard_variables

            for variable in shard_variables(whole):
                variable.assign(client.values[variable.path])
        finally:
            client.close()
        export_model(whole, self.config)

    def _write_summary(self, final: tuple[float, float]) -> None:
        write_summary(self.config.run_dir, final, self.clock.wall_s(), self.progress,
                      self.recorder, self.run, len(self.config.ps), self.model.data, self.membership.stop_reason,
                      self.ledger, self.model.evaluator, self.gate.describe(), self.provenance, self.verdict,
                      self.checkpointer.failed)


def run_chief(config: ChiefConfig, interrupt: threading.Event | None = None,
              handover: threading.Event | None = None) -> int:
    """Hold the run directory's lock (asyncps.rundir.ChiefLock; RunDirLocked while another chief runs on
    it), build the chief's parts, bring the shards to the run's state (new, resumed live, or restored),
    and run. A resume with other run-defining settings than the run recorded is a ValueError."""
    with ChiefLock.acquire(config.run_dir):
        return _run_locked(config, interrupt, handover)


def _run_locked(config: ChiefConfig, interrupt: threading.Event | None,
                handover: threading.Event | None) -> int:
    started = time.monotonic()
    run = config.run
    manifest = RunManifest.load(config.run_dir)
    resuming = manifest is not None
    reshard = check_resume(config, resuming)
    manifest = (dataclasses.replace(manifest, chief_starts=manifest.chief_starts + 1) if manifest is not None
                else RunManifest.new())
    if resuming:
        log.info("run directory %s has a manifest: resuming run %s (chief start %d)", config.run_dir,
                 manifest.run_id, manifest.chief_starts)
    provenance = Provenance.collect()
    prepare_run_dir(config, provenance)
    model = build_model_parts(config)
    progress = Progress()
    membership = Membership(run.num_workers, run.heartbeat_timeout_s)
    ledger = TaskLedger(len(model.data.x_train), run.task_size or 4 * run.batch_size, run.epochs)
    checkpointer = Checkpointer(config, model.client, model.placement, model.initial_values, ledger, membership,
                                progress, since=started, run_id=manifest.run_id, tables=model.tables,
                                state=model.state)
    try:
        how = checkpointer.start_shards(resuming, reshard)
    except Unreachable as exc:
        log.error("%s", exc)
        return EXIT_UNREACHABLE
    except ShardStateError as exc:
        log.error("%s", exc)
        return EXIT_SHARD_STATE
    files = RunDir(config.run_dir)
    if how == LIVE and replay(files.ledger, ledger):
        log.info("data ledger continues from %s: %s", files.ledger.name, ledger.summary())
    elif how == RESTORED and resuming:
        previous = TaskLedger(ledger.num_examples, ledger.task_size, run.epochs)
        try:
            found = replay(files.ledger, previous)
        except ValueError as exc:  # the accounting of the rewind is lost, not the run
            log.warning("the previous chief's data ledger cannot be read (%s): rewound tasks not counted", exc)
            found = False
        if found:
            rewound = ledger.rewound_from(previous)
            log.info("data ledger went back to the checkpoint: %d task(s) the previous chief had done are done "
                     "again (tasks_rewound)", rewound)
    ledger_log = LedgerLog(files.ledger, ledger)
    manifest.save(config.run_dir)
    append = resuming or config.resume
    torn = (drop_torn_report(files.reports, config.run_dir,
                             lambda worker, task: ledger.is_done(task) or ledger.complete(worker, task))
            if append else None)
    if torn is not None:
        log.warning("%s", torn)
    recorder = Recorder(config.run_dir, append=append, planned_workers=run.num_workers)
    if append:
        checkpointer.examples_offset = 0  # the recorder counts the examples of the files it continues
    eval_log = EvalLog(config.run_dir, recorder, append=append, run=run)
    reports = ReportLog(files.reports, resume=append, sizes=recorder.sizes)  # follows the rows the recorder continues
    chief = Chief(config, interrupt or threading.Event(), model, progress, membership, ledger, checkpointer,
                  recorder, eval_log, manifest, reports, handover, provenance)
    try:
        return chief.serve()
    finally:
        ledger_log.close()
        reports.close()
