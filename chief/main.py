"""Chief process: the composition of its parts, wired together by the control loop.

Parts, one job each: membership (registration, heartbeats, the live set pushed to the shards),
tasks (the data task ledger), checkpointer (initialize/restore shards, consistent checkpoints),
evaluator (scheduled evaluations), recorder (pushes, timeline, eval log, summary.json), progress
(shard counters, training time), lifecycle (run directory, server, stop condition, shutdown).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncps.chief.checkpointer import Checkpointer
from asyncps.chief.config import ChiefConfig
from asyncps.chief.evaluator import Evaluation, Evaluator
from asyncps.chief.lifecycle import Lifecycle, export_model, prepare_run_dir
from asyncps.chief.membership import LiveSet, Membership
from asyncps.chief.progress import Progress, ShardPoller, TrainClock
from asyncps.chief.recorder import EvalLog, Recorder, write_summary
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.chief.tasks import TaskLedger
from asyncps.codec import Array
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rpc import Unreachable
from asyncps.rundir import StalenessSummary
from asyncps.tfutil import limit_threads, quiet_tensorflow

if TYPE_CHECKING:
    from asyncps.datasets import Dataset
    from asyncps.placement import Placement
    from asyncps.transport import ModelClient

__all__ = ["Chief", "ChiefConfig", "run_chief"]

log = logging.getLogger("asyncps.chief")


@dataclass(frozen=True)
class ModelParts:
    """The dataset, the Keras model with its evaluator, and the model's placement over the shards."""

    data: Dataset
    keras: Any
    evaluator: Evaluator
    initial_values: dict[str, Array]
    placement: Placement
    client: ModelClient


def build_model_parts(config: ChiefConfig) -> ModelParts:
    """Load the dataset, build the model, place it over the shards and connect to them."""
    run = config.run
    quiet_tensorflow()
    limit_threads(run.tf_threads)
    from asyncps.datasets import load_dataset
    from asyncps.models import build_model, make_loss, make_metrics
    from asyncps.placement import VariableSpec, place
    from asyncps.transport import connect_model

    data = load_dataset(run.dataset, run.seed)
    model = build_model(run.model, data.num_features, data.num_classes, data.image_shape, run.seed)
    evaluator = Evaluator(model, make_loss(run.loss), metrics=make_metrics(run.metrics))
    initial_values = evaluator.values()
    specs = [VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in model.trainable_variables]
    placement = place(specs, len(config.ps), run.slice_threshold_bytes)
    client = connect_model("chief", list(config.ps), placement, run.rpc_deadline_s, run.chunk_bytes, config.security)
    log.info("model %s: %d variables, %d parameters; bytes per shard %s", run.model, len(specs),
             sum(math.prod(s.shape) for s in specs), placement.shard_bytes())
    return ModelParts(data, model, evaluator, initial_values, placement, client)


class Chief:
    """Owns the run: wires the parts together and runs the control loop."""

    def __init__(self, config: ChiefConfig, interrupt: threading.Event, model: ModelParts, progress: Progress,
                 membership: Membership, ledger: TaskLedger, checkpointer: Checkpointer, recorder: Recorder,
                 eval_log: EvalLog) -> None:
        self.config = config
        self.run = config.run
        self.interrupt = interrupt
        self.model = model
        self.progress = progress
        self.membership = membership
        self.ledger = ledger
        self.checkpointer = checkpointer
        self.recorder = recorder
        self.eval_log = eval_log
        self.clock = TrainClock()
        self.live_set = LiveSet(membership, model.client.shards)
        self.poller = ShardPoller(model.client.shards, config.ps, self.run.rpc_deadline_s, progress,
                                  self._recover_shard)
        self.evaluation = Evaluation(model.evaluator, model.client, model.data, self.run.eval_every_s, progress,
                                     self.clock, eval_log)
        self.lifecycle = Lifecycle(config, interrupt, progress, self.clock, ledger, model.client)

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
            return cpb.ClusterStatus(
                updates=p.updates, updates_per_s=p.updates_per_s, mean_staleness=stale.mean,
                workers_alive=len(self.membership.live_workers()), eval_loss=p.eval_loss,
                eval_accuracy=p.eval_accuracy, eval_version=p.eval_updates, worker_loss=loss,
                done=p.done, elapsed_s=self.clock.elapsed(),
                epochs=(examples + self.checkpointer.examples_offset) / max(1, len(self.model.data.x_train)),
            )

    # -- the run --------------------------------------------------------------------------
    def serve(self) -> int:
        """Run to completion; return the process exit code."""
        servicer = CoordinatorServicer(self.membership, self.recorder, self.config.ps, self.run.to_json(),
                                       self.status, self.ledger)
        self.lifecycle.start(servicer)
        try:
            self._control_loop()
            if self.run.checkpoint_every_updates or self.run.checkpoint_every_s:
                self._checkpoint()
            final = self.evaluation.evaluate()
            self._write_summary(final)
            if self.config.export:
                export_model(self.model.keras, self.config)
        finally:
            with self.progress.lock:
                self.progress.done = True
            self.eval_log.close()
            self.recorder.close()
            self.lifecycle.shutdown()
        log.info("run complete: %s", self.config.run_dir)
        return 0

    def _control_loop(self) -> None:
        stop_at: float | None = None
        while True:
            self.interrupt.wait(0.2)
            for member in self.membership.reap():
                requeued = self.ledger.requeue(member.member_id)
                log.warning("worker %d (%s) missed heartbeats for %.0fs: declared dead; %d data task(s) "
                            "re-queued", member.index, member.member_id, self.run.heartbeat_timeout_s, requeued)
            try:
                self.live_set.sync()
                self.poller.poll()
            except Unreachable as exc:
                log.error("%s", exc)
                self.membership.request_stop(f"shard unreachable: {exc}")
            self.clock.observe(self.progress.updates)
            if stop_at is None:
                reason = self.lifecycle.stop_reason()
                if reason is not None:
                    log.info("stopping: %s", reason)
                    self.membership.request_stop(reason)
                    stop_at = time.monotonic()
                elif self.checkpointer.due(self.clock.started):
                    self._checkpoint()
                elif self.evaluation.due():
                    self.evaluation.scheduled()
            elif self.membership.all_done() or time.monotonic() - stop_at > self.config.stop_grace_s:
                self.clock.stop()
                return

    def _checkpoint(self) -> None:
        self.checkpointer.checkpoint(lambda: self.recorder.snapshot()[2])

    def _write_summary(self, final: tuple[float, float]) -> None:
        write_summary(self.config.run_dir, final, self.clock.wall_s(), self.progress,
                      self.recorder, self.run, len(self.config.ps), self.model.data, self.membership.stop_reason,
                      self.ledger, self.model.evaluator)


def run_chief(config: ChiefConfig, interrupt: threading.Event | None = None) -> int:
    """Build the chief's parts, initialize (or restore) the shards, and run."""
    started = time.monotonic()
    run = config.run
    prepare_run_dir(config)
    model = build_model_parts(config)
    progress = Progress()
    membership = Membership(run.num_workers, run.heartbeat_timeout_s)
    ledger = TaskLedger(len(model.data.x_train), run.task_size or 4 * run.batch_size, run.epochs)
    checkpointer = Checkpointer(config, model.client, model.placement, model.initial_values, ledger, membership,
                                progress, since=started)
    try:
        checkpointer.initialize_shards()
    except Unreachable as exc:
        log.error("%s", exc)
        return 2
    recorder = Recorder(config.run_dir, append=config.resume)
    eval_log = EvalLog(config.run_dir, recorder, append=config.resume)
    chief = Chief(config, interrupt or threading.Event(), model, progress, membership, ledger, checkpointer,
                  recorder, eval_log)
    return chief.serve()
