"""No single point of failure, end to end with real processes: a chief killed with SIGKILL mid-run
is restarted by `asyncps local` and resumes the run; a shard killed with the default settings is
restored from the automatic checkpoint; with the chief gone for good every process exits."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.config import RunConfig
from asyncps.rundir import PUSHES_CSV, PushRow, RunConfigRecord, RunDir, RunSummary, iter_rows
from asyncps.tools.local import LocalCluster
from asyncps.transport.coordinator import CoordinatorClient
from tests.conftest import REPO_ROOT, asyncps_processes, child_env
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow


def start_local(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`asyncps local` in the background (the process under test: launcher, chief, shards, workers)."""
    run_dir.mkdir(parents=True)
    return subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", "local", "--run-dir", str(run_dir),
                             "--quiet", *args], cwd=REPO_ROOT, env={**child_env(), **(env or {})},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def role_pid(run_dir: Path, role: str, index: str | None = None) -> int:
    """The pid of a live cluster process of this run: `chief`, or `ps` with its index (the process serving the
    shard's port: the shard, a shard restarted there, or a backup that took over the port, --replicas 2)."""
    if role == "ps" and index is not None:
        return listening_pid(int(_ps_addresses(run_dir)[int(index)].rsplit(":", 1)[-1]))
    for pid, argv in asyncps_processes():
        if argv and argv[0] == role and role == "chief" and str(run_dir) in argv:
            return pid
    raise AssertionError(f"no live {role} {index or ''} of {run_dir}")


def listening_pid(port: int) -> int:
    """The pid of the process listening on `port` (from /proc: the socket's inode, then its owner)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"nothing listens on port {port}")


def _ps_addresses(run_dir: Path) -> tuple[str, ...]:
    return RunConfigRecord.load(run_dir).ps


def wait_for_updates(run_dir: Path, updates: int, proc: subprocess.Popen[str], timeout_s: float = 180) -> None:
    """Wait until the chief reports at least `updates` applied updates."""
    port_file = RunDir(run_dir).port_file("chief")
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the cluster did not start"
        time.sleep(0.2)
    coord = CoordinatorClient(f"127.0.0.1:{port_file.read_text().strip()}", deadline_s=60)
    try:
        while coord.status().updates < updates:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not progress"
            time.sleep(0.2)
    finally:
        coord.close()


def finish(proc: subprocess.Popen[str], timeout_s: float = 300) -> str:
    """Wait for `asyncps local` to end by itself; its output."""
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-3000:]
    return out


def pushes_per_shard(run_dir: Path) -> dict[int, int]:
    """Rows of pushes.csv per shard."""
    return dict(collections.Counter(row.shard for row in iter_rows(run_dir / PUSHES_CSV, PushRow)))


# long enough to converge: two async runs of the same seed then agree within a point (30 epochs: not always)
ARGS = ("--epochs", "60", "--eval-every-s", "30", "--seed", "3")


def test_killed_chief_is_restarted_and_the_run_finishes_as_if_uninterrupted(tmp_path: Path) -> None:
    baseline_dir = tmp_path / "baseline"
    result = run_cli(["local", "--run-dir", str(baseline_dir), "--quiet", *ARGS])
    assert result.returncode == 0, result.stdout + result.stderr
    baseline = RunSummary.load(baseline_dir)

    run_dir = tmp_path / "crashed"
    proc = start_local(run_dir, *ARGS)
    try:
        wait_for_updates(run_dir, 600, proc)
        os.kill(role_pid(run_dir, "chief"), signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the chief died; restarted it" in out
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "resuming run" in chief_log and "resuming on the live shards" in chief_log, chief_log[-3000:]
    assert json.loads(RunDir(run_dir).manifest.read_text())["chief_starts"] == 2

    summary = RunSummary.load(run_dir)
    data = summary.data
    assert data["tasks_done"] == data["tasks_planned"] and data["tasks_not_done"] == 0, data
    assert data["duplicate_completions"] == 0 and data["tasks_in_flight"] == 0, data
    # every push of the whole run is in pushes.csv once: rows per shard = accepted + dropped
    rows = pushes_per_shard(run_dir)
    assert rows == {i: s.accepted + s.dropped for i, s in enumerate(summary.shards)}, (rows, summary.shards)
    assert (run_dir / PUSHES_CSV).read_text().count("wall_time") == 1  # appended, never truncated
    assert summary.pushes_recorded == sum(rows.values())
    print(f"chief SIGKILLed after 600 updates: accuracy {summary.final_eval.accuracy:.4f} against "
          f"{baseline.final_eval.accuracy:.4f} uninterrupted; tasks {data['tasks_done']}/{data['tasks_planned']}; "
          f"pushes.csv rows per shard {rows}")
    assert abs(summary.final_eval.accuracy - baseline.final_eval.accuracy) <= 0.01, (
        baseline.final_eval.accuracy, summary.final_eval.accuracy)


def test_a_crash_past_max_restarts_ends_the_run_and_says_why(tmp_path: Path) -> None:
    """`--max-restarts 0`: the chief killed once is not restarted; the launcher exits non-zero and names it."""
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "--epochs", "1000", "--max-restarts", "0")
    try:
        wait_for_updates(run_dir, 50, proc)
        os.kill(role_pid(run_dir, "chief"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert "chief crashed with its 0 restarts used (--max-restarts 0): not restarted" in out, out[-3000:]
    assert "restarted it" not in out


def test_chief_sigtermed_with_handover_leaves_the_shards_to_its_replacement(tmp_path: Path) -> None:
    # An orchestrator replacing the chief's task (swarm: unhealthy) sends SIGTERM: with
    # --on-sigterm handover the chief exits 143 without stopping the workers or the shards, and the
    # restarted chief resumes on the live shards (no restore, no shard restart).
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "--max-training-s", "20", "--eval-every-s", "30",
                       env={"ASYNCPS_ON_SIGTERM": "handover"})
    try:
        wait_for_updates(run_dir, 200, proc)
        os.kill(role_pid(run_dir, "chief"), signal.SIGTERM)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the chief died; restarted it" in out and "ps-0 died" not in out and "ps-1 died" not in out, out
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "SIGTERM (--on-sigterm handover)" in chief_log and "exiting 143" in chief_log, chief_log[-3000:]
    assert "resuming on the live shards" in chief_log and "restored from" not in chief_log, chief_log[-3000:]
    for i in range(2):  # the same shard processes, asked to shut down once: at the run's end
        shard_log = RunDir(run_dir).log(f"ps-{i}").read_text()
        assert shard_log.count("shutdown requested") == 1, shard_log[-2000:]
    assert json.loads(RunDir(run_dir).manifest.read_text())["chief_starts"] == 2
    # the run went on under the new chief to its own end (no duplicate-free ledger asserted: a worker
    # that comes back after the heartbeat timeout on a loaded machine rightly has its tasks re-queued)
    resumed_at = re.search(r"resuming on the live shards at versions \[(\d+), (\d+)\]", chief_log)
    assert resumed_at is not None
    summary = RunSummary.load(run_dir)
    assert summary.stop_reason == "reached 20 s", summary.stop_reason
    assert summary.updates_applied > max(int(v) for v in resumed_at.groups()), summary.updates_applied


def test_killed_shard_with_default_settings_is_restored_from_the_automatic_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "--max-training-s", "45", "--eval-every-s", "30")
    try:
        deadline = time.monotonic() + 180
        while not CheckpointDir(RunDir(run_dir).checkpoints).complete():  # the first time-based checkpoint (30 s)
            assert proc.poll() is None and time.monotonic() < deadline, "no automatic checkpoint"
            time.sleep(0.5)
        os.kill(role_pid(run_dir, "ps", "1"), signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "ps-1 died; restarted it" in out
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "shard 1 at" in chief_log and "restored from ckpt-" in chief_log, chief_log[-3000:]
    print("shard SIGKILLed with default settings:", *(line.strip() for line in chief_log.splitlines()
                                                      if "restored from ckpt-" in line))
    assert "initial values" not in chief_log


def test_with_the_chief_gone_every_shard_and_worker_exits_within_the_chief_timeout(tmp_path: Path) -> None:
    timeout_s = 6.0
    run = RunConfig(num_workers=2, num_ps=2, epochs=0, max_training_s=120, eval_every_s=30, chief_timeout_s=timeout_s)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = LocalCluster(run, run_dir)
    try:
        cluster.start()
        coord = CoordinatorClient(cluster.chief_address, deadline_s=30)
        deadline = time.monotonic() + 120
        while coord.status().updates < 50:
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        coord.close()
        cluster.chief.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        others = [c for c in cluster.children if c.name != "chief"]
        for child in others:
            child.proc.wait(timeout=timeout_s + 15)
        took = time.monotonic() - killed
    finally:
        cluster.stop(grace_s=1)
    codes = {c.name: c.proc.returncode for c in others}
    assert all(code not in (0, None) for code in codes.values()), codes
    # detection within the timeout (plus retry backoff and the watchdog's tick), then the process's own exit
    print(f"chief SIGKILLed, --chief-timeout-s {timeout_s:.0f}s: the others exited after {took:.1f}s with {codes}")
    assert took <= timeout_s + 12, took
    for child in others:
        text = RunDir(run_dir).log(child.name).read_text()
        line = "no call from the chief for" if child.name.startswith("ps-") else "the chief is gone"
        assert text.count(line) == 1, text[-2000:]
