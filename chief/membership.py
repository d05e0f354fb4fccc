"""Who is in the cluster: worker registration, indices, heartbeats, dead-worker detection, stop,
and telling the shards which workers are alive."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncps.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

log = logging.getLogger("asyncps.chief")


@dataclass
class Member:
    """One process incarnation that registered."""

    worker_id: str
    role: str
    index: int
    last_seen: float
    alive: bool = True
    finished: bool = False
    step: int = 0
    replaced_by: str = ""  # the new incarnation that took this member's index (it is no longer alive)


class Membership:
    """Registration and liveness, guarded by one lock; no grpc here."""

    def __init__(self, num_workers: int, heartbeat_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_workers = num_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._stop_reason: str | None = None
        self.first_registration: float | None = None
        self._replaced: list[Member] = []  # taken over by a new incarnation since the last reap()

    def register(self, worker_id: str, role: str, requested_index: int = -1) -> int:
        """Admit a worker and return its index: the requested one, or the lowest not held by a
        live worker. A new incarnation asking for a live worker's index takes it over (the old
        one is declared dead: a restarted pod keeps its index) and the next reap() returns the old
        one, so that its data tasks are re-queued as a dead worker's are."""
        if not worker_id:
            raise InvalidArgumentError("register needs a worker_id")
        if role != "worker":
            raise InvalidArgumentError(f"unknown role {role!r}; only workers register")
        with self._lock:
            now = self._clock()
            if self.first_registration is None:
                self.first_registration = now
            existing = self._members.get(worker_id)
            if existing is not None:
                existing.last_seen, existing.alive = now, True
                return existing.index
            live = {m.index: m for m in self._members.values() if m.alive and not m.finished}
            if requested_index >= 0:
                index = requested_index
                if index in live:
                    replaced = live[index]
                    replaced.alive, replaced.replaced_by = False, worker_id
                    self._replaced.append(replaced)
            else:
                index = next(i for i in range(len(live) + 1) if i not in live)
            self._members[worker_id] = Member(worker_id, role, index, now)
            return index

    def heartbeat(self, worker_id: str, step: int = 0) -> None:
        """Record that a member is alive; unknown members must register first."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                raise NotFoundError(f"unknown member {worker_id!r}: register first")
            member.last_seen = self._clock()
            member.alive = True
            member.step = max(member.step, step)

    def finish(self, worker_id: str) -> None:
        """A worker sent its final report and is exiting."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                raise NotFoundError(f"unknown member {worker_id!r}")
            member.finished = True

    def reap(self) -> list[Member]:
        """Declare dead the members silent for longer than the heartbeat timeout; return them, with
        the members a new incarnation replaced since the last call (each member is returned once)."""
        with self._lock:
            now = self._clock()
            dead, self._replaced = self._replaced, []
            for m in self._members.values():
                if m.alive and not m.finished and now - m.last_seen > self.heartbeat_timeout_s:
                    m.alive = False
                    dead.append(m)
            return dead

    def request_stop(self, reason: str) -> None:
        """From now on every heartbeat is answered with STOP."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason

    @property
    def stop_reason(self) -> str | None:
        """Why the run is stopping, once it is."""
        with self._lock:
            return self._stop_reason

    def live_workers(self) -> list[Member]:
        """Workers alive and not finished."""
        with self._lock:
            return [m for m in self._members.values() if m.alive and not m.finished]

    def all_done(self) -> bool:
        """True when every registered worker finished or died."""
        with self._lock:
            return all(m.finished or not m.alive for m in self._members.values())

    def worker_steps(self) -> dict[str, int]:
        """The last reported step of every worker index (newest incarnation wins)."""
        with self._lock:
            return {str(m.index): m.step for m in self._members.values()}

    def indices_seen(self) -> int:
        """How many distinct worker indices ever registered (training starts once all did)."""
        with self._lock:
            return len({m.index for m in self._members.values()})

    def worker_ids(self) -> set[str]:
        """Every member that registered with this chief (alive or not)."""
        with self._lock:
            return set(self._members)

    def index_of(self, worker_id: str) -> int:
        """The index of a registered member."""
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                raise NotFoundError(f"unknown member {worker_id!r}")
            return member.index


class LiveWorkersSink(Protocol):
    """A shard that is told which workers are alive (a ShardTransport)."""

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """Replace the shard's live set."""


class LiveSet:
    """Pushes the live worker set to the shards once every planned worker joined, and on every change.

    `with_work` (the data ledger's workers_with_work) narrows it at the end of an epochs-limited run: a
    live worker with no task left to do will push no more, so a synchronous quorum (or an SSP bound)
    must not wait for it. Without this the last worker still training waited read_wait_s at every step
    for the idle ones. A worker that gets a task again (one re-queued from a dead worker) is counted
    again at the next sync."""

    def __init__(self, membership: Membership, shards: Sequence[LiveWorkersSink],
                 with_work: Callable[[], set[str] | None] | None = None) -> None:
        self._membership = membership
        self._shards = shards
        self._with_work = with_work
        self._sent: list[str] | None = None

    def sync(self) -> None:
        """Tell the shards who is alive (and has work) once every planned worker has joined, and on
        every change."""
        if self._membership.indices_seen() < self._membership.num_workers:
            return
        working = self._with_work() if self._with_work is not None else None
        alive = [m.worker_id for m in self._membership.live_workers()]
        live = sorted(w for w in alive if working is None or w in working)
        if live == self._sent:
            return
        empty = []
        for index, shard in enumerate(self._shards):
            try:
                shard.set_live_workers(live)
            except FailedPreconditionError:
                empty.append(index)  # restarted empty: the chief's poll restores it, then restored() sends
        if empty:  # not recorded as sent: the next sync sends it to every shard again
            log.info("live set not sent to shard(s) %s: restarted, waiting for their restore", empty)
            return
        self._sent = live
        idle = len(alive) - len(live)
        log.info("live workers: %d%s", len(live), f" ({idle} more alive with no data task left)" if idle else "")

    def restored(self, shard: int) -> None:
        """A shard was restored (or started anew): its live set is gone with its old state, send it again."""
        if self._sent is not None:
            self._shards[shard].set_live_workers(self._sent)
            log.info("live workers sent again to restored shard %d", shard)
