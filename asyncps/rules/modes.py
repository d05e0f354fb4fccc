"""Consistency models of a shard: when gradients become updates and when a worker may read again.

A mode is chosen by the update rule's mode spec (`async`, `sync:backup=1`, `ssp:bound=2`): a
small frozen dataclass of its typed parameters registered in `MODES`, whose `start` builds the
mode's running state for one shard, a `Consistency`. The store asks that object four things and
never branches on the mode:
- `admit`: apply a gradient now, accumulate it for a synchronous step, or drop it (and why);
- `accumulate` / `take_step`: keep an accumulated gradient; the averaged step once it is complete;
- `readable`: whether a worker that just pushed may receive parameters and start its next step.

All methods run with the store's state lock held.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from asyncps.codec import Array, Gradient, SparseRows
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import Registry, param


class Verdict(Enum):
    """What the store does with an admitted gradient."""

    APPLY = "apply"
    ACCUMULATE = "accumulate"
    DROP = "drop"


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

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.live: set[str] | None = None  # None until the chief first says who is alive

    @abc.abstractmethod
    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Decide what to do with a gradient from `worker_id` computed from `base_version`."""

    def pushed(self, worker_id: str) -> None:  # noqa: B027 - a hook; most models need nothing
        """A push from worker_id was handled (applied, accumulated or dropped)."""

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient]) -> None:
        """Keep a gradient `admit` answered ACCUMULATE with (only models that accumulate)."""
        raise TypeError(f"the {self.name} model does not accumulate gradients")

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

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
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
                self.sparse.setdefault(name, []).append(grad)
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


class SyncConsistency(Consistency):
    """Bulk-synchronous: version v+1 is the average of the first quorum gradients computed from v.

    With b backup workers the quorum is (live workers - b) (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"): gradients arriving after their version was applied are
    dropped as late. The quorum follows the chief's live set, so a dead worker cannot stall
    training and a joining one is waited for.
    """

    name = "sync"
    exclusive = True

    def __init__(self, num_workers: int, backup_workers: int) -> None:
        super().__init__(num_workers)
        self.backup_workers = backup_workers
        self.contributors: set[str] = set()
        self._pending = _PendingStep()

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Accumulate a gradient for the current version; drop late or duplicate ones."""
        if base_version < version:
            return Admission(Verdict.DROP, f"late: version {base_version} already applied", DropReason.LATE)
        if worker_id in self.contributors:
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already pushed for version {version}",
                             DropReason.DUPLICATE)
        self.contributors.add(worker_id)
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient]) -> None:
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
        self._pending = _PendingStep()
        self.contributors.clear()
        return step

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """A worker waits for the step its gradient belongs to."""
        return version > base_version


class SSPConsistency(Consistency):
    """Stale Synchronous Parallel (Ho et al. 2013): updates apply at once, but a worker whose
    clock (pushes so far) leads the slowest live worker's by more than s must wait."""

    name = "ssp"

    def __init__(self, num_workers: int, staleness_bound: int) -> None:
        super().__init__(num_workers)
        self.bound = staleness_bound
        self.clocks: dict[str, int] = {}
        self.max_lead = 0

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Apply at once (asynchronous updates, bounded clocks)."""
        return Admission(Verdict.APPLY)

    def pushed(self, worker_id: str) -> None:
        """Advance the worker's clock; a worker the model has not seen joins at the slowest clock."""
        if worker_id not in self.clocks:
            self.clocks[worker_id] = self._min_clock()
        self.clocks[worker_id] += 1

    def _min_clock(self) -> int:
        if self.live is None:
            clocks = list(self.clocks.values())
            if len(clocks) < self.num_workers:
                clocks.append(0)  # planned workers not seen yet are at clock 0
            return min(clocks, default=0)
        return min((self.clocks[w] for w in self.live if w in self.clocks), default=0)

    def lead(self, worker_id: str) -> int:
        """How far worker_id's clock is ahead of the slowest live worker."""
        return self.clocks.get(worker_id, 0) - self._min_clock()

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """Start the next clock only while the lead is within the bound."""
        lead = self.lead(worker_id)
        if lead <= self.bound:
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

    @abc.abstractmethod
    def start(self, num_workers: int) -> Consistency:
        """The running state of this mode on one shard, for a run planned with num_workers."""


MODES: Registry[ModeSpec] = Registry("consistency mode", ModeSpec, group="asyncps.modes")


@MODES.register("async")
@dataclass(frozen=True)
class AsyncMode(ModeSpec):
    """Fully asynchronous: every gradient is applied as soon as it arrives."""

    def start(self, num_workers: int) -> Consistency:
        """An AsyncConsistency."""
        return AsyncConsistency(num_workers)


@MODES.register("sync")
@dataclass(frozen=True)
class SyncMode(ModeSpec):
    """Bulk-synchronous: each version is the average of the first (live workers - backup) gradients."""

    backup: int = param(0, help="backup workers: later gradients of a step are dropped as late")

    def __post_init__(self) -> None:
        _check_count("backup", self.backup)

    def start(self, num_workers: int) -> Consistency:
        """A SyncConsistency with this many backup workers."""
        return SyncConsistency(num_workers, self.backup)


@MODES.register("ssp")
@dataclass(frozen=True)
class SSPMode(ModeSpec):
    """Stale synchronous parallel: a worker may lead the slowest live worker by at most bound clocks."""

    bound: int = param(0, help="the largest clock lead s")

    def __post_init__(self) -> None:
        _check_count("bound", self.bound)

    def start(self, num_workers: int) -> Consistency:
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
