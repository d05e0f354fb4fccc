"""Consistency modes over two shards end to end: one sync decision for all shards, SSP's bound
checked from what the run recorded, and no stall after a shard restore, a worker death or join."""

from __future__ import annotations

import collections
import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from asyncps.chief.checkpoint import CheckpointDir
from asyncps.ps.main import NO_SSP_BOUND_ENV

from asyncps.config import RunConfig
from asyncps.rundir import PushRow, RunDir, StepRow, read_rows
from asyncps.rundir.clocklead import push_clock_lead, timeline_start_lead
from asyncps.tools.local import LocalCluster
from asyncps.transport.coordinator import CoordinatorClient
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow


def run(tmp_path: Path, name: str, *flags: str, env: dict[str, str] | None = None) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path / name
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        result = run_cli(["local", "--run-dir", str(run_dir), "--eval-every-s", "30", "--quiet", "--model", "logreg",
                          "--num-ps", "2", *flags])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, json.loads(RunDir(run_dir).summary.read_text())


def accepted_sets(run_dir: Path) -> dict[tuple[int, int], set[int]]:
    """(shard, version computed from) -> the workers whose gradient that step applied."""
    sets: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for row in read_rows(RunDir(run_dir).pushes, PushRow):
        if row.accepted:
            sets[(row.shard, row.base_version)].add(row.worker)
    return sets


@pytest.mark.parametrize("processes", ["0", "2"], ids=["a-process-each", "logical-workers"])
def test_sync_with_a_backup_worker_averages_the_same_workers_on_every_shard(tmp_path: Path, processes: str) -> None:
    run_dir, s = run(tmp_path, "sync", "--mode", "sync:backup=1", "--num-workers", "4", "--stragglers", "0:4x",
                     "--compute-delay", "uniform:0,0.03", "--max-updates", "60", "--worker-processes", processes)
    sets = accepted_sets(run_dir)
    versions = sorted({v for _, v in sets})
    assert len(versions) >= 60
    differ = {v: (sets.get((0, v)), sets.get((1, v))) for v in versions if sets.get((0, v)) != sets.get((1, v))}
    assert not differ
    # not vacuous: the quorum really changed hands, and late gradients were dropped on both shards
    assert len({frozenset(sets[(0, v)]) for v in versions}) > 1
    assert s["dropped_by_reason"].get("late", 0) >= 2 and s["shards"][0]["version"] == s["shards"][1]["version"]
    # and the run stops on time: every worker says it finished within seconds of the chief's stop, not
    # after a --read-wait-s (30 s) spent waiting for a quorum of workers that had already stopped
    log = RunDir(run_dir).log("chief").read_text().splitlines()
    stamp = lambda line: datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    stopped = next(stamp(line) for line in log if "stopping: " in line)
    finished = [stamp(line) for line in log if line.endswith(" finished")]
    assert len(finished) == 4 and max(finished) - stopped < datetime.timedelta(seconds=10), (stopped, finished)


# The straggler's step is at least 40 x 10 ms = 0.4 s whatever the gradient costs, so a read wait of 0.2 s
# runs out on every wait for it (0.5 s did only while a logreg gradient took more than 2.5 ms)
SSP = ("--mode", "ssp:bound=1", "--num-workers", "3", "--stragglers", "0:40x", "--compute-delay", "const:0.01",
       "--read-wait-s", "0.2", "--max-updates", "40")


def test_ssp_bound_holds_on_two_shards_with_a_40x_straggler(tmp_path: Path) -> None:
    run_dir, s = run(tmp_path, "ssp", *SSP)
    assert s["measured_clock_lead"] <= 1 and s["max_clock_lead"] <= 1
    assert push_clock_lead(read_rows(RunDir(run_dir).pushes, PushRow)) == s["measured_clock_lead"]
    assert timeline_start_lead(read_rows(RunDir(run_dir).timeline, StepRow)) <= 1
    assert s["reads_refused"].get("deadline", 0) > 0  # the short read wait ran out: refused, retried
    assert s["updates_applied"] >= 40


def test_without_the_bound_the_measurement_sees_the_lead(tmp_path: Path) -> None:
    # more updates: unbounded, the fast workers must not finish before the straggler's first push
    run_dir, s = run(tmp_path, "unbounded", *SSP[:-1], "300", env={NO_SSP_BOUND_ENV: "1"})
    assert s["measured_clock_lead"] > 1
    assert timeline_start_lead(read_rows(RunDir(run_dir).timeline, StepRow)) > 1
    assert not s["reads_refused"]


def kill(cluster: LocalCluster, name: str) -> None:
    child = next(c for c in cluster.children if c.name == name)
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(timeout=30)


def wait_for(coord: CoordinatorClient, updates: int, timeout_s: float = 40.0) -> None:
    """Wait until the run reached `updates`; a stall (read_wait_s per step) would take far longer."""
    deadline = time.monotonic() + timeout_s
    while coord.status().updates < updates:
        assert time.monotonic() < deadline, f"stalled before {updates} updates: {coord.status()}"
        time.sleep(0.1)


@pytest.mark.parametrize(("mode", "shard"), [("sync", "ps-0"), ("ssp:bound=1", "ps-1")])
def test_no_stall_after_a_shard_restore_a_worker_death_and_a_join(tmp_path: Path, mode: str, shard: str) -> None:
    """Sync restores the coordinator (shard 0) and SSP a shard with clocks; each must learn the
    live set again, or the dead worker would hold every step for read_wait_s."""
    config = RunConfig(mode=mode, num_workers=3, num_ps=2, model="logreg", epochs=0.0, max_updates=100000,
                       compute_delay="const:0.01", heartbeat_timeout_s=2.0, eval_every_s=30.0,
                       checkpoint_every_updates=20, read_wait_s=5.0)
    (tmp_path / "run").mkdir()
    cluster = LocalCluster(config, tmp_path / "run", max_restarts=5)
    cluster.start()
    coord = CoordinatorClient(cluster.chief_address, deadline_s=30)
    try:
        wait_for(coord, 30, timeout_s=180)  # start-up included
        checkpoints = CheckpointDir(RunDir(tmp_path / "run").checkpoints)
        deadline = time.monotonic() + 60  # a shard that lost its state is restored from a checkpoint: one exists
        while not checkpoints.complete():
            assert time.monotonic() < deadline, f"no checkpoint: {coord.status()}"
            time.sleep(0.1)
        kill(cluster, shard)
        assert cluster.restart_dead_shards() == [shard]  # the chief restores it and tells it who is alive
        wait_for(coord, coord.status().updates + 30)
        kill(cluster, "worker-2")  # dead: the sync quorum shrinks, SSP stops waiting for it
        wait_for(coord, coord.status().updates + 30)
        cluster._spawn("worker-2b", ["worker", "--chief", cluster.chief_address, "--index", "2"])  # a join
        deadline = time.monotonic() + 180  # the joiner loads TensorFlow first
        while coord.status().workers_alive < 3:
            assert time.monotonic() < deadline, "the joining worker never registered"
            time.sleep(0.2)
        wait_for(coord, coord.status().updates + 30)  # the quorum grows back / SSP takes it in at the slowest clock
    finally:
        coord.close()
        cluster.stop()


@pytest.mark.parametrize("mode", ["sync", "k-async:k=3"])
def test_an_epochs_limited_run_does_not_wait_for_workers_with_no_data_left(tmp_path: Path, mode: str) -> None:
    """At the end of an epochs-limited run the workers that hold no task are left out of the live set the
    shards count: the workers still training are not held read_wait_s (30 s) at every step by a quorum
    that waits for a worker that will never push again. 2.6 epochs are 32 tasks of 128 examples: the last
    round of tasks leaves one of the three workers without one even in lockstep. (Without the narrowed
    live set both modes fail here with steps that waited 30.0 s.)"""
    run_dir, s = run(tmp_path, "tail", "--mode", mode, "--num-workers", "3", "--epochs", "2.6", "--stragglers", "0:3x",
                     "--read-wait-s", "30")
    assert s["data"]["tasks_done"] == s["data"]["tasks_planned"] == 32, s["data"]
    waits = [row.wait_s for row in read_rows(RunDir(run_dir).timeline, StepRow)]
    assert max(waits) < 10.0, sorted(waits)[-5:]  # a step held for a quorum that cannot come waited ~30 s
    assert "more alive with no data task left" in RunDir(run_dir).log("chief").read_text()
