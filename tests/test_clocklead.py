"""The chief's clock-lead measurement from pushes.csv and the check from timeline.csv."""

from __future__ import annotations

from asyncps.rundir import PushRow, StepRow
from asyncps.rundir.clocklead import push_clock_lead, timeline_start_lead


def push(worker: int, base: int, version: int, shard: int = 0) -> PushRow:
    return PushRow(0.0, worker, shard, 0, base, version, version - 1 - base, True, "", 0.1, 1.0)


def test_push_lead_follows_the_version_order() -> None:
    # w0 reads at 0, 1, 2, 3 (its own pushes make versions 1..4); w1 reads at 0 and pushes at 5
    ahead = [push(0, v, v + 1) for v in range(4)] + [push(1, 0, 5), push(1, 5, 6)]
    assert push_clock_lead(ahead) == 3  # w0 read at 3 with 3 pushes while w1 had none
    lockstep = [push(0, 0, 1), push(1, 0, 2), push(0, 2, 3), push(1, 2, 4), push(0, 4, 5), push(1, 4, 6)]
    assert push_clock_lead(lockstep) == 0  # each reads after both pushed
    assert push_clock_lead([*ahead, *(push(0, v, v + 1, shard=1) for v in range(2))]) == 3


def test_a_finished_worker_no_longer_counts_and_a_late_reader_counts_from_zero() -> None:
    gone = [push(1, 0, 1)] + [push(0, v, v + 1) for v in range(1, 6)]  # w1 pushed once and left
    assert push_clock_lead(gone) == 0
    late = [push(0, 0, 1), push(1, 0, 2), push(0, 2, 3), push(1, 2, 4), push(2, 4, 5), push(0, 4, 6), push(1, 6, 7),
            push(2, 6, 8)]  # w2 first reads at version 4, when the others have pushed twice
    assert push_clock_lead(late) == 2


def step(worker: int, k: int, start: float) -> StepRow:
    return StepRow(worker, k, start, 0.0, 0.01, 0.001, 0.0, 8)


def test_timeline_lead_counts_steps_started() -> None:
    fast = [step(0, k, 0.1 * k) for k in range(1, 11)]  # ten steps in a second
    slow = [step(1, 1, 0.0), step(1, 2, 2.0)]
    assert timeline_start_lead(fast + slow) == 8  # step 10 starts with 9 pushes; the other started 1 step
    paced = [step(0, k, 1.0 * k) for k in range(1, 5)] + [step(1, k, 1.0 * k + 0.5) for k in range(1, 5)]
    assert timeline_start_lead(paced) <= 1
