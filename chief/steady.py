"""Steady-state staleness: the pushes after every planned worker's first push.

Why: the whole-run mean mixes in the start, when fewer than the planned workers push (staleness
below λ - 1) and the first round's pushes all read the initial values (staleness 0 .. λ - 1). The
steady figure counts only pushes made after the last planned worker's first push (by the workers'
wall clocks; same-host clocks in `asyncps local`). Reports arrive in batches, so pushes are held
until that moment is known, then filtered; from then on they are counted as they come.
"""

from __future__ import annotations

import collections
import threading

#: Start-up pushes held while a planned worker has not pushed yet (a dead one never will).
MAX_HELD = 1_000_000


class SteadyStaleness:
    """Counts staleness of the steady-state pushes; first pushes of every worker on the side."""

    def __init__(self, planned: int) -> None:
        self.planned = planned
        self._lock = threading.Lock()
        self._first_time: dict[int, float] = {}
        self.first_base: dict[int, int] = {}  # worker -> base version of its first push (shard 0)
        self._ready_at: float | None = None
        self._held: list[tuple[float, int]] = []
        self.histogram: collections.Counter[int] = collections.Counter()

    def add(self, worker: int, shard: int, wall_time: float, base_version: int, staleness: int) -> None:
        """One push record (reports of one worker arrive in order)."""
        with self._lock:
            if worker not in self._first_time:
                self._first_time[worker] = wall_time
            if shard == 0 and worker not in self.first_base:
                self.first_base[worker] = base_version
            if self._ready_at is None:
                if len(self._held) < MAX_HELD:
                    self._held.append((wall_time, staleness))
                if self.planned and all(w in self._first_time for w in range(self.planned)):
                    self._settle(max(self._first_time[w] for w in range(self.planned)))
            elif wall_time > self._ready_at:
                self.histogram[staleness] += 1

    def _settle(self, ready_at: float) -> None:
        self._ready_at = ready_at
        for wall_time, staleness in self._held:
            if wall_time > ready_at:
                self.histogram[staleness] += 1
        self._held = []

    def snapshot(self) -> dict[int, int]:
        """The steady histogram; if some planned worker never pushed, after the last first push seen."""
        with self._lock:
            if self._ready_at is None and self._first_time:
                held = self._held
                ready_at = max(self._first_time.values())
                return dict(collections.Counter(s for t, s in held if t > ready_at))
            return dict(self.histogram)

    def late_workers(self, round_size: int) -> list[int]:
        """Planned workers whose first gradient read values a whole round (round_size updates) or
        more past the earliest first read (0, or a resumed run's checkpoint version): they started
        late. Planned workers that never pushed count as late."""
        with self._lock:
            start = min(self.first_base.values(), default=0)
            return [w for w in range(self.planned)
                    if w not in self.first_base or self.first_base[w] - start >= round_size]
