"""A worker's heartbeats: its liveness and telemetry to the chief, and the chief's stop back."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from asyncps.worker.chieflink import ChiefLink
from asyncps.worker.outbox import ReportOutbox

from asyncps.errors import AsyncpsError, Unreachable
from asyncps.pb import coordinator_pb2 as cpb

log = logging.getLogger("asyncps.worker")


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
