"""The run's telemetry: push records, step timings, staleness statistics, written as CSV."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from pathlib import Path

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rundir import PUSHES_CSV, TIMELINE_CSV, PushRow, RowWriter, StepRow
from asyncps.wire import drop_from_wire


class Recorder:
    """Appends telemetry to pushes.csv and timeline.csv and keeps running statistics."""

    def __init__(self, run_dir: Path, append: bool = False) -> None:
        self._lock = threading.Lock()
        # a resumed run continues the same files
        self._pushes = RowWriter(run_dir / PUSHES_CSV, PushRow, append=append)
        self._steps = RowWriter(run_dir / TIMELINE_CSV, StepRow, append=append)
        self.staleness: collections.Counter[int] = collections.Counter()
        self.recent_staleness: collections.deque[int] = collections.deque(maxlen=4096)
        self.dropped_reasons: collections.Counter[str] = collections.Counter()
        self.examples = 0
        self.busy_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.wait_s: collections.defaultdict[int, float] = collections.defaultdict(float)
        self.pushes_recorded = 0
        self.last_loss = float("nan")

    def add(self, worker: int, pushes: Sequence[cpb.PushRecord], steps: Sequence[cpb.StepTiming]) -> None:
        """Record one report from a worker."""
        with self._lock:
            for p in pushes:
                drop = drop_from_wire(p.drop)
                kind = drop.value if drop is not None else ""
                self._pushes.write(PushRow(p.wall_time, worker, p.shard, p.step, p.base_version, p.version,
                                           p.staleness, p.accepted, kind, p.effective_lr, p.loss, p.drop_detail))
                self.staleness[p.staleness] += 1
                self.recent_staleness.append(p.staleness)
                if drop is not None:
                    self.dropped_reasons[drop.value] += 1
                self.last_loss = p.loss
            for s in steps:
                self._steps.write(StepRow(worker, s.step, s.start, s.pull_s, s.compute_s, s.push_s, s.wait_s,
                                          s.examples))
                self.examples += s.examples
                self.busy_s[worker] += s.pull_s + s.compute_s + s.push_s
                self.wait_s[worker] += s.wait_s
            self.pushes_recorded += len(pushes)

    def snapshot(self) -> tuple[dict[int, int], list[int], int, float]:
        """(staleness histogram, recent staleness values, examples seen, last worker loss)."""
        with self._lock:
            return dict(self.staleness), list(self.recent_staleness), self.examples, self.last_loss

    def idle_fractions(self) -> dict[int, float]:
        """Per worker: the share of its step time spent held back by the consistency model."""
        with self._lock:
            return {w: self.wait_s[w] / (self.busy_s[w] + self.wait_s[w])
                    for w in sorted(self.busy_s) if self.busy_s[w] + self.wait_s[w] > 0}

    def close(self) -> None:
        """Flush and close the CSV files."""
        with self._lock:
            self._pushes.close()
            self._steps.close()
