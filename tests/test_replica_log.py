"""A shard's log of state changes (asyncps.ps.replica), replayed on a backup store: the backup ends with the
primary's state bit for bit (values, slots, versions, answer numbers, row clocks, keyed places, incarnation)
and gives every push the primary's answer, after concurrent pushes of dense, sparse and keyed gradients,
row reads, drops, a restore and a live set; and a backup that holds another state is caught, not trusted."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from asyncps.ps.live_state import decode_live
from asyncps.ps.replica import ForwardingJournal, MemoryJournal, Pushed, Read, ReplicaDiverged, Restored, replay
from asyncps.ps.store import ShardStore

from asyncps.errors import FailedPreconditionError, InvalidArgumentError, PermissionDeniedError
from asyncps.net.security import SecurityConfig
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.tools.devcerts import CHIEF_COMMON_NAME, SERVER_COMMON_NAME, generate_dev_certs
from asyncps.transport import GrpcShardTransport
from asyncps.transport.grpc_shard import GrpcShardControl
from asyncps.transport.link import ShardLink
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import PushRequest
from tests.conftest import ShardLauncher, ShardProcess

UNIFORM = RowInit.parse("uniform:min=-1,max=1,seed=5")
ROWS = 50


def rule(optimizer: str, mode: str = "async", policy: str = "none") -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig(optimizer, 0.05), mode=mode, staleness_policy=policy, num_workers=4)


def primary(optimizer: str, mode: str = "async", policy: str = "none", keyed: bool = True
            ) -> tuple[ShardStore, MemoryJournal]:
    store = ShardStore(shard_index=1)
    journal = MemoryJournal()
    store.attach_journal(journal)
    generated = {"keyed": TableSpec((16, 3), "float32", 0, UNIFORM, keyed=True)} if keyed else {}
    rng = np.random.default_rng(0)
    assert store.initialize(rule(optimizer, mode, policy),
                            {"w": rng.normal(size=(8, 4)).astype(np.float32),
                             "emb": rng.normal(size=(ROWS, 3)).astype(np.float32)},
                            run_id="run-a", generated=generated)
    return store, journal


def same_state(a: ShardStore, b: ShardStore) -> None:
    """Every part of the two stores' states, bit for bit."""
    sa, sb = a.snapshot(), b.snapshot()
    assert (sa.version, sa.accepted, sa.dropped, sa.answers, sa.answers_by_worker, sa.updates, sa.run_id) == \
           (sb.version, sb.accepted, sb.dropped, sb.answers, sb.answers_by_worker, sb.updates, sb.run_id)
    assert a.incarnation == b.incarnation and a.stats().dropped_by_reason == b.stats().dropped_by_reason
    for name in sa.values:
        np.testing.assert_array_equal(sa.values[name], sb.values[name], strict=True)
        assert sa.slots[name].keys() == sb.slots[name].keys()
        for slot in sa.slots[name]:
            np.testing.assert_array_equal(sa.slots[name][slot], sb.slots[name][slot], strict=True)
    assert sa.policy_state.keys() == sb.policy_state.keys()
    for name, state in sa.policy_state.items():
        for key, array in state.items():
            np.testing.assert_array_equal(array, sb.policy_state[name][key], strict=True)
    for name in sa.values:  # row clocks: made by the first row read, advanced by every row update
        ca, cb = a._vars[name].clock, b._vars[name].clock
        assert (ca is None) == (cb is None), name
        if ca is not None and cb is not None:
            np.testing.assert_array_equal(ca, cb)
            assert a._vars[name].clock_base == b._vars[name].clock_base


def worker(store: ShardStore, index: int, steps: int, keyed: bool, start: threading.Barrier) -> Callable[[], None]:
    """A worker's loop of reads and pushes, each computed from what it read (some late, some stale)."""
    def run() -> None:
        rng = random.Random(index)
        start.wait()
        for step in range(1, steps + 1):
            ids = np.unique(np.array([rng.randrange(ROWS) for _ in range(5)], dtype=np.int64))
            reply = store.pull(-1, f"w{index}", rows={"emb": ids})
            assert reply.rows is not None
            grads: dict[str, object] = {
                "w": np.full((8, 4), rng.uniform(-1, 1), np.float32),
                "emb": SparseRows(ids, np.full((ids.size, 3), rng.uniform(-1, 1), np.float32),
                                  reply.rows["emb"].clocks),
            }
            if keyed:
                grads["keyed"] = SparseRows(np.array([rng.randrange(-40, 40) * 7919], dtype=np.int64),
                                            np.ones((1, 3), np.float32))
            # now and then a push sent with an incarnation the shard no longer has, or from long ago
            incarnation = 12345 if rng.random() < 0.05 else reply.incarnation
            base = max(0, reply.version - rng.choice((0, 0, 1, 3)))
            store.push(f"w{index}", base, grads, incarnation, step, worker_index=index)  # type: ignore[arg-type]
    return run


@pytest.mark.parametrize(("optimizer", "mode", "policy"), [
    ("adam", "async", "none"), ("momentum", "async", "row-drop:bound=2"), ("adagrad", "ssp:bound=3", "none"),
    ("sgd", "async", "dc-asgd:lambda=0.1"),
])
def test_a_backup_that_replays_the_log_holds_the_primarys_state_bit_for_bit(optimizer: str, mode: str,
                                                                            policy: str) -> None:
    keyed = policy == "none"  # keyed parts train without policies that correct with the values read
    store, journal = primary(optimizer, mode, policy, keyed)
    start = threading.Barrier(4)
    threads = [threading.Thread(target=worker(store, i, 40, keyed, start)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store.set_live_workers(["w0", "w1", "w2"])
    pushes = [op for op in journal.ops if isinstance(op, Pushed)]
    assert len(pushes) == 160 and [op.outcome.seq for op in pushes] == list(range(1, 161))  # every answer, in order
    assert any(not op.outcome.accepted for op in pushes)  # drops are logged too: they are answers
    backup = ShardStore(shard_index=1)
    journal.replay_into(backup)  # replay raises ReplicaDiverged on any answer that differs
    same_state(store, backup)


def test_a_restore_and_the_pushes_after_it_replay_to_the_same_state_and_the_same_incarnation() -> None:
    store, journal = primary("adam", keyed=False)
    worker(store, 0, 10, False, threading.Barrier(1))()
    snap = store.snapshot()
    worker(store, 1, 10, False, threading.Barrier(1))()
    store.restore(snap)  # back to the snapshot: a new incarnation, drawn on the primary
    worker(store, 2, 10, False, threading.Barrier(1))()
    restored = [op for op in journal.ops if isinstance(op, Restored)]
    assert len(restored) == 1 and restored[0].snapshot.incarnation == store.incarnation
    backup = ShardStore(shard_index=1)
    journal.replay_into(backup)
    same_state(store, backup)


def test_only_reads_that_change_state_are_logged() -> None:
    store, journal = primary("sgd", keyed=False)
    store.pull(-1, "w0")  # whole values, nothing kept: no op
    store.pull(-1, "w0", rows={"emb": np.array([1, 2], dtype=np.int64)})  # the table's row clocks are made
    store.pull(-1, "w0", rows={"emb": np.array([3], dtype=np.int64)})  # already made: no op
    reads = [op for op in journal.ops if isinstance(op, Read)]
    assert len(reads) == 1 and reads[0].rows["emb"].tolist() == [1, 2]


def test_a_backup_holding_another_state_is_caught_at_the_first_answer_that_differs() -> None:
    store, journal = primary("sgd", keyed=False)
    worker(store, 0, 5, False, threading.Barrier(1))()
    backup = ShardStore(shard_index=1)
    ops = list(journal.ops)
    replay(backup, ops[0])  # initialized alike, then one push the primary never had
    backup.push("stranger", 0, {"w": np.ones((8, 4), np.float32)})
    with pytest.raises(ReplicaDiverged, match="answer"):
        for op in ops[1:]:
            replay(backup, op)
    changed = dataclasses.replace(next(op for op in ops if isinstance(op, Pushed)), worker_index=3)
    fresh = ShardStore(shard_index=1)
    replay(fresh, ops[0])
    with pytest.raises(ReplicaDiverged):  # an answer counted for another worker index: not the same answer
        replay(fresh, dataclasses.replace(changed, outcome=dataclasses.replace(changed.outcome, seq=2)))


def test_a_backup_seeded_from_a_live_primary_goes_on_from_where_it_stands() -> None:
    """A journal attached to a store in use starts with its whole state (row clocks included): a backup fed
    from there holds the primary's state, as one fed from the start does."""
    store = ShardStore(shard_index=1)
    rng = np.random.default_rng(0)
    assert store.initialize(rule("momentum", policy="row-drop:bound=2"),
                            {"w": rng.normal(size=(8, 4)).astype(np.float32),
                             "emb": rng.normal(size=(ROWS, 3)).astype(np.float32)})
    worker(store, 0, 15, False, threading.Barrier(1))()  # trained for a while, its row clocks made
    journal = MemoryJournal()
    store.attach_journal(journal)
    seed = journal.ops[0]
    assert isinstance(seed, Restored) and seed.snapshot.version == store.version and seed.snapshot.live is not None
    assert "emb" in decode_live(seed.snapshot.live, type(store._mode)).clocks
    start = threading.Barrier(2)
    threads = [threading.Thread(target=worker(store, i, 20, False, start)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    backup = ShardStore(shard_index=1)
    journal.replay_into(backup)
    same_state(store, backup)


def test_a_backup_shard_process_fed_by_a_forwarding_journal_holds_every_answered_push(
        shard_factory: ShardLauncher) -> None:
    """The primary's ops go to a real backup shard process over gRPC, in order, each answered on the primary only
    once the backup applied it and gave the same answer: after concurrent pushes the backup's state is the
    primary's, bit for bit. A backup that dies is let go: the primary goes on alone and says why."""
    [process] = shard_factory(1)
    backup = GrpcShardTransport(process.address, deadline_s=0.0, call_timeout_s=30.0)  # one attempt per call
    store = ShardStore(shard_index=0)
    journal = ForwardingJournal(backup, 0, 1)
    store.attach_journal(journal)
    rng = np.random.default_rng(0)
    assert store.initialize(rule("adam"), {"w": rng.normal(size=(8, 4)).astype(np.float32),
                                           "emb": rng.normal(size=(ROWS, 3)).astype(np.float32)},
                            run_id="run-a", generated={"keyed": TableSpec((16, 3), "float32", 0, UNIFORM, keyed=True)})
    start = threading.Barrier(3)
    threads = [threading.Thread(target=worker(store, i, 25, True, start)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert journal.lost is None and journal.acknowledged > 75  # every push (75), the reads that made clocks, ...
    mirror = ShardStore(shard_index=0)
    mirror.restore(backup.snapshot())  # the backup's state, read over the wire, in a store to compare
    theirs, ours = mirror.snapshot(), store.snapshot()
    assert (theirs.version, theirs.answers, theirs.answers_by_worker, theirs.updates) == \
           (ours.version, ours.answers, ours.answers_by_worker, ours.updates)
    for name in ours.values:
        np.testing.assert_array_equal(theirs.values[name], ours.values[name], strict=True)
        for slot in ours.slots[name]:
            np.testing.assert_array_equal(theirs.slots[name][slot], ours.slots[name][slot], strict=True)
    every_row = {"emb": np.arange(ROWS, dtype=np.int64)}  # row clocks too (not in snapshots): read them
    rows_there, rows_here = backup.pull("", 1 << 62, rows=every_row).rows, store.pull(1 << 62, "", rows=every_row).rows
    assert rows_there is not None and rows_here is not None
    np.testing.assert_array_equal(rows_there["emb"].clocks, rows_here["emb"].clocks)
    assert rows_here["emb"].clocks.any()
    assert backup.stats().version == store.version
    process.kill()
    outcome = store.push("w9", store.version, {"w": np.ones((8, 4), np.float32)})
    assert outcome.accepted and journal.lost is not None and "Pushed" in journal.lost
    journal.close()
    backup.close()


def test_a_backup_that_already_holds_a_state_is_refused_and_neither_state_changes(
        shard_factory: ShardLauncher) -> None:
    """A backup ahead of its primary (the same variables, trained further) is not fed the primary's ops on top
    of its own: the primary lets it go at its first op, says why, trains on, and asks it to exit (a backup that
    may not hold its primary's state must never take over); the backup exits with its state as it was."""
    [process] = shard_factory(1)
    ahead = GrpcShardTransport(process.address, deadline_s=0.0, call_timeout_s=30.0)
    values = {"w": np.zeros((8, 4), np.float32)}
    ahead.initialize("someone", 0, 1, rule("sgd"), values)
    for _ in range(3):
        ahead.push(PushRequest("someone", ahead.stats().version, {"w": np.ones((8, 4), np.float32)}))
    store = ShardStore(shard_index=0)
    journal = ForwardingJournal(ahead, 0, 1)
    store.attach_journal(journal)
    assert store.initialize(rule("sgd"), values)
    outcome = store.push("w0", 0, {"w": np.ones((8, 4), np.float32)})
    assert outcome.accepted and store.version == 1
    assert journal.lost is not None and "already holds a state (at version 3)" in journal.lost
    assert process.process.wait(timeout=30) == 0  # asked to exit, it did
    log = process.log_tail()
    assert "let go by its primary" in log and "stopping at version 3" in log, log  # its state as it was
    journal.close()
    ahead.close()


def test_the_replication_endpoints_refuse_what_they_cannot_do_and_change_nothing(
        shard_factory: ShardLauncher) -> None:
    """SetBackup and Promote given bad input: a clear error (INVALID_ARGUMENT, FAILED_PRECONDITION), the shard's
    state unchanged, its service going on; a backup that cannot be seeded is refused (FAILED_PRECONDITION) and let
    go, the shard trains on."""
    shard, other = shard_factory(2)
    client = GrpcShardTransport(shard.address, deadline_s=5.0, call_timeout_s=10.0)
    control = client.control
    assert isinstance(control, GrpcShardControl)
    client.initialize("chief", 0, 1, rule("sgd"), {"w": np.zeros((8, 4), np.float32)})
    client.push(PushRequest("w0", 0, {"w": np.ones((8, 4), np.float32)}, 1))
    before = client.snapshot()
    for address in ("no-port", "host:port", "x" * 300 + ":1", "127.0.0.1:"):
        with pytest.raises(InvalidArgumentError, match="host:port"):
            control.set_backup(address)
    with pytest.raises(InvalidArgumentError, match="its own backup"):
        control.set_backup(shard.address)
    for port in (0, -1, 70000):
        with pytest.raises(InvalidArgumentError, match="1-65535"):
            control.promote(port)
    with pytest.raises(FailedPreconditionError, match="in use"):  # another live process's port: never shared
        control.promote(int(other.address.rsplit(":", 1)[1]))
    after = client.snapshot()
    assert (after.version, after.answers) == (before.version, before.answers) == (1, 1)
    np.testing.assert_array_equal(after.values["w"], before.values["w"])
    with pytest.raises(FailedPreconditionError, match="could not be seeded"):  # nothing listens there
        control.set_backup("127.0.0.1:1")
    outcome = client.push(PushRequest("w0", 1, {"w": np.ones((8, 4), np.float32)}, 2))  # the shard goes on alone
    assert outcome.accepted and client.stats().version == 2
    wait_for_text(shard, "its backup is let go")
    client.close()


def test_under_mtls_and_tokens_a_primary_forwards_with_the_shards_credentials_and_a_worker_cannot(
        shard_factory: ShardLauncher, tmp_path: Path) -> None:
    """`asyncps local --secure --replicas 2`'s credentials: a primary calls its backup's chief-only methods with the
    shards' certificate and the chief's token (the shards take that certificate's name for a chief's); a worker's
    credentials are refused there (PERMISSION_DENIED, the backup unchanged). The chief's Shutdown of the primary
    ends the backup too (exit 0); only a primary that dies leaves it, to take over."""
    certs = generate_dev_certs(tmp_path / "secrets")
    token, chief_token = tmp_path / "token", tmp_path / "chief-token"
    token.write_text("workers-" + "w" * 32 + "\n")
    chief_token.write_text("chief-" + "c" * 32 + "\n")
    tls = ["--tls-ca", str(certs.ca_cert)]
    primary, backup = shard_factory(2, args=(
        "--token-file", str(token), "--chief-token-file", str(chief_token), "--tls-cert", str(certs.server_cert),
        "--tls-key", str(certs.server_key), *tls, "--chief-identity", f"{CHIEF_COMMON_NAME},{SERVER_COMMON_NAME}"))
    chief = SecurityConfig.from_flags(str(token), str(certs.chief_cert), str(certs.chief_key), str(certs.ca_cert),
                                      chief_token_file=str(chief_token))
    worker = SecurityConfig.from_flags(str(token), str(certs.client_cert), str(certs.client_key), str(certs.ca_cert))
    control = GrpcShardControl(ShardLink(primary.address, deadline_s=10.0, security=chief))
    control.set_backup(backup.address)
    as_chief = GrpcShardTransport(primary.address, deadline_s=10.0, security=chief)
    as_chief.initialize("chief", 0, 1, rule("sgd"), {"w": np.zeros((8, 4), np.float32)})
    as_worker = GrpcShardTransport(primary.address, deadline_s=10.0, security=worker)
    assert as_worker.push(PushRequest("w0", 0, {"w": np.ones((8, 4), np.float32)}, 1)).accepted
    stranger = GrpcShardTransport(backup.address, deadline_s=10.0, security=worker)
    with pytest.raises(PermissionDeniedError):  # a worker claiming a primary's part
        stranger.initialize("w0", 0, 1, rule("sgd"), {"w": np.ones((8, 4), np.float32)})
    held = GrpcShardTransport(backup.address, deadline_s=10.0, security=chief).snapshot()
    assert held.version == 1  # the primary's push, and nothing of the stranger's
    np.testing.assert_array_equal(held.values["w"], np.full((8, 4), -0.05, np.float32))
    as_chief.shutdown("tests are done")
    assert primary.process.wait(timeout=30) == 0 and backup.process.wait(timeout=30) == 0, backup.log_tail()
    assert "its primary shard 0 was shut down: tests are done" in backup.log_tail()
    for client in (control, as_chief, as_worker, stranger):
        client.close()


def wait_for_text(shard: ShardProcess, text: str, timeout_s: float = 30.0) -> None:
    """Until the shard's log says `text` (it logs as it goes)."""
    deadline = time.monotonic() + timeout_s
    while text not in shard.log_tail(100_000):
        assert time.monotonic() < deadline, shard.log_tail()
        time.sleep(0.1)  # polling a log file: nothing to wait on
