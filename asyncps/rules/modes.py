"""Consistency models of a shard: when gradients become updates and when a worker may read again.

A mode is chosen by the update rule's mode spec (`async`, `sync:backup=1`, `ssp:bound=2`): a
small frozen dataclass of its typed parameters registered in `MODES`, whose `start` builds the
mode's running state for one shard, a `Consistency`. The store asks that object four things and
never branches on the mode:
- `admit`: apply a gradient now, accumulate it for a synchronous step, or drop it (and why);
- `accumulate` / `take_step`: keep an accumulated gradient; the averaged step once it is complete;
- `readable`: whether a worker that just pushed may receive parameters and start its next step
  (`strict_reads`: a worker that may not read yet gets no values at all, the call fails).

Sync over several shards is decided once (`SyncConsistency` on shard 0, the coordinator, and
`SyncFollower` on every other shard); the protocol is described on `SyncFollower`.

All methods run with the store's state lock held.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from asyncps.errors import InvalidArgumentError
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import Registry, param
from asyncps.wire.codec import Array, Gradient, SparseRows


class Verdict(Enum):
    """What the store does with an admitted gradient."""

    APPLY = "apply"
    ACCUMULATE = "accumulate"
    DROP = "drop"


@dataclass(frozen=True)
class Ballot:
    """The coordinator's version (`step`) and incarnation a gradient was computed from.

    A sync worker sends it with every push of a step, so a follower shard knows which of the
    coordinator's decisions the gradient belongs to."""

    step: int
    incarnation: int


@dataclass(frozen=True)
class SyncStep:
    """The coordinator's decision for one step: version `step` + 1 averages exactly these workers."""

    step: int
    workers: frozenset[str]


@dataclass(frozen=True)
class Decisions:
    """Consecutive decisions of one coordinator incarnation, oldest first."""

    incarnation: int
    steps: tuple[SyncStep, ...] = ()


@dataclass(frozen=True)
class Resolution:
    """What became of a staged gradient on a follower: applied in the step that made `version`,
    or dropped for a reason."""

    accepted: bool
    version: int
    staleness: int
    drop: DropReason | None = None
    reason: str = ""


@dataclass(frozen=True)
class Held:
    """A shard's answer to a pause: its version and, in multi-shard sync, where it stands.

    A follower says which coordinator incarnation it follows and the first step it has not
    committed; the coordinator answers the decisions the pause asked for. A cut uses them to
    bring every follower to the coordinator's step while all shards are held."""

    version: int
    follower: bool = False
    lineage: int = 0
    next_step: int = 0
    decided: Decisions | None = None


@dataclass(frozen=True)
class Admission:
    """A verdict and, for drops, the reason."""

    verdict: Verdict
    reason: str = ""
    drop: DropReason | None = None  # the kind of a DROP verdict


class Consistency(abc.ABC):
    """A consistency model: BSP (sync), SSP or fully asynchronous."""

    name: str
    exclusive = False  # True: a push needs every variable lock (it may complete a step)
    # True: a worker that may not read yet never gets values (SSP's bound); the shard refuses the
    # call and the worker pushes again (the shard recognizes the repeated push: step)
    strict_reads = False
    enforce_bound = True  # False only in tests that show what the bound prevents

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.live: set[str] | None = None  # None until the chief first says who is alive

    @abc.abstractmethod
    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Decide what to do with a gradient from `worker_id` computed from `base_version`."""

    def pushed(self, worker_id: str) -> None:  # noqa: B027 - a hook; most models need nothing
        """A push from worker_id was handled (applied, accumulated or dropped)."""

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Keep a gradient `admit` answered ACCUMULATE with (only models that accumulate)."""
        raise TypeError(f"the {self.name} model does not accumulate gradients")

    def decisions_since(self, step: int) -> tuple[SyncStep, ...]:
        """The coordinator's decisions for steps >= step that it still remembers (others: none)."""
        return ()

    def commit(self, decisions: Decisions, version: int) -> list[tuple[SyncStep, dict[str, Gradient] | None]]:
        """A follower takes the coordinator's decisions: the averaged step of each new one (None
        when none of its gradients is staged here), in order; `version` is the shard's now."""
        raise TypeError(f"the {self.name} model on this shard takes no sync decisions (not a follower)")

    def resolution(self, worker_id: str, step: int) -> Resolution | None:
        """What became of worker_id's gradient staged for `step` (None: still staged, or unknown)."""
        return None

    def sync_position(self) -> tuple[int, int] | None:
        """A follower's (coordinator incarnation followed, first step not committed); others None."""
        return None

    def take_drops(self) -> list[DropReason]:
        """The reasons of staged gradients dropped since the last call (a follower's commits),
        so the shard counts them as it counts a gradient dropped when pushed."""
        return []

    def take_step(self) -> dict[str, Gradient] | None:
        """The accumulated step to apply now (and forget), or None while it is not complete."""
        return None

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """May worker_id, whose last gradient was computed from base_version, read now?"""
        return True

    def set_live(self, workers: Iterable[str]) -> None:
        """The chief's current set of live workers."""
        self.live = set(workers)

    def stats(self) -> dict[str, float]:
        """Model-specific counters for ShardStats."""
        return {}


class AsyncConsistency(Consistency):
    """Fully asynchronous: every gradient is applied as soon as it arrives (Hogwild-style PS)."""

    name = "async"

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Always apply (the staleness policy may still drop or scale it)."""
        return Admission(Verdict.APPLY)


@dataclass
class _PendingStep:
    """Gradients accumulated for one synchronous step (sums of dense, lists of sparse)."""

    count: int = 0
    dense: dict[str, Array] = field(default_factory=dict)
    sparse: dict[str, list[SparseRows]] = field(default_factory=dict)

    def add(self, grads: Mapping[str, Gradient]) -> None:
        """Add one worker's gradient."""
        self.count += 1
        for name, grad in grads.items():
            if isinstance(grad, SparseRows):
                # copied: a transport may hand over views of a buffer it reuses (shared memory)
                self.sparse.setdefault(name, []).append(SparseRows(np.array(grad.indices, copy=True),
                                                                   np.array(grad.values, copy=True)))
            elif name in self.dense:
                self.dense[name] += grad
            else:
                self.dense[name] = np.array(grad, copy=True)

    def average(self) -> dict[str, Gradient]:
        """The mean gradient over the accumulated workers."""
        out: dict[str, Gradient] = {name: total / np.float32(self.count) for name, total in self.dense.items()}
        for name, parts in self.sparse.items():
            values = np.concatenate([p.values for p in parts]) / np.float32(self.count)
            out[name] = SparseRows(np.concatenate([p.indices for p in parts]), values.astype(parts[0].values.dtype))
        return out


# How many decided steps a coordinator remembers: a worker up to this many steps behind still
# carries every decision its follower shards lack.
DECISION_LOG = 4096


class SyncConsistency(Consistency):
    """Bulk-synchronous: version v+1 is the average of the first quorum gradients computed from v.

    With b backup workers the quorum is (live workers - b) (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"): gradients arriving after their version was applied are
    dropped as late. The quorum follows the chief's live set, so a dead worker cannot stall
    training and a joining one is waited for. On shard 0 it is also the coordinator of the other
    shards: it remembers which workers each step averaged (`decisions_since`, see SyncFollower).
    """

    name = "sync"
    exclusive = True

    def __init__(self, num_workers: int, backup_workers: int) -> None:
        super().__init__(num_workers)
        self.backup_workers = backup_workers
        self.contributors: set[str] = set()
        self._pending = _PendingStep()
        self._pending_version = 0
        self._decided: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Accumulate a gradient for the current version; drop late or duplicate ones."""
        if base_version < version:
            return Admission(Verdict.DROP, f"late: version {base_version} already applied", DropReason.LATE)
        if worker_id in self.contributors:
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already pushed for version {version}",
                             DropReason.DUPLICATE)
        self.contributors.add(worker_id)
        self._pending_version = version
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Add an admitted gradient to the current step's sums."""
        self._pending.add(grads)

    def quorum(self) -> int:
        """Live workers minus backups, at least one."""
        live = self.num_workers if self.live is None else len(self.live)
        return max(1, live - self.backup_workers)

    def take_step(self) -> dict[str, Gradient] | None:
        """The average of the step's gradients once the quorum is reached; the next version then
        starts with no gradients and no contributors."""
        if self._pending.count == 0 or self._pending.count < self.quorum():
            return None
        step = self._pending.average()
        self._decided[self._pending_version] = frozenset(self.contributors)
        while len(self._decided) > DECISION_LOG:
            self._decided.popitem(last=False)
        self._pending = _PendingStep()
        self.contributors.clear()
        return step

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """A worker waits for the step its gradient belongs to."""
        return version > base_version

    def decisions_since(self, step: int) -> tuple[SyncStep, ...]:
        """The contributor sets of the steps >= step still remembered, oldest first."""
        if step < 0 or not self._decided or step > next(reversed(self._decided)):
            return ()
        return tuple(SyncStep(s, workers) for s, workers in self._decided.items() if s >= step)


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
        kept = _PendingStep()
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
            step = _PendingStep()
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
        """Staged gradients dropped by commits since the last call (see Consistency)."""
        drops, self._drops = self._drops, []
        return drops

    def stats(self) -> dict[str, float]:
        """Decided steps none of whose gradients were staged here (after a restore)."""
        return {"sync_skipped_steps": float(self.skipped_steps)}


class SSPConsistency(Consistency):
    """Stale Synchronous Parallel (Ho et al. 2013): updates apply at once, but a worker whose
    clock (pushes so far) leads the slowest live worker's by more than s must wait; when it
    cannot wait any longer the shard refuses the call instead of answering (strict_reads)."""

    name = "ssp"
    strict_reads = True

    def __init__(self, num_workers: int, staleness_bound: int) -> None:
        super().__init__(num_workers)
        self.bound = staleness_bound
        self.clocks: dict[str, int] = {}
        self.max_lead = 0

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Apply at once (asynchronous updates, bounded clocks)."""
        return Admission(Verdict.APPLY)

    def pushed(self, worker_id: str) -> None:
        """Advance the worker's clock; a worker the model has not seen joins at the slowest clock."""
        if worker_id not in self.clocks:
            self.clocks[worker_id] = self._min_clock()
        self.clocks[worker_id] += 1

    def _min_clock(self) -> int:
        clocks = self.clocks
        if self.live is None:
            seen = list(clocks.values())
            if len(seen) < self.num_workers:
                seen.append(0)  # planned workers not seen yet are at clock 0
            return min(seen, default=0)
        return min((clocks[w] for w in self.live if w in clocks), default=0)

    def lead(self, worker_id: str) -> int:
        """How far worker_id's clock is ahead of the slowest live worker."""
        return self.clocks.get(worker_id, 0) - self._min_clock()

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """Start the next clock only while the lead is within the bound."""
        lead = self.lead(worker_id)
        if lead <= self.bound or not self.enforce_bound:
            self.max_lead = max(self.max_lead, lead)
            return True
        return False

    def set_live(self, workers: Iterable[str]) -> None:
        """Dead workers no longer hold the others back; new ones start at the slowest live clock.

        Workers named in the first live set are the run's initial workers and start at 0.
        """
        first = self.live is None
        joining = set(workers) - self.clocks.keys()
        frontier = 0 if first else self._min_clock()
        super().set_live(workers)
        for worker in joining:
            self.clocks[worker] = frontier

    def stats(self) -> dict[str, float]:
        """The largest lead with which any worker started a step."""
        return {"max_clock_lead": float(self.max_lead)}


class ModeSpec(abc.ABC):
    """A consistency mode with its parameters (a frozen dataclass registered in MODES)."""

    @property
    def spec(self) -> str:
        """The canonical spec string; MODES.parse(spec) rebuilds an equal mode."""
        return MODES.canonical(self)

    @property
    def coordinated(self) -> bool:
        """Whether a worker exchanges a step with shard 0 first and the others after (SyncFollower)."""
        return False

    @abc.abstractmethod
    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """The running state of this mode on one shard, for a run planned with num_workers."""


MODES: Registry[ModeSpec] = Registry("consistency mode", ModeSpec, group="asyncps.modes")


@MODES.register("async")
@dataclass(frozen=True)
class AsyncMode(ModeSpec):
    """Fully asynchronous: every gradient is applied as soon as it arrives."""

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """An AsyncConsistency."""
        return AsyncConsistency(num_workers)


@MODES.register("sync")
@dataclass(frozen=True)
class SyncMode(ModeSpec):
    """Bulk-synchronous: each version is the average of the first (live workers - backup) gradients."""

    backup: int = param(0, help="backup workers: later gradients of a step are dropped as late")

    def __post_init__(self) -> None:
        _check_count("backup", self.backup)

    @property
    def coordinated(self) -> bool:
        """Shard 0 decides each step for every shard."""
        return True

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """The coordinator's SyncConsistency on shard 0, a SyncFollower on the others."""
        if shard_index == 0:
            return SyncConsistency(num_workers, self.backup)
        return SyncFollower(num_workers)


@MODES.register("ssp")
@dataclass(frozen=True)
class SSPMode(ModeSpec):
    """Stale synchronous parallel: a worker may lead the slowest live worker by at most bound clocks."""

    bound: int = param(0, help="the largest clock lead s")

    def __post_init__(self) -> None:
        _check_count("bound", self.bound)

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """An SSPConsistency with this staleness bound."""
        return SSPConsistency(num_workers, self.bound)


def _check_count(key: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")


def make_consistency(spec: str, num_workers: int) -> Consistency:
    """The running state of the mode a spec names (ValueError when the spec is malformed)."""
    return MODES.parse(spec).start(num_workers)


# The flags and RunConfig fields older than mode specs, each the parameter of one mode.
MODE_ALIASES: dict[str, tuple[str, str]] = {"backup_workers": ("sync", "backup"), "staleness_bound": ("ssp", "bound")}


def fold_mode_aliases(spec: str, aliases: Mapping[str, int]) -> str:
    """The canonical mode spec with the old per-mode settings folded in.

    `aliases` maps names of MODE_ALIASES to values; 0 (every alias's default) means not given.
    `sync` with backup_workers=1 is `sync:backup=1`. An alias for another mode, or one that
    contradicts a value the spec gives, is a ValueError.
    """
    name, given = MODES.split(spec)
    extra: list[str] = []
    for alias, value in aliases.items():
        if alias not in MODE_ALIASES:
            raise ValueError(f"unknown mode setting {alias!r}; known: {', '.join(MODE_ALIASES)}")
        if not value:
            continue
        mode, key = MODE_ALIASES[alias]
        if mode != name:
            raise ValueError(f"{alias}={value} applies to mode {mode}, not to {spec!r}")
        if key in given and MODES.normalize(f"{mode}:{key}={given[key]}") != MODES.normalize(f"{mode}:{key}={value}"):
            raise ValueError(f"{alias}={value} contradicts the mode spec {spec!r}")
        extra.append(f"{key}={value}")
    if not extra:
        return MODES.normalize(spec)
    merged = dict(given, **dict(item.split("=") for item in extra))
    return MODES.normalize(f"{name}:" + ",".join(f"{k}={v}" for k, v in merged.items()))


def mode_alias_values(spec: str) -> dict[str, int]:
    """The old per-mode settings a mode spec amounts to (0 for the settings of other modes)."""
    mode = MODES.parse(spec)
    name = MODES.name_of(mode)
    return {alias: int(getattr(mode, key)) if mode_name == name else 0
            for alias, (mode_name, key) in MODE_ALIASES.items()}
