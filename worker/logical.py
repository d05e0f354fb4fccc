"""Logical workers: several workers as threads of one process, sharing one TensorFlow runtime.

Why: a worker process holds ~700 MB (TensorFlow), so a 24 GB machine runs ~30 of them, while
staleness studies go to λ = 64..256. A logical worker is everything that makes a worker a worker
to the rest of the cluster: its own worker id and registration (so its own index, data tasks,
injected delays, stragglers and slowdowns by its index), its own shard connections (so its own
versions, clock and staleness on the shards), its own heartbeats and telemetry. What the threads
share is the process: the dataset arrays, the model's gradient function (a tf.function, safe to
call from several threads) with TensorFlow's thread pools, the Python interpreter (its GIL) and
the CPU. Killing the process loses exactly its logical workers; the chief notices each one by its
missing heartbeats. A logical worker whose thread fails stops its heartbeats, so the chief
declares that one dead while its siblings go on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncps.worker.build import build_trainer, connect_worker, run_grad_fn
from asyncps.worker.chieflink import ChiefLink
from asyncps.worker.config import WorkerConfig
from asyncps.worker.heartbeat import HeartbeatLoop
from asyncps.worker.outbox import ReportOutbox
from asyncps.worker.start import wait_for_start, warm_up
from asyncps.worker.trainer import GradFn, Telemetry

from asyncps.config import RunConfig
from asyncps.errors import Unreachable
from asyncps.identity import new_worker_id
from asyncps.ml.datasets import Dataset
from asyncps.ml.tfutil import limit_threads, quiet_tensorflow
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.procenv import freeze_heap
from asyncps.runmodel import build_worker_model
from asyncps.transport.coordinator import CoordinatorClient

if TYPE_CHECKING:
    from asyncps.ml.sparse import SparseModel

log = logging.getLogger("asyncps.worker")


@dataclass
class LogicalWorker:
    """One logical worker's identity, telemetry and exit code."""

    link: ChiefLink
    reg: cpb.RegisterResponse
    telemetry: Telemetry = field(default_factory=Telemetry)
    steps_done: list[int] = field(default_factory=lambda: [0])
    beats: HeartbeatLoop | None = None
    warmed: threading.Event = field(default_factory=threading.Event)
    code: int = 0
    steps: int = 0
    outbox: ReportOutbox = field(init=False)  # its numbered reports (asyncps.worker.outbox)

    def __post_init__(self) -> None:
        self.outbox = ReportOutbox(self.link, self.telemetry)


def _register(config: WorkerConfig, coord: CoordinatorClient) -> list[LogicalWorker]:
    workers = []
    for k in range(config.logical):
        index = config.index + k if config.index >= 0 else -1
        link = ChiefLink(coord, f"{new_worker_id('worker', index)}-l{k}", index)
        workers.append(LogicalWorker(link, link.register()))
    return workers


def run_logical_workers(config: WorkerConfig, interrupt: threading.Event | None = None) -> int:
    """Run config.logical workers as threads of this process; the worst exit code of them."""
    quiet_tensorflow()
    coord = CoordinatorClient(config.chief, config.deadline_s, config.security)
    try:
        workers = _register(config, coord)
    except Unreachable as exc:
        log.error("%s", exc)
        coord.close()
        return 2
    run = RunConfig.from_json(workers[0].reg.run_config_json)
    log.info("registered %d logical workers (indices %s) of %d", len(workers),
             ", ".join(str(w.reg.index) for w in workers), workers[0].reg.num_workers)
    stop = interrupt or threading.Event()
    for w in workers:  # heartbeats first: loading TensorFlow can take many seconds
        steps = w.steps_done
        w.beats = HeartbeatLoop(w.link, run.heartbeat_interval_s, config.deadline_s, w.outbox, stop,
                                lambda steps=steps: steps[0])  # type: ignore[misc]
        w.beats.start()
    try:
        return _train_all(config, coord, workers, run, stop)
    finally:
        for w in workers:
            if w.beats is not None:
                w.beats.finished.set()
                w.beats.join(timeout=5)
        coord.close()


def _train_all(config: WorkerConfig, coord: CoordinatorClient, workers: list[LogicalWorker], run: RunConfig,
               stop: threading.Event) -> int:
    """Load the data and the model once, run every logical worker in its thread, report, exit code."""
    limit_threads(run.tf_threads)
    from asyncps.ml.models import seed_random_state  # TensorFlow's: loaded once the workers are registered

    data, model, sparse = build_worker_model(run)
    seed_random_state(model, run.seed, workers[0].reg.index)  # one model, its generators shared by the threads
    grad_fn = run_grad_fn(run, model, sparse)
    freeze_heap()  # set up: later collections skip TensorFlow's objects
    go = threading.Event()
    def run_and_report(w: LogicalWorker) -> None:
        # Each logical worker reports its end as soon as it stops, as a worker process does: a sync
        # quorum waiting for it shrinks at once instead of when its process's last thread is done.
        try:
            _run_one(config, coord, w, run, data, model, grad_fn, stop, go, sparse)
        finally:
            _final_report(coord, w)

    threads = [threading.Thread(target=run_and_report, args=(w,), name=f"logical-{w.reg.index}", daemon=True)
               for w in workers]
    for t in threads:
        t.start()
    for w in workers:  # every thread has computed its warm-up gradient (or failed)
        while not w.warmed.wait(0.5) and not stop.is_set():
            pass
    try:
        ready = [w.link.worker_id for w in workers if w.code == 0]
        if ready and wait_for_start(coord, ready, stop, config.deadline_s):
            go.set()
        else:
            stop.set()
    except Unreachable as exc:
        log.error("%s", exc)
        stop.set()
    for t in threads:
        t.join()
    log.info("logical workers done: %s steps", ", ".join(f"{w.reg.index}: {w.steps}" for w in workers))
    return max((w.code for w in workers), default=0)


def _run_one(config: WorkerConfig, coord: CoordinatorClient, w: LogicalWorker, run: RunConfig, data: Dataset,
             model: Any, grad_fn: GradFn, stop: threading.Event, go: threading.Event,
             sparse: SparseModel | None = None) -> None:
    """One logical worker's life: connect, warm up, pull, wait for the release, train."""
    client = None
    try:
        client = connect_worker(w.link.worker_id, w.reg, model, run, config.security, stop, sparse)
        warm_up(grad_fn, model, data.x_train, data.y_train, run.batch_size)
        if run.start_barrier:  # the values at the release: every planned worker's first gradient reads them
            client.pull()
        w.warmed.set()
        while not go.wait(0.5):
            if stop.is_set():
                return
        trainer = build_trainer(run, w.link, w.reg, client, model=model, data=data, grad_fn=grad_fn,
                                telemetry=w.telemetry, steps_done=w.steps_done, sparse=sparse)
        try:
            trainer.run(stop, config.max_steps, pulled=run.start_barrier)
        finally:
            w.steps = trainer.step
    except Unreachable as exc:
        log.error("logical worker %d: %s", w.reg.index, exc)
        w.code = 3
    except Exception:  # this logical worker dies alone: its heartbeats stop, the chief notices
        log.exception("logical worker %d failed", w.reg.index)
        w.code = 1
        if w.beats is not None:
            w.beats.finished.set()
    finally:
        w.warmed.set()
        if client is not None:
            client.close()


def _final_report(coord: CoordinatorClient, w: LogicalWorker) -> None:
    """The last telemetry of a logical worker, marking it finished (not for one that failed)."""
    if w.beats is not None:
        w.beats.finished.set()
        w.beats.join(timeout=5)
        if w.beats.lost_chief:
            w.code = max(w.code, 3)
            return
    if w.code == 1:
        return
    try:
        w.outbox.send(final=True, deadline_s=10.0)
    except Unreachable as exc:
        log.warning("final report of logical worker %d not delivered: %s", w.reg.index, exc)
