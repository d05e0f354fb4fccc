"""The worker's calls to the chief, across chief restarts.

A chief that was killed and started again knows no worker: it answers NOT_FOUND until the worker
registers again. The link then registers again under the same worker id and index (so the data
tasks this worker holds stay its own in the new chief's ledger) and repeats the call once. While
the chief is down the calls are retried (UNAVAILABLE) up to the chief timeout; past it they raise
Unreachable and the worker exits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from asyncps.errors import NotFoundError, Unreachable
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.transport.coordinator import CoordinatorClient

log = logging.getLogger("asyncps.worker")

T = TypeVar("T")


class ChiefLost(Unreachable):
    """The chief stayed unreachable for the whole chief timeout."""


class ChiefLink:
    """Heartbeats, reports and task requests that survive a chief restart (thread-safe)."""

    def __init__(self, coord: CoordinatorClient, worker_id: str, index: int) -> None:
        self.coord = coord
        self.worker_id = worker_id
        self.index = index  # the index to ask for again: the one the first chief gave
        self._lock = threading.Lock()
        self.registrations = 0
        self._task_requests = 0  # numbers this worker's task requests (TaskRequest.seq)

    def register(self) -> cpb.RegisterResponse:
        """Register (again) with the chief under this worker id and index."""
        with self._lock:
            reply = self.coord.register(self.worker_id, "worker", self.index)
            self.index = reply.index
            self.registrations += 1
            return reply

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return self._once(fn)
        except Unreachable as exc:
            raise ChiefLost(str(exc)) from exc

    def _once(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except NotFoundError as exc:
            log.warning("the chief does not know this worker (%s): it restarted; registering again as worker %d",
                        exc, self.index)
            self.register()
            return fn()

    def heartbeat(self, step: int, deadline_s: float | None = None) -> cpb.HeartbeatResponse:
        """Say this worker is alive; the reply says continue or stop."""
        return self._call(lambda: self.coord.heartbeat(self.worker_id, "worker", step, deadline_s))

    def report(self, pushes: Sequence[cpb.PushRecord], steps: Sequence[cpb.StepTiming], final: bool = False,
               deadline_s: float | None = None, completed_tasks: Sequence[int] = (),
               seq: int = 0) -> cpb.ReportResponse:
        """Send telemetry and completed data tasks (report number `seq`, asyncps.worker.outbox)."""
        return self._call(lambda: self.coord.report(self.worker_id, self.index, pushes, steps, final, deadline_s,
                                                    completed_tasks, seq))

    def get_task(self) -> cpb.TaskReply:
        """The next data task for this worker (a timed-out request is sent again under its number)."""
        with self._lock:
            self._task_requests += 1
            seq = self._task_requests
        return self._call(lambda: self.coord.get_task(self.worker_id, seq=seq))


__all__ = ["ChiefLink", "ChiefLost"]
