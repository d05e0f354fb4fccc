"""The shard's service layer: push -> wait -> pull, waiter slots, refusals and byte counters.

Transport adapters (the gRPC servicer) translate their messages to these calls and back; what a
call means, how long it may block and what it counts is decided here, once for every transport.
A worker's step enters the store once per phase (apply, wait, read; see ps/store.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping

from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError, UnavailableError
from asyncps.rules import UpdateRuleConfig
from asyncps.rules.initializers import TableSpec
from asyncps.rules.sync.types import Decisions, Held
from asyncps.wire.codec import Array, IndexArray
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues, Snapshot, StoreStats

# Blocking waits (sync steps, SSP gates, long polls) allowed at once; a server must have more
# handler threads than this, so waiters can never starve other calls.
DEFAULT_MAX_WAITERS = 192


class ShardService:
    """One shard's operations in domain terms, shared by every transport."""

    def __init__(self, store: ShardStore, max_waiters: int = DEFAULT_MAX_WAITERS) -> None:
        self.store = store
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._counter_lock = threading.Lock()
        self._bytes_pulled = 0
        self._bytes_pushed = 0
        self._pulled_by: dict[str, int] = {}
        self._pushed_by: dict[str, int] = {}
        self._refused: dict[str, int] = {}  # reads refused, by why (SSP's bound): deadline, no_slot

    @property
    def shard_index(self) -> int:
        """Which shard this is (for reply headers and checkpoints)."""
        return self.store.shard_index

    @contextlib.contextmanager
    def _waiter(self) -> Iterator[bool]:
        """A slot for a blocking wait; when every slot is taken the call answers at once instead,
        so long polls can never occupy all handler threads."""
        acquired = self._waiters.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                self._waiters.release()

    def count(self, transport: str, pulled: int = 0, pushed: int = 0) -> None:
        """Tensor bytes `transport` (its registry name) sent (pulled) or received (pushed)."""
        with self._counter_lock:
            self._bytes_pulled += pulled
            self._bytes_pushed += pushed
            if pulled:
                self._pulled_by[transport] = self._pulled_by.get(transport, 0) + pulled
            if pushed:
                self._pushed_by[transport] = self._pushed_by.get(transport, 0) + pushed

    def initialize(self, rule: UpdateRuleConfig, values: Mapping[str, Array], run_id: str = "",
                   generated: Mapping[str, TableSpec] | None = None, incarnation: int = 0) -> tuple[bool, int]:
        """Create the variables, those in `generated` made here (idempotent for the same run), with
        `incarnation` (0: drawn); (created, version)."""
        created = self.store.initialize(rule, values, run_id, generated, incarnation)
        return created, self.store.version

    def pull(self, worker_id: str, if_newer_than: int, wait_s: float = 0.0,
             rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """The values, after a long-poll of up to wait_s for a version newer than if_newer_than
        (with the sync coordinator's decisions since if_newer_than); the parts in `rows` as those rows,
        whatever the version."""
        if wait_s > 0:
            with self._waiter() as may_wait:
                if may_wait:
                    self.store.wait_newer(if_newer_than, wait_s)
        return self.store.pull(if_newer_than, worker_id, decisions_since=if_newer_than, rows=rows)

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply, accumulate or drop one gradient (a sync commit when it carries decisions)."""
        if request.decisions is not None:
            if request.grads or request.ballot is None:
                raise InvalidArgumentError("a sync commit carries the worker's ballot and no gradients")
            return self.store.commit(request.worker_id, request.ballot, request.decisions, request.step,
                                     request.worker_index)
        return self.store.push(request.worker_id, request.base_version, request.grads, request.incarnation,
                               request.step, request.ballot, request.worker_index)

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int, read_wait_s: float,
        rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome, ShardValues]:
        """Push, wait until the consistency model lets the worker read (up to read_wait_s), pull (the
        parts in `rows` as those rows). The rows asked are checked before the push is applied, so a bad
        row read changes nothing.

        With strict reads (SSP) a worker that still may not read gets no values: the call fails
        (UNAVAILABLE, counted as refused for lack of a waiting slot or at the deadline) and the
        worker repeats it; the shard recognizes the repeated push and does not apply it twice.
        """
        if rows:
            self.check_rows(rows)  # a bad row read refuses the whole request before the push applies
        outcome = self.push(request)  # apply: one store entry
        waited = 0.0
        if request.decisions is None:  # a sync commit never waits
            waited = self._wait_readable(request, read_wait_s)  # wait: one store entry
        # read: one store entry, the values and the sync coordinator's decisions of one instant
        values = self.store.pull(pull_if_newer_than, request.worker_id, decisions_since=request.base_version,
                                 rows=rows)
        return outcome, dataclasses.replace(values, waited_s=waited)

    def check_rows(self, rows: Mapping[str, IndexArray]) -> None:
        """The rows a push-pull reads, checked as the store's read will (ShardStore.check_rows) before its push,
        so that a refused read leaves its push unapplied; an uninitialized shard: the push refuses first."""
        if self.store.rule is not None:
            self.store.check_rows(rows)

    def _wait_readable(self, request: PushRequest, read_wait_s: float) -> float:
        """Wait (with a waiting slot, up to read_wait_s) until the worker may read; the seconds
        waited. A worker that still may not read with strict reads is refused (counted here)."""
        refused = "deadline"
        if read_wait_s > 0:
            with self._waiter() as may_wait:
                gate = self.store.wait_readable(request.worker_id, request.base_version,
                                                read_wait_s if may_wait else 0.0)
            refused = "deadline" if may_wait else "no_slot"
        else:
            gate = self.store.wait_readable(request.worker_id, request.base_version, 0.0)
        if gate.readable or not gate.strict:
            return gate.waited_s
        with self._counter_lock:
            self._refused[refused] = self._refused.get(refused, 0) + 1
        raise UnavailableError(
            f"{request.worker_id} leads the slowest live worker by more than the bound"
            + (" and every waiting slot is taken" if refused == "no_slot" else f" after {gate.waited_s:.2f}s")
            + f" (shard {self.shard_index}); its push was applied once, repeat the call to read")

    def stats(self) -> StoreStats:
        """Counters, variable metadata, the bytes moved and the reads refused (in mode_stats)."""
        with self._counter_lock:
            pulled, pushed = self._bytes_pulled, self._bytes_pushed
            pulled_by, pushed_by = dict(self._pulled_by), dict(self._pushed_by)
            refused = {f"refused_{why}": float(n) for why, n in self._refused.items()}
        stats = self.store.stats()
        return dataclasses.replace(stats, shard_index=self.shard_index, bytes_pulled=pulled, bytes_pushed=pushed,
                                   bytes_pulled_by_transport=pulled_by, bytes_pushed_by_transport=pushed_by,
                                   mode_stats={**stats.mode_stats, **refused})

    def stop(self) -> None:
        """The shard is stopping: every blocked call answers now, pushes are refused (UNAVAILABLE)."""
        self.store.stop()

    def set_live_workers(self, worker_ids: list[str]) -> int:
        """Update the live set used by the consistency model; the version."""
        self.store.set_live_workers(worker_ids)
        return self.store.version

    def pause(self, hold_s: float) -> int:
        """Hold (hold_s > 0) or release pushes; the version."""
        return self.store.pause(hold_s)

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """Hold or release pushes; in multi-shard sync also bring a follower to the cut (ShardStore.hold)."""
        return self.store.hold(hold_s, decisions_since, sync)

    def snapshot(self) -> Snapshot:
        """The whole state for a checkpoint."""
        return self.store.snapshot()

    def restore(self, snap: Snapshot) -> int:
        """Replace the state with a checkpoint's part; the version."""
        self.store.restore(snap)
        return snap.version


__all__ = ["DEFAULT_MAX_WAITERS", "ShardService"]
