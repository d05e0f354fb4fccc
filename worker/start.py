"""A worker's start: one warm-up gradient (not pushed), then the chief's start barrier.

Why: the first call of the gradient function traces it (0.5-2 s on a busy machine); done before the
barrier, that cost no longer lands on a worker's first real step, and every planned worker begins
training at the same moment (see asyncps.chief.startgate).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from asyncps.worker.trainer import GradFn

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.transport.coordinator import CoordinatorClient

log = logging.getLogger("asyncps.worker")

#: How long one WaitStart call may be held by the chief before the worker asks again.
START_POLL_S = 5.0


def warm_up(grad_fn: GradFn, model: Any, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], batch_size: int) -> float:
    """One gradient at the model's initial values on the first batch of the data; its seconds."""
    started = time.monotonic()
    from asyncps.ml.models import shard_variables

    values = [np.asarray(v.numpy()) for v in shard_variables(model)]
    grad_fn(values, x[:batch_size], y[:batch_size])
    return time.monotonic() - started


def wait_for_start(coord: CoordinatorClient, worker_ids: Sequence[str], stop: threading.Event,
                   deadline_s: float) -> bool:
    """Tell the chief these members are ready; block until it releases the run and the moment it
    names has come (True), or the run stops first (False). Ends the wait early when `stop` is set
    (chief's STOP on a heartbeat, a signal)."""
    started = time.monotonic()
    while not stop.is_set():
        reply = coord.wait_start(worker_ids, START_POLL_S, deadline_s)
        if reply.released:
            stop.wait(max(0.0, reply.start_at - time.time()))
            log.info("released by the start barrier after %.1fs (%d planned workers ready)",
                     time.monotonic() - started, reply.ready)
            return True
        if reply.command == cpb.STOP:
            return False
        log.info("start barrier: %d of %d planned workers ready", reply.ready, reply.planned)
    return False
