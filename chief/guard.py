"""The stop rules of a run that cannot go on by itself: every live worker diverged (its steps are all
non-finite), or no worker has been alive for a grace period; and the end-of-run rule that a run which
stopped for any other reason did not diverge on the way (final_verdict). Pure state with a clock; no grpc."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from asyncps.chief.lifecycle import EXIT_DIVERGED, EXIT_NO_WORKERS


@dataclass(frozen=True)
class NonfiniteStreak:
    """A worker's consecutive non-finite steps up to now, and the last of them."""

    steps: int
    last_step: int
    last_loss: float


#: The largest share of the examples trained whose steps may be skipped as non-finite in a run that still
#: counts as trained. A run that recovers from a spike skips a few steps (well under 1%); past half, most of
#: the data never moved the model: whatever its final evaluation says, it is not the run that was asked for.
MAX_NONFINITE_SHARE = 0.5


@dataclass(frozen=True)
class NonfiniteTally:
    """The run's steps skipped as non-finite (every worker, every chief start), and the first of them."""

    steps: int = 0
    examples: int = 0
    first: str = ""  # "worker W step S: <the worker's words>", e.g. "... loss nan; first non-finite gradient: w"

    def describe(self) -> str:
        """`N non-finite steps skipped (E examples)`, with the first one when known."""
        first = f"; first: {self.first}" if self.first else ""
        return f"{self.steps} non-finite step(s) skipped ({self.examples} examples){first}"


@dataclass(frozen=True)
class Verdict:
    """Why a run ends with an error, and the chief's exit status for it."""

    exit_code: int
    reason: str

    @property
    def outcome(self) -> str:
        """summary.json's `outcome` for this verdict: diverged or no_workers."""
        return "diverged" if self.exit_code == EXIT_DIVERGED else "no_workers"


def final_verdict(final_loss: float, nonfinite: NonfiniteTally, examples: int) -> Verdict | None:
    """Diverged (whatever stopped the run) when the final evaluation's loss is NaN or infinite, or when more
    than MAX_NONFINITE_SHARE of the `examples` trained were in steps skipped as non-finite; else None."""
    share = nonfinite.examples / examples if examples > 0 else 0.0
    if math.isfinite(final_loss) and share <= MAX_NONFINITE_SHARE:
        return None
    why = (f"the final evaluation's loss is {final_loss:g}" if not math.isfinite(final_loss)
           else f"{share:.1%} of the examples trained were in non-finite steps (more than {MAX_NONFINITE_SHARE:.0%})")
    return Verdict(EXIT_DIVERGED, f"diverged: {why}; {nonfinite.describe()}")


class RunGuard:
    """Says when a run must end with an error: diverged (every live worker had `max_nonfinite_steps`
    consecutive non-finite steps) or abandoned (no live worker for `no_workers_grace_s`).

    The grace period is counted from the guard's creation (the chief's start) too: workers that never
    registered end the run as well, but not before they could have started: until a first worker is
    seen alive, the wait is at least `start_allowance_s` (the start barrier's own limit: pods scheduled
    late, images pulled, TensorFlow imported on a busy machine).
    """

    def __init__(self, max_nonfinite_steps: int, no_workers_grace_s: float, start_allowance_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_nonfinite_steps = max_nonfinite_steps
        self.no_workers_grace_s = no_workers_grace_s
        self.start_allowance_s = start_allowance_s
        self._clock = clock
        self._last_alive = clock()
        self._seen_alive = False

    def check(self, live: Iterable[int], streaks: Mapping[int, NonfiniteStreak]) -> Verdict | None:
        """The verdict for the live worker indices and the workers' non-finite streaks, or None."""
        now = self._clock()
        indices = sorted(set(live))
        grace = self.no_workers_grace_s if self._seen_alive else max(self.no_workers_grace_s, self.start_allowance_s)
        if indices:
            self._last_alive, self._seen_alive = now, True
        elif now - self._last_alive > grace:
            return Verdict(EXIT_NO_WORKERS, f"no worker alive for {now - self._last_alive:.0f} s "
                                            f"(--idle-without-workers-s {self.no_workers_grace_s:g}"
                                            + ("" if self._seen_alive else ", none ever registered") + ")")
        k = self.max_nonfinite_steps
        if not k or not indices:
            return None
        diverged = [streaks[i] for i in indices if i in streaks and streaks[i].steps >= k]
        if len(diverged) < len(indices):
            return None
        last_worker = max(indices, key=lambda i: streaks[i].last_step)
        last = streaks[last_worker]
        loss = "nan" if math.isnan(last.last_loss) else f"{last.last_loss:g}"
        return Verdict(EXIT_DIVERGED, f"diverged: every live worker ({len(indices)}) had {k} consecutive steps with "
                                      f"a non-finite loss or gradient; last loss {loss} at step {last.last_step} "
                                      f"of worker {last_worker}")


__all__ = ["MAX_NONFINITE_SHARE", "NonfiniteStreak", "NonfiniteTally", "RunGuard", "Verdict", "final_verdict"]
