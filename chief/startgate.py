"""The start barrier: workers train only once every planned worker is ready.

Why: on a small machine TensorFlow's start-up (import, model, tracing the gradient function)
staggers the workers by seconds, so the first seconds of a run have fewer workers pushing than
planned and a few very stale first pushes: transients, not the phenomenon under study. A worker is
*ready* once it registered and computed one warm-up gradient (not pushed); the gate opens when as
many worker indices as planned have a ready member, and stays open: workers joining later train at
once. Any index counts: a worker that replaces one lost before the release (its node died while the
lost one was not yet declared dead) registers under a new index beyond the plan, and stands in.
Switched off (`start_barrier` false), the gate is open from the start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from asyncps.errors import InvalidArgumentError

#: The release names a moment this far ahead, so that every waiting process has its answer before
#: it and all begin together (answers reach processes tens of ms apart on a busy machine).
START_MARGIN_S = 0.3
#: A planned worker that never becomes ready (crashed during start-up, fewer containers started than
#: planned) must not hold the others forever: after this long the gate opens for those ready.
START_TIMEOUT_S = 300.0


class StartGate:
    """Who is ready, and whether the run is released; waiters block on one condition."""

    def __init__(self, planned: int, enabled: bool, index_of: Callable[[str], int],
                 clock: Callable[[], float] = time.monotonic, timeout_s: float = START_TIMEOUT_S) -> None:
        self.planned = planned
        self.timeout_s = timeout_s
        self.timed_out = False
        self.enabled = enabled
        self._index_of = index_of
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: set[int] = set()
        self._created = clock()
        self.released_after_s: float | None = None if enabled else 0.0
        self.released_wall: float | None = None if enabled else time.time()
        self._cancelled = False

    @property
    def released(self) -> bool:
        """True once every planned worker was ready (always, when the barrier is off)."""
        with self._cond:
            return self.released_after_s is not None

    def ready_count(self) -> int:
        """Worker indices with a ready member."""
        with self._cond:
            return len(self._ready)

    def mark_ready(self, worker_ids: Iterable[str]) -> None:
        """These registered members computed their warm-up gradient (unknown ones: NOT_FOUND)."""
        ids = list(worker_ids)
        if not ids:
            raise InvalidArgumentError("WaitStart needs at least one worker_id")
        indices = [self._index_of(m) for m in ids]
        with self._cond:
            self._ready.update(indices)
            if self.released_after_s is None and len(self._ready) >= self.planned:
                self._release()

    def cancel(self) -> None:
        """The run is stopping: wake every waiter (they are told to stop, not to train)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    @property
    def start_at(self) -> float:
        """The wall time at which released workers begin (0 before the release)."""
        with self._cond:
            return self.released_wall or 0.0

    def wait(self, timeout_s: float) -> bool:
        """Block until released, cancelled or timeout_s passed; True when released."""
        with self._cond:
            left = self.timeout_s - (self._clock() - self._created)
            self._cond.wait_for(lambda: self.released_after_s is not None or self._cancelled,
                                max(0.0, min(timeout_s, left)))
            if self.released_after_s is None and not self._cancelled and self._ready \
                    and self._clock() - self._created >= self.timeout_s:
                self.timed_out = True  # open for the workers that are ready; late ones train on joining
                self._release()
            return self.released_after_s is not None

    def _release(self) -> None:
        self.released_after_s = self._clock() - self._created
        self.released_wall = time.time() + START_MARGIN_S
        self._cond.notify_all()

    def describe(self) -> dict[str, float | int | bool | None]:
        """The barrier's part of summary.json."""
        with self._cond:
            return {"enabled": self.enabled, "planned": self.planned, "ready": len(self._ready),
                    "released_after_s": self.released_after_s, "released_wall_time": self.released_wall,
                    "timed_out": self.timed_out}
