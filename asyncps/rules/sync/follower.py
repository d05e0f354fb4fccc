"""A follower shard of a coordinated mode: it applies exactly the sets the coordinator decided.

The protocol is described on SyncFollower; asyncps.rules.sync.client is the worker's side of it and
asyncps.rules.sync.cut the chief's.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

from asyncps.errors import InvalidArgumentError
from asyncps.rules.consistency import Admission, Consistency, Verdict
from asyncps.rules.drops import DropReason
from asyncps.rules.sync.steps import DECISION_LOG, PendingStep
from asyncps.rules.sync.types import Ballot, Decisions, Resolution, SyncStep
from asyncps.wire.codec import Gradient


@dataclass
class _Staged:
    """A gradient a follower holds until the coordinator decides its step."""

    incarnation: int  # the coordinator's, from the ballot
    grads: dict[str, Gradient]
    base_version: int  # this shard's version it was computed from


class SyncFollower(Consistency):
    """Sync on a shard other than shard 0: apply exactly the steps the coordinator decided.

    The protocol (one decision per step for all shards; a worker's gradient is applied on all of
    its shards or on none):
    1. stage: the worker pushes its parts to every follower with a Ballot (the coordinator
       version and incarnation it computed from); a follower only keeps them;
    2. vote: then it pushes its part to shard 0, the coordinator, which runs SyncConsistency: the
       first (live - backup) gradients of version v make version v+1; shard 0 records that set.
       Every gradient that can be in a set is therefore already staged on every follower;
    3. commit: the reply from shard 0 carries the decisions since the worker's step; the worker
       hands them to each follower with its pull (empty push). A follower applies, for every new
       decided step in order, the average of exactly the staged gradients of that step's set,
       and drops the other staged gradients of that step and earlier ones as late.
    Any worker may deliver a decision and a follower applies each once, so a dead worker cannot
    stall a follower. The follower never waits, so the cost is the order: followers, shard 0,
    followers (three round trips in a row instead of one in parallel). A follower tracks one
    coordinator incarnation; decisions from a new one (shard 0 restored) replace it and drop what
    was staged against the old one; a restored follower lost its staged gradients (as any
    restore loses work since the checkpoint) and applies the next decisions it sees.
    """

    name = "sync"
    exclusive = True

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self.lineage = 0  # the coordinator incarnation whose decisions this shard follows
        self.next_step = 0  # the first coordinator step not decided here yet
        self._retired: set[int] = set()
        self._staged: dict[tuple[str, int], _Staged] = {}
        self._resolved: collections.OrderedDict[tuple[str, int], Resolution] = collections.OrderedDict()
        self.version = 0  # this shard's version (the store's, given with each commit)
        self._admitted_base = 0
        self.skipped_steps = 0  # decided steps with none of their gradients staged here
        self._drops: list[DropReason] = []  # staged gradients dropped by commits, not counted yet

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Stage a gradient under its ballot; drop one whose step was decided, or a second one."""
        if ballot is None:
            raise InvalidArgumentError("a sync push to a follower shard needs the coordinator's version and "
                                       "incarnation it was computed from (sync_step, sync_incarnation)")
        if ballot.incarnation in self._retired or (ballot.incarnation == self.lineage and ballot.step < self.next_step):
            return Admission(Verdict.DROP, f"late: coordinator step {ballot.step} already decided", DropReason.LATE)
        if (worker_id, ballot.step) in self._staged:
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already staged for step {ballot.step}",
                             DropReason.DUPLICATE)
        self._admitted_base = base_version
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Keep a copy of the gradient until its step is decided."""
        assert ballot is not None
        kept = PendingStep()
        kept.add(grads)
        self._staged[(worker_id, ballot.step)] = _Staged(ballot.incarnation, kept.average(), self._admitted_base)

    def commit(self, decisions: Decisions, version: int) -> list[tuple[SyncStep, dict[str, Gradient] | None]]:
        """The averaged step of every decision not applied yet, in order (see the class);
        `version` is this shard's version now."""
        self.version = version
        if decisions.incarnation in self._retired:
            return []
        if decisions.incarnation != self.lineage:
            if self.lineage:
                self._retired.add(self.lineage)
            self.lineage, self.next_step = decisions.incarnation, 0
            for key in [k for k, e in self._staged.items() if e.incarnation != self.lineage]:
                entry = self._staged.pop(key)
                self._resolve(key, Resolution(False, self.version, self.version - entry.base_version,
                                              DropReason.RESTORED,
                                              "computed from a previous incarnation of the coordinator shard"))
        steps: list[tuple[SyncStep, dict[str, Gradient] | None]] = []
        for decided in decisions.steps:
            if decided.step < self.next_step:
                continue
            step = PendingStep()
            chosen = []
            for key in sorted(k for k in self._staged if k[1] <= decided.step):
                entry = self._staged.pop(key)
                if key[1] == decided.step and key[0] in decided.workers:
                    step.add(entry.grads)
                    chosen.append((key, entry))
                else:
                    self._resolve(key, Resolution(False, self.version, self.version - entry.base_version,
                                                  DropReason.LATE,
                                                  f"late: coordinator step {decided.step} was decided without it"))
            if chosen:
                for key, entry in chosen:
                    self._resolve(key, Resolution(True, self.version + 1, self.version - entry.base_version))
                self.version += 1
            else:
                self.skipped_steps += 1
            steps.append((decided, step.average() if chosen else None))
            self.next_step = decided.step + 1
        return steps

    def _resolve(self, key: tuple[str, int], resolution: Resolution) -> None:
        """Record what became of a staged gradient; a drop is counted by the shard (take_drops)."""
        self._resolved[key] = resolution
        if resolution.drop is not None:
            self._drops.append(resolution.drop)
        while len(self._resolved) > DECISION_LOG:
            self._resolved.popitem(last=False)

    def resolution(self, worker_id: str, step: int) -> Resolution | None:
        """What became of worker_id's gradient staged for `step` (None while it is staged)."""
        return self._resolved.get((worker_id, step))

    def sync_position(self) -> tuple[int, int] | None:
        """(the coordinator incarnation followed, the first step not committed here)."""
        return self.lineage, self.next_step

    def take_drops(self) -> list[DropReason]:
        """The reasons of staged gradients dropped by commits since the last call, so the shard
        counts them as it counts a gradient dropped when pushed."""
        drops, self._drops = self._drops, []
        return drops

    def stats(self) -> dict[str, float]:
        """Decided steps none of whose gradients were staged here (after a restore)."""
        return {"sync_skipped_steps": float(self.skipped_steps)}


__all__ = ["SyncFollower"]
