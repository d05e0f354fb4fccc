"""A backup seeded from a live primary (asyncps.ps.replica: the journal attached while workers train) holds
the primary's whole state, the part a checkpoint leaves out included (asyncps.ps.live_state: a sync
follower's staged gradients, a coordinator's pending step and decisions, SSP's clocks, the K-variants'
accumulations, the values read for DC-ASGD, the retry memo, the row clocks), sent through the wire's
encoding: every answer after the seeding is the primary's, in every mode. A live state that names
anything else is refused and changes nothing."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from asyncps.ps.live_state import LiveState, decode_live, encode_live
from asyncps.ps.replica import MemoryJournal, ReplicaDiverged, Restored, replay
from asyncps.ps.service import ShardService
from asyncps.ps.store import ShardStore

from asyncps.errors import FailedPreconditionError, InvalidArgumentError
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.sync.client import StepOnShard, WorkerStep, coordinated_step
from asyncps.wire.codec import Array, TensorAssembler
from asyncps.wire.frames import read_frames
from asyncps.wire.proto import parse_snapshot, snapshot_frames, snapshot_from_wire, snapshot_header
from asyncps.wire.shard import LiveBlob, PushOutcome, PushRequest, ShardValues, Snapshot
from tests.test_replica_log import same_state

WORKERS = 3
SHAPE = (6, 4)


class Local:
    """A shard store as a worker's data path, in this process; `before(n)` runs before its n-th call."""

    def __init__(self, store: ShardStore, before: Callable[[int], None] = lambda n: None) -> None:
        self.service = ShardService(store)
        self._calls = itertools.count(1)
        self._before = before

    def push(self, request: PushRequest) -> PushOutcome:
        self._before(next(self._calls))
        return self.service.push(request)

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  ) -> tuple[PushOutcome, ShardValues]:
        self._before(next(self._calls))
        return self.service.push_pull(request, pull_if_newer_than, read_wait_s)


def over_the_wire(snap: Snapshot, chunk_bytes: int = 256) -> Snapshot:
    """The snapshot as a backup receives it (Restore's frames, small chunks: arrays cut in pieces)."""
    assembler = TensorAssembler(1 << 26)
    header = read_frames(iter(list(snapshot_frames(snapshot_header(snap, 1), snap, chunk_bytes))), parse_snapshot,
                         assembler, "Restore")
    return snapshot_from_wire(header, assembler.finish())


def cluster(mode: str, policy: str = "none", optimizer: str = "momentum") -> list[ShardStore]:
    rule = UpdateRuleConfig(OptimizerConfig(optimizer, 0.05), mode=mode, staleness_policy=policy,
                            num_workers=WORKERS)
    stores = []
    for index in range(2):
        store = ShardStore(shard_index=index)
        store.initialize(rule, {f"v{index}": np.random.default_rng(index).normal(size=SHAPE).astype(np.float32)})
        store.set_live_workers([f"w{i}" for i in range(WORKERS)])
        stores.append(store)
    return stores


def train(stores: Sequence[ShardStore], steps: int, seed: int,
          journals: Sequence[MemoryJournal] = (), at_call: int = 0) -> None:
    """WORKERS threads, each `steps` steps: read, push to every shard (a coordinated step in sync and the
    K-variants: stage on the follower, vote at shard 0, commit). `journals`: attached to the stores, in a
    worker's thread, just before shard 1's `at_call`-th call (mid-step: a gradient staged, a step pending)."""
    lock = threading.Lock()

    def attach(n: int) -> None:
        if n == at_call:
            with lock:
                for store, journal in zip(stores, journals, strict=True):
                    store.attach_journal(journal)

    paths = [Local(stores[0]), Local(stores[1], attach)]
    coordinated = stores[0].rule is not None and stores[0].rule.consistency().coordinated
    pool = ThreadPoolExecutor(4)

    def run(w: int) -> None:
        rng = np.random.default_rng(seed * 10 + w)
        for step in range(1, steps + 1):
            read = [s.pull(-1, f"w{w}") for s in stores]
            grads = [{f"v{i}": rng.normal(size=SHAPE).astype(np.float32)} for i in range(len(stores))]
            work = WorkerStep(f"w{w}", grads, seed * 1000 + step, 0.0, [r.version for r in read],
                              [r.incarnation for r in read], w)
            if coordinated:
                got: list[StepOnShard] = coordinated_step(work, paths, [{}, {}], 1.0, lambda i, v: None, pool.map)
                assert len(got) == len(stores)
            else:
                for i, path in enumerate(paths):
                    path.push_pull(work.request(i, None), -1, None, 1.0)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    pool.shutdown()


def live_of(store: ShardStore) -> LiveBlob:
    clocks = {n: (v.clock, v.clock_base) for n, v in store._vars.items() if v.clock is not None}
    return encode_live(LiveState(store._mode, store._reads, store._last_pushes,  # type: ignore[arg-type]
                                 store._last_commits, dict(store._dropped_by_reason), clocks))


@pytest.mark.parametrize(("mode", "policy"), [
    ("sync", "none"), ("sync:backup=1", "none"), ("k-async:k=2", "none"), ("k-batch-async:k=2", "none"),
    ("k-batch-sync:k=2", "none"), ("ssp:bound=1", "none"), ("async", "dc-asgd:lambda=0.1"),
])
def test_a_backup_seeded_mid_run_gives_every_later_answer_of_its_primary(mode: str, policy: str) -> None:
    stores = cluster(mode, policy)
    journals = [MemoryJournal() for _ in stores]
    # seeded mid-run, with a live state: staged, pending, decided, clocks, values read
    train(stores, 12, seed=1, journals=journals, at_call=3 * WORKERS * 2 + 2)
    for store, journal in zip(stores, journals, strict=True):
        seed_op = journal.ops[0]
        assert isinstance(seed_op, Restored) and seed_op.snapshot.live is not None
        backup = ShardStore(shard_index=store.shard_index)
        replay(backup, Restored(over_the_wire(seed_op.snapshot)))
        for op in journal.ops[1:]:
            replay(backup, op)  # ReplicaDiverged on the first answer that differs from the primary's
        same_state(store, backup)
        assert same_live(store, backup)
        # and the live part mattered: seeded without it, a backup is caught or ends in another state
        bare = ShardStore(shard_index=store.shard_index)
        replay(bare, Restored(dataclasses.replace(seed_op.snapshot, live=None)))
        try:
            for op in journal.ops[1:]:
                replay(bare, op)
        except ReplicaDiverged:
            continue
        assert not same_live(store, bare)


def same_live(a: ShardStore, b: ShardStore) -> bool:
    mine, theirs = live_of(a), live_of(b)
    return json.loads(mine.tree) == json.loads(theirs.tree) and len(mine.arrays) == len(theirs.arrays) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(mine.arrays, theirs.arrays, strict=True))


def test_without_its_live_part_a_seeded_sync_follower_answers_otherwise() -> None:
    """What the live part is for: the same seeding with a checkpoint's part only is caught diverging."""
    stores = cluster("sync")
    journals = [MemoryJournal() for _ in stores]
    train(stores, 6, seed=1, journals=journals, at_call=3 * WORKERS * 2 + 2)
    journal = journals[1]
    seed_op = journal.ops[0]
    assert isinstance(seed_op, Restored) and seed_op.snapshot.live is not None
    assert decode_live(seed_op.snapshot.live, type(stores[1]._mode)).mode._staged  # type: ignore[attr-defined]  # a step half staged
    backup = ShardStore(shard_index=1)
    replay(backup, Restored(dataclasses.replace(seed_op.snapshot, live=None)))
    with pytest.raises(ReplicaDiverged):
        for op in journal.ops[1:]:
            replay(backup, op)


def hostile(blob: LiveBlob, tree: object) -> LiveBlob:
    return dataclasses.replace(blob, tree=json.dumps(tree).encode())


@pytest.mark.parametrize("change", [
    "a class not named", "a function", "a missing field", "another mode", "a stray array", "not json",
    "a wrong dtype", "a field of another type",
])
def test_a_live_state_naming_anything_else_is_refused_and_changes_nothing(change: str) -> None:
    stores = cluster("sync")
    train(stores, 2, seed=1)
    journal = MemoryJournal()
    stores[1].attach_journal(journal)
    seed_op = journal.ops[0]
    assert isinstance(seed_op, Restored) and seed_op.snapshot.live is not None
    blob = seed_op.snapshot.live
    tree = json.loads(blob.tree)
    if change == "a class not named":
        tree["c"] = "asyncps.ps.main.Replication"
    elif change == "a function":
        tree["v"]["mode"]["c"] = "builtins.eval"
    elif change == "a missing field":
        del tree["v"]["last_pushes"]
    elif change == "another mode":
        tree["v"]["mode"]["c"] = "asyncps.rules.modes.AsyncConsistency"
    elif change == "a stray array":
        blob = dataclasses.replace(blob, arrays=(*blob.arrays, np.zeros(3, np.float32)))
    elif change == "not json":
        tree = None
        blob = dataclasses.replace(blob, tree=b"\x80not json")
    elif change == "a wrong dtype":
        tree["v"]["mode"]["v"]["version"] = {"n": ["<U4", "abcd"]}
    else:
        tree["v"]["mode"]["v"]["next_step"] = "seven"
    if tree is not None:
        blob = hostile(blob, tree)
    backup = ShardStore(shard_index=1)
    replay(backup, Restored(seed_op.snapshot))  # a state to keep
    before = backup.snapshot()
    with pytest.raises(InvalidArgumentError):
        backup.restore(over_the_wire(dataclasses.replace(seed_op.snapshot, live=blob, incarnation=7)))
    after = backup.snapshot()
    assert (after.version, after.incarnation, after.answers) == (before.version, before.incarnation, before.answers)
    assert backup.incarnation == seed_op.snapshot.incarnation
    decode_live(seed_op.snapshot.live, type(stores[1]._mode))  # the untouched one still decodes


def test_a_mode_the_live_state_cannot_hold_is_named_at_the_seeding() -> None:
    class Plugin:
        pass

    stores = cluster("async")
    stores[0]._mode.plugin = Plugin()  # type: ignore[union-attr]  # a plugin mode's own object
    journal = MemoryJournal()
    with pytest.raises(FailedPreconditionError, match=r"cannot seed a backup.*Plugin cannot be sent"):
        stores[0].attach_journal(journal)
    assert stores[0]._journal is None and not journal.ops  # nothing attached, nothing recorded
