"""Clock leads measured from what a run recorded, independently of the shards' own SSP clocks.

SSP bounds how far a worker's clock (its pushes so far) may lead the slowest live worker's when
it starts a step. The shards enforce it on their own clocks; these functions check it from the
run directory, so a shard that counted wrong cannot vouch for itself:

- `push_clock_lead` (pushes.csv): on each shard every applied push raises the version by one, so
  versions order the pushes exactly. A push computed from `base_version` b was read at b: then the
  worker's clock was its pushes applied at versions <= b, and so was every other worker's. A worker
  counts from its first read, at clock 0 (a worker index that joins late looks slow: measure runs
  whose workers all start together) until its last push (a finished or dead worker no longer holds
  the others back, as on the shard).
- `timeline_start_lead` (timeline.csv): when a worker starts step k it has pushed k - 1 times; any
  other worker has pushed at most as many steps as it has started. So (k - 1) minus the fewest
  steps started by another worker still running is a lower bound of the true lead: above s it
  proves a violation.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable

from asyncps.rundir.tables import PushRow, StepRow


def push_clock_lead(rows: Iterable[PushRow]) -> int:
    """The largest lead with which any worker read, over every shard (0 without applied pushes)."""
    by_shard: dict[int, list[PushRow]] = collections.defaultdict(list)
    for row in rows:
        if row.accepted:
            by_shard[row.shard].append(row)
    return max((_shard_lead(shard_rows) for shard_rows in by_shard.values()), default=0)


def _shard_lead(rows: list[PushRow]) -> int:
    rows.sort(key=lambda r: r.version)
    versions: dict[int, list[int]] = collections.defaultdict(list)
    first_read: dict[int, int] = {}
    for row in rows:
        versions[row.worker].append(row.version)
        first_read[row.worker] = min(first_read.get(row.worker, row.base_version), row.base_version)
    last = {w: v[-1] for w, v in versions.items()}

    def pushes(worker: int, at: int) -> int:
        return bisect.bisect_right(versions[worker], at)

    lead = 0
    for row in rows:
        read = row.base_version
        running = [pushes(u, read) for u in versions if first_read[u] <= read and last[u] > read]
        if running:
            lead = max(lead, pushes(row.worker, read) - min(running))
    return lead


def timeline_start_lead(rows: Iterable[StepRow]) -> int:
    """The largest (k - 1) - (fewest steps started by another running worker) at any step start."""
    starts: dict[int, list[float]] = collections.defaultdict(list)
    for row in rows:
        starts[row.worker].append(row.start)
    for times in starts.values():
        times.sort()
    lead = 0
    for worker, times in starts.items():
        for k, t in enumerate(times, start=1):
            others = [bisect.bisect_right(o, t) for u, o in starts.items()
                      if u != worker and o[0] <= t < o[-1]]
            if others:
                lead = max(lead, (k - 1) - min(others))
    return lead


__all__ = ["push_clock_lead", "timeline_start_lead"]
