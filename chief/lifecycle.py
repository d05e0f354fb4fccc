"""The run's lifecycle: the run directory and the Coordinator server at the start, the stop
condition, the final model export, and the shutdown of the server and the shards."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.chief.config import ChiefConfig
from asyncps.chief.progress import Progress, TrainClock
from asyncps.chief.tasks import TaskLedger

from asyncps.config import resume_changes
from asyncps.ml.stopat import EarlyStopWatch, parse_early_stop, parse_stop_at
from asyncps.net.rpc import create_server, serve_health
from asyncps.net.security import exposure_warning
from asyncps.pb import coordinator_pb2_grpc
from asyncps.rundir import INTERRUPTED, Provenance, RunConfigRecord, RunDir, exported_model, write_port_file

if TYPE_CHECKING:
    import grpc

    from asyncps.net.health import HealthServicer
    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.chief")

# The chief's exit codes: launchers restart a chief that exited otherwise (a crash, a kill).
EXIT_DONE = 0
EXIT_UNREACHABLE = 2  # a shard stayed unreachable at start
EXIT_SHARD_STATE = 4  # the shards' state cannot be used: another run's, or lost with no checkpoint
EXIT_DIVERGED = 5  # every live worker had max_nonfinite_steps consecutive non-finite steps (summary written)
EXIT_NO_WORKERS = 6  # no worker alive for idle_without_workers_s (summary written)
EXIT_HANDED_OVER = 143  # SIGTERM with --on-sigterm handover: the run goes on under the next chief (128 + 15)
FINAL_EXIT_CODES = frozenset({EXIT_DONE, EXIT_UNREACHABLE, EXIT_SHARD_STATE, EXIT_DIVERGED, EXIT_NO_WORKERS})


def check_resume(config: ChiefConfig, resuming: bool) -> bool:
    """On a resumed run (`resuming`: the directory has a manifest; or --resume), compare the settings with
    those its config.json recorded: a run-defining one changed is a ValueError naming it with both values;
    return True for a changed shard layout (a reshard: the shards get the latest checkpoint, never kept live)."""
    record = RunConfigRecord.load_if_present(config.run_dir) if resuming or config.resume else None
    if record is None:
        return False
    changes = resume_changes(record.run, config.run)
    if changes.refused:
        raise ValueError(changes.refusal(config.run_dir, RunDir(config.run_dir).config))
    if changes.reshard:
        log.info("resharding (%s): the shards get the latest checkpoint", "; ".join(changes.reshard))
    return bool(changes.reshard)


def prepare_run_dir(config: ChiefConfig, provenance: Provenance) -> None:
    """The run directory with its config.json (settings and provenance) and the TensorBoard folder."""
    run_dir = config.run_dir
    RunDir(run_dir).tensorboard.mkdir(parents=True, exist_ok=True)
    RunConfigRecord.of(config.run, config.ps, run_dir, provenance).save(run_dir)


def save_model(model: Any, out_dir: Path) -> None:
    """out_dir/model.keras and out_dir/saved_model, a SavedModel that plain TensorFlow can load."""
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save(exported_model(out_dir))
    model.export(str(out_dir / "saved_model"), verbose=False)
    log.info("exported model.keras and saved_model/ to %s in %.1fs", out_dir, time.monotonic() - t0)


def export_model(model: Any, config: ChiefConfig) -> None:
    """The final model into the run directory."""
    save_model(model, config.run_dir)


class Lifecycle:
    """Starts the Coordinator server, says when the run must stop, and shuts everything down."""

    def __init__(self, config: ChiefConfig, interrupt: threading.Event, progress: Progress, clock: TrainClock,
                 ledger: TaskLedger, client: ModelClient) -> None:
        self._config = config
        self._run = config.run
        self._interrupt = interrupt
        self._progress = progress
        self._clock = clock
        self._ledger = ledger
        self._client = client
        self._server: grpc.Server | None = None
        self._health: HealthServicer | None = None
        self._probe: grpc.Server | None = None  # the plaintext health server (--health-port)
        self._stop_at = parse_stop_at(self._run.stop_at)
        early = parse_early_stop(self._run.early_stop)
        self._early = EarlyStopWatch(early) if early is not None else None
        self._early_seen: tuple[int, float] | None = None  # the last evaluation the early-stop rule took

    def start(self, servicer: coordinator_pb2_grpc.CoordinatorServicer) -> int:
        """Serve the Coordinator service; write the port file; return the bound port."""
        config = self._config
        self._server, port, self._health = create_server(
            f"{config.host}:{config.port}",
            [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)],
            interceptors=config.security.server_interceptors(),
            credentials=config.security.server_credentials())
        if config.health_port is not None:
            self._probe, probe_port = serve_health(f"{config.host}:{config.health_port}", self._health)
            log.info("chief: health service in plaintext on port %d", probe_port)
        log.info("chief serving on port %d of %s (%s); waiting for %d workers", port, config.host,
                 config.security.describe(), self._run.num_workers)
        exposed = exposure_warning("the chief", f"{config.host}:{port}", config.security)
        if exposed:
            log.warning("%s", exposed)
        write_port_file(config.port_file, port)
        return port

    def stop_reason(self) -> str | None:
        """Why the run must stop now (interrupt, updates, epochs or time reached), or None."""
        run, p = self._run, self._progress
        if self._interrupt.is_set():
            return INTERRUPTED
        requested = self._stop_requested()
        if requested is not None:
            return requested
        if run.max_updates and p.updates >= run.max_updates:
            return f"reached {run.max_updates} updates"
        if run.epochs and self._ledger.finished():
            return f"reached {run.epochs:g} epochs (every data task done)"
        if run.max_training_s and self._clock.elapsed() >= run.max_training_s:
            return f"reached {run.max_training_s:g} s"
        return self._level_reached()

    def _stop_requested(self) -> str | None:
        """The run directory's stop request (asyncps.train: a callback set stop_training), consumed: its reason."""
        path = RunDir(self._config.run_dir).stop_request
        try:
            why = path.read_text().strip()
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        return f"stop requested: {why or 'no reason given'}"

    def _level_reached(self) -> str | None:
        """--stop-at: why the last evaluation ends the run, or None (the chief refused at start a metric its
        evaluation does not report: asyncps.chief.main.check_stop_at)."""
        stop_at, p = self._stop_at, self._progress
        if stop_at is None and self._early is None:
            return None
        with p.lock:
            loss, accuracy, metrics, updates = p.eval_loss, p.eval_accuracy, dict(p.eval_metrics), p.eval_updates
        if math.isnan(loss):  # no evaluation yet
            return None
        if stop_at is not None and stop_at.met(loss, accuracy, metrics):
            return f"reached {stop_at.describe()} (evaluation at {updates} updates)"
        return self._early_stopped(loss, accuracy, metrics, updates)

    def _early_stopped(self, loss: float, accuracy: float, metrics: dict[str, float], updates: int) -> str | None:
        """--early-stop: each evaluation taken once; why the rule ends the run, or None."""
        if self._early is None or self._early_seen == (updates, loss):
            return None
        self._early_seen = (updates, loss)
        if self._early.observe(loss, accuracy, metrics):
            return (f"early stopping: {self._early.rule.describe()} (best {self._early.best:g}; evaluation at "
                    f"{updates} updates)")
        return None

    def fraction_done(self, updates: int) -> float:
        """Share of the run done, 0..1: the stop condition nearest to being met; -1 with none."""
        run = self._run
        shares = []
        if run.max_updates:
            shares.append(updates / run.max_updates)
        if run.epochs:
            shares.append(self._ledger.fraction_done())
        if run.max_training_s:
            shares.append(self._clock.elapsed() / run.max_training_s)
        return min(1.0, max(shares)) if shares else -1.0

    def shutdown(self, keep_shards: bool = False, reason: str = "training finished") -> None:
        """Ask the shards to exit, telling them `reason` (unless keep_shards: a handover, or a chief that stops
        before the run's end and leaves them to the next one), stop serving, close the shard channels."""
        if not keep_shards:
            self._shutdown_shards(reason)
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace=2.0).wait()
        if self._probe is not None:
            self._probe.stop(grace=None)
        self._client.close()

    def _shutdown_shards(self, reason: str) -> None:
        for shard in self._client.shards:
            try:
                shard.shutdown(reason)
            except Exception as exc:  # a shard already gone is fine: we only ask it to exit
                log.warning("could not ask %s to shut down: %s", shard.address, exc)
