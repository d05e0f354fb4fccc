"""What the chief knows about the run's progress: shard counters, update rate, training time."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncps.transport import ShardTransport

log = logging.getLogger("asyncps.chief")


@dataclass
class Progress:
    """What the control loop knows about the run, read by GetStatus (guarded by a lock)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    versions: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)
    bytes_pushed: list[int] = dataclasses.field(default_factory=list)
    bytes_pulled: list[int] = dataclasses.field(default_factory=list)
    # per shard: transport -> {"pushed": bytes, "pulled": bytes}
    bytes_by_transport: list[dict[str, dict[str, int]]] = dataclasses.field(default_factory=list)
    # per shard: the answers to pushes its state has given, by worker index (asyncps.ps.store.Answers)
    answers: list[int] = dataclasses.field(default_factory=list)
    answers_by_worker: list[dict[int, int]] = dataclasses.field(default_factory=list)
    dropped_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    max_clock_lead: float = 0.0
    reads_refused: dict[str, int] = dataclasses.field(default_factory=dict)  # SSP: by why, over shards
    updates_per_s: float = 0.0
    eval_loss: float = math.nan
    eval_accuracy: float = math.nan  # NaN too when the task is not classification
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the task's metrics, by name
    eval_updates: int = 0
    done: bool = False

    @property
    def updates(self) -> int:
        """Applied updates: the mean over shards of accepted pushes (each step pushes to all)."""
        return round(sum(self.accepted) / len(self.accepted)) if self.accepted else 0


class TrainClock:
    """Training time: it starts at the first applied update and stops when the control loop ends."""

    def __init__(self, before_s: float = 0.0) -> None:
        """`before_s`: training time of earlier chiefs of this run (a restarted chief continues it)."""
        self._before_s = before_s
        self._start: float | None = None
        self._wall_s: float | None = None

    @property
    def started(self) -> bool:
        """Whether the first update was applied."""
        return self._start is not None

    def observe(self, updates: int) -> None:
        """Start the clock at the first update."""
        if self._start is None and updates > 0:
            self._start = time.monotonic()  # training time starts at the first update

    def elapsed(self) -> float:
        """Seconds of training: earlier chiefs' time, plus this one's since its first update."""
        return self._before_s + (0.0 if self._start is None else time.monotonic() - self._start)

    def stop(self) -> None:
        """The control loop ended: freeze the training wall time."""
        self._wall_s = self.elapsed()

    def wall_s(self) -> float:
        """The training wall time: frozen at stop, or the time so far."""
        return self._wall_s if self._wall_s is not None else self.elapsed()


class ShardPoller:
    """Reads every shard's counters into Progress; an empty (restarted) shard is handed to `recover`."""

    def __init__(self, shards: Sequence[ShardTransport], addresses: Sequence[str], deadline_s: float,
                 progress: Progress, recover: Callable[[int], None]) -> None:
        self._shards = shards
        self._addresses = addresses
        self._deadline_s = deadline_s
        self._progress = progress
        self._recover = recover
        self._last_poll: float | None = None

    def poll(self) -> None:
        """One round of stats over all shards."""
        stats = [s.stats(deadline_s=self._deadline_s) for s in self._shards]
        for shard, st in enumerate(stats):
            if not st.initialized:
                log.warning("shard %d at %s is empty (restarted): recovering", shard, self._addresses[shard])
                self._recover(shard)
                stats[shard] = self._shards[shard].stats(deadline_s=self._deadline_s)
        p = self._progress
        with p.lock:
            before, t_before = p.updates, self._last_poll
            p.versions = [s.version for s in stats]
            p.accepted = [s.pushes_accepted for s in stats]
            p.dropped = [s.pushes_dropped for s in stats]
            p.bytes_pushed = [s.bytes_pushed for s in stats]
            p.bytes_pulled = [s.bytes_pulled for s in stats]
            p.bytes_by_transport = [s.bytes_by_transport() for s in stats]
            p.answers = [s.answers for s in stats]
            p.answers_by_worker = [dict(s.answers_by_worker) for s in stats]
            reasons: dict[str, int] = {}
            for s in stats:
                for reason, count in s.dropped_by_reason.items():
                    reasons[reason] = reasons.get(reason, 0) + count
            p.dropped_by_reason = reasons
            p.max_clock_lead = max((s.mode_stats.get("max_clock_lead", 0.0) for s in stats), default=0.0)
            refused: dict[str, int] = {}
            for st in stats:
                for key, value in st.mode_stats.items():
                    if key.startswith("refused_"):
                        why = key.removeprefix("refused_")
                        refused[why] = refused.get(why, 0) + int(value)
            p.reads_refused = refused
            now = time.monotonic()
            if t_before is not None and now > t_before:
                rate = (p.updates - before) / (now - t_before)
                p.updates_per_s = rate if p.updates_per_s == 0 else 0.7 * p.updates_per_s + 0.3 * rate
            self._last_poll = now
