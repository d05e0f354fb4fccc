"""The consistency modes a shard can run, registered in MODES: async, sync, SSP and the K-variants.

The interface every mode implements (`Consistency`, `ModeSpec`, the `MODES` registry) is in
asyncps.rules.consistency and re-exported here. Sync over several shards is decided once (shard 0
coordinates, the other shards follow); that protocol and the sync mode itself live in their own
home, asyncps.rules.sync.

All methods run with the store's state lock held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from asyncps.rules.consistency import MODES, Admission, Consistency, ModeSpec, RetryMemo, Verdict, check_count
from asyncps.rules.registry import param
from asyncps.rules.sync.bsp import SyncMode
from asyncps.rules.sync.k_async import KAsyncMode
from asyncps.rules.sync.k_batch_async import KBatchAsyncMode
from asyncps.rules.sync.k_batch_sync import KBatchSyncMode
from asyncps.rules.sync.types import Ballot


class AsyncConsistency(Consistency):
    """Fully asynchronous: every gradient is applied as soon as it arrives (Hogwild-style PS)."""

    name = "async"

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Always apply (the staleness policy may still drop or scale it)."""
        return Admission(Verdict.APPLY)


class SSPConsistency(Consistency):
    """Stale Synchronous Parallel (Ho et al. 2013): updates apply at once, but a worker whose
    clock (pushes so far) leads the slowest live worker's by more than s must wait; when it
    cannot wait any longer the shard refuses the call instead of answering (strict_reads)."""

    name = "ssp"
    strict_reads = True
    state_types = (RetryMemo,)

    def __init__(self, num_workers: int, staleness_bound: int) -> None:
        super().__init__(num_workers)
        self.bound = staleness_bound
        self.clocks: dict[str, int] = {}
        self.max_lead = 0
        self.retries = RetryMemo()  # a refused read is retried with the same push

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


@MODES.register("async")
@dataclass(frozen=True)
class AsyncMode(ModeSpec):
    """Fully asynchronous: every gradient is applied as soon as it arrives."""

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """An AsyncConsistency."""
        return AsyncConsistency(num_workers)


MODES.register("sync")(SyncMode)  # the coordinated modes live in asyncps.rules.sync


@MODES.register("ssp")
@dataclass(frozen=True)
class SSPMode(ModeSpec):
    """Stale synchronous parallel: a worker may lead the slowest live worker by at most bound clocks."""

    bound: int = param(0, help="the largest clock lead s")

    def __post_init__(self) -> None:
        check_count("bound", self.bound)

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """An SSPConsistency with this staleness bound."""
        return SSPConsistency(num_workers, self.bound)


MODES.register("k-async")(KAsyncMode)  # Dutta et al. 2018's K-variants, coordinated like sync
MODES.register("k-batch-sync")(KBatchSyncMode)
MODES.register("k-batch-async")(KBatchAsyncMode)


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


__all__ = ["MODES", "MODE_ALIASES", "Admission", "AsyncConsistency", "AsyncMode", "Consistency", "KAsyncMode",
           "KBatchAsyncMode", "KBatchSyncMode", "ModeSpec", "SSPConsistency", "SSPMode", "SyncMode", "Verdict",
           "fold_mode_aliases", "make_consistency", "mode_alias_values"]
