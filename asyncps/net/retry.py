"""The one retry policy of every client (gRPC, TCP, shared memory, the chief's client): which errors
are tried again, with exponential backoff and full jitter, until a deadline or the caller's stop.

It sees only asyncps.errors: each path turns its failures into them at its own edge before a
policy judges them. No grpc import (and no dependency beyond the standard library), so any role
may use it; shards never retry.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from asyncps.errors import AsyncpsError, UnavailableError, Unreachable

log = logging.getLogger(__name__)

T = TypeVar("T")

# how long a peer may fail before the retries say so (once per call): a wrong address or a dead peer is
# reported within seconds, while the call keeps trying until its deadline
UNREACHABLE_WARNING_S = 3.0


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed call is tried again. Only errors whose exact type is in `retry_on` are (a
    subclass is a verdict or a typed outcome the caller acts on at once: Unreachable, AttachAgainError,
    PathNotVisibleError); each pause is uniform in [0, backoff], the backoff doubling from
    initial_backoff_s up to max_backoff_s; past deadline_s, or on a failure once `stop` is set (the
    owner's stop event, which also ends a pause), the call raises Unreachable."""

    deadline_s: float = 60.0
    retry_on: tuple[type[AsyncpsError], ...] = (UnavailableError,)
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    stop: threading.Event | None = None
    warn_after_s: float = UNREACHABLE_WARNING_S

    def within(self, deadline_s: float | None) -> RetryPolicy:
        """This policy with another overall deadline (itself when None)."""
        return self if deadline_s is None else replace(self, deadline_s=deadline_s)

    def retries(self, exc: BaseException) -> bool:
        """Whether a failure is worth another attempt."""
        return type(exc) in self.retry_on

    def pause_s(self, attempt: int, rng: random.Random) -> float:
        """The pause after failed attempt number `attempt` (0 first): full jitter over the backoff."""
        return rng.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** min(attempt, 64)))

    def call(self, fn: Callable[[], T], what: str, rng: random.Random | None = None) -> T:
        """fn(), tried again on the errors this policy retries; the others propagate at once.

        Once `what` has failed for warn_after_s, logs one WARNING while the retries go on and one INFO
        line if it answers after all; raises Unreachable naming `what` and the last error at the end.
        """
        rng = rng or random.Random()
        started = time.monotonic()
        warned = False
        attempt = 0
        while True:
            try:
                result = fn()
            except AsyncpsError as exc:
                if not self.retries(exc):
                    raise
                warned = self._after_failure(exc, what, started, warned, self.pause_s(attempt, rng))
                attempt += 1
                continue
            if warned:
                log.info("reached %s after %.1fs", what, time.monotonic() - started)
            return result

    def _after_failure(self, exc: AsyncpsError, what: str, started: float, warned: bool, pause: float) -> bool:
        """Raise Unreachable when the call must end, else warn (once) and wait `pause`; whether warned."""
        now = time.monotonic()
        left = started + self.deadline_s - now
        cause = f"{exc.code or type(exc).__name__}: {exc}"
        if left <= 0:
            raise Unreachable(f"could not reach {what} within {self.deadline_s:.0f}s ({cause})", "UNAVAILABLE") from exc
        if self.stop is not None and self.stop.is_set():
            raise Unreachable(f"gave up on {what} after {now - started:.1f}s: stopping ({cause})",
                              "UNAVAILABLE") from exc
        if not warned and now - started >= self.warn_after_s:
            warned = True
            log.warning("cannot reach %s for %.1fs (%s); still trying, for up to %.0fs more", what, now - started,
                        cause, left)
        if not warned:  # wake for the warning on time even in a long backoff
            pause = min(pause, max(0.0, started + self.warn_after_s - now))
        if self.stop is not None:
            self.stop.wait(min(left, pause))
        else:
            time.sleep(min(left, pause))
        return warned


__all__ = ["UNREACHABLE_WARNING_S", "RetryPolicy"]
