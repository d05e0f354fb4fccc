"""A follower shard of a coordinated mode: it applies exactly the sets the coordinator decided.

The protocol is described on SyncFollower; asyncps.rules.sync.client is the worker's side of it and
asyncps.rules.sync.cut the chief's.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass

from asyncps.errors import InvalidArgumentError
from asyncps.rules.consistency import Admission, Consistency, ShardHandle, Verdict
from asyncps.rules.drops import DropReason
from asyncps.rules.sync.steps import DECISION_LOG, PendingStep
from asyncps.rules.sync.types import Ballot, Decisions, Held, Resolution, SyncStep, parse_push_name
from asyncps.wire.codec import Gradient

# A staged gradient: (worker, coordinator step of its ballot, the worker's step it is from)
_Key = tuple[str, int, int]


@dataclass(frozen=True)
class FollowRule:
    """How a follower reads its coordinator's decided sets (the mode's CoordinatedMode.follow_rule).

    by_push: the sets name pushes (`push_name`), which may come from any earlier step of the
    coordinator and several from one worker (the K-variants); otherwise they name workers whose
    gradients of exactly that step are averaged, one per worker (sync).
    retire_late: a decided step drops the staged gradients of it and earlier steps it did not
    take (sync, K-batch-sync); otherwise they wait for a later step (K-async, K-batch-async).
    """

    by_push: bool = False
    retire_late: bool = True


SYNC_RULE = FollowRule()


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
    state_types = (FollowRule, _Staged, Resolution)  # DropReason: every state may hold one

    def __init__(self, num_workers: int, rule: FollowRule = SYNC_RULE) -> None:
        super().__init__(num_workers)
        self.rule = rule
        self.lineage = 0  # the coordinator incarnation whose decisions this shard follows
        self.next_step = 0  # the first coordinator step not decided here yet
        self._retired: set[int] = set()
        self._staged: dict[_Key, _Staged] = {}
        self._resolved: collections.OrderedDict[_Key, Resolution] = collections.OrderedDict()
        # gradients refused when staged (late, duplicate, from a restored state), for the commit to answer
        self._refused: collections.OrderedDict[_Key, Resolution] = collections.OrderedDict()
        self.version = 0  # this shard's version (the store's, given with each commit)
        self._admitted_base = 0
        self.skipped_steps = 0  # decided steps with none of their gradients staged here
        self._drops: list[DropReason] = []  # staged gradients dropped by commits, not counted yet

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Stage a gradient under its ballot; drop one whose step was decided, or a second one."""
        if ballot is None:
            raise InvalidArgumentError("a sync push to a follower shard needs the coordinator's version and "
                                       "incarnation it was computed from (sync_step, sync_incarnation)")
        late = ballot.incarnation == self.lineage and ballot.step < self.next_step and self.rule.retire_late
        if ballot.incarnation in self._retired or late:
            return Admission(Verdict.DROP, f"late: coordinator step {ballot.step} already decided", DropReason.LATE)
        if self._key(worker_id, ballot) in self._staged or (
                not self.rule.by_push and any(k[:2] == (worker_id, ballot.step) for k in self._staged)):
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already staged for step {ballot.step}",
                             DropReason.DUPLICATE)
        self._admitted_base = base_version
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Keep a copy of the gradient until its step is decided."""
        assert ballot is not None
        kept = PendingStep()
        kept.add(grads)
        self._staged[self._key(worker_id, ballot)] = _Staged(ballot.incarnation, kept.average(), self._admitted_base)

    @staticmethod
    def _key(worker_id: str, ballot: Ballot) -> _Key:
        """A staged gradient's key (a push with no worker step is -1: one per worker and step)."""
        return worker_id, ballot.step, -1 if ballot.push is None else ballot.push

    def _takes(self, decided: SyncStep, key: _Key, pushes: set[tuple[str, int] | None]) -> bool:
        """Whether the decided step averages the staged gradient `key` (`pushes`: its named pushes)."""
        if self.rule.by_push:
            return (key[0], key[2]) in pushes
        return key[1] == decided.step and key[0] in decided.workers

    def commit(self, shard: ShardHandle, worker_id: str, ballot: Ballot, decisions: Decisions) -> Resolution | None:
        """Apply the new decided steps to the shard; what became of worker_id's gradient staged
        under `ballot`: applied or dropped by a step, else why staging refused it, else None while
        it is staged still; else this state never saw it (the shard was restored since)."""
        self._catch_up(shard, decisions)
        key = self._key(worker_id, ballot)
        resolution = self._resolved.get(key) or self._refused.get(key)
        if resolution is None and key not in self._staged:
            return Resolution(False, shard.version, 0, DropReason.RESTORED,
                              "its staged gradient was lost: the shard was restored since it was staged")
        return resolution

    def hold(self, shard: ShardHandle, sync: Decisions | None, decisions_since: int) -> Held:
        """Commit `sync` (the coordinator's decisions read at a cut), then say where this shard
        stands: the coordinator incarnation it follows and the first step not committed here."""
        if sync is not None:
            self._catch_up(shard, sync)
        return Held(shard.version, True, self.lineage, self.next_step)

    def defers_answer(self, worker_id: str, ballot: Ballot | None, refusal: Resolution | None) -> bool:
        """Staging is answered by the commit: a refusal is kept for it."""
        if refusal is not None and ballot is not None:
            key = self._key(worker_id, ballot)
            self._refused[key] = refusal
            while len(self._refused) > DECISION_LOG:
                self._refused.popitem(last=False)
        return True

    def _catch_up(self, shard: ShardHandle, decisions: Decisions) -> None:
        """Apply every new decided step to the shard and count the staged gradients they dropped."""
        for _, step in self._decided_steps(decisions, shard.version):
            if step is not None:
                shard.apply_step(step)
        for drop in self._drops:
            shard.count_drop(drop)
        self._drops = []

    def _decided_steps(self, decisions: Decisions,
                       version: int) -> list[tuple[SyncStep, dict[str, Gradient] | None]]:
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
            pushes = {parse_push_name(name) for name in decided.workers} if self.rule.by_push else set()
            for key in sorted(k for k in self._staged if k[1] <= decided.step):
                if self._takes(decided, key, pushes):
                    entry = self._staged.pop(key)
                    step.add(entry.grads)
                    chosen.append((key, entry))
                elif self.rule.retire_late or key[1] < decided.step - DECISION_LOG:
                    # (a gradient the coordinator kept waiting this long was dropped there)
                    entry = self._staged.pop(key)
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

    def _resolve(self, key: _Key, resolution: Resolution) -> None:
        """Record what became of a staged gradient; a drop is counted by the shard (`_catch_up`)."""
        self._resolved[key] = resolution
        if resolution.drop is not None:
            self._drops.append(resolution.drop)
        while len(self._resolved) > DECISION_LOG:
            self._resolved.popitem(last=False)

    def stats(self) -> dict[str, float]:
        """Decided steps none of whose gradients were staged here (after a restore)."""
        return {"sync_skipped_steps": float(self.skipped_steps)}


__all__ = ["SYNC_RULE", "FollowRule", "SyncFollower"]
