"""The run's telemetry: push records, step timings, staleness statistics, written as CSV."""

from __future__ import annotations

import collections
import csv
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.wire import drop_from_wire

PUSH_COLUMNS = ["wall_time", "worker", "shard", "step", "base_version", "version", "staleness",
                "accepted", "drop_reason", "effective_lr", "loss", "drop_detail"]
STEP_COLUMNS = ["worker", "step", "start", "pull_s", "compute_s", "push_s", "wait_s", "examples"]


def staleness_summary(histogram: dict[int, int]) -> dict[str, Any]:
    """mean, p50, p95, max and the histogram of integer staleness counts."""
    total = sum(histogram.values())
    if total == 0:
        return {"mean": 0.0, "p50": 0, "p95": 0, "max": 0, "count": 0, "histogram": {}}
    keys = sorted(histogram)

    def quantile(q: float) -> int:
        target, seen = q * total, 0
        for k in keys:
            seen += histogram[k]
            if seen >= target:
                return k
        return keys[-1]

    return {
        "mean": sum(k * c for k, c in histogram.items()) / total,
        "p50": quantile(0.5),
        "p95": quantile(0.95),
        "max": keys[-1],
        "count": total,
        "histogram": {str(k): histogram[k] for k in keys},
    }


class Recorder:
    """Appends telemetry to pushes.csv and timeline.csv and keeps running statistics."""

    def __init__(self, run_dir: Path, append: bool = False) -> None:
        self._lock = threading.Lock()
        pushes, steps = run_dir / "pushes.csv", run_dir / "timeline.csv"
        # a resumed run continues the same files
        new_pushes, new_steps = not (append and pushes.exists()), not (append and steps.exists())
        self._push_file: IO[str] = open(pushes, "w" if new_pushes else "a", newline="")  # noqa: SIM115
        self._step_file: IO[str] = open(steps, "w" if new_steps else "a", newline="")  # noqa: SIM115
        self._pushes = csv.writer(self._push_file)
        self._steps = csv.writer(self._step_file)
        if new_pushes:
            self._pushes.writerow(PUSH_COLUMNS)
        if new_steps:
            self._steps.writerow(STEP_COLUMNS)
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
                self._pushes.writerow([f"{p.wall_time:.6f}", worker, p.shard, p.step, p.base_version,
                                       p.version, p.staleness, int(p.accepted), kind,
                                       f"{p.effective_lr:.6g}", f"{p.loss:.6g}", p.drop_detail])
                self.staleness[p.staleness] += 1
                self.recent_staleness.append(p.staleness)
                if drop is not None:
                    self.dropped_reasons[drop.value] += 1
                self.last_loss = p.loss
            for s in steps:
                self._steps.writerow([worker, s.step, f"{s.start:.6f}", f"{s.pull_s:.6f}",
                                      f"{s.compute_s:.6f}", f"{s.push_s:.6f}", f"{s.wait_s:.6f}",
                                      s.examples])
                self.examples += s.examples
                self.busy_s[worker] += s.pull_s + s.compute_s + s.push_s
                self.wait_s[worker] += s.wait_s
            self.pushes_recorded += len(pushes)

    def snapshot(self) -> tuple[dict[int, int], list[int], int, float]:
        """(staleness histogram, recent staleness values, examples seen, last worker loss)."""
        with self._lock:
            return dict(self.staleness), list(self.recent_staleness), self.examples, self.last_loss

    def idle_fractions(self) -> dict[str, float]:
        """Per worker: the share of its step time spent held back by the consistency model."""
        with self._lock:
            return {str(w): self.wait_s[w] / (self.busy_s[w] + self.wait_s[w])
                    for w in sorted(self.busy_s) if self.busy_s[w] + self.wait_s[w] > 0}

    def close(self) -> None:
        """Flush and close the CSV files."""
        with self._lock:
            self._push_file.close()
            self._step_file.close()
