"""Checkpoints and evaluations as one cut: Pause holds pushes (no push slips past it), and
checkpoints and evaluation pulls taken while several workers push continuously hold exactly the
values of their recorded versions, form a consistent cut, and (checkpoints) restore those values,
with a data ledger taken at the same cut."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir, split
from asyncps.chief.checkpointer import Checkpointer
from asyncps.chief.config import ChiefConfig
from asyncps.chief.cut import CutLapsed, at_cut, pull_at_cut
from asyncps.chief.membership import Membership
from asyncps.chief.progress import Progress
from asyncps.chief.tasks import TaskLedger
from asyncps.ps.store import ShardStore

from asyncps.config import RunConfig
from asyncps.placement import Placement, VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.optimizers import make_optimizer
from asyncps.transport import connect_model, connect_shard
from asyncps.wire.shard import PushRequest

# A push that is not held finishes in milliseconds; one held this long is held by the pause.
HELD_S = 0.5
JOIN_S = 60.0


class _HookedLock:
    """A variable's lock that first runs a hook (once), before the push thread takes it."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._hook: Callable[[], None] | None = hook

    def __enter__(self) -> bool:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _store() -> ShardStore:
    store = ShardStore()
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 1.0)), {"w": np.zeros(3, np.float32)})
    return store


def _push(store: ShardStore) -> None:
    store.push("w0", store.version, {"w": np.ones(3, np.float32)})


def test_pause_holds_pushes_on_the_store_until_released() -> None:
    store = _store()
    store.pause(hold_s=30.0)
    with ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(_push, store)
        with pytest.raises(FutureTimeout):
            pushed.result(timeout=HELD_S)
        assert store.version == 0
        store.pause(0.0)
        pushed.result(timeout=JOIN_S)
    assert store.version == 1


def test_a_pause_landing_between_the_pause_check_and_the_locks_still_holds_the_push() -> None:
    store = _store()
    paused = threading.Event()

    def pause_from_another_thread() -> None:
        # runs in the push thread after it found the shard unpaused, before it takes the lock
        threading.Thread(target=lambda: (store.pause(hold_s=30.0), paused.set())).start()
        assert paused.wait(JOIN_S)

    store._vars["w"].lock = _HookedLock(pause_from_another_thread)  # type: ignore[assignment]
    with ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(_push, store)
        assert paused.wait(JOIN_S)
        with pytest.raises(FutureTimeout):
            pushed.result(timeout=HELD_S)
        assert store.version == 0 and store.values()["w"].tolist() == [0.0, 0.0, 0.0]
        store.pause(0.0)
        pushed.result(timeout=JOIN_S)
    assert store.version == 1


def test_a_cut_that_outlasts_the_hold_is_refused_and_releases_every_shard() -> None:
    stores = [_store(), _store()]
    hold_s = 0.2

    def slow_read(index: int, store: ShardStore) -> int:
        threading.Event().wait(hold_s * 1.5)  # reading takes longer than the shards hold pushes
        return store.version

    with pytest.raises(CutLapsed, match="hold"):
        at_cut(stores, slow_read, lambda: None, hold_s=hold_s)  # type: ignore[arg-type]
    for store in stores:  # released: a push goes through at once
        _push(store)
        assert store.version == 1
    cut = at_cut(stores, lambda _, store: store.snapshot().version, lambda: "recorded")  # type: ignore[arg-type]
    assert cut.reads == cut.paused_versions == [1, 1] and cut.record == "recorded"


def test_pause_holds_pushes_on_a_shard_process(shard_server: str) -> None:
    shard = connect_shard(shard_server, deadline_s=JOIN_S)
    try:
        shard.initialize("chief", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1.0)), {"w": np.zeros(3, np.float32)})
        assert shard.pause(30.0) == 0
        request = PushRequest("w0", 0, {"w": np.ones(3, np.float32)}, 1, 0.0)
        with ThreadPoolExecutor(1) as pool:
            pushed = pool.submit(shard.push, request)
            # wait for the shard to have received the push (a fixed wait failed on a loaded machine)
            deadline = time.monotonic() + JOIN_S
            while shard.stats().bytes_pushed < 12 and time.monotonic() < deadline:
                with contextlib.suppress(FutureTimeout):
                    pushed.result(timeout=0.05)
            stats = shard.stats()
            assert stats.bytes_pushed == 12 and stats.version == 0  # received, not applied
            with pytest.raises(FutureTimeout):  # and still held
                pushed.result(timeout=HELD_S)
            assert shard.pause(0.0) == 0
            assert pushed.result(timeout=JOIN_S).accepted
        assert shard.stats().version == 1
    finally:
        shard.close()


# -- checkpoints under load ----------------------------------------------------------------

LR = 0.01
SPECS = [VariableSpec("w", (64, 8), "float32"), VariableSpec("b", (8,), "float32"),
         VariableSpec("v", (16,), "float32")]


@dataclass
class Pushes:
    """Every push the workers made: per shard, version -> the gradient parts applied at it;
    per data task, the version its push got on each shard."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_shard: dict[int, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict)
    task_versions: dict[int, dict[int, int]] = field(default_factory=dict)
    base_of: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # shard -> version -> base vector
    count: int = 0
    more: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, count: int) -> None:
        with self.more:
            assert self.more.wait_for(lambda: self.count >= count, timeout=JOIN_S), "workers stopped pushing"


def _worker(index: int, addresses: list[str], placement: Placement, ledger: TaskLedger, pushes: Pushes,
            stop: threading.Event) -> None:
    """Push random dense gradients as fast as possible, one data task per step."""
    client = connect_model(f"worker-{index}", addresses, placement, deadline_s=JOIN_S)
    rng = np.random.default_rng(index)
    try:
        client.pull()
        step = 0
        while not stop.is_set():
            task = ledger.next_task(f"worker-{index}")
            assert task is not None
            grads = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}
            parts = client.split(grads)
            step += 1
            base = list(client.versions)
            results = client.push_pull(grads, step, 0.0)
            with pushes.lock:
                for r in results:
                    assert r.outcome is not None and r.outcome.accepted
                    assert r.outcome.version not in pushes.by_shard.setdefault(r.shard, {})
                    pushes.by_shard[r.shard][r.outcome.version] = parts[r.shard]
                    pushes.base_of.setdefault(r.shard, {})[r.outcome.version] = base
                pushes.task_versions[task.task_id] = {r.shard: r.outcome.version for r in results
                                                      if r.outcome is not None}
            ledger.complete(f"worker-{index}", task.task_id)  # reported after the push, as a worker does
            with pushes.more:
                pushes.count += 1
                pushes.more.notify_all()
    finally:
        client.close()


def _replay(placement: Placement, initial: dict[str, np.ndarray], pushes: Pushes, shard: int,
            version: int) -> dict[str, np.ndarray]:
    """The values of `shard`'s parts after its first `version` updates, applied in version order."""
    optimizer = make_optimizer(OptimizerConfig("sgd", LR))
    values = {p.name: np.array(initial[p.variable][p.rows()] if p.sliced else initial[p.variable])
              for p in placement.parts_on(shard)}
    applied = pushes.by_shard[shard]
    assert set(range(1, version + 1)) <= set(applied), "a version with no recorded push"
    for v in range(1, version + 1):
        for name, grad in applied[v].items():
            optimizer.apply_dense(values[name], grad, {}, LR, v)
    return values


def _assert_values_at(placement: Placement, initial: dict[str, np.ndarray], pushes: Pushes,
                      versions: list[int], values: dict[str, np.ndarray]) -> None:
    """`values` are exactly those of the shards at `versions`, and the versions are a consistent
    cut: no update a shard holds was computed from another shard's values past the cut."""
    for shard, version in enumerate(versions):
        expected = _replay(placement, initial, pushes, shard, version)
        for part in placement.parts_on(shard):
            value = values[part.variable]
            np.testing.assert_array_equal(value[part.rows()] if part.sliced else value, expected[part.name])
    _assert_consistent(pushes, versions)


def _assert_consistent(pushes: Pushes, versions: list[int]) -> None:
    """No update a shard holds at `versions` was computed from another shard's values past them."""
    for shard, version in enumerate(versions):
        for v in range(1, version + 1):
            base = pushes.base_of[shard][v]
            assert all(b <= c for b, c in zip(base, versions, strict=True)), (shard, v, base, versions)


def test_checkpoints_under_continuous_pushes_restore_the_values_of_their_versions(
    tmp_path: Path, start_shards: Callable[[int], list[str]]
) -> None:
    addresses = start_shards(2)
    placement = place(SPECS, 2, slice_threshold_bytes=1024)
    assert any(p.sliced for p in placement.parts)  # w is cut over both shards
    rng = np.random.default_rng(7)
    initial = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}
    run = RunConfig(num_workers=3, num_ps=2, learning_rate=LR, keep_checkpoints=10)
    config = ChiefConfig(ps=tuple(addresses), run=run, run_dir=tmp_path)
    chief = connect_model("chief", addresses, placement, deadline_s=JOIN_S)
    ledger = TaskLedger(10**6, 1, 0.0)
    checkpointer = Checkpointer(config, chief, placement, initial, ledger, Membership(3, 60.0), Progress(), 0.0)
    checkpointer.initialize_shards()
    pushes = Pushes()
    stop = threading.Event()
    paths = []
    evaluations = []
    reader = connect_model("evaluator", addresses, placement, deadline_s=JOIN_S)
    with ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(_worker, i, addresses, placement, ledger, pushes, stop) for i in range(3)]
        try:
            for n in range(6):
                pushes.wait_for(30 * (n + 1))  # the workers keep pushing between and during checkpoints
                path = checkpointer.checkpoint(lambda: 0)
                assert path is not None
                paths.append(path)
                versions = pull_at_cut(reader)  # what an evaluation reads
                evaluations.append((versions, {k: v.copy() for k, v in reader.values.items()}))
        finally:
            stop.set()
            for w in workers:
                w.result(timeout=JOIN_S)

    versions = [CheckpointDir.load(p).manifest["shard_versions"] for p in paths]
    assert all(a < b for earlier, later in itertools.pairwise(versions)
               for a, b in zip(earlier, later, strict=True))
    # the check is not vacuous: shard 0 read before any update, shard 1 read at the end, is no cut
    with pytest.raises(AssertionError):
        _assert_consistent(pushes, [0, max(pushes.by_shard[1])])
    for versions, values in evaluations:
        _assert_values_at(placement, initial, pushes, versions, values)
    reader.close()
    for path in paths:
        ckpt = CheckpointDir.load(path)
        shard_versions = ckpt.manifest["shard_versions"]
        _assert_values_at(placement, initial, pushes, shard_versions, ckpt.values)
        # the ledger is read at the cut: every task it counts as done is in the checkpoint's values
        done = ckpt.manifest["data_tasks"]["done"]
        assert done
        for task in done:
            for shard, version in pushes.task_versions[task].items():
                assert version <= shard_versions[shard], (task, version, shard_versions)

    # restore the first checkpoint into the running shards: a pull sees its values and versions
    first = CheckpointDir.load(paths[0])
    for shard, snap in enumerate(split(placement, first, run.update_rule())):
        chief.shards[shard].restore(snap, shard)
    assert chief.pull() == first.manifest["shard_versions"]
    for name, value in first.values.items():
        np.testing.assert_array_equal(chief.values[name], value)
    chief.close()
