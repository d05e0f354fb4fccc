"""A worker that registers again under its index (TF_CONFIG, --index: a restarted pod or process)
frees the data tasks its previous incarnation held (issue 24, item 3)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from asyncps.chief.membership import Membership
from asyncps.chief.tasks import TaskLedger

from asyncps.config import RunConfig
from asyncps.ml.datasets import load_dataset
from asyncps.rundir import RunDir
from asyncps.tools.local import LocalCluster
from tests.conftest import start_until


class Clock:
    """A hand-moved clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_new_incarnation_under_an_index_hands_the_old_ones_tasks_back_once() -> None:
    clock = Clock()
    membership = Membership(2, heartbeat_timeout_s=10.0, clock=clock)
    ledger = TaskLedger(num_examples=100, task_size=10, epochs=1)
    assert membership.register("worker#0-host-1-aaa", "worker", 0) == 0
    assert membership.register("worker#1-host-2-bbb", "worker", 1) == 1
    held = [ledger.next_task("worker#0-host-1-aaa"), ledger.next_task("worker#0-host-1-aaa")]
    ledger.next_task("worker#1-host-2-bbb")
    clock.now = 1.0  # well inside the heartbeat timeout: the old incarnation is not silent yet
    assert membership.register("worker#0-host-3-ccc", "worker", 0) == 0

    gone = membership.reap()
    assert [(m.worker_id, m.replaced_by) for m in gone] == [("worker#0-host-1-aaa", "worker#0-host-3-ccc")]
    assert ledger.requeue(gone[0].worker_id) == 2  # what the chief's control loop does with them
    assert membership.reap() == []  # once
    clock.now = 100.0  # the old incarnation is never reaped again; the others time out as usual
    assert sorted(m.worker_id for m in membership.reap()) == ["worker#0-host-3-ccc", "worker#1-host-2-bbb"]
    reissued = [ledger.next_task("worker#0-host-3-ccc") for _ in held]
    assert [t.task_id for t in reissued if t] == [t.task_id for t in held if t]
    assert ledger.summary()["tasks_requeued"] == 2


def test_the_same_incarnation_registering_again_is_not_a_replacement() -> None:
    membership = Membership(1, heartbeat_timeout_s=10.0, clock=Clock())
    membership.register("worker#0-host-1-aaa", "worker", 0)
    membership.register("worker#0-host-1-aaa", "worker", 0)  # a chief restart: the link registers again
    assert membership.reap() == []
    assert [m.worker_id for m in membership.live_workers()] == ["worker#0-host-1-aaa"]


def holds_a_task(run_dir: Path, prefix: str) -> bool:
    """Whether a worker whose id starts with `prefix` holds a data task, by the chief's ledger journal."""
    held: set[int] = set()
    path = RunDir(run_dir).ledger
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            event = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "issue" in event and str(event.get("to", "")).startswith(prefix):
            held.add(int(event["issue"]))
        elif "done" in event:
            held.discard(int(event["done"]))
    return bool(held)


@pytest.mark.slow
def test_an_indexed_worker_restarted_inside_the_heartbeat_timeout_and_the_epochs_run_finishes(
        tmp_path: Path) -> None:
    """kill -9 of a worker while it holds data tasks, started again at once under the same index
    (as `asyncps local`, compose or Kubernetes do): the run ends by its epochs, every example done once."""
    run = RunConfig(num_workers=2, num_ps=1, epochs=3.0, eval_every_s=30.0, heartbeat_timeout_s=120.0,
                    checkpoint_every_s=0.0, seed=3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = LocalCluster(run, run_dir)
    try:
        start_until(cluster, lambda status: status.updates >= 30)
        # the kill lands on a worker that holds a task (the ledger's journal, written before a worker hears of a
        # task): between tasks it would hold none, and nothing would be re-queued (it failed so 2 times in 5)
        until = time.monotonic() + 60
        while not (holders := [i for i in (0, 1) if holds_a_task(run_dir, f"worker#{i}-")]):
            assert time.monotonic() < until, "no worker was seen holding a task"
            time.sleep(0.005)  # polling a file the chief appends to
        worker = next(c for c in cluster.children if c.name == f"worker-{holders[0]}")
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait()
        assert cluster.restart_dead_workers() == [worker.name]
        deadline = time.monotonic() + 180  # far less than the heartbeat timeout (120 s) + the run
        while cluster.chief.alive():
            assert time.monotonic() < deadline, "the run did not finish: the old incarnation's tasks leaked"
            time.sleep(0.2)
    finally:
        cluster.stop()
    assert cluster.exit_codes()["chief"] == 0
    summary = json.loads(RunDir(run_dir).summary.read_text())
    data = summary["data"]
    assert summary["stop_reason"].startswith("reached 3 epochs"), summary["stop_reason"]
    assert data["tasks_requeued"] >= 1, data  # the killed worker held a task
    assert data["tasks_done"] == data["tasks_planned"] and data["tasks_not_done"] == 0, data
    assert data["tasks_in_flight"] == 0 and data["tasks_pending"] == 0, data
    assert data["examples_done"] == 3 * len(load_dataset(run.dataset, run.seed).x_train), data
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "registered again" in chief_log and "re-queued" in chief_log

