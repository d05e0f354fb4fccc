"""Chief process: initialize the shards, coordinate workers, evaluate, stop, summarize."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.chief.membership import Membership
from asyncps.chief.recorder import Recorder, staleness_summary
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.config import RunConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc
from asyncps.rpc import Unreachable, create_server
from asyncps.rundir import write_json, write_port_file
from asyncps.security import SecurityConfig
from asyncps.tfutil import limit_threads, quiet_tensorflow

if TYPE_CHECKING:
    from asyncps.chief.checkpoint import Checkpoint

log = logging.getLogger("asyncps.chief")

EVAL_COLUMNS = "wall_time,elapsed_s,updates,shard_versions,loss,accuracy\n"


@dataclass(frozen=True)
class ChiefConfig:
    """Where the chief serves, which shards it drives, and the run it runs."""

    ps: tuple[str, ...]
    run: RunConfig
    run_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    stop_grace_s: float = 30.0  # how long to wait for workers to finish after STOP
    checkpoint_dir: Path | None = None  # default: run_dir/ckpt
    resume: bool = False  # continue from the latest checkpoint instead of initializing
    export: bool = True  # write the final model (Keras file and SavedModel) into the run directory
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)

    @property
    def checkpoints(self) -> Path:
        """Where checkpoints go."""
        return self.checkpoint_dir or self.run_dir / "ckpt"

    def __post_init__(self) -> None:
        if not self.ps:
            raise ValueError("chief needs the shard addresses (--ps HOST:PORT,...)")
        if len(self.ps) != self.run.num_ps:
            raise ValueError(f"{len(self.ps)} shard addresses but num_ps={self.run.num_ps}")


@dataclass
class Progress:
    """What the control loop knows about the run, read by GetStatus (guarded by a lock)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    versions: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)
    dropped_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    max_clock_lead: float = 0.0
    updates_per_s: float = 0.0
    eval_loss: float = math.nan
    eval_accuracy: float = math.nan
    eval_updates: int = 0
    done: bool = False

    @property
    def updates(self) -> int:
        """Applied updates: the mean over shards of accepted pushes (each step pushes to all)."""
        return round(sum(self.accepted) / len(self.accepted)) if self.accepted else 0


class Chief:
    """Owns the run: shard initialization, the control loop, evaluation and the run directory."""

    def __init__(self, config: ChiefConfig, interrupt: threading.Event | None = None) -> None:
        self.config = config
        self.run = config.run
        self.interrupt = interrupt or threading.Event()
        self.progress = Progress()
        self.membership = Membership(self.run.num_workers, self.run.heartbeat_timeout_s)
        self._start = time.monotonic()
        self._train_start: float | None = None
        self._eval_history: list[tuple[float, int, float, float]] = []
        self._examples_offset = 0
        self._checkpoint_number = 0
        self._last_checkpoint = (time.monotonic(), 0)

    # -- setup ----------------------------------------------------------------------------
    def _build(self) -> None:
        quiet_tensorflow()
        limit_threads(self.run.tf_threads)
        from asyncps.chief.evaluator import Evaluator
        from asyncps.datasets import load_dataset
        from asyncps.models import build_model, loss_fn
        from asyncps.placement import VariableSpec, place
        from asyncps.transport import connect_model

        self.data = load_dataset(self.run.dataset, self.run.seed)
        model = build_model(self.run.model, self.data.num_features, self.data.num_classes,
                            self.data.image_shape, self.run.seed)
        self.model = model
        self.evaluator = Evaluator(model, loss_fn)
        self.initial_values = self.evaluator.values()
        from asyncps.chief.tasks import TaskLedger

        self.ledger = TaskLedger(len(self.data.x_train), self.run.task_size or 4 * self.run.batch_size,
                                 self.run.epochs)
        from asyncps.chief.checkpoint import CheckpointDir

        self.checkpoints = CheckpointDir(self.config.checkpoints, self.run.keep_checkpoints)
        specs = [VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in model.trainable_variables]
        self.placement = place(specs, len(self.config.ps), self.run.slice_threshold_bytes)
        self.client = connect_model("chief", list(self.config.ps), self.placement, self.run.rpc_deadline_s,
                                  self.run.chunk_bytes, self.config.security)
        log.info("model %s: %d variables, %d parameters; bytes per shard %s", self.run.model, len(specs),
                 sum(math.prod(s.shape) for s in specs), self.placement.shard_bytes())

    def _initialize_shards(self) -> None:
        n = len(self.config.ps)
        ckpt = self.checkpoints.latest() if self.config.resume else None
        if self.config.resume and ckpt is None:
            log.warning("--resume: no checkpoint in %s; starting from initial values", self.config.checkpoints)
        if ckpt is not None:
            self._examples_offset = int(ckpt.manifest.get("examples", 0))
            self._checkpoint_number = ckpt.number
            if "data_tasks" in ckpt.manifest:
                self.ledger.load(ckpt.manifest["data_tasks"])
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda shard: self._start_shard(shard, ckpt), range(n)))

    def _start_shard(self, shard: int, ckpt: Checkpoint | None) -> None:
        """Initialize a shard from the initial values, or restore it from a checkpoint."""
        from asyncps.chief.checkpoint import split
        from asyncps.placement import split_for_shards

        client = self.client.shards[shard]
        if ckpt is None:
            part = split_for_shards(self.placement, self.initial_values)[shard]
            reply = client.initialize("chief", shard, len(self.config.ps), self.run.update_rule(), part)
            log.info("shard %d at %s: %s at version %d", shard, self.config.ps[shard],
                     "initialized" if reply.created else "already initialized", reply.version)
            return
        snap = split(self.placement, ckpt, self.run.update_rule())[shard]
        reply = client.restore(snap, shard)
        log.info("shard %d at %s: restored from %s at version %d", shard, self.config.ps[shard], ckpt.path.name,
                 reply.version)

    def _recover_shard(self, shard: int) -> None:
        """A shard came back empty (it crashed and restarted): restore its part of the latest checkpoint."""
        ckpt = self.checkpoints.latest()
        if ckpt is None:
            log.warning("shard %d restarted and there is no checkpoint: it restarts from initial values", shard)
        self._start_shard(shard, ckpt)

    def _checkpoint(self) -> None:
        """A consistent cut: hold pushes on every shard, snapshot all, release, write atomically."""
        from asyncps.chief.checkpoint import assemble

        t0 = time.monotonic()
        shards = self.client.shards
        try:
            for shard in shards:
                shard.pause(hold_s=30.0)
            snaps = [shard.snapshot() for shard in shards]
        finally:
            for shard in shards:
                shard.pause(0.0)
        values, slots = assemble(self.placement, snaps)
        _, _, examples, _ = self.recorder.snapshot()
        self._checkpoint_number += 1
        updates = {name: n for snap in snaps for name, n in snap.updates.items()}
        variable_updates: dict[str, int] = {}
        for part in self.placement.parts:
            variable_updates[part.variable] = max(variable_updates.get(part.variable, 0), updates.get(part.name, 0))
        path = self.checkpoints.save(self._checkpoint_number, values, slots, {
            "shard_versions": [s.version for s in snaps],
            "shard_counters": [{"accepted": s.accepted, "dropped": s.dropped} for s in snaps],
            "updates": updates,
            "variable_updates": variable_updates,
            "examples": examples + self._examples_offset,
            "worker_steps": self.membership.worker_steps(),
            "data_tasks": self.ledger.state(),
            "run": dataclasses.asdict(self.run),
            "placement": [dataclasses.asdict(p) for p in self.placement.parts],
            "wall_time": time.time(),
        })
        self._last_checkpoint = (time.monotonic(), self.progress.updates)
        log.info("checkpoint %s at versions %s in %.3fs", path.name, [s.version for s in snaps],
                 time.monotonic() - t0)

    # -- status ---------------------------------------------------------------------------
    def status(self) -> cpb.ClusterStatus:
        """The run's progress for GetStatus."""
        histogram, _, examples, loss = self.recorder.snapshot()
        stale = staleness_summary(histogram)
        p = self.progress
        with p.lock:
            return cpb.ClusterStatus(
                updates=p.updates, updates_per_s=p.updates_per_s, mean_staleness=stale["mean"],
                workers_alive=len(self.membership.live_workers()), eval_loss=p.eval_loss,
                eval_accuracy=p.eval_accuracy, eval_version=p.eval_updates, worker_loss=loss,
                done=p.done, elapsed_s=self._elapsed(),
                epochs=(examples + self._examples_offset) / max(1, len(self.data.x_train)),
            )

    def _elapsed(self) -> float:
        return 0.0 if self._train_start is None else time.monotonic() - self._train_start

    # -- the run --------------------------------------------------------------------------
    def serve(self) -> int:
        """Run to completion; return the process exit code."""
        run_dir = self.config.run_dir
        (run_dir / "tb").mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "config.json", {
            "run": dataclasses.asdict(self.run), "ps": list(self.config.ps),
            "run_dir": str(run_dir),
        })
        self._build()
        try:
            self._initialize_shards()
        except Unreachable as exc:
            log.error("%s", exc)
            return 2
        self.recorder = Recorder(run_dir, append=self.config.resume)
        servicer = CoordinatorServicer(self.membership, self.recorder, self.config.ps, self.run.to_json(),
                                       self.status, self.ledger)
        server, port, health = create_server(
            f"{self.config.host}:{self.config.port}",
            [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)],
            interceptors=self.config.security.server_interceptors(),
            credentials=self.config.security.server_credentials())
        write_port_file(self.config.port_file, port)
        log.info("chief serving on port %d (%s); waiting for %d workers", port, self.config.security.describe(),
                 self.run.num_workers)
        import tensorflow as tf

        self.writer = tf.summary.create_file_writer(str(run_dir / "tb"))
        eval_path = run_dir / "eval.csv"
        continuing = self.config.resume and eval_path.exists()
        self._eval_file = open(eval_path, "a" if continuing else "w")  # noqa: SIM115
        if not continuing:
            self._eval_file.write(EVAL_COLUMNS)
        try:
            self._control_loop()
            if self.run.checkpoint_every_updates or self.run.checkpoint_every_s:
                self._checkpoint()
            final = self._evaluate()
            self._write_summary(final)
            if self.config.export:
                self._export()
        finally:
            with self.progress.lock:
                self.progress.done = True
            self._eval_file.close()
            self.recorder.close()
            self.writer.close()
            self._shutdown_shards()
            health.enter_graceful_shutdown()
            server.stop(grace=2.0).wait()
            self.client.close()
        log.info("run complete: %s", run_dir)
        return 0

    def _poll_shards(self) -> None:
        stats = [s.stats(deadline_s=self.run.rpc_deadline_s) for s in self.client.shards]
        for shard, st in enumerate(stats):
            if not st.initialized:
                log.warning("shard %d at %s is empty (restarted): recovering", shard, self.config.ps[shard])
                self._recover_shard(shard)
                stats[shard] = self.client.shards[shard].stats(deadline_s=self.run.rpc_deadline_s)
        p = self.progress
        with p.lock:
            before, t_before = p.updates, getattr(self, "_last_poll", None)
            p.versions = [s.version for s in stats]
            p.accepted = [s.pushes_accepted for s in stats]
            p.dropped = [s.pushes_dropped for s in stats]
            reasons: dict[str, int] = {}
            for s in stats:
                for reason, count in s.dropped_by_reason.items():
                    reasons[reason] = reasons.get(reason, 0) + count
            p.dropped_by_reason = reasons
            p.max_clock_lead = max((s.mode_stats.get("max_clock_lead", 0.0) for s in stats), default=0.0)
            now = time.monotonic()
            if t_before is not None and now > t_before:
                rate = (p.updates - before) / (now - t_before)
                p.updates_per_s = rate if p.updates_per_s == 0 else 0.7 * p.updates_per_s + 0.3 * rate
            self._last_poll = now

    def _checkpoint_due(self) -> bool:
        at, updates = self._last_checkpoint
        run = self.run
        by_updates = run.checkpoint_every_updates and self.progress.updates - updates >= run.checkpoint_every_updates
        by_time = run.checkpoint_every_s and time.monotonic() - at >= run.checkpoint_every_s
        return bool(by_updates or by_time) and self._train_start is not None

    def _sync_live_workers(self) -> None:
        """Tell the shards who is alive once every planned worker has joined, and on every change."""
        if self.membership.indices_seen() < self.run.num_workers:
            return
        live = sorted(m.member_id for m in self.membership.live_workers())
        if live == getattr(self, "_sent_live", None):
            return
        for shard in self.client.shards:
            shard.set_live_workers(live)
        self._sent_live = live
        log.info("live workers: %d", len(live))

    def _stop_reason(self) -> str | None:
        run, p = self.run, self.progress
        if self.interrupt.is_set():
            return "interrupted"
        if run.max_updates and p.updates >= run.max_updates:
            return f"reached {run.max_updates} updates"
        if run.epochs and self.ledger.finished():
            return f"reached {run.epochs:g} epochs (every data task done)"
        if run.max_seconds and self._elapsed() >= run.max_seconds:
            return f"reached {run.max_seconds:g} s"
        return None

    def _control_loop(self) -> None:
        last_eval = 0.0
        stop_at: float | None = None
        while True:
            self.interrupt.wait(0.2)
            for member in self.membership.reap():
                requeued = self.ledger.requeue(member.member_id)
                log.warning("worker %d (%s) missed heartbeats for %.0fs: declared dead; %d data task(s) "
                            "re-queued", member.index, member.member_id, self.run.heartbeat_timeout_s, requeued)
            try:
                self._sync_live_workers()
                self._poll_shards()
            except Unreachable as exc:
                log.error("%s", exc)
                self.membership.request_stop(f"shard unreachable: {exc}")
            if self._train_start is None and self.progress.updates > 0:
                self._train_start = time.monotonic()  # training time starts at the first update
            if stop_at is None:
                reason = self._stop_reason()
                if reason is not None:
                    log.info("stopping: %s", reason)
                    self.membership.request_stop(reason)
                    stop_at = time.monotonic()
                elif self._checkpoint_due():
                    self._checkpoint()
                elif self._train_start is not None and time.monotonic() - last_eval >= self.run.eval_every_s:
                    self._evaluate()
                    last_eval = time.monotonic()
            elif self.membership.all_done() or time.monotonic() - stop_at > self.config.stop_grace_s:
                self._train_wall_s = self._elapsed()
                return

    def _evaluate(self) -> tuple[float, float]:
        versions = self.client.pull()
        self.evaluator.load(self.client.values)
        loss, accuracy = self.evaluator.evaluate(self.data.x_test, self.data.y_test)
        updates = round(sum(versions) / len(versions))
        elapsed = self._elapsed()
        with self.progress.lock:
            self.progress.eval_loss, self.progress.eval_accuracy = loss, accuracy
            self.progress.eval_updates = updates
        self._eval_file.write(f"{time.time():.3f},{elapsed:.3f},{updates},{'|'.join(map(str, versions))},"
                              f"{loss:.6f},{accuracy:.6f}\n")
        self._eval_file.flush()
        self._eval_history.append((elapsed, updates, loss, accuracy))
        import tensorflow as tf

        _, recent, _, _ = self.recorder.snapshot()
        with self.writer.as_default(step=updates):
            tf.summary.scalar("eval/loss", loss)
            tf.summary.scalar("eval/accuracy", accuracy)
            tf.summary.scalar("train/updates_per_s", self.progress.updates_per_s)
            if recent:
                tf.summary.histogram("train/staleness", recent)
                tf.summary.scalar("train/mean_staleness", sum(recent) / len(recent))
        self.writer.flush()
        log.info("eval at %d updates: loss %.4f accuracy %.4f", updates, loss, accuracy)
        return loss, accuracy

    def _write_summary(self, final: tuple[float, float]) -> None:
        p = self.progress
        histogram, _, examples, _ = self.recorder.snapshot()
        wall_s = getattr(self, "_train_wall_s", self._elapsed())
        summary: dict[str, Any] = {
            "updates_applied": p.updates,
            "updates_dropped": round(sum(p.dropped) / len(p.dropped)) if p.dropped else 0,
            "staleness": staleness_summary(histogram),
            "throughput_updates_per_s": p.updates / wall_s if wall_s > 0 else 0.0,
            "final_eval": {"loss": final[0], "accuracy": final[1]},
            "wall_s": wall_s,
            "mode": self.run.mode,
            "staleness_policy": self.run.staleness_policy,
            "workers": self.run.num_workers,
            "ps_shards": len(self.config.ps),
            "model": self.run.model,
            "dataset": self.run.dataset,
            "epochs": examples / max(1, len(self.data.x_train)),
            "stop_reason": self.membership.stop_reason,
            "pushes_recorded": self.recorder.pushes_recorded,
            "data": self.ledger.summary(),
            "dropped_by_reason": p.dropped_by_reason,
            "idle_fraction": self.recorder.idle_fractions(),
            "max_clock_lead": p.max_clock_lead,
            "backup_workers": self.run.backup_workers,
            "staleness_bound": self.run.staleness_bound,
            "shards": [{"version": v, "accepted": a, "dropped": d}
                       for v, a, d in zip(p.versions, p.accepted, p.dropped, strict=True)],
        }
        if self.data.optimal_loss is not None:
            train_loss, _ = self.evaluator.evaluate(self.data.x_train, self.data.y_train)
            summary["final_train_loss"] = train_loss
            summary["optimality_gap"] = train_loss - self.data.optimal_loss
        write_json(self.config.run_dir / "summary.json", summary)

    def _export(self) -> None:
        """The final model as a Keras file and a SavedModel that plain TensorFlow can load."""
        t0 = time.monotonic()
        self.model.save(self.config.run_dir / "model.keras")
        self.model.export(str(self.config.run_dir / "saved_model"), verbose=False)
        log.info("exported model.keras and saved_model/ in %.1fs", time.monotonic() - t0)

    def _shutdown_shards(self) -> None:
        for shard in self.client.shards:
            try:
                shard.shutdown("training finished")
            except Exception as exc:  # a shard already gone is fine: we only ask it to exit
                log.warning("could not ask %s to shut down: %s", shard.address, exc)


def run_chief(config: ChiefConfig, interrupt: threading.Event | None = None) -> int:
    """Build and run the chief."""
    return Chief(config, interrupt).serve()
