"""Worker process: register with the chief, train until told to stop, report telemetry."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncps.worker.chieflink import ChiefLink, ChiefLost
from asyncps.worker.outbox import ReportOutbox
from asyncps.worker.trainer import Telemetry

from asyncps.config import RunConfig
from asyncps.errors import AsyncpsError
from asyncps.identity import new_worker_id
from asyncps.ml.tfutil import limit_threads, quiet_tensorflow
from asyncps.net.rpc import Unreachable
from asyncps.net.security import SecurityConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.procenv import freeze_heap
from asyncps.transport.coordinator import CoordinatorClient

if TYPE_CHECKING:
    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker process reaches the cluster."""

    chief: str
    index: int = -1  # -1: the chief assigns one
    deadline_s: float = 60.0  # how long to keep trying an unreachable chief (the chief timeout)
    max_steps: int = 0  # stop on its own after this many steps (0: only when the chief says)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    logical: int = 1  # logical workers (threads) in this process: indices index .. index+logical-1

    def __post_init__(self) -> None:
        if not self.chief:
            raise ValueError("worker needs the chief's address (--chief HOST:PORT)")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        if self.logical < 1:
            raise ValueError("logical must be >= 1")


class HeartbeatLoop(threading.Thread):
    """Sends heartbeats and telemetry to the chief; sets `stop` when the chief says so."""

    def __init__(self, link: ChiefLink, interval_s: float, deadline_s: float, outbox: ReportOutbox,
                 stop: threading.Event, step_of: Callable[[], int]) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._link = link
        self._interval_s, self._deadline_s = interval_s, deadline_s
        self._outbox = outbox
        self._stop_event = stop
        self._step_of = step_of
        self.finished = threading.Event()
        self.lost_chief: str | None = None

    def run(self) -> None:
        """Beat until stopped; losing the chief for deadline_s stops the worker with a reason."""
        while not self.finished.wait(self._interval_s):
            try:
                reply = self._link.heartbeat(self._step_of(), self._deadline_s)
                self._outbox.send(deadline_s=self._deadline_s)  # what is not delivered is sent again next time
            except Unreachable as exc:
                self.lost_chief = str(exc)
                self._stop_event.set()
                return
            except AsyncpsError as exc:  # e.g. a chief shutting down: the next beat tells
                log.warning("heartbeat failed: %s", exc)
                continue
            if reply.command == cpb.STOP:
                log.info("chief says stop: %s", reply.reason)
                self._stop_event.set()


def run_worker(config: WorkerConfig, interrupt: threading.Event | None = None) -> int:
    """Run one worker (or config.logical logical workers) to completion; return the exit code."""
    if config.logical > 1:
        from asyncps.worker.logical import run_logical_workers

        return run_logical_workers(config, interrupt)
    quiet_tensorflow()
    worker_id = new_worker_id("worker", config.index)
    coord = CoordinatorClient(config.chief, config.deadline_s, config.security)
    link = ChiefLink(coord, worker_id, config.index)
    try:
        reg = link.register()
    except Unreachable as exc:
        log.error("%s", exc)
        return 2
    run = RunConfig.from_json(reg.run_config_json)
    log.info("registered as worker %d of %d (%s); shards: %s", reg.index, reg.num_workers, worker_id,
             ", ".join(reg.ps_addresses))
    # Heartbeats start now: loading TensorFlow, the data and the model can take many seconds on
    # a busy machine, and a silent worker would be declared dead (and its index reused).
    telemetry = Telemetry()
    stop = interrupt or threading.Event()
    steps_done = [0]
    outbox = ReportOutbox(link, telemetry)
    beats = HeartbeatLoop(link, run.heartbeat_interval_s, config.deadline_s, outbox, stop, lambda: steps_done[0])
    beats.start()
    try:
        return _train(config, link, reg, run, telemetry, stop, beats, steps_done, outbox)
    finally:
        beats.finished.set()
        beats.join(timeout=5)
        coord.close()


def connect_worker(worker_id: str, reg: cpb.RegisterResponse, model: Any, run: RunConfig,
                   security: SecurityConfig, stop: threading.Event | None = None) -> ModelClient:
    """A worker's client to every shard, as the run says: placement, transport, its index, and for a
    sync run over several shards shard 0 deciding each step (every worker of a process or a logical one).
    Once `stop` is set (the chief said stop, or is gone) a failing shard call is not retried: shards
    that lost the chief exit too, and the worker must not wait out rpc_deadline_s for them."""
    from asyncps.placement import VariableSpec, place
    from asyncps.transport import connect_model

    specs = [VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in model.trainable_variables]
    placement = place(specs, len(reg.ps_addresses), run.slice_threshold_bytes)
    return connect_model(worker_id, list(reg.ps_addresses), placement, run.rpc_deadline_s, run.chunk_bytes,
                         security, transport=run.transport, worker_index=reg.index,
                         coordinated=run.update_rule().consistency().coordinated, abort=stop)


def _train(config: WorkerConfig, link: ChiefLink, reg: cpb.RegisterResponse, run: RunConfig,
           telemetry: Telemetry, stop: threading.Event, beats: HeartbeatLoop, steps_done: list[int],
           outbox: ReportOutbox) -> int:
    """Build the model and data, train until stopped, send the final report; return the exit code."""
    limit_threads(run.tf_threads)

    from asyncps.worker.local import local_model
    from asyncps.worker.start import wait_for_start, warm_up
    from asyncps.worker.trainer import TaskBatches, Trainer, make_grad_fn

    from asyncps.ml.models import make_loss
    from asyncps.runmodel import build_run_model

    data, model = build_run_model(run)
    names = [v.path for v in model.trainable_variables]
    batches = TaskBatches(link.get_task, data.x_train, data.y_train, run.batch_size, run.seed)
    client = connect_worker(link.worker_id, reg, model, run, config.security, stop)
    delay = run.step_delay(reg.index)
    log.info("injected delays: %s", delay.describe())
    grad_fn = make_grad_fn(model, make_loss(run.loss, model))
    log.info("warm-up gradient (traces the function): %.2fs",
             warm_up(grad_fn, model, data.x_train, data.y_train, run.batch_size))
    freeze_heap()  # set up: later collections skip TensorFlow's objects
    trainer = Trainer(client, names, grad_fn, batches, delay, telemetry,
                      read_wait_s=run.read_wait_s, on_step=lambda step: steps_done.__setitem__(0, step),
                      pipeline=run.pipeline, local=local_model(run, names))
    code = 0
    lost: str | None = None
    try:
        if run.start_barrier:  # the values at the release: every planned worker's first gradient reads them
            client.pull()
        if wait_for_start(link.coord, [link.worker_id], stop, config.deadline_s):
            trainer.run(stop, config.max_steps, pulled=run.start_barrier)
    except ChiefLost as exc:  # a task request gave up on the chief (said once, below)
        lost = str(exc)
    except Unreachable as exc:
        log.error("%s", exc)
        code = 3
    finally:
        beats.finished.set()
        beats.join(timeout=1 if lost else 5)  # a beat still retrying a lost chief need not be awaited
        client.close()
    lost = beats.lost_chief or lost
    if lost:
        log.error("the chief is gone: %s; exiting", lost)
        return 3
    try:
        outbox.send(final=True, deadline_s=config.deadline_s)
    except Unreachable as exc:
        log.warning("final report not delivered: %s", exc)
    log.info("worker %d done after %d steps", reg.index, trainer.step)
    return code
