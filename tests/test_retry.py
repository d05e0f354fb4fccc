"""The one retry policy (asyncps.net.retry): what it retries, how long, how it pauses, how it stops."""

from __future__ import annotations

import random
import threading
import time

import pytest

from asyncps.errors import (
    AsyncpsError,
    AttachAgainError,
    FailedPreconditionError,
    NotFoundError,
    PathNotVisibleError,
    UnavailableError,
    Unreachable,
)
from asyncps.net.retry import RetryPolicy


class Failing:
    """A call that fails with `error` its first `times` calls (forever when None), then answers "ok";
    `failed` is set at its first failure."""

    def __init__(self, error: AsyncpsError, times: int | None = None) -> None:
        self.error = error
        self.times = times
        self.calls = 0
        self.failed = threading.Event()

    def __call__(self) -> str:
        self.calls += 1
        if self.times is None or self.calls <= self.times:
            self.failed.set()
            raise self.error
        return "ok"


class Longest(random.Random):
    """Jitter that always draws the longest pause: a pause the test ends with the stop event."""

    def uniform(self, a: float, b: float) -> float:
        """The upper bound."""
        return b


def test_unavailable_is_retried_until_the_call_answers() -> None:
    flaky = Failing(UnavailableError("not now", "UNAVAILABLE"), times=3)
    assert RetryPolicy(deadline_s=30.0, initial_backoff_s=0.001).call(flaky, "the peer") == "ok"
    assert flaky.calls == 4


@pytest.mark.parametrize("error", [NotFoundError("no variable 'x'", "NOT_FOUND"),
                                   FailedPreconditionError("not initialized", "FAILED_PRECONDITION"),
                                   Unreachable("gave up", "UNAVAILABLE")])
def test_an_error_not_retried_is_raised_at_once(error: AsyncpsError) -> None:
    failing = Failing(error)
    with pytest.raises(type(error)) as raised:
        RetryPolicy(deadline_s=30.0).call(failing, "the peer")
    assert raised.value is error and failing.calls == 1


@pytest.mark.parametrize("outcome", [PathNotVisibleError("another host"), AttachAgainError("restarted")])
def test_a_typed_outcome_is_the_callers_even_where_its_base_is_retried(outcome: AsyncpsError) -> None:
    """Only exact types retry: a restarted shard's FAILED_PRECONDITION is waited for, its typed outcomes
    (fall back, attach again) are acted on at once."""
    failing = Failing(outcome)
    policy = RetryPolicy(deadline_s=30.0, retry_on=(UnavailableError, FailedPreconditionError))
    with pytest.raises(type(outcome)):
        policy.call(failing, "the peer")
    assert failing.calls == 1
    assert policy.call(Failing(FailedPreconditionError("not initialized"), times=1), "the peer") == "ok"


def test_the_deadline_is_honoured_and_named_with_the_last_error() -> None:
    failing = Failing(UnavailableError("connection refused", "UNAVAILABLE"))
    started = time.monotonic()
    with pytest.raises(Unreachable, match=r"could not reach the peer within 0s \(UNAVAILABLE: connection refused\)"):
        RetryPolicy(deadline_s=0.4, max_backoff_s=0.05).call(failing, "the peer")
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 3.0 and failing.calls > 2
    assert isinstance(Unreachable("x"), UnavailableError)  # code above the seam may catch either


def test_jitter_is_bounded_by_a_doubling_backoff() -> None:
    policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=2.0)
    rng = random.Random(7)
    for attempt in range(12):
        cap = min(2.0, 0.05 * 2**attempt)
        pauses = [policy.pause_s(attempt, rng) for _ in range(200)]
        assert all(0.0 <= p <= cap for p in pauses)
        assert max(pauses) > cap / 2  # full jitter: the whole range is used, not a fixed pause
    assert policy.pause_s(10_000, rng) <= 2.0


def test_the_stop_event_ends_a_long_pause_and_the_retries() -> None:
    stop = threading.Event()
    failing = Failing(UnavailableError("shard gone", "UNAVAILABLE"))
    # every pause would last 60 s: only the event can end this call in time
    policy = RetryPolicy(deadline_s=600.0, initial_backoff_s=60.0, max_backoff_s=60.0, stop=stop, warn_after_s=600.0)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            policy.call(failing, "the peer", rng=Longest())
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    started = time.monotonic()
    caller.start()
    assert failing.failed.wait(30.0)
    stop.set()
    caller.join(30.0)
    assert not caller.is_alive() and time.monotonic() - started < 30.0
    assert isinstance(outcome[0], Unreachable) and "stopping" in str(outcome[0])
    assert failing.calls == 2  # woken, one more attempt; its failure, the stop set, ends the call


def test_a_policy_takes_another_deadline_and_stays_frozen() -> None:
    policy = RetryPolicy(deadline_s=60.0)
    assert policy.within(None) is policy and policy.within(5.0).deadline_s == 5.0 and policy.deadline_s == 60.0
    with pytest.raises(AttributeError):
        policy.deadline_s = 1.0  # type: ignore[misc]
