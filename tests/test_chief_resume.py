"""Chief restart = resume, piece by piece with real shard processes and a real Coordinator server:
the run id on the shards, adopt-or-restore at start, the ledger's journal, the worker's
re-registration, and the shard's chief watchdog."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from asyncps.chief.checkpointer import INITIALIZED, LIVE, RESTORED, Checkpointer, ShardStateError
from asyncps.chief.config import ChiefConfig
from asyncps.chief.ledgerlog import LedgerLog, replay
from asyncps.chief.membership import Membership
from asyncps.chief.progress import Progress
from asyncps.chief.recorder import Recorder
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.chief.tasks import TaskLedger
from asyncps.ps.store import ShardStore
from asyncps.ps.watchdog import ChiefWatch
from asyncps.worker.chieflink import ChiefLink

from asyncps.config import RunConfig
from asyncps.errors import AlreadyExistsError
from asyncps.net.rpc import create_server
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc
from asyncps.placement import VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import RunDir, wait_port_file
from asyncps.transport import connect_model
from asyncps.transport.coordinator import CoordinatorClient
from asyncps.wire.shard import PushRequest
from tests.conftest import REPO_ROOT, ShardLauncher, child_env

RULE = UpdateRuleConfig(OptimizerConfig("sgd", 0.1))
VALUES = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32)}


# -- the run id on a shard ---------------------------------------------------------------------
def test_a_shard_refuses_another_runs_initialize_and_restore_carries_the_run_id() -> None:
    store = ShardStore(0)
    assert store.initialize(RULE, VALUES, run_id="run-a")
    assert not store.initialize(RULE, VALUES, run_id="run-a")  # the same run again: idempotent
    with pytest.raises(AlreadyExistsError, match="run-a"):
        store.initialize(RULE, VALUES, run_id="run-b")
    snap = store.snapshot()
    assert snap.run_id == "run-a" and store.stats().run_id == "run-a"
    other = ShardStore(0)
    other.restore(snap)
    assert other.stats().run_id == "run-a"


# -- adopt, restore or refuse at the chief's start ---------------------------------------------
def make_checkpointer(addresses: list[str], run_dir: Path, run_id: str, **run: object) -> Checkpointer:
    config = ChiefConfig(ps=tuple(addresses), run=RunConfig(num_ps=len(addresses), max_updates=10, **run),
                         run_dir=run_dir)
    specs = [VariableSpec(n, tuple(v.shape), str(v.dtype)) for n, v in VALUES.items()]
    placement = place(specs, len(addresses), config.run.slice_threshold_bytes)
    client = connect_model("chief", addresses, placement, deadline_s=10)
    ledger = TaskLedger(100, 10, 1)
    return Checkpointer(config, client, placement, dict(VALUES), ledger, Membership(1, 10), Progress(),
                        since=time.monotonic(), run_id=run_id)


def push_once(addresses: list[str]) -> None:
    specs = [VariableSpec(n, tuple(v.shape), str(v.dtype)) for n, v in VALUES.items()]
    client = connect_model("w", addresses, place(specs, len(addresses)), deadline_s=10)
    client.pull()
    for shard, transport in enumerate(client.shards):
        grads = {p.name: np.ones_like(VALUES[p.variable]) for p in client.placement.parts_on(shard)}
        transport.push(PushRequest("w", client.versions[shard], grads))
    client.close()


def test_a_resuming_chief_adopts_its_live_shards_restores_empty_ones_and_refuses_others(
    shard_factory: ShardLauncher, tmp_path: Path
) -> None:
    first = [s.address for s in shard_factory(2)]
    chief = make_checkpointer(first, tmp_path, "run-a")
    assert chief.start_shards(resuming=False) == INITIALIZED
    with pytest.raises(ShardStateError, match="another run"):  # a new run meeting run-a's shards
        make_checkpointer(first, tmp_path / "other", "run-b").start_shards(resuming=False)
    assert make_checkpointer(first, tmp_path, "run-a").start_shards(resuming=True) == LIVE
    push_once(first)
    chief.checkpoint(lambda: 0)
    saved = chief.checkpoints.latest()
    assert saved is not None and saved.manifest["shard_versions"] == [1, 1]
    # a reshard (another shard layout) never adopts the live shards: they get the checkpoint in the new layout
    resharded = make_checkpointer(first, tmp_path, "run-a", slice_threshold_bytes=16)
    assert resharded.start_shards(resuming=True, reshard=True) == RESTORED

    # the shards died and came back empty: the resumed chief restores the checkpoint into them
    empty = [s.address for s in shard_factory(2)]
    restarted = make_checkpointer(empty, tmp_path, "run-a")
    assert restarted.start_shards(resuming=True) == RESTORED
    stats = [s.stats() for s in restarted._client.shards]
    assert [(st.run_id, st.version) for st in stats] == [("run-a", 1), ("run-a", 1)]
    # new checkpoints continue the numbering instead of overwriting the old ones
    restarted.checkpoint(lambda: 0)
    assert [p.name for p in restarted.checkpoints.complete()] == ["ckpt-00000001", "ckpt-00000002"]


def test_state_lost_with_no_checkpoint_stops_unless_reinit_is_allowed(shard_factory: ShardLauncher,
                                                                      tmp_path: Path) -> None:
    addresses = [s.address for s in shard_factory(1)]
    with pytest.raises(ShardStateError, match="no checkpoint"):
        make_checkpointer(addresses, tmp_path, "run-a").start_shards(resuming=True)
    chief = make_checkpointer(addresses, tmp_path, "run-a")
    chief.initialize_shards()
    with pytest.raises(ShardStateError, match="lost its state"):
        chief.recover_shard(0)
    allowed = make_checkpointer(addresses, tmp_path / "allowed", "run-c", allow_reinit=True)
    with pytest.raises(ShardStateError, match="another run"):  # allow_reinit never takes another run's shards
        allowed.start_shards(resuming=True)
    fresh = [s.address for s in shard_factory(1)]
    assert make_checkpointer(fresh, tmp_path / "allowed", "run-c", allow_reinit=True).start_shards(
        resuming=True) == INITIALIZED


# -- the ledger's journal -----------------------------------------------------------------------
def test_the_ledger_journal_replays_to_the_same_state_with_tasks_in_flight(tmp_path: Path) -> None:
    path = RunDir(tmp_path).ledger
    ledger = TaskLedger(100, 10, 2)
    journal = LedgerLog(path, ledger)
    tasks = [ledger.next_task(w) for w in ("w1", "w2", "w1", "w2", "w3")]
    assert all(t is not None for t in tasks)
    ledger.complete("w1", 0)
    ledger.complete("w2", 1)
    ledger.complete("w2", 1)  # a duplicate
    ledger.requeue("w3")  # task 4 back to pending
    assert ledger.next_task("w1") is not None  # task 4 again, now w1's
    ledger.complete("w1", 4)  # a re-run: the journal says who completed it
    assert ledger.summary()["tasks_rerun"] == 1
    journal.close()

    again = TaskLedger(100, 10, 2)
    assert replay(path, again)
    assert again.full_state() == ledger.full_state()
    assert again.summary() == ledger.summary()
    assert again.holders() == {"w1", "w2"}
    with open(path, "a") as f:
        f.write('{"done": 2')  # a line torn by a kill: its change was never answered
    torn = TaskLedger(100, 10, 2)
    assert replay(path, torn) and torn.full_state() == ledger.full_state()
    LedgerLog(path, torn).close()  # a new chief starts the file over from the whole state
    assert len(path.read_text().splitlines()) == 1 and "state" in json.loads(path.read_text())


# -- a worker re-registers with a restarted chief ------------------------------------------------
def serve_coordinator(port: int, tmp_path: Path) -> tuple[grpc.Server, Membership, TaskLedger]:
    membership, ledger = Membership(2, 10), TaskLedger(100, 10, 1)
    servicer = CoordinatorServicer(membership, Recorder(tmp_path), ["127.0.0.1:1"], RunConfig().to_json(),
                                   lambda: cpb.ClusterStatus(), ledger)
    server, _, _ = create_server(f"127.0.0.1:{port}",
                                 [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)])
    return server, membership, ledger


def test_a_worker_registers_again_with_a_restarted_chief_under_its_id_and_index(tmp_path: Path) -> None:
    server, membership, _ = serve_coordinator(0, tmp_path)
    port = int(server.add_insecure_port("127.0.0.1:0"))  # a second port, so the first chief's is known
    server.stop(0).wait()
    server, membership, _ = serve_coordinator(port, tmp_path)
    link = ChiefLink(CoordinatorClient(f"127.0.0.1:{port}", deadline_s=20), "worker-x", 1)
    try:
        assert link.register().index == 1
        link.heartbeat(3)
        server.stop(0).wait()  # the chief dies; a new one knows nobody
        server, membership, ledger = serve_coordinator(port, tmp_path)
        assert link.heartbeat(4).command == cpb.CONTINUE
        assert link.registrations == 2 and membership.index_of("worker-x") == 1
        task = link.get_task()
        assert task.has_task and link.report([], [], completed_tasks=[task.task_id]).command == cpb.CONTINUE
        assert ledger.summary()["tasks_done"] == 1
    finally:
        link.coord.close()
        server.stop(0).wait()


# -- the shard's chief watchdog -----------------------------------------------------------------
def test_a_shard_exits_when_the_chief_is_silent_past_the_timeout_and_not_before(tmp_path: Path) -> None:
    port_file, log_path = tmp_path / "ps.port", tmp_path / "ps.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", "ps", "--host", "127.0.0.1", "--port",
                                 "0", "--port-file", str(port_file), "--chief-timeout-s", "2"],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO_ROOT)
    try:
        port = wait_port_file(port_file, 60, alive=lambda: proc.poll() is None)
        specs = [VariableSpec(n, tuple(v.shape), str(v.dtype)) for n, v in VALUES.items()]
        client = connect_model("chief", [f"127.0.0.1:{port}"], place(specs, 1), deadline_s=10)
        until = time.monotonic() + 5
        while time.monotonic() < until:  # a chief polling: the shard stays, well past the timeout
            client.shards[0].stats()
            time.sleep(0.3)
        assert proc.poll() is None, log_path.read_text()
        silent = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - silent
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 3 and 1.5 <= took <= 6, (code, took)
    assert log_path.read_text().count("no call from the chief for") == 1


def test_the_watch_gives_a_starting_chief_its_startup_allowance_then_only_the_timeout() -> None:
    now = [0.0]
    watch = ChiefWatch(5.0, startup_s=60.0, clock=lambda: now[0])
    now[0] = 30.0
    assert not watch.expired()  # no call yet: the chief may still be loading
    now[0] = 61.0
    assert watch.expired()
    watch.heard()
    now[0] = 65.0
    assert not watch.expired()
    now[0] = 66.5
    assert watch.expired()
    assert not ChiefWatch(0.0, startup_s=1.0, clock=lambda: 1e9).expired()  # 0: never
