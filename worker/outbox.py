"""The worker's reports to the chief: numbered, and each re-sent unchanged until the chief answers it.

A report the chief recorded but never answered (it was killed in between) reaches the next chief
again; the chief recognizes it by its number (ReportRequest.seq, per worker id) and does not record
it twice (asyncps.chief.reportlog). That works only if a re-sent report is the same report: so an
unanswered report is kept whole and sent again, first, before anything queued since is numbered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from asyncps.worker.chieflink import ChiefLink
from asyncps.worker.trainer import Telemetry

from asyncps.pb import coordinator_pb2 as cpb


@dataclass(frozen=True)
class Report:
    """One numbered report, as sent (and as re-sent)."""

    seq: int
    pushes: list[cpb.PushRecord]
    steps: list[cpb.StepTiming]
    completed_tasks: list[int]
    final: bool


class ReportOutbox:
    """Sends the telemetry queued in `telemetry` to the chief as numbered reports (thread-safe)."""

    def __init__(self, link: ChiefLink, telemetry: Telemetry) -> None:
        self._link = link
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self.seq = 0  # the number of the last report made
        self.unanswered: Report | None = None  # made and sent, not yet answered: sent again first

    def send(self, final: bool = False, deadline_s: float | None = None) -> cpb.ReportResponse | None:
        """Deliver the unanswered report, then one of everything queued (a final one even when empty);
        None when there was nothing to send. An error leaves the report it failed on unanswered."""
        with self._lock:
            reply = self._deliver(deadline_s) if self.unanswered is not None else None
            pushes, steps = self._telemetry.drain()
            tasks = self._telemetry.drain_tasks()
            if not (pushes or steps or tasks or final):
                return reply
            self.seq += 1
            self.unanswered = Report(self.seq, pushes, steps, tasks, final)
            return self._deliver(deadline_s)

    def _deliver(self, deadline_s: float | None) -> cpb.ReportResponse:
        report = self.unanswered
        assert report is not None
        reply = self._link.report(report.pushes, report.steps, report.final, deadline_s, report.completed_tasks,
                                  seq=report.seq)
        self.unanswered = None
        return reply


__all__ = ["Report", "ReportOutbox"]
