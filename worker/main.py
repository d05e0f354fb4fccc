"""Worker process: register with the chief, train until told to stop, report telemetry."""

from __future__ import annotations

import logging
import threading

from asyncps.worker.build import build_trainer, connect_worker, run_grad_fn
from asyncps.worker.chieflink import ChiefLink, ChiefLost
from asyncps.worker.config import WorkerConfig
from asyncps.worker.heartbeat import HeartbeatLoop
from asyncps.worker.logical import run_logical_workers
from asyncps.worker.outbox import ReportOutbox
from asyncps.worker.start import wait_for_start, warm_up
from asyncps.worker.trainer import Telemetry

from asyncps.config import RunConfig
from asyncps.errors import Unreachable
from asyncps.identity import new_worker_id
from asyncps.ml.tfutil import limit_threads, quiet_tensorflow
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.procenv import freeze_heap
from asyncps.runmodel import build_worker_model
from asyncps.transport.coordinator import CoordinatorClient

log = logging.getLogger("asyncps.worker")


def run_worker(config: WorkerConfig, interrupt: threading.Event | None = None) -> int:
    """Run one worker (or config.logical logical workers) to completion; return the exit code."""
    if config.logical > 1:
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


def _train(config: WorkerConfig, link: ChiefLink, reg: cpb.RegisterResponse, run: RunConfig,
           telemetry: Telemetry, stop: threading.Event, beats: HeartbeatLoop, steps_done: list[int],
           outbox: ReportOutbox) -> int:
    """Build the model and data, train until stopped, send the final report; return the exit code."""
    limit_threads(run.tf_threads)
    from asyncps.ml.models import seed_random_state  # TensorFlow's: loaded once the worker is registered

    data, model, sparse = build_worker_model(run)
    seed_random_state(model, run.seed, reg.index)  # dropout masks of its own, reproducibly
    client = connect_worker(link.worker_id, reg, model, run, config.security, stop, sparse)
    log.info("injected delays: %s", run.step_delay(reg.index).describe())
    grad_fn = run_grad_fn(run, model, sparse)
    log.info("warm-up gradient (traces the function): %.2fs",
             warm_up(grad_fn, model, data.x_train, data.y_train, run.batch_size))
    freeze_heap()  # set up: later collections skip TensorFlow's objects
    trainer = build_trainer(run, link, reg, client, model=model, data=data, grad_fn=grad_fn, telemetry=telemetry,
                            steps_done=steps_done, sparse=sparse)
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
    if client.row_cache is not None:
        c = client.row_cache.counts
        log.info("row cache (S=%d): %d of %d rows served from the cache (hit rate %.3f), %.1f MB not pulled",
                 client.row_cache.staleness, c.hits, c.rows, c.hit_rate, c.bytes_saved / 1e6)
    return code
