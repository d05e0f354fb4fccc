"""A shard's state changes as a log, and their replay: what a backup of a shard applies to hold the same
state as its primary, bit for bit (replicated shards, `--replicas`).

The store records every call that changes its state as an op (StoreOp), with the state lock held, at the
moment the change is made; the journal numbers them 1, 2, ... so the log's order is the order the store
made the changes in. Replayed in that order through the same ShardStore code (`replay`), the ops give a
backup the same values, optimizer slots, versions, answer numbers, row clocks, keyed places and mode state,
and the same answers: `replay` checks each push's answer against the primary's and raises ReplicaDiverged
on a difference, so a backup never silently holds another state.

What is an op: an initialization (with the incarnation it drew) and a restore (with its incarnation); a
push, applied, accumulated or dropped (its call's arguments, the gradients as received, and the answer
given); a sync follower's commit; the chief's live set; a cut's hold that commits sync decisions; and a
pull that changes state (the first row read of a table makes its row clocks; a staleness policy that
corrects with the values a worker read keeps them). A validation error changes nothing and is no op.

The primary waits for its journal's acknowledgement of an op (Journal.wait) before it answers the call
that made it, with no lock held: a push is answered only once the backup has it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from asyncps.errors import FailedPreconditionError
from asyncps.rules import UpdateRuleConfig
from asyncps.rules.initializers import TableSpec
from asyncps.rules.sync.types import Ballot, Decisions, Held
from asyncps.wire.codec import Array, Gradient, IndexArray
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues, Snapshot

if TYPE_CHECKING:
    from asyncps.ps.store import ShardStore

log = logging.getLogger("asyncps.ps")


@dataclass(frozen=True)
class Initialized:
    """`ShardStore.initialize` that created the state, with the incarnation it drew."""

    rule: UpdateRuleConfig
    values: Mapping[str, Array]
    run_id: str
    generated: Mapping[str, TableSpec]
    incarnation: int


@dataclass(frozen=True)
class Restored:
    """`ShardStore.restore`: the snapshot, with the incarnation the state took; or a live state a backup is
    seeded with (ShardStore.attach_journal), whose snapshot carries the live part a checkpoint leaves out
    (Snapshot.live: mode state, values read, retry memo, row clocks; asyncps.ps.live_state)."""

    snapshot: Snapshot


@dataclass(frozen=True)
class Pushed:
    """`ShardStore.push` as called (the gradients as received) and the answer it gave."""

    worker_id: str
    base_version: int
    grads: Mapping[str, Gradient]
    incarnation: int
    step: int | None
    ballot: Ballot | None
    worker_index: int | None
    outcome: PushOutcome


@dataclass(frozen=True)
class Committed:
    """`ShardStore.commit` (a sync follower) as called and the answer it gave."""

    worker_id: str
    ballot: Ballot
    decisions: Decisions
    step: int | None
    worker_index: int | None
    outcome: PushOutcome


@dataclass(frozen=True)
class LiveSet:
    """`ShardStore.set_live_workers`."""

    workers: tuple[str, ...]


@dataclass(frozen=True)
class HeldWith:
    """`ShardStore.hold` with the coordinator's decisions for a sync follower (it commits them)."""

    sync: Decisions
    decisions_since: int


@dataclass(frozen=True)
class Read:
    """`ShardStore.pull` that changed state: it made row clocks, or kept the values read for a policy."""

    worker_id: str
    if_newer_than: int
    rows: Mapping[str, IndexArray]


StoreOp = Initialized | Restored | Pushed | Committed | LiveSet | HeldWith | Read


class Journal(Protocol):
    """Where a store records its ops (with its state lock held) and waits for their acknowledgement."""

    def record(self, op: StoreOp) -> int:
        """Take the next op; its number (1, 2, ...). Must not block on the network: called under the lock."""
        ...

    def wait(self, seq: int) -> None:
        """Return once op `seq` is acknowledged (no lock held); raise when it cannot be."""
        ...


class ReplicaDiverged(FailedPreconditionError):
    """A replayed op did not give the answer the primary gave: the backup's state is not the primary's."""


def replay(store: ShardStore, op: StoreOp) -> PushOutcome | None:
    """Apply one op of a primary's log to `store` through the same calls; a push's or commit's answer,
    checked against the primary's (ReplicaDiverged on a difference, the number included)."""
    if isinstance(op, Initialized):
        store.initialize(op.rule, op.values, op.run_id, op.generated, incarnation=op.incarnation)
        return None
    if isinstance(op, Restored):
        store.restore(op.snapshot)
        return None
    if isinstance(op, Pushed):
        got = store.push(op.worker_id, op.base_version, op.grads, op.incarnation, op.step, op.ballot,
                         op.worker_index)
        return _same(got, op.outcome, f"push of {op.worker_id} (step {op.step})")
    if isinstance(op, Committed):
        got = store.commit(op.worker_id, op.ballot, op.decisions, op.step, op.worker_index)
        return _same(got, op.outcome, f"commit of {op.worker_id} (step {op.step})")
    if isinstance(op, LiveSet):
        store.set_live_workers(op.workers)
        return None
    if isinstance(op, HeldWith):
        store.hold(0.0, op.decisions_since, op.sync)
        return None
    store.pull(op.if_newer_than, op.worker_id, rows=op.rows)
    return None


def _same(got: PushOutcome, want: PushOutcome, what: str) -> PushOutcome:
    if got != want or got.seq != want.seq or got.incarnation != want.incarnation:
        raise ReplicaDiverged(f"the backup answered the {what} with {got} (answer {got.seq}), the primary with "
                              f"{want} (answer {want.seq})")
    return got


class MemoryJournal:
    """A journal kept in memory, every op acknowledged at once (tests; a log read by a replica's stream)."""

    def __init__(self) -> None:
        self.ops: list[StoreOp] = []

    def record(self, op: StoreOp) -> int:
        """Append the op."""
        self.ops.append(op)
        return len(self.ops)

    def wait(self, seq: int) -> None:
        """Nothing to wait for."""

    def replay_into(self, store: ShardStore, ops: Sequence[StoreOp] | None = None) -> None:
        """Replay every op (or `ops`) into `store`, in order."""
        for op in self.ops if ops is None else ops:
            replay(store, op)


class Backup(Protocol):
    """The backup shard as a ForwardingJournal calls it: a shard's transport (asyncps.transport), making one
    attempt per call (a retried push could be applied twice)."""

    def initialize(self, worker_id: str, shard_index: int, num_shards: int, rule: UpdateRuleConfig,
                   values: Mapping[str, Array], run_id: str = "", generated: Mapping[str, TableSpec] | None = None,
                   incarnation: int = 0) -> object:
        """Create the state, with the primary's incarnation."""
        ...

    def restore(self, snap: Snapshot, shard_index: int) -> object:
        """Replace the state (the snapshot names the incarnation)."""
        ...

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply, accumulate or drop a push, or commit (the request carries decisions)."""
        ...

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """The chief's live set."""
        ...

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """A cut's hold (one that commits sync decisions)."""
        ...

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """A read (one that changes state)."""
        ...

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """Ask the backup's process to exit (it is let go: its state is no longer its primary's)."""
        ...


class ForwardingJournal:
    """Forwards a primary store's ops to its backup shard, one at a time in their order, from one sender thread:
    `wait(seq)` returns once the backup applied op `seq` and gave the primary's answer. A backup that fails
    (unreachable, an error, another answer: ReplicaDiverged) is let go: the primary goes on alone, `lost` says
    why (logged once), nothing waits for it any more, and the backup is asked to exit (a backup that may not
    hold its primary's state must never take over)."""

    def __init__(self, backup: Backup, shard_index: int, num_shards: int) -> None:
        self._backup, self._shard_index, self._num_shards = backup, shard_index, num_shards
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, StoreOp]] = collections.deque()
        self._recorded = self._acked = 0
        self._closed = False
        self.lost: str | None = None  # why the backup was let go
        self._sender = threading.Thread(target=self._send, name=f"replica-{shard_index}", daemon=True)
        self._sender.start()

    @property
    def acknowledged(self) -> int:
        """The number of the last op the backup applied."""
        with self._cond:
            return self._acked

    @property
    def recorded(self) -> int:
        """The number of the last op taken."""
        with self._cond:
            return self._recorded

    def record(self, op: StoreOp) -> int:
        """Queue the op for the backup (0: no backup any more, nothing to wait for)."""
        with self._cond:
            if self.lost is not None or self._closed:
                return 0
            self._recorded += 1
            self._queue.append((self._recorded, op))
            self._cond.notify_all()
            return self._recorded

    def wait(self, seq: int) -> None:
        """Until the backup applied op `seq`, or was let go."""
        with self._cond:
            self._cond.wait_for(lambda: self._acked >= seq or self.lost is not None or self._closed)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue or self.lost is not None, timeout=timeout_s)
            self._closed = True
            self._cond.notify_all()
        self._sender.join(timeout_s)

    def _send(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                seq, op = self._queue[0]
            try:
                self._forward(op)
            except Exception as exc:  # the backup is gone or not the primary's any more: go on alone
                with self._cond:
                    self.lost = f"op {seq} ({type(op).__name__}): {type(exc).__name__}: {exc}"
                    self._queue.clear()
                    self._cond.notify_all()
                log.warning("shard %d: its backup is let go, the shard goes on alone: %s", self._shard_index,
                            self.lost)
                try:  # a backup that may not hold its primary's state must never take over: it exits
                    self._backup.shutdown(f"let go by its primary: {self.lost}", deadline_s=2.0)
                except Exception as exc:  # gone already
                    log.info("shard %d: the backup let go did not take its shutdown (%s)", self._shard_index, exc)
                return
            with self._cond:
                self._queue.popleft()
                self._acked = seq
                self._cond.notify_all()

    def _forward(self, op: StoreOp) -> None:
        backup = self._backup
        if isinstance(op, Initialized):
            made = backup.initialize("primary", self._shard_index, self._num_shards, op.rule, op.values, op.run_id,
                                     op.generated, incarnation=op.incarnation)
            if not getattr(made, "created", True):  # it holds a state already (ahead of this one, or another)
                raise ReplicaDiverged(f"the backup already holds a state (at version {getattr(made, 'version', '?')}):"
                                      " a backup starts empty, or is seeded whole from its primary")
        elif isinstance(op, Restored):
            backup.restore(op.snapshot, self._shard_index)
        elif isinstance(op, Pushed):
            got = backup.push(PushRequest(op.worker_id, op.base_version, op.grads, op.step or 0, 0.0, op.incarnation,
                                          op.ballot, None, op.worker_index))
            _same(got, op.outcome, f"push of {op.worker_id} (step {op.step})")
        elif isinstance(op, Committed):
            got = backup.push(PushRequest(op.worker_id, 0, {}, op.step or 0, 0.0, 0, op.ballot, op.decisions,
                                          op.worker_index))
            _same(got, op.outcome, f"commit of {op.worker_id} (step {op.step})")
        elif isinstance(op, LiveSet):
            backup.set_live_workers(list(op.workers))
        elif isinstance(op, HeldWith):
            backup.hold(0.0, op.decisions_since, op.sync)
        else:
            backup.pull(op.worker_id, op.if_newer_than, rows=op.rows)


__all__ = [
    "Backup",
    "Committed",
    "ForwardingJournal",
    "HeldWith",
    "Initialized",
    "Journal",
    "LiveSet",
    "MemoryJournal",
    "Pushed",
    "Read",
    "ReplicaDiverged",
    "Restored",
    "StoreOp",
    "replay",
]
