"""The state of one parameter-server shard: variables, optimizer slots, version, counters.

No grpc here: the servicer adapts the wire to this object, and tests drive it directly.

The consistency mode is injected (like ps-lite's request handle): the store drives it through the
`Consistency` interface only and never names a concrete mode. The mode owns the multi-shard sync
protocol: `commit` (a follower applies the coordinator's decided steps), `decisions` (what shard 0
decided) and `hold` (where a shard stands at a cut); for async and SSP they are no-ops. Its hooks
act on the store through `_ModeHandle` (apply a step, count a drop). The store keeps the values,
the optimizer slots, the version, the counters and the validation of every request.

Locking: every variable has its own lock, and one state lock (the version condition) guards the
version, the counters and the mode; every mode method runs with the state lock held. A worker's
step enters the store once per phase, each taking its locks once (ShardService.push_pull drives them):
- apply (`push`, or `commit` on a sync follower): the locks of the variables it touches (in name
  order, so two pushes never deadlock; every lock for a commit, or a mode that may complete a step),
  then the state lock, held for admission, the update and the version bump, so applying a push and
  bumping the version is atomic and no update is lost;
- wait (`wait_readable`): the state lock only, released while waiting on it;
- read (`pull`): every variable lock, then the state lock, so the values it returns are a model
  that existed at the version it reports (and the sync decisions are those of the same instant).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from asyncps.ps.keyed import KEYS, TOUCHED, KeyedRows
from asyncps.ps.live_state import LiveState, check_mode, decode_live, encode_live
from asyncps.ps.policy_state import ReadValues, RowState
from asyncps.ps.replica import Committed, HeldWith, Initialized, Journal, LiveSet, Pushed, Read, Restored, StoreOp

from asyncps.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NonFiniteGradientError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from asyncps.rules import UpdateRuleConfig
from asyncps.rules.consistency import Consistency, RetryMemo, Verdict
from asyncps.rules.initializers import TableSpec
from asyncps.rules.optimizers import Optimizer, make_optimizer
from asyncps.rules.policies import PushContext, StalenessPolicy
from asyncps.rules.sync.types import Ballot, Decisions, Held, Resolution
from asyncps.wire.codec import Array, Gradient, IndexArray, SparseRows, all_finite, check_row_ids, coalesce_rows
from asyncps.wire.shard import DropReason, PushOutcome, RowStaleness, ShardValues, Snapshot, StoreStats

#: The most rows one request may read of one part (a reply of 2^20 rows of 64 float32 is 256 MiB).
MAX_ROWS_PER_READ = 1 << 20
#: The consistency modes a keyed part trains in (a push applied as it arrives: see _check_keyed_rule).
KEYED_MODES = ("async", "ssp")
#: A row is hot (RowStaleness.hot_rows) when it took part in at least this share of its table's updates
#: since its clock was made (before 1 / HOT_SHARE updates: in at least one): popularity as the shard sees it,
#: whatever the ids' numbering
HOT_SHARE = 0.01


class Answers:
    """The answers a shard's state has given to pushes, the ones workers record in pushes.csv: in all
    and by worker index (-1: a push that named none). Each answer carries its number (PushOutcome.seq);
    a snapshot keeps the counts, so after a restore an answer numbered above the restored count is one
    the restore took back, and the final counts against pushes.csv say which answers no worker
    reported (those of workers killed before their report). Guarded by the store's state lock."""

    def __init__(self, total: int = 0, by_worker: Mapping[int, int] | None = None) -> None:
        self.total = total
        self._by_worker = collections.Counter(by_worker or {})

    def give(self, outcome: PushOutcome, worker_index: int | None, incarnation: int) -> PushOutcome:
        """Count one answer; the outcome numbered, with the `incarnation` of the state that gave it."""
        self.total += 1
        self._by_worker[-1 if worker_index is None else worker_index] += 1
        return dataclasses.replace(outcome, seq=self.total, incarnation=incarnation)

    def by_worker(self) -> dict[int, int]:
        """The answers by worker index."""
        return dict(self._by_worker)


@dataclass
class _Variable:
    value: Array
    slots: dict[str, Array]
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0
    policy_state: RowState = field(init=False)  # the staleness policy's state, per row

    def __post_init__(self) -> None:
        self.policy_state = RowState(_state_shape(self.value))
    shared: bool = False  # `value` was handed to a reader: read-only, copy before the next update
    # per row, the updates it received since the first row read of the variable (made then: a variable
    # never read by rows keeps none); served with each row read, for per-row staleness
    clock: npt.NDArray[np.int64] | None = None
    clock_base: int = 0  # `updates` when the clock was made
    generated: TableSpec | None = None  # made by the shard from a row initializer (initialize)
    keyed: KeyedRows | None = None  # a keyed part's key -> row (asyncps.ps.keyed): its rows are places
    # non-trainable state (UpdateRuleConfig.state): a push carries its delta, added as is (no optimizer, no slots)
    state: bool = False

    def count_update(self, grad: Gradient) -> None:
        """Advance the row clocks of the rows an update touches (every row for a dense one)."""
        if self.clock is None:
            return
        if isinstance(grad, SparseRows):
            self.clock[np.unique(grad.indices)] += 1
        else:
            self.clock += 1




def _row_state(var: _Variable) -> dict[str, Array]:
    """A variable's per-row state in a snapshot: its policy's, and a keyed part's keys (asyncps.ps.keyed)."""
    state = var.policy_state.export()
    if var.keyed is not None:
        state.update(var.keyed.export())
    return state


def _state_shape(value: Array) -> tuple[int, ...]:
    """The shape policy state is kept in: the variable's, a scalar's as one row."""
    return tuple(value.shape) if value.ndim else (1,)


def _is_float(dtype: np.dtype[Any]) -> bool:
    return bool(np.issubdtype(dtype, np.floating))


def _rows_read(seen: Gradient, rows: IndexArray, now: Array) -> Array:
    """The values rows `rows` had when a worker read them (`seen`: the whole variable, or the rows it read
    by id); a row it did not read: its value now."""
    if not isinstance(seen, SparseRows):
        return seen[rows]
    at = np.minimum(np.searchsorted(seen.indices, rows), max(0, seen.indices.size - 1))
    found = seen.indices[at] == rows if seen.indices.size else np.zeros(rows.shape, dtype=bool)
    out: Array = np.where(found.reshape(-1, *([1] * (now.ndim - 1))), seen.values[at] if seen.indices.size else now,
                          now)
    return out


def _check_keyed_rule(rule: UpdateRuleConfig, generated: Mapping[str, TableSpec]) -> None:
    """InvalidArgumentError when a keyed part meets a rule it cannot serve: a push applies to a keyed part
    at once (keys become places as it enters), so a mode that accumulates or decides steps (sync, the
    K-variants) or a policy that corrects with the values read (they are kept by place) is refused."""
    keyed = sorted(name for name, spec in generated.items() if spec.keyed)
    if not keyed:
        return
    mode = rule.mode.partition(":")[0]
    if mode not in KEYED_MODES:
        raise InvalidArgumentError(f"{keyed}: keyed tables train in the modes {', '.join(KEYED_MODES)}, "
                                   f"not {rule.mode!r}")
    if rule.policy().needs_read_values:
        raise InvalidArgumentError(f"{keyed}: keyed tables cannot use the staleness policy "
                                   f"{rule.staleness_policy!r} (it corrects with the values read)")


def _make_keyed(var: _Variable, spec: TableSpec, rows: KeyedRows | None = None) -> None:
    """Make `var` a keyed part of `spec` (its rows: `rows`, or none yet), with its row clocks."""
    var.generated = spec
    var.keyed = rows if rows is not None else KeyedRows(spec.shape[0])
    var.clock = np.zeros(spec.shape[0], dtype=np.int64)
    var.clock_base = 0


def _generate(name: str, spec: TableSpec) -> Array:
    """A generated table's values; InvalidArgumentError naming the part when its spec is not one."""
    nbytes = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize if spec.shape else 0
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > available:
        raise ResourceExhaustedError(f"{name}: a generated table of {nbytes / 2**20:.0f} MiB does not fit this "
                                     f"shard's free memory ({available / 2**20:.0f} MiB)")
    try:
        return spec.make()
    except (ValueError, TypeError, MemoryError) as exc:
        raise InvalidArgumentError(f"{name}: cannot make the table {list(spec.shape)} {spec.dtype} "
                                   f"({spec.init.spec}): {exc}") from None




class _ModeHandle:
    """The store as its mode's protocol hooks see it (asyncps.rules.consistency.ShardHandle): used
    only inside a store call, with the locks that call holds."""

    def __init__(self, store: ShardStore) -> None:
        self._store = store

    @property
    def version(self) -> int:
        """The store's version."""
        return self._store._version

    @property
    def incarnation(self) -> int:
        """The store's incarnation."""
        return self._store._incarnation

    def apply_step(self, grads: Mapping[str, Gradient]) -> None:
        """Apply one averaged step (every variable lock held)."""
        self._store._apply_step(grads)

    def count_drop(self, reason: DropReason) -> None:
        """Count a dropped gradient."""
        self._store._count_drop(reason)


@dataclass(frozen=True)
class _Part:
    """A part of a push as the staleness policy keeps it: the gradient (a sparse one cut to its kept rows)
    with its learning rate's scale, or one scale per row (a per-row policy's, strictly increasing rows)."""

    grad: Gradient
    lr_scale: float = 1.0
    row_scale: Array | None = None


def _rows_once(grad: SparseRows, ages: npt.NDArray[np.int64]) -> tuple[SparseRows, npt.NDArray[np.int64]]:
    """A sparse gradient with each row once, sorted (duplicates summed, read at their earliest clock, as stale
    as their stalest), with the rows' staleness: a per-row learning rate needs each row named once."""
    if grad.indices.size < 2 or bool(np.all(grad.indices[1:] > grad.indices[:-1])):
        return grad, ages
    order = np.argsort(grad.indices, kind="stable")
    ordered = grad.indices[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    assert grad.clocks is not None
    return (SparseRows(ordered[starts], np.add.reduceat(grad.values[order], starts, axis=0),
                       np.minimum.reduceat(grad.clocks[order], starts)), np.maximum.reduceat(ages[order], starts))


@dataclass(frozen=True)
class ReadGate:
    """The wait phase's answer: may the worker read, how long it waited, and whether a worker that
    may not read must get no values (the mode's strict reads)."""

    readable: bool
    waited_s: float
    strict: bool


class ShardStore:
    """Variables of one shard with their optimizer state and a monotonically increasing version."""

    def __init__(self, shard_index: int = 0, clock: Callable[[], float] = time.monotonic,
                 enforce_bounds: bool = True, state_lock: threading.Condition | None = None) -> None:
        self.shard_index = shard_index
        # False only in tests that show what SSP's bound prevents (ASYNCPS_TEST_NO_SSP_GATE)
        self._enforce_bounds = enforce_bounds
        self._clock = clock
        self._init_lock = threading.Lock()
        # the state lock (tests inject an instrumented one to count how often a step takes it)
        self._version_cond = state_lock if state_lock is not None else threading.Condition()
        self._vars: dict[str, _Variable] = {}
        self._rule: UpdateRuleConfig | None = None
        self._optimizer: Optimizer | None = None
        self._policy: StalenessPolicy | None = None
        self._mode: Consistency | None = None  # the consistency mode's state, accumulation included
        self._reads = ReadValues()  # the values each worker read, by version (staleness policies)
        self._version = 0
        self._accepted = 0
        self._dropped = 0
        self._dropped_by_reason: dict[str, int] = {}
        self._answers = Answers()  # the answers workers record (PushOutcome.seq), restored with the state
        self._incarnation = 0
        self._run_id = ""  # the run this state belongs to (set by initialize and restore)
        self._paused_until = 0.0  # pushes wait while clock() < this (a checkpoint cut)
        self._stopping = False  # set by stop(): every wait returns, new pushes are refused
        self._handle = _ModeHandle(self)  # what the mode's protocol hooks act on
        self._journal: Journal | None = None  # where state changes are recorded for a backup (asyncps.ps.replica)
        self._last_pushes: RetryMemo[PushOutcome] = RetryMemo()  # each worker's last push (_retries)
        self._last_commits: RetryMemo[PushOutcome] = RetryMemo()  # each worker's last sync commit (commit)
        self._recorded = threading.local()  # per calling thread: the number of its last op, to wait for

    # -- replication ----------------------------------------------------------------------
    def attach_journal(self, journal: Journal | None) -> None:
        """Record every state change in `journal` from now on (None: stop), in the order they are made; an
        initialized state is recorded first, whole (a Restored op of its snapshot and incarnation), so a
        backup seeded from the journal starts from where the primary stands."""
        with self._init_lock, self._all_locks(), self._version_cond:
            if journal is not None and self._rule is not None:
                assert self._mode is not None
                clocks = {name: (var.clock, var.clock_base) for name, var in self._vars.items()
                          if var.clock is not None and var.keyed is None}
                try:
                    live = encode_live(LiveState(self._mode, self._reads, self._last_pushes, self._last_commits,
                                                 dict(self._dropped_by_reason), clocks))
                except TypeError as exc:  # a plugin mode's own objects: nothing is attached
                    raise FailedPreconditionError(f"this shard's live state cannot seed a backup: {exc}") from None
                journal.record(Restored(dataclasses.replace(self._snapshot(), incarnation=self._incarnation,
                                                            live=live)))
            self._journal = journal

    def _record(self, op: StoreOp) -> None:
        """Record a state change (the lock that orders it held); the caller waits for it before answering."""
        if self._journal is not None:
            self._recorded.seq = self._journal.record(op)

    def _acknowledged(self) -> None:
        """Wait (no lock held) until the backup acknowledged the state change this thread's call made."""
        seq = getattr(self._recorded, "seq", 0)
        if seq:
            self._recorded.seq = 0
            journal = self._journal
            if journal is not None:
                journal.wait(seq)

    # -- initialization -------------------------------------------------------------------
    def initialize(self, rule: UpdateRuleConfig, values: Mapping[str, Array], run_id: str = "",
                   generated: Mapping[str, TableSpec] | None = None, incarnation: int = 0) -> bool:
        """Create the variables; True if created, False if an identical init already happened.
        `incarnation`: the one the state takes (a backup's, the primary's); 0: drawn here.

        `generated` names parts the shard makes itself from their row initializer (tables too large
        to send: asyncps.rules.initializers), beside the `values` sent. A conflicting re-initialization
        (other rule, names, shapes, dtypes, values or table specs, or another run's id) raises
        AlreadyExistsError and changes nothing.
        """
        if incarnation < 0:
            raise InvalidArgumentError(f"an initialized incarnation must be > 0 (0: the shard draws one), got "
                                       f"{incarnation}")
        generated = dict(generated or {})
        # A shard may hold no variables: placement can leave one empty (fewer variables than shards).
        for name, value in values.items():
            if not _is_float(value.dtype):
                raise InvalidArgumentError(f"{name}: variables must be floating point, got {value.dtype}")
            if not all_finite(value):
                raise InvalidArgumentError(f"{name}: initial value contains NaN or Inf")
        both = sorted(set(values) & set(generated))
        if both:
            raise InvalidArgumentError(f"{both}: sent with values and as generated tables")
        with self._init_lock:
            if self._rule is not None:
                if run_id and self._run_id and run_id != self._run_id:
                    raise AlreadyExistsError(f"shard already holds the state of run {self._run_id!r}, "
                                             f"not {run_id!r}")
                self._check_same_init(rule, values, generated)
                return False
            _check_keyed_rule(rule, generated)
            optimizer = make_optimizer(rule.optimizer)
            made = {name: _generate(name, spec) for name, spec in generated.items()}
            state = set(rule.state)
            if state & set(made):
                raise InvalidArgumentError(f"{sorted(state & set(made))}: a generated table cannot be state")
            variables = {name: _Variable(value=np.array(value, copy=True),
                                         slots={} if name in state else optimizer.init_slots(value),
                                         state=name in state)
                         for name, value in values.items()}
            for name, value in made.items():
                variables[name] = _Variable(value=value, slots=optimizer.init_slots(value), generated=generated[name])
                if generated[name].keyed:
                    _make_keyed(variables[name], generated[name])
            self._vars = dict(sorted(variables.items()))
            self._optimizer = optimizer
            self._policy = rule.policy()
            self._mode = self._start_mode(rule)
            self._last_pushes = RetryMemo()
            self._last_commits = RetryMemo()
            self._incarnation = incarnation or secrets.randbits(62) + 1
            self._run_id = run_id
            self._rule = rule
            self._record(Initialized(rule, dict(values), run_id, generated, self._incarnation))
        self._acknowledged()
        return True

    def _start_mode(self, rule: UpdateRuleConfig) -> Consistency:
        mode = rule.consistency().start(rule.num_workers, self.shard_index)
        mode.enforce_bound = self._enforce_bounds
        return mode

    def _check_same_init(self, rule: UpdateRuleConfig, values: Mapping[str, Array],
                         generated: Mapping[str, TableSpec]) -> None:
        if rule != self._rule:
            raise AlreadyExistsError(f"shard already initialized with a different rule: {self._rule}")
        names = set(values) | set(generated)
        if names != set(self._vars):
            raise AlreadyExistsError(f"shard already initialized with variables {sorted(self._vars)}, "
                                     f"not {sorted(names)}")
        for name, spec in generated.items():
            var = self._vars[name]  # restored from a checkpoint: made once, its spec not kept
            made = var.generated if var.generated is not None else TableSpec(var.value.shape, var.value.dtype.name,
                                                                             spec.row_start, spec.init)
            if made != spec:
                raise AlreadyExistsError(f"{name}: already initialized as {made}, not {spec}")
        # Compare against the initial values is impossible once training moved them, so an
        # identical re-init means: same names, shapes and dtypes, and (before any update) values.
        with self._all_locks():
            for name, value in values.items():
                var = self._vars[name]
                if var.generated is not None:
                    raise AlreadyExistsError(f"{name}: already initialized as a generated table, not with values")
                if var.value.shape != value.shape or var.value.dtype != value.dtype:
                    raise AlreadyExistsError(
                        f"{name}: already initialized as {var.value.dtype}{list(var.value.shape)}, "
                        f"not {value.dtype}{list(value.shape)}"
                    )
                if self._version == 0 and not np.array_equal(var.value, value):
                    raise AlreadyExistsError(f"{name}: already initialized with different values")

    # -- pull -----------------------------------------------------------------------------
    def pull(self, if_newer_than: int = -1, worker_id: str = "", decisions_since: int = -1,
             rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """The read phase: the values at the current version (one consistent model), or None when
        not newer than `if_newer_than`, with the sync coordinator's decisions for steps >=
        `decisions_since` (none when negative, or on a shard that decides none).

        Row reads: each part named in `rows` is served as exactly those rows (ShardValues.rows, with
        each row's clock), whatever the version, and is never among the values. Ids are validated
        first (NotFoundError for an unknown part, InvalidArgumentError for ids that are not int64,
        1-D, strictly increasing and within the part's rows, or more than MAX_ROWS_PER_READ).

        Costs no copy of what is read whole: the returned arrays are marked read-only and shared, and
        the next update of a shared variable copies it first (copy-on-write), so a reply can be encoded
        and sent with no lock held while pushes go on; rows are copied out (a row read never makes a
        table shared). When the staleness policy corrects gradients with the values a worker read, the
        same arrays are kept for it. Takes every variable lock and the state lock once; a pull that
        asks only for newer values (and no rows) first checks the version with the state lock alone,
        so a long poll's "not modified" never waits for pushes.
        """
        self._require_initialized()
        assert self._policy is not None
        rows = dict(rows or {})
        self._check_rows(rows)
        if if_newer_than >= 0 and not rows:
            with self._version_cond:
                if self._version <= if_newer_than:
                    return ShardValues(self._version, self._incarnation, None,
                                       decisions=self._decisions(decisions_since))
        with self._all_locks(), self._version_cond:
            decisions = self._decisions(decisions_since)
            clocks_made = any(self._vars[name].clock is None and self._vars[name].keyed is None for name in rows)
            read = {name: self._read_rows(self._vars[name], ids) for name, ids in rows.items()} or None
            keep: dict[str, Gradient] = dict(read or {})
            values: dict[str, Array] | None = None
            if self._version > if_newer_than:
                values = {}
                for name, var in self._vars.items():
                    if name in rows or var.keyed is not None:  # a keyed part is only ever read by keys
                        continue
                    if not var.shared:
                        var.value.flags.writeable = False
                        var.shared = True
                    values[name] = var.value
                keep.update(values)
            kept = self._policy.needs_read_values and bool(worker_id) and bool(keep)
            if kept:
                self._reads.keep(worker_id, self._version, keep)
            if clocks_made or kept:
                self._record(Read(worker_id, if_newer_than, rows))
            reply = ShardValues(self._version, self._incarnation, values, decisions=decisions, rows=read)
        self._acknowledged()
        return reply

    def check_rows(self, rows: Mapping[str, IndexArray]) -> None:
        """The rows a read asks, checked as `pull` checks them (NotFoundError for a part this shard does
        not hold, InvalidArgumentError for ids that break asyncps.wire.codec.check_row_ids): a push-pull
        checks its read's rows before its push, so a refused read leaves the push unapplied."""
        self._require_initialized()
        self._check_rows(rows)

    def _check_rows(self, rows: Mapping[str, IndexArray]) -> None:
        for name, ids in rows.items():
            var = self._vars.get(name)
            if var is None:
                raise NotFoundError(f"rows asked of unknown variable {name!r} on shard {self.shard_index}")
            if var.value.ndim == 0:
                raise InvalidArgumentError(f"{name}: a scalar has no rows to read")
            check_row_ids(name, ids, None if var.keyed is not None else var.value.shape[0], MAX_ROWS_PER_READ)

    @staticmethod
    def _read_rows(var: _Variable, ids: IndexArray) -> SparseRows:
        """Rows `ids` of a variable with their clocks (copies; the variable's locks held); of a keyed part,
        the rows of keys `ids`, those of keys it holds no row for made from its initializer (clock 0)."""
        if var.keyed is not None:
            assert var.generated is not None and var.clock is not None
            places = var.keyed.find(ids)
            held = places >= 0
            values = np.empty((ids.size, *var.value.shape[1:]), dtype=var.value.dtype)
            values[held] = var.value[places[held]]
            values[~held] = var.generated.init.rows_at(ids[~held], var.value.shape[1:], var.value.dtype)
            clocks = np.where(held, var.clock[np.maximum(places, 0)], 0)
            return SparseRows(np.array(ids, copy=True), values, clocks)
        if var.clock is None:
            var.clock = np.zeros(var.value.shape[0], dtype=np.int64)
            var.clock_base = var.updates
        return SparseRows(np.array(ids, copy=True), var.value[ids], var.clock[ids])

    def wait_readable(self, worker_id: str, base_version: int, timeout_s: float) -> ReadGate:
        """The wait phase: block until the consistency model lets worker_id read, or up to
        timeout_s (0: only check); whether it may read, the seconds waited and whether a worker
        that may not read must get no values (strict reads, SSP's bound). One state-lock entry."""
        self._require_initialized()
        assert self._mode is not None
        mode = self._mode
        start = self._clock()
        with self._version_cond:
            if mode.readable(worker_id, base_version, self._version):
                return ReadGate(True, 0.0, mode.strict_reads)
            readable = timeout_s > 0 and self._version_cond.wait_for(
                lambda: self._stopping or mode.readable(worker_id, base_version, self._version), timeout=timeout_s)
            readable = readable and not self._stopping
            strict = mode.strict_reads
        return ReadGate(readable, self._clock() - start if timeout_s > 0 else 0.0, strict)

    def decisions_since(self, step: int) -> Decisions | None:
        """The coordinator's decisions for steps >= step (None: this shard decides none)."""
        with self._version_cond:
            return self._decisions(step)

    def _decisions(self, step: int) -> Decisions | None:
        """decisions_since with the state lock held (the mode's: none but on a coordinator)."""
        return self._mode.decisions(self._handle, step) if self._mode is not None else None

    def commit(self, worker_id: str, ballot: Ballot, decisions: Decisions, step: int | None = None,
               worker_index: int | None = None) -> PushOutcome:
        """Hand another shard's decided steps to the mode, which applies them (a follower of a
        coordinated mode; InvalidArgumentError on others); what became of worker_id's gradient
        staged under `ballot` (accepted while it is still staged): the answer the worker records
        for this shard (counted, PushOutcome.seq)."""
        self._require_initialized()
        assert self._rule is not None
        call_ballot = ballot
        ballot = ballot.naming(step)
        lr = self._rule.optimizer.rate_at(self._version)
        with self._unpaused(sorted(self._vars)):  # a cut holds commits too
            assert self._mode is not None
            # a commit answered by a primary that died before its answer arrived, repeated to the backup that
            # took over: its first answer again, not a second one (the worker records one per step)
            # (a memo of its own: the worker's staging of the same step is remembered as a push)
            repeated = self._last_commits.repeated(worker_id, step or None)
            if repeated is not None:
                return repeated
            try:
                resolution = self._mode.commit(self._handle, worker_id, ballot, decisions)
            finally:
                self._version_cond.notify_all()
            # the commit is the answer a worker records for this shard (its staging was not)
            if resolution is None:
                outcome = PushOutcome(True, 0, self._version, lr)
            elif resolution.accepted:
                outcome = PushOutcome(True, resolution.staleness, resolution.version, lr)
            else:
                assert resolution.drop is not None
                outcome = PushOutcome(False, resolution.staleness, resolution.version, 0.0, resolution.drop,
                                      resolution.reason)
            outcome = self._last_commits.remember(worker_id, step or None,
                                                  self._answers.give(outcome, worker_index, self._incarnation))
            self._record(Committed(worker_id, call_ballot, decisions, step, worker_index, outcome))
        self._acknowledged()
        return outcome

    def set_live_workers(self, workers: Iterable[str]) -> None:
        """The chief's live set: a synchronous quorum shrinks or grows, SSP stops waiting for the dead."""
        self._require_initialized()
        assert self._mode is not None
        workers = tuple(workers)
        with self._all_locks(), self._version_cond:
            self._mode.set_live(workers)
            self._maybe_complete_step()
            self._version_cond.notify_all()
            self._record(LiveSet(workers))
        self._acknowledged()

    def wait_newer(self, version: int, timeout_s: float) -> int:
        """Block until the shard's version exceeds `version` or timeout; return the version."""
        with self._version_cond:
            self._version_cond.wait_for(lambda: self._stopping or self._version > version, timeout=max(0.0, timeout_s))
            return self._version

    def values(self) -> dict[str, Array]:
        """A consistent copy of every variable (tests, checkpoints)."""
        self._require_initialized()
        with self._all_locks():
            return {name: var.value.copy() for name, var in self._vars.items()}

    # -- push -----------------------------------------------------------------------------
    def push(
        self, worker_id: str, base_version: int, grads: Mapping[str, Gradient], incarnation: int = 0,
        step: int | None = None, ballot: Ballot | None = None, worker_index: int | None = None,
    ) -> PushOutcome:
        """Apply, accumulate (sync) or drop one gradient computed from `base_version`; never partially.
        Answered once a journal's backup has it (asyncps.ps.replica).

        Everything is validated before any state changes: unknown names (NotFoundError), shape,
        dtype, indices, NaN/Inf and versions from the future (InvalidArgumentError). A sync push
        with a ballot may carry no gradients (the worker's step touched nothing on this shard).
        With strict reads (SSP) a push of the same worker `step` as its last one is the retry of a
        call whose read was refused: it is not applied again, its first outcome is the answer.
        """
        outcome = self._push(worker_id, base_version, grads, incarnation, step, ballot, worker_index)
        self._acknowledged()
        return outcome

    def _push(
        self, worker_id: str, base_version: int, grads: Mapping[str, Gradient], incarnation: int,
        step: int | None, ballot: Ballot | None, worker_index: int | None,
    ) -> PushOutcome:
        call = (worker_id, base_version, grads, incarnation, step, ballot, worker_index)  # as a backup replays it
        self._require_initialized()
        if not grads and ballot is None:
            raise InvalidArgumentError("push without gradients")
        if ballot is not None:
            ballot = ballot.naming(step)  # names the gradient (modes that decide pushes)
        if base_version < 0:
            raise InvalidArgumentError(f"base_version must be >= 0, got {base_version}")
        for name, grad in grads.items():
            self._validate_gradient(name, grad)
        assert self._optimizer is not None and self._policy is not None and self._rule is not None
        assert self._mode is not None
        names = sorted(self._vars) if self._mode.exclusive else sorted(grads)
        # one state-lock entry for admission, update and version bump: the variable locks already
        # order pushes to the same variables, and a pull takes every variable lock anyway

        def answer(outcome: PushOutcome) -> PushOutcome:
            """The answer a worker records (counted: PushOutcome.seq), unless the mode defers it to
            a commit (a follower's staging; a refusal is kept for the commit to give)."""
            assert self._mode is not None
            refusal = None if outcome.accepted else Resolution(False, outcome.version, outcome.staleness,
                                                               outcome.drop, outcome.detail)
            if not self._mode.defers_answer(worker_id, ballot, refusal):
                outcome = self._answers.give(outcome, worker_index, self._incarnation)
            self._record(Pushed(*call, outcome))
            return outcome

        with self._unpaused(names):
            version_now = self._version
            if incarnation and incarnation != self._incarnation:
                # computed from values this shard no longer has (it was restored): drop, the
                # worker gets the current values with the reply
                self._count_drop(DropReason.RESTORED)
                return answer(PushOutcome(False, 0, version_now, 0.0, DropReason.RESTORED,
                                          "gradient from a previous incarnation of the shard (it was restored)"))
            if base_version > version_now:
                raise InvalidArgumentError(
                    f"base_version {base_version} is from the future: shard version is {version_now}"
                )
            repeated = self._retries().repeated(worker_id, self._retry_step(step))
            if repeated is not None:
                return repeated
            staleness = version_now - base_version
            grads = self._keys_to_places(grads)
            ages = self._row_ages(grads)
            rows = self._row_summary(ages, grads)
            admission = self._mode.admit(worker_id, base_version, version_now, ballot)
            self._mode.pushed(worker_id)
            if admission.verdict is Verdict.ACCUMULATE:
                self._mode.accumulate(worker_id, grads, ballot)
                self._maybe_complete_step()
                self._version_cond.notify_all()
                accumulated = answer(PushOutcome(True, staleness, self._version,
                                                 self._rule.optimizer.rate_at(self._version), rows=rows))
                # its retry (an answer lost with a primary) is answered the same, not refused as a duplicate: a
                # follower's staging (unnumbered; the commit gives the answer the worker records) too
                return self._remember(worker_id, step, accumulated)
            decision = self._policy.decide_push(PushContext(worker_id, step or 0, staleness, worker_index))
            if admission.verdict is Verdict.DROP or not decision.accept:
                drop = admission.drop if admission.verdict is Verdict.DROP else decision.drop
                assert drop is not None, "a drop verdict names its reason"
                self._count_drop(drop)
                self._version_cond.notify_all()
                return self._remember(worker_id, step, answer(PushOutcome(False, staleness, version_now, 0.0, drop,
                                                                          admission.reason or decision.reason,
                                                                          rows=rows)))
            parts, part_scale, dropped_rows = self._kept_parts(grads, ages, staleness)
            if rows is not None:
                rows = dataclasses.replace(rows, dropped=dropped_rows)
            if not parts:  # a per-row policy kept none of it
                self._count_drop(DropReason.STALE)
                self._version_cond.notify_all()
                detail = f"every row and part of the push is staler than {self._policy.spec} keeps"
                return self._remember(worker_id, step, answer(PushOutcome(False, staleness, version_now, 0.0,
                                                                          DropReason.STALE, detail, rows=rows)))
            lr = self._rule.optimizer.rate_at(self._version) * decision.lr_scale
            read = self._reads.get(worker_id, base_version) if self._policy.needs_read_values else None
            for name, part in sorted(parts.items()):
                var = self._vars[name]
                self._apply(var, part.grad if var.state else self._adjusted(name, part.grad, read),
                            lr * part.lr_scale, part.row_scale)
            self._version += 1
            self._accepted += 1
            self._version_cond.notify_all()
            return self._remember(worker_id, step, answer(PushOutcome(True, staleness, self._version,
                                                                      lr * part_scale, rows=rows)))

    def _keys_to_places(self, grads: Mapping[str, Gradient]) -> Mapping[str, Gradient]:
        """A push's gradients with the keys of keyed parts as their places, a place made for each new key
        (its row the initializer's, its slots fresh, its clock 0: asyncps.ps.keyed); the locks held, the
        push validated."""
        if not any(self._vars[name].keyed is not None for name in grads):
            return grads
        assert self._optimizer is not None
        out = dict(grads)
        for name, grad in grads.items():
            var = self._vars[name]
            if var.keyed is None:
                continue
            assert isinstance(grad, SparseRows) and var.generated is not None and var.clock is not None
            places, made, keys = var.keyed.places_for_push(grad.indices)
            if made.size:
                if var.shared:
                    var.value = var.value.copy()
                    var.shared = False
                var.value[made] = var.generated.init.rows_at(keys, var.value.shape[1:], var.value.dtype)
                fresh = self._optimizer.init_slots(var.value[:1])
                for slot, array in var.slots.items():
                    array[made] = fresh[slot][0]
                var.clock[made] = 0
            out[name] = SparseRows(places, grad.values, grad.clocks)
        return out

    def _row_ages(self, grads: Mapping[str, Gradient]) -> dict[str, npt.NDArray[np.int64]]:
        """Per-row staleness of a push's parts (the locks of its variables held): for the rows of each sparse
        gradient sent with the clocks they were read at, the updates each row received since."""
        return {name: np.maximum(clock[g.indices] - g.clocks, 0) for name, g in grads.items()
                if isinstance(g, SparseRows) and g.clocks is not None and (clock := self._vars[name].clock) is not None}

    def _row_summary(self, ages: Mapping[str, npt.NDArray[np.int64]],
                     grads: Mapping[str, Gradient]) -> RowStaleness | None:
        """The summary of a push's per-row staleness, hot rows apart (before the push changes any clock)."""
        if not ages:
            return None
        hot = [self._hot(self._vars[name], grads[name]) for name in ages]
        return RowStaleness.of(np.concatenate(list(ages.values())), np.concatenate(hot))

    @staticmethod
    def _hot(var: _Variable, grad: Gradient) -> npt.NDArray[np.bool_]:
        """Which rows of a sparse gradient are hot (HOT_SHARE) now."""
        assert var.clock is not None and isinstance(grad, SparseRows)
        share: npt.NDArray[np.bool_] = var.clock[grad.indices] >= HOT_SHARE * max(var.updates - var.clock_base,
                                                                                   1 / HOT_SHARE)
        return share

    def _kept_parts(self, grads: Mapping[str, Gradient], ages: Mapping[str, npt.NDArray[np.int64]],
                    staleness: int) -> tuple[dict[str, _Part], float, int]:
        """What the staleness policy keeps of an admitted push: the parts with their learning rates' scales,
        the scale of a part judged by the push's staleness, and the rows dropped. A per-row policy
        (StalenessPolicy.per_row) cuts each sparse gradient sent with clocks to the rows it keeps, by each
        row's own staleness, and keeps or drops every other part whole, by the push's."""
        assert self._policy is not None
        if not self._policy.per_row:
            return {name: _Part(grad) for name, grad in grads.items()}, 1.0, 0
        whole = self._policy.decide_rows(np.array([staleness], dtype=np.int64))
        part_scale = float(whole.scale[0])
        parts = {name: _Part(grad, part_scale) for name, grad in grads.items() if name not in ages and whole.keep[0]}
        dropped = 0
        for name, age in ages.items():
            grad = grads[name]
            assert isinstance(grad, SparseRows)
            grad, age = _rows_once(grad, age)
            decided = self._policy.decide_rows(age)
            keep = decided.keep
            dropped += int(keep.size - np.count_nonzero(keep))
            if keep.any():
                assert grad.clocks is not None
                parts[name] = _Part(SparseRows(grad.indices[keep], grad.values[keep], grad.clocks[keep]),
                                    row_scale=decided.scale[keep])
        return parts, part_scale, dropped

    def _remember(self, worker_id: str, step: int | None, outcome: PushOutcome) -> PushOutcome:
        """Keep the outcome of a worker's push for a retry of it (state lock held)."""
        return self._retries().remember(worker_id, self._retry_step(step), outcome)

    def _retries(self) -> RetryMemo[PushOutcome]:
        """The memo of each worker's last push: the mode's (strict reads: a refused read repeats the push), else
        the store's own (a push answered by a primary that died before its answer arrived is repeated to the
        backup that took over, which applied it: answered again, not applied twice)."""
        assert self._mode is not None
        mode: RetryMemo[PushOutcome] | None = self._mode.retries
        return mode if mode is not None else self._last_pushes

    def _retry_step(self, step: int | None) -> int | None:
        """The step a retry is known by: a mode with strict reads numbers every push; otherwise step 0 (a
        worker's first, and every push of a caller that numbers none) is not remembered."""
        assert self._mode is not None
        return step if self._mode.retries is not None or step else None

    def _adjusted(self, name: str, grad: Gradient, read: dict[str, Gradient] | None) -> Gradient:
        """The gradient after the policy's correction with the values the worker read (a row the worker
        did not read is corrected against its value now: no correction)."""
        assert self._policy is not None
        seen = read.get(name) if read is not None else None
        if seen is None:
            return grad
        var = self._vars[name]
        if isinstance(grad, SparseRows):
            # each row once, so each row's state advances once per push
            grad = coalesce_rows(grad.indices, grad.values)
            rows = grad.indices
            now = var.value[rows]
            values = var.policy_state.adjust(self._policy, name, rows, grad.values, now, _rows_read(seen, rows, now))
            return SparseRows(rows, values, grad.clocks)
        if isinstance(seen, SparseRows):  # read by rows, pushed whole: no correction
            return grad
        shape = _state_shape(grad)
        adjusted = var.policy_state.adjust(self._policy, name, None, grad.reshape(shape), var.value.reshape(shape),
                                           seen.reshape(shape))
        out: Array = adjusted.reshape(grad.shape)
        return out

    def _maybe_complete_step(self) -> None:
        """Apply the mode's accumulated step once it is complete (all locks held)."""
        assert self._mode is not None
        step = self._mode.take_step()
        if step is not None:
            self._apply_step(step)

    def _apply_step(self, step: Mapping[str, Gradient]) -> None:
        """Apply one averaged step at the rule's learning rate: the next version (all locks held)."""
        assert self._rule is not None
        lr = self._rule.optimizer.rate_at(self._version)
        for name, grad in sorted(step.items()):
            self._apply(self._vars[name], grad, lr)
        self._version += 1
        self._accepted += 1

    def _count_drop(self, reason: DropReason) -> None:
        self._dropped += 1
        self._dropped_by_reason[reason.value] = self._dropped_by_reason.get(reason.value, 0) + 1

    def _apply(self, var: _Variable, grad: Gradient, lr: float, row_scale: Array | None = None) -> None:
        """Apply one update to a variable (`row_scale`: a sparse update's per-row learning rate scales); a
        state part's update is a delta, added as is: v += delta (no optimizer, no learning rate)."""
        assert self._optimizer is not None
        var.updates += 1
        var.count_update(grad)
        if var.state:
            assert not isinstance(grad, SparseRows)  # _validate_gradient refuses sparse deltas
            if var.shared:  # a reader holds the current array: the sum is a new one
                var.value = var.value + grad
                var.shared = False
            else:
                var.value += grad
            return
        if isinstance(grad, SparseRows):
            if var.shared:  # a reader holds the current array: update a private copy
                var.value = var.value.copy()
                var.shared = False
            self._optimizer.apply_sparse(var.value, grad.indices, grad.values, var.slots, lr, var.updates,
                                         row_scale)
        elif var.shared:  # a reader holds the current array: the update is written to a new one
            updated = np.empty_like(var.value)
            self._optimizer.apply_dense(updated, grad, var.slots, lr, var.updates, source=var.value)
            var.value = updated
            var.shared = False
        else:
            self._optimizer.apply_dense(var.value, grad, var.slots, lr, var.updates)

    def _validate_gradient(self, name: str, grad: Gradient) -> None:
        var = self._vars.get(name)
        if var is None:
            raise NotFoundError(f"unknown variable {name!r} on shard {self.shard_index}")
        shape, dtype = var.value.shape, var.value.dtype
        if var.state and isinstance(grad, SparseRows):
            raise InvalidArgumentError(f"{name}: a state part takes a dense delta, not sparse rows")
        if isinstance(grad, SparseRows):
            values = grad.values
            indices = grad.indices
            if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
                raise InvalidArgumentError(f"{name}: sparse indices must be a 1-D integer array")
            rows = values.shape[0] if values.ndim else 0
            if values.ndim == 0 or indices.shape[0] != rows:
                raise InvalidArgumentError(f"{name}: {indices.shape[0]} sparse indices for {rows} rows of values")
            if values.shape[1:] != shape[1:] or values.ndim != len(shape):
                raise InvalidArgumentError(
                    f"{name}: sparse rows of shape {list(values.shape)} do not fit a variable "
                    f"of shape {list(shape)}"
                )
            if var.keyed is not None:  # keys of any value; no more distinct ones than the part keeps
                if indices.dtype != np.int64:
                    raise InvalidArgumentError(f"{name}: a keyed table's keys must be int64, got {indices.dtype}")
                var.keyed.check_push(name, indices)
            elif grad.indices.size and (grad.indices.min() < 0 or grad.indices.max() >= shape[0]):
                raise InvalidArgumentError(f"{name}: sparse row index outside [0, {shape[0]})")
            clocks = grad.clocks
            if clocks is not None and (clocks.dtype != np.int64 or clocks.shape != indices.shape):
                raise InvalidArgumentError(f"{name}: row clocks must be int64 [{indices.shape[0]}], one per index, "
                                           f"got {clocks.dtype} {list(clocks.shape)}")
            if clocks is not None and clocks.size and clocks.min() < 0:
                raise InvalidArgumentError(f"{name}: row clocks must be >= 0")
        else:
            values = grad
            if var.keyed is not None:
                raise InvalidArgumentError(f"{name}: a keyed table takes rows by key (a sparse gradient), not a "
                                           "whole one")
            if values.shape != shape:
                raise InvalidArgumentError(
                    f"{name}: gradient shape {list(values.shape)} != variable shape {list(shape)}"
                )
        if values.dtype != dtype:
            raise InvalidArgumentError(f"{name}: gradient dtype {values.dtype} != variable dtype {dtype}")
        if not all_finite(values):
            raise NonFiniteGradientError(f"{name}: gradient contains NaN or Inf")

    # -- checkpoints ----------------------------------------------------------------------
    def pause(self, hold_s: float) -> int:
        """Hold new pushes for up to hold_s (0: release); in-flight pushes finish first. Returns the version."""
        return self.hold(hold_s).version

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """Pause (see `pause`); in multi-shard sync also what a consistent cut needs, which the
        mode answers (`Consistency.hold`).

        A follower first commits `sync`, the coordinator's decisions the chief read at the cut
        (a held follower takes no commit from a worker), and says where it stands; the coordinator
        answers its decisions for steps >= decisions_since. Both with every lock held, so the
        state read after is the one answered; the mode answers before the pause is set, so a
        refused `sync` (InvalidArgumentError) changes nothing."""
        with self._all_locks(), self._version_cond:
            try:
                if self._mode is not None:
                    held = self._mode.hold(self._handle, sync, decisions_since)
                elif sync is not None:
                    raise InvalidArgumentError("sync decisions go to a follower shard of a sync run only")
                else:
                    held = Held(self._version)
                self._paused_until = self._clock() + hold_s if hold_s > 0 else 0.0
                if sync is not None:
                    self._record(HeldWith(sync, decisions_since))
            finally:
                self._version_cond.notify_all()  # a release, or steps a commit applied
        self._acknowledged()
        return held

    def _paused(self) -> bool:
        """Whether pushes are held now (call with the version condition held)."""
        return self._paused_until > self._clock()

    def _wait_unpaused(self) -> None:
        with self._version_cond:
            while self._paused() and not self._stopping:
                self._version_cond.wait(timeout=max(0.0, self._paused_until - self._clock()))

    def stop(self) -> None:
        """The shard is going away: wake every waiting call now and refuse pushes from here on.

        A handler thread blocked in a wait (a sync step, SSP's gate, a long poll, a push held by a
        cut) would otherwise outlive the server's grace and keep the process from exiting.
        """
        with self._version_cond:
            self._stopping = True
            self._version_cond.notify_all()

    def _refuse_if_stopping(self) -> None:
        """Call with the state lock held."""
        if self._stopping:
            raise UnavailableError(f"shard {self.shard_index} is stopping")

    @contextlib.contextmanager
    def _unpaused(self, names: list[str]) -> Iterator[None]:
        """The locks of `names`, then the state lock, taken while no pause holds pushes.

        The pause is checked with every lock held: a pause sets its flag holding every lock, so a
        push either sees it here, lets go of its locks and waits, or is applied before the pause
        returns (it never slips past a cut). Unpaused, the state lock is taken once.
        """
        while True:
            with contextlib.ExitStack() as attempt:
                for name in names:
                    attempt.enter_context(self._vars[name].lock)
                attempt.enter_context(self._version_cond)
                self._refuse_if_stopping()
                if not self._paused():
                    held = attempt.pop_all()
                    break
            self._wait_unpaused()
        with held:
            yield

    def snapshot(self) -> Snapshot:
        """A consistent copy of the whole state: values, optimizer slots, policy state, counters."""
        self._require_initialized()
        with self._all_locks(), self._version_cond:
            return self._snapshot()

    def _snapshot(self) -> Snapshot:
        """`snapshot` with every lock held."""
        assert self._rule is not None
        return Snapshot(
            rule=self._rule, version=self._version, accepted=self._accepted, dropped=self._dropped,
            values={n: v.value.copy() for n, v in self._vars.items()},
            slots={n: {k: a.copy() for k, a in v.slots.items()} for n, v in self._vars.items()},
            updates={n: v.updates for n, v in self._vars.items()}, run_id=self._run_id,
            policy_state={n: state for n, v in self._vars.items() if (state := _row_state(v))},
            keyed={n: v.generated for n, v in self._vars.items() if v.keyed is not None and v.generated},
            answers=self._answers.total, answers_by_worker=self._answers.by_worker(),
        )

    def restore(self, snap: Snapshot) -> None:
        """Replace the whole state with a snapshot (a new incarnation: older gradients are dropped): the
        snapshot's, else one drawn here. A snapshot with a live part (a backup seeded from a live primary:
        asyncps.ps.live_state) keeps the mode's state, the values read, the retry memo, the drops by reason
        and the row clocks it holds; else they start over (every row clock at the first row read)."""
        if snap.incarnation < 0:
            raise InvalidArgumentError(f"a restored incarnation must be > 0 (0: the shard draws one), got "
                                       f"{snap.incarnation}")
        if min(snap.version, snap.accepted, snap.dropped, snap.answers, *snap.updates.values(),
               *snap.answers_by_worker.values()) < 0:
            raise InvalidArgumentError("restored version, counters and update counts must be >= 0")
        if sum(snap.answers_by_worker.values()) > snap.answers:
            raise InvalidArgumentError(f"restored answers by worker add up to {sum(snap.answers_by_worker.values())}, "
                                       f"more than the {snap.answers} answers in all")
        unknown = sorted(set(snap.updates) - set(snap.values))
        if unknown:
            raise InvalidArgumentError(f"update counts for unknown variables {unknown}")
        optimizer = make_optimizer(snap.rule.optimizer)
        state_parts = set(snap.rule.state)
        for name, value in snap.values.items():
            if not _is_float(value.dtype) or not all_finite(value):
                raise InvalidArgumentError(f"{name}: restored values must be finite floating point")
            expected = {} if name in state_parts else optimizer.init_slots(value)
            slots = snap.slots.get(name, {})
            if set(slots) != set(expected) or any(a.shape != expected[k].shape for k, a in slots.items()):
                raise InvalidArgumentError(
                    f"{name}: restored slots {sorted(slots)} do not fit {snap.rule.optimizer.name}")
        unknown = sorted((set(snap.policy_state) | set(snap.keyed)) - set(snap.values))
        if unknown:
            raise InvalidArgumentError(f"policy state or keys for unknown variables {unknown}")
        _check_keyed_rule(snap.rule, snap.keyed)
        mode = self._start_mode(snap.rule)
        live = decode_live(snap.live, type(mode)) if snap.live is not None else None
        if live is not None:
            check_mode(live.mode, mode)
            if not all(type(k) is str and type(v) is int and v >= 0 for k, v in live.dropped_by_reason.items()):
                raise InvalidArgumentError("a live state's drops by reason must be counts >= 0 by name")
        clocks = live.clocks if live is not None else {}
        for name, (clock, base) in clocks.items():
            rows = snap.values[name].shape[:1] if name in snap.values else None
            if rows is None or name in snap.keyed or clock.shape != rows or base < 0:
                raise InvalidArgumentError(f"{name}: row clocks of shape {list(clock.shape)} (made at {base} updates) "
                                           "for no table of the snapshot read by rows")
        keyed: dict[str, KeyedRows] = {}
        policy_states: dict[str, RowState] = {}
        for name, value in snap.values.items():
            row_state = dict(snap.policy_state.get(name, {}))
            own = {key: row_state.pop(key) for key in (KEYS, TOUCHED) if key in row_state}
            spec = snap.keyed.get(name)
            if spec is not None:
                if not spec.keyed or value.shape != spec.shape or value.dtype != np.dtype(spec.dtype):
                    raise InvalidArgumentError(f"{name}: restored values {value.dtype}{list(value.shape)} are not "
                                               f"the keyed part {spec}")
                keyed[name] = KeyedRows.load(name, spec.shape[0], own)
            elif own:
                raise InvalidArgumentError(f"{name}: restored keys for a part that is not keyed")
            policy_states[name] = RowState.load(name, _state_shape(value), row_state)
        with self._init_lock, self._all_locks(), self._version_cond:
            self._vars = {
                name: _Variable(value=np.array(value, copy=True),
                                slots={k: np.array(a, copy=True) for k, a in snap.slots.get(name, {}).items()},
                                updates=snap.updates.get(name, 0), state=name in state_parts)
                for name, value in sorted(snap.values.items())
            }
            for name, var in self._vars.items():
                var.policy_state = policy_states[name]
                if name in keyed:
                    _make_keyed(var, snap.keyed[name], keyed[name])
            for name, (clock, base) in clocks.items():
                self._vars[name].clock, self._vars[name].clock_base = np.array(clock, dtype=np.int64), base
            self._optimizer = optimizer
            self._policy = snap.rule.policy()
            self._mode = live.mode if live is not None else mode
            self._mode.enforce_bound = self._enforce_bounds
            self._last_pushes = live.last_pushes if live is not None else RetryMemo()
            self._last_commits = live.last_commits if live is not None else RetryMemo()
            self._rule = snap.rule
            self._version, self._accepted, self._dropped = snap.version, snap.accepted, snap.dropped
            if live is not None:  # else the drops counted so far stay counted
                self._dropped_by_reason = dict(live.dropped_by_reason)
            self._answers = Answers(snap.answers, snap.answers_by_worker)
            self._reads = live.reads if live is not None else ReadValues()
            self._incarnation = snap.incarnation or secrets.randbits(62) + 1
            self._run_id = snap.run_id
            self._version_cond.notify_all()
            self._record(Restored(dataclasses.replace(snap, incarnation=self._incarnation)))
        self._acknowledged()

    @property
    def incarnation(self) -> int:
        """Identifies the current state's lineage; changes on initialize and restore."""
        with self._version_cond:
            return self._incarnation

    # -- introspection --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The number of updates applied so far."""
        with self._version_cond:
            return self._version

    @property
    def rule(self) -> UpdateRuleConfig | None:
        """The update rule, once initialized."""
        return self._rule

    def stats(self) -> StoreStats:
        """Counters and variable metadata."""
        with self._version_cond:
            version, accepted, dropped = self._version, self._accepted, self._dropped
            by_reason = dict(self._dropped_by_reason)
            mode_stats = self._mode.stats() if self._mode else {}
            run_id = self._run_id
            answers, answers_by_worker = self._answers.total, self._answers.by_worker()
        return StoreStats(
            initialized=self._rule is not None,
            version=version,
            pushes_accepted=accepted,
            pushes_dropped=dropped,
            variables=tuple((n, v.value.dtype.name, v.value.shape) for n, v in self._vars.items()),
            rule=self._rule,
            dropped_by_reason=by_reason,
            mode_stats=mode_stats,
            run_id=run_id,
            answers=answers,
            answers_by_worker=answers_by_worker,
        )

    def _require_initialized(self) -> None:
        if self._rule is None:
            raise FailedPreconditionError(f"shard {self.shard_index} is not initialized yet")

    @contextlib.contextmanager
    def _all_locks(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for name in sorted(self._vars):
                stack.enter_context(self._vars[name].lock)
            yield
