"""ps.store.ShardStore driven directly (no grpc): initialization, pulls, pushes, concurrency."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore

from asyncps.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import DropReason, PushOutcome, PushRequest

JOIN_TIMEOUT_S = 60.0


def rule(lr: float = 1.0, policy: str = "none", optimizer: str = "sgd") -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig(optimizer, lr), staleness_policy=policy)


def initial_values() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(24, dtype=np.float32).reshape(6, 4),
        "b": np.array([1.0, -2.0, 3.0], dtype=np.float32),
    }


def make_store(policy: str = "none", lr: float = 1.0) -> ShardStore:
    store = ShardStore(shard_index=3)
    assert store.initialize(rule(lr, policy), initial_values()) is True
    return store


@dataclass
class Snapshot:
    values: dict[str, np.ndarray]
    version: int
    accepted: int
    dropped: int


def snapshot(store: ShardStore) -> Snapshot:
    stats = store.stats()
    return Snapshot(store.values(), stats.version, stats.pushes_accepted, stats.pushes_dropped)


def assert_unchanged(store: ShardStore, before: Snapshot) -> None:
    after = snapshot(store)
    assert after.version == before.version
    assert (after.accepted, after.dropped) == (before.accepted, before.dropped)
    assert sorted(after.values) == sorted(before.values)
    for name, value in before.values.items():
        assert after.values[name].tobytes() == value.tobytes(), name


def pulled(store: ShardStore, if_newer_than: int = -1) -> tuple[int, dict[str, np.ndarray] | None]:
    """(version, values or None) of one pull."""
    reply = store.pull(if_newer_than)
    return reply.version, None if reply.values is None else dict(reply.values)


def start_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()


def join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive(), f"{thread.name} is stuck"


# ----------------------------------------------------------------------------- initialize


def test_initialize_copies_values_and_starts_at_version_zero() -> None:
    values = initial_values()
    store = ShardStore()
    assert store.initialize(rule(), values) is True
    values["w"][:] = -1  # the caller's arrays are not the store's
    assert store.version == 0
    got = store.values()
    assert np.array_equal(got["w"], initial_values()["w"])
    got["b"][:] = 99  # nor are the arrays values() hands out
    assert np.array_equal(store.values()["b"], initial_values()["b"])
    stats = store.stats()
    assert stats.initialized and stats.rule == rule()
    assert stats.variables == (("b", "float32", (3,)), ("w", "float32", (6, 4)))


def test_identical_initialize_is_accepted_without_change() -> None:
    store = make_store()
    before = snapshot(store)
    assert store.initialize(rule(), initial_values()) is False
    assert_unchanged(store, before)


def _conflicts() -> dict[str, tuple[UpdateRuleConfig, dict[str, np.ndarray], str]]:
    base = initial_values()
    return {
        "rule-lr": (rule(lr=0.5), base, "different rule"),
        "rule-policy": (rule(policy="drop:2"), base, "different rule"),
        "rule-optimizer": (rule(optimizer="adam"), base, "different rule"),
        "extra-variable": (rule(), {**base, "c": np.zeros(2, np.float32)}, "variables"),
        "missing-variable": (rule(), {"w": base["w"]}, "variables"),
        "renamed-variable": (rule(), {"w": base["w"], "bias": base["b"]}, "variables"),
        "shape": (rule(), {**base, "w": base["w"].reshape(4, 6)}, "w: already initialized as"),
        "dtype": (rule(), {**base, "b": base["b"].astype(np.float64)}, "b: already initialized as"),
        "values": (rule(), {**base, "b": base["b"] + 1}, "b: already initialized with different"),
    }


@pytest.mark.parametrize("case", list(_conflicts()))
def test_conflicting_initialize_is_already_exists_and_changes_nothing(case: str) -> None:
    new_rule, values, message = _conflicts()[case]
    store = make_store()
    before = snapshot(store)
    with pytest.raises(AlreadyExistsError, match=message):
        store.initialize(new_rule, values)
    assert_unchanged(store, before)
    assert store.rule == rule()


def test_reinitialize_after_training_keeps_the_trained_values() -> None:
    store = make_store()
    store.push("w0", 0, {"b": np.ones(3, np.float32)})
    before = snapshot(store)
    # values can no longer be compared once training moved them: same names/shapes/rule is enough
    assert store.initialize(rule(), initial_values()) is False
    assert_unchanged(store, before)
    np.testing.assert_array_equal(before.values["b"], initial_values()["b"] - 1)
    # shapes, names and the rule are still checked
    with pytest.raises(AlreadyExistsError, match="w: already initialized as"):
        store.initialize(rule(), {**initial_values(), "w": np.zeros((2, 12), np.float32)})
    assert_unchanged(store, before)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"w": np.arange(3, dtype=np.int32)}, "floating point"),
        ({"w": np.array([1.0, np.nan], np.float32)}, "NaN or Inf"),
        ({"w": np.array([1.0, -np.inf], np.float32)}, "NaN or Inf"),
    ],
    ids=["int", "nan", "inf"],
)
def test_bad_initialize_is_invalid_and_leaves_the_shard_uninitialized(
    values: dict[str, np.ndarray], message: str
) -> None:
    store = ShardStore()
    with pytest.raises(InvalidArgumentError, match=message):
        store.initialize(rule(), values)
    assert not store.stats().initialized
    assert store.initialize(rule(), initial_values()) is True


def test_a_shard_placement_leaves_empty_initializes_and_holds_nothing() -> None:
    store = ShardStore()
    assert store.initialize(rule(), {}) is True
    assert pulled(store) == (0, {})
    with pytest.raises(InvalidArgumentError, match="without gradients"):
        store.push("w0", 0, {})


def test_push_and_pull_before_initialize_are_failed_precondition() -> None:
    store = ShardStore(shard_index=5)
    with pytest.raises(FailedPreconditionError, match="shard 5 is not initialized"):
        store.push("w0", 0, {"w": np.zeros((6, 4), np.float32)})
    with pytest.raises(FailedPreconditionError, match="not initialized"):
        store.pull(-1)
    with pytest.raises(FailedPreconditionError, match="not initialized"):
        store.values()
    stats = store.stats()
    assert (stats.initialized, stats.version, stats.variables, stats.rule) == (False, 0, (), None)


# ----------------------------------------------------------------------------- push and pull


def test_accepted_push_applies_sgd_and_bumps_the_version() -> None:
    store = make_store(lr=0.5)
    grad = {"w": np.full((6, 4), 2.0, np.float32), "b": np.array([4.0, 0.0, -2.0], np.float32)}
    outcome = store.push("w0", 0, grad)
    assert outcome == PushOutcome(accepted=True, staleness=0, version=1, effective_lr=0.5)
    values = store.values()
    np.testing.assert_array_equal(values["w"], initial_values()["w"] - 1.0)
    np.testing.assert_array_equal(values["b"], [-1.0, -2.0, 4.0])
    stats = store.stats()
    assert (stats.version, stats.pushes_accepted, stats.pushes_dropped) == (1, 1, 0)


def test_version_counts_accepted_pushes_and_staleness_is_version_minus_base() -> None:
    store = make_store()
    one = {"b": np.ones(3, np.float32)}
    for expected_version in range(1, 5):
        outcome = store.push("w0", store.version, one)
        assert (outcome.version, outcome.staleness) == (expected_version, 0)
    for base in (4, 3, 1, 0):
        version_now = store.version
        outcome = store.push("w1", base, one)
        assert outcome.staleness == version_now - base
        assert outcome.version == version_now + 1
    assert store.version == 8 and store.stats().pushes_accepted == 8
    np.testing.assert_array_equal(store.values()["b"], initial_values()["b"] - 8)


def test_pull_if_newer_than() -> None:
    store = make_store()
    version, values = pulled(store)
    assert version == 0 and values is not None
    assert list(values) == ["b", "w"]
    assert pulled(store, 0) == (0, None)
    store.push("w0", 0, {"b": np.ones(3, np.float32)})
    version, newer = pulled(store, 0)
    assert version == 1 and newer is not None
    np.testing.assert_array_equal(newer["b"], initial_values()["b"] - 1)
    assert pulled(store, 1) == (1, None)
    assert pulled(store, 7) == (1, None)


def test_pulled_values_are_read_only_and_never_change_afterwards() -> None:
    """Copy-on-write: a reply is encoded with no lock held, so what a pull returned must stay
    exactly as it was while pushes go on, and the store must not copy when nobody reads."""
    store = make_store()
    first = store.pull().values
    assert first is not None
    kept = {name: value.copy() for name, value in first.items()}
    with pytest.raises(ValueError, match="read-only"):
        first["b"][0] = 7.0
    store.push("w0", 0, {"b": np.ones(3, np.float32), "w": np.ones((6, 4), np.float32)})
    for name, value in kept.items():
        np.testing.assert_array_equal(first[name], value)  # the old reply is untouched
    second = store.pull().values
    assert second is not None
    np.testing.assert_array_equal(second["b"], kept["b"] - 1)
    assert second["b"] is not first["b"]
    # with no reader in between, updates happen in place: the next two pushes copy once
    store.push("w0", 1, {"b": np.ones(3, np.float32)})
    private = store._vars["b"].value
    store.push("w0", 2, {"b": np.ones(3, np.float32)})
    assert store._vars["b"].value is private and private.flags.writeable
    np.testing.assert_array_equal(second["b"], kept["b"] - 1)


def sparse(indices: list[int], rows: np.ndarray) -> SparseRows:
    return SparseRows(np.array(indices, np.int64), rows.astype(np.float32))


def _nan_w() -> np.ndarray:
    w = np.zeros((6, 4), np.float32)
    w[5, 3] = np.nan
    return w


def _bad_pushes() -> dict[str, tuple[Callable[[int], int], Mapping[str, Any], type, str]]:
    ok_w = np.ones((6, 4), np.float32)
    return {
        "unknown-variable": (lambda v: v, {"nope": np.ones(3, np.float32)}, NotFoundError,
                             "unknown variable 'nope' on shard 3"),
        "unknown-beside-valid": (lambda v: v, {"w": ok_w, "nope": ok_w}, NotFoundError, "'nope'"),
        "shape": (lambda v: v, {"w": np.ones((4, 6), np.float32)}, InvalidArgumentError,
                  "gradient shape \\[4, 6\\] != variable shape \\[6, 4\\]"),
        "dtype": (lambda v: v, {"w": np.ones((6, 4), np.float64)}, InvalidArgumentError,
                  "dtype float64 != variable dtype float32"),
        "nan": (lambda v: v, {"w": _nan_w()}, InvalidArgumentError, "NaN or Inf"),
        "inf": (lambda v: v, {"b": np.array([0, np.inf, 0], np.float32)}, InvalidArgumentError,
                "NaN or Inf"),
        "nan-beside-valid": (lambda v: v, {"w": ok_w, "b": np.array([0, 0, np.nan], np.float32)},
                             InvalidArgumentError, "b: gradient contains NaN"),
        "sparse-index-too-big": (lambda v: v, {"w": sparse([0, 6], np.ones((2, 4)))},
                                 InvalidArgumentError, "index outside \\[0, 6\\)"),
        "sparse-index-negative": (lambda v: v, {"w": sparse([-1], np.ones((1, 4)))},
                                  InvalidArgumentError, "index outside"),
        "sparse-row-width": (lambda v: v, {"w": sparse([0], np.ones((1, 3)))},
                             InvalidArgumentError, "do not fit"),
        "sparse-nan": (lambda v: v, {"w": sparse([1], np.full((1, 4), np.nan))},
                       InvalidArgumentError, "NaN or Inf"),
        "future-base-version": (lambda v: v + 1, {"w": ok_w}, InvalidArgumentError,
                                "from the future"),
        "negative-base-version": (lambda v: -1, {"w": ok_w}, InvalidArgumentError,
                                  "base_version must be >= 0"),
        "empty": (lambda v: v, {}, InvalidArgumentError, "push without gradients"),
    }


@pytest.mark.parametrize("case", list(_bad_pushes()))
def test_bad_push_raises_and_changes_nothing(case: str) -> None:
    base_of, grads, error, message = _bad_pushes()[case]
    store = make_store()
    store.push("w0", 0, {"b": np.ones(3, np.float32)})  # version 1: "future" means 2
    before = snapshot(store)
    with pytest.raises(error, match=message):
        store.push("w1", base_of(before.version), grads)
    assert_unchanged(store, before)
    # and the shard still takes good pushes afterwards
    assert store.push("w1", before.version, {"b": np.ones(3, np.float32)}).version == 2


@pytest.mark.parametrize(
    "sparse",
    [SparseRows(np.array([0, 1]), np.ones((1, 4), np.float32)),
     SparseRows(np.array([[0], [1]]), np.ones((2, 4), np.float32)),
     SparseRows(np.array([0.0, 1.0]), np.ones((2, 4), np.float32))],
    ids=["count-mismatch", "2d-indices", "float-indices"],
)
def test_malformed_sparse_push_is_invalid_and_not_partially_applied(sparse: SparseRows) -> None:
    store = make_store()
    before = snapshot(store)
    with pytest.raises(InvalidArgumentError):
        # "b" sorts first, so it would be applied before "w" fails
        store.push("w0", 0, {"b": np.ones(3, np.float32), "w": sparse})
    assert_unchanged(store, before)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_large_finite_float64_gradient_is_accepted() -> None:
    store = ShardStore()
    store.initialize(rule(), {"d": np.zeros(2, np.float64)})
    outcome = store.push("w0", 0, {"d": np.array([1e308, 1e308])})
    assert outcome.accepted


def test_sparse_push_touches_only_its_rows() -> None:
    store = make_store()
    before = store.values()
    indices = np.array([4, 1, 4], dtype=np.int64)  # row 4 twice: summed
    rows = np.array([[1, 2, 3, 4], [10, 10, 10, 10], [100, 0, 0, 0]], dtype=np.float32)
    outcome = store.push("w0", 0, {"w": SparseRows(indices, rows)})
    assert outcome.accepted and outcome.version == 1
    after = store.values()
    np.testing.assert_array_equal(after["w"][1], before["w"][1] - 10)
    np.testing.assert_array_equal(after["w"][4], before["w"][4] - [101, 2, 3, 4])
    for row in (0, 2, 3, 5):
        assert after["w"][row].tobytes() == before["w"][row].tobytes()
    assert after["b"].tobytes() == before["b"].tobytes()


def test_empty_sparse_push_changes_no_values() -> None:
    store = make_store()
    before = store.values()
    outcome = store.push("w0", 0, {"w": sparse([], np.zeros((0, 4)))})
    assert outcome.accepted and outcome.version == 1
    assert store.values()["w"].tobytes() == before["w"].tobytes()


# ----------------------------------------------------------------------------- policies


def test_drop_policy_never_applies_staleness_above_its_bound() -> None:
    store = make_store(policy="drop:2")
    one = {"b": np.ones(3, np.float32)}
    for _ in range(5):
        store.push("w0", store.version, one)
    applied = 5
    for staleness in range(6):
        version_now = store.version
        outcome = store.push("w1", version_now - staleness, one)
        assert outcome.staleness == staleness
        if staleness <= 2:
            applied += 1
            assert outcome == PushOutcome(True, staleness, version_now + 1, 1.0)
        else:
            assert outcome == PushOutcome(False, staleness, version_now, 0.0, DropReason.STALE,
                                          f"staleness {staleness} > 2")
    stats = store.stats()
    assert (stats.version, stats.pushes_accepted, stats.pushes_dropped) == (applied, applied, 3)
    np.testing.assert_array_equal(store.values()["b"], initial_values()["b"] - applied)


@pytest.mark.parametrize("staleness", [0, 1, 2, 3, 4, 8])
def test_lr_scale_policy_divides_the_learning_rate_by_staleness(staleness: int) -> None:
    store = make_store(policy="lr-scale", lr=0.5)
    for _ in range(staleness):
        store.push("w0", store.version, {"w": np.zeros((6, 4), np.float32)})
    outcome = store.push("w1", 0, {"b": np.full(3, 24.0, np.float32)})
    expected_lr = 0.5 / max(1, staleness)
    assert outcome.accepted and outcome.staleness == staleness
    assert outcome.effective_lr == pytest.approx(expected_lr, rel=1e-12)
    np.testing.assert_allclose(store.values()["b"], initial_values()["b"] - 24.0 * expected_lr,
                               rtol=1e-6)


# ----------------------------------------------------------------------------- concurrency


def test_concurrent_pushes_lose_nothing_and_pulls_are_consistent() -> None:
    threads_n, pushes_n = 8, 25
    store = make_store()
    start = threading.Barrier(threads_n + 1)  # the pushers and the puller
    outcomes: list[list[PushOutcome]] = [[] for _ in range(threads_n)]
    pushers_done = threading.Event()
    pulled_versions: list[int] = []
    problems: list[str] = []

    def pusher(t: int) -> None:
        start.wait()
        for j in range(pushes_n):
            c = float(t * pushes_n + j + 1)  # integer-valued: every partial sum is exact
            grads = {"w": np.full((6, 4), c, np.float32), "b": np.full(3, c, np.float32)}
            outcomes[t].append(store.push(f"w{t}", 0, grads))

    def puller() -> None:
        # every pull must see a model in which "w" and "b" moved by the same sum
        start.wait()
        w0, b0 = initial_values()["w"], initial_values()["b"]
        while not pushers_done.is_set():
            version, pulled_values = pulled(store)
            values = pulled_values or {}
            dw, db = w0 - values["w"], b0 - values["b"]
            if not (np.all(dw == dw.flat[0]) and np.all(db == dw.flat[0])):
                problems.append(f"torn model at version {version}: {dw.flat[0]} vs {db}")
            pulled_versions.append(version)

    pushers = [threading.Thread(target=pusher, args=(t,), name=f"pusher{t}")
               for t in range(threads_n)]
    reader = threading.Thread(target=puller, name="puller")
    start_all([*pushers, reader])
    join_all(pushers)
    pushers_done.set()
    join_all([reader])

    total = threads_n * pushes_n
    all_outcomes = [o for per_thread in outcomes for o in per_thread]
    assert len(all_outcomes) == total and all(o.accepted for o in all_outcomes)
    assert sorted(o.version for o in all_outcomes) == list(range(1, total + 1))
    assert sorted(o.staleness for o in all_outcomes) == list(range(total))
    assert store.version == total and store.stats().pushes_accepted == total
    grad_sum = total * (total + 1) / 2
    values = store.values()
    np.testing.assert_array_equal(values["w"], initial_values()["w"] - grad_sum)
    np.testing.assert_array_equal(values["b"], initial_values()["b"] - grad_sum)
    assert not problems, problems[:3]
    assert pulled_versions == sorted(pulled_versions)


def test_concurrent_stale_pushes_under_drop_policy_apply_exactly_bound_plus_one() -> None:
    threads_n, bound = 8, 3
    store = make_store(policy=f"drop:{bound}")
    start = threading.Barrier(threads_n)
    outcomes: list[PushOutcome | None] = [None] * threads_n

    def pusher(t: int) -> None:
        start.wait()
        outcomes[t] = store.push(f"w{t}", 0, {"b": np.full(3, 2.0**t, np.float32)})

    threads = [threading.Thread(target=pusher, args=(t,)) for t in range(threads_n)]
    start_all(threads)
    join_all(threads)
    done = [o for o in outcomes if o is not None]
    accepted = [t for t, o in enumerate(outcomes) if o is not None and o.accepted]
    assert len(done) == threads_n
    assert len(accepted) == bound + 1
    assert sorted(o.staleness for o in done if o.accepted) == list(range(bound + 1))
    assert all(o.staleness == bound + 1 for o in done if not o.accepted)
    stats = store.stats()
    assert (stats.version, stats.pushes_accepted, stats.pushes_dropped) == (
        bound + 1, bound + 1, threads_n - bound - 1)
    applied = sum(2.0**t for t in accepted)  # distinct powers of two: tells which were applied
    np.testing.assert_array_equal(store.values()["b"], initial_values()["b"] - applied)


def test_wait_newer_wakes_up_when_another_thread_pushes() -> None:
    store = make_store()
    ready = threading.Barrier(2)
    returned = threading.Event()
    result: list[int] = []

    def waiter() -> None:
        ready.wait()
        result.append(store.wait_newer(0, timeout_s=JOIN_TIMEOUT_S))
        returned.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    ready.wait()
    assert not returned.is_set()  # nothing newer than version 0 exists yet
    started = time.monotonic()
    store.push("w0", 0, {"b": np.ones(3, np.float32)})
    assert returned.wait(JOIN_TIMEOUT_S)
    thread.join(JOIN_TIMEOUT_S)
    assert result == [1]
    assert time.monotonic() - started < JOIN_TIMEOUT_S / 2


def test_wait_newer_times_out_or_returns_at_once() -> None:
    store = make_store()
    started = time.monotonic()
    assert store.wait_newer(0, timeout_s=0.2) == 0
    assert time.monotonic() - started >= 0.19
    store.push("w0", 0, {"b": np.ones(3, np.float32)})
    started = time.monotonic()
    assert store.wait_newer(0, timeout_s=30.0) == 1
    assert store.wait_newer(5, timeout_s=-1.0) == 1  # negative timeout: no wait
    assert time.monotonic() - started < 15.0


def test_finite_gradients_whose_sum_overflows_are_accepted_and_nan_beside_them_is_not() -> None:
    """The finiteness check sums first: an overflowing sum of finite values must fall back to
    an exact check, not reject a valid gradient (and a NaN must still be found)."""
    store = make_store(lr=1e-30)
    huge = np.full(3, 3e38, np.float32)  # the float32 sum is inf, every element is finite
    assert store.push("w0", 0, {"b": huge}).accepted
    with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
        store.push("w0", 1, {"b": np.array([3e38, 3e38, np.nan], np.float32)})
    assert store.version == 1


# -- one step enters the store once per phase ---------------------------------------------------
class CountingCondition(threading.Condition):
    """A state lock that counts how often it is taken (waits inside wait_for do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries = 0

    def __enter__(self) -> bool:
        self.entries += 1
        return super().__enter__()


class CountingLock:
    """A variable lock that counts its acquisitions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries = 0

    def __enter__(self) -> bool:
        self.entries += 1
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


class RecordingStore(ShardStore):
    """A store that records which of its public methods a caller uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[str] = []
        super().__init__(*args, **kwargs)

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if not name.startswith("_") and name != "calls" and callable(attr):
            object.__getattribute__(self, "calls").append(name)
        return attr


@pytest.mark.parametrize(("mode", "policy"), [("async", "none"), ("ssp:bound=4", "none"), ("sync", "none"),
                                              ("async", "dc-asgd-a")])
def test_one_push_pull_enters_the_store_once_per_phase(mode: str, policy: str) -> None:
    """ShardService.push_pull: apply, wait, read; each one store call taking each lock once."""
    state_lock = CountingCondition()
    store = RecordingStore(shard_index=0, state_lock=state_lock)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.1), mode=mode, staleness_policy=policy,
                                      num_workers=1), initial_values())
    store.set_live_workers(["w0"])
    service = ShardService(store)
    var_locks = {name: CountingLock() for name in initial_values()}
    for name, lock in var_locks.items():
        store._vars[name].lock = lock  # type: ignore[assignment]  # instrumented, same semantics
    grads = {name: np.ones_like(value) for name, value in initial_values().items()}
    service.pull("w0", -1)  # a policy that corrects with read values has them
    store.calls, state_lock.entries = [], 0
    for lock in var_locks.values():
        lock.entries = 0

    outcome, values = service.push_pull(PushRequest("w0", 0, grads, step=0), -1, read_wait_s=5.0)

    assert outcome.accepted and values.version == 1 and values.values is not None
    assert store.calls == ["push", "wait_readable", "pull"]  # apply, wait, read
    assert state_lock.entries == 3  # once per phase
    assert {name: lock.entries for name, lock in var_locks.items()} == {name: 2 for name in var_locks}  # apply, read


class WaitersCondition(threading.Condition):
    """A state lock that tells how many threads are blocked in it, so a test stops a store only once
    its calls really wait."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self.blocked = threading.Semaphore(0)

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1
        self.blocked.release()
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def test_stop_wakes_every_blocked_call_and_refuses_new_pushes() -> None:
    """A stopping shard answers its waiting handlers at once (else they outlive the server's grace and
    the process cannot exit: seen as a shard ignoring SIGTERM for 20 s)."""
    state = WaitersCondition()
    store = ShardStore(shard_index=0, state_lock=state)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.1), mode="sync", num_workers=2), initial_values())
    store.set_live_workers(["w0", "w1"])
    service = ShardService(store)
    grads = {name: np.ones_like(value) for name, value in initial_values().items()}
    results: dict[str, Any] = {}

    def sync_step() -> None:  # w1 never pushes: w0 waits for the step to complete
        results["sync"] = service.push_pull(PushRequest("w0", 0, grads, step=0), -1, read_wait_s=600.0)

    def long_poll() -> None:
        results["poll"] = service.pull("w9", 5, wait_s=600.0)

    threads = [threading.Thread(target=f) for f in (sync_step, long_poll)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert state.blocked.acquire(timeout=JOIN_TIMEOUT_S)
    store.stop()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive()
    assert set(results) == {"sync", "poll"}
    with pytest.raises(UnavailableError, match="stopping"):
        store.push("w1", 0, grads, step=0)


def test_stop_releases_a_push_held_by_a_cut() -> None:
    store = make_store()
    store.pause(600.0)
    refused: list[BaseException] = []

    def held_push() -> None:
        try:
            store.push("w0", 0, {"b": np.ones(3, np.float32)})
        except UnavailableError as exc:
            refused.append(exc)

    thread = threading.Thread(target=held_push)
    thread.start()
    store.stop()
    thread.join(JOIN_TIMEOUT_S)
    assert not thread.is_alive() and len(refused) == 1 and store.version == 0


def test_a_scheduled_rate_is_applied_at_the_shards_version() -> None:
    """sgd with decay_steps=1, decay_rate=0.5: the k-th push (at version k) moves b by 0.5**k, and its outcome
    reports that rate (pushes.csv's lr)."""
    store = ShardStore()
    schedule = OptimizerConfig("sgd", 1.0, {"decay_steps": 1, "decay_rate": 0.5})
    store.initialize(UpdateRuleConfig(schedule), initial_values())
    rates = [store.push("w0", k, {"b": np.ones(3, np.float32)}).effective_lr for k in range(3)]
    assert rates == [1.0, 0.5, 0.25]
    _, values = pulled(store)
    assert values is not None
    np.testing.assert_allclose(values["b"], initial_values()["b"] - 1.75)


def test_an_answer_names_the_incarnation_that_numbered_it_and_a_restore_takes_the_one_it_is_given() -> None:
    """A push sent to an earlier incarnation is dropped and answered, and numbered, by the current one: its
    answer says so (pushes.csv records that incarnation, so the restores that take the answer back are found).
    A restore takes the incarnation the chief chose (recorded before the restore happens), or a backup's
    primary's; a negative one is refused and changes nothing."""
    store = make_store()
    first = store.incarnation
    applied = store.push("w0", 0, {"b": np.ones(3, np.float32)}, incarnation=first)
    assert applied.accepted and applied.seq == 1 and applied.incarnation == first
    snap = store.snapshot()
    store.restore(dataclasses.replace(snap, incarnation=12345))
    assert store.incarnation == 12345
    late = store.push("w1", 0, {"b": np.ones(3, np.float32)}, incarnation=first)  # computed before the restore
    assert late.drop is DropReason.RESTORED and late.seq == 2 and late.incarnation == 12345
    unchecked = store.push("w1", 1, {"b": np.ones(3, np.float32)})  # a worker that names no incarnation
    assert unchecked.accepted and unchecked.seq == 3 and unchecked.incarnation == 12345
    before = snapshot(store)
    with pytest.raises(InvalidArgumentError, match="incarnation"):
        store.restore(dataclasses.replace(snap, incarnation=-1))
    assert store.incarnation == 12345
    assert_unchanged(store, before)
    store.restore(snap)  # none given: the shard draws a new one
    assert store.incarnation not in (0, first, 12345)


def test_a_repeated_push_of_a_workers_step_is_answered_again_not_applied_twice() -> None:
    """A worker numbers its pushes; the same step again is a retry of a call whose answer was lost (the shard, or
    the primary a backup took over from, died after applying it): the first answer, with its number, and no
    second update. Step 0 (a worker's first, or a caller that numbers none) is not remembered."""
    store = make_store()
    first = store.push("w0", 0, {"b": np.ones(3, np.float32)}, step=7)
    again = store.push("w0", 0, {"b": np.ones(3, np.float32)}, step=7)
    assert again == first and again.seq == first.seq == 1 and store.version == 1
    np.testing.assert_array_equal(store.values()["b"], initial_values()["b"] - 1.0)
    assert store.push("w1", 1, {"b": np.ones(3, np.float32)}, step=7).seq == 2  # another worker's step 7
    assert store.push("w0", 2, {"b": np.ones(3, np.float32)}, step=8).seq == 3  # w0's next step
    unnumbered = [store.push("w2", store.version, {"b": np.ones(3, np.float32)}, step=0) for _ in range(2)]
    assert [o.seq for o in unnumbered] == [4, 5] and store.version == 5


def test_a_repeated_sync_push_is_answered_again_not_refused_as_a_duplicate() -> None:
    """Sync: a worker's gradient accumulated for the step, then the same step again (its answer lost with a
    primary that died, asked again of the backup that took over): the first answer, not a DUPLICATE drop, and the
    step averages each worker's gradient once."""
    store = ShardStore(0)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 1.0), mode="sync", num_workers=2), initial_values())
    first = store.push("w0", 0, {"b": np.full(3, 2.0, np.float32)}, step=7)
    again = store.push("w0", 0, {"b": np.full(3, 2.0, np.float32)}, step=7)
    assert first.accepted and again == first and again.seq == first.seq == 1 and store.version == 0
    store.push("w1", 0, {"b": np.zeros(3, np.float32)}, step=7)  # the quorum: one step, the mean of the two
    assert store.version == 1
    np.testing.assert_array_equal(store.values()["b"], initial_values()["b"] - 1.0)
    late = store.push("w0", 0, {"b": np.ones(3, np.float32)}, step=8)  # a new step of w0's from version 0: late
    assert late.drop is DropReason.LATE
