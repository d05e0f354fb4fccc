"""A cut survives a shard's death (issue 24, item 0), end to end with `asyncps local`: a shard killed
with SIGKILL while the chief holds a checkpoint or an evaluation cut comes back empty, the chief
restores it and takes the cut again, and the run finishes by itself. The timing is exact: the chief's
test gate (asyncps.chief.cut.CUT_GATE_ENV) stops the cut once every shard is held, until the test,
having killed the processes and seen the shard restarted, lets it go on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir
from asyncps.chief.cut import CUT_GATE_ENV

from asyncps.rundir import RunDir, RunSummary
from asyncps.transport.shmseg import SHM_DIR
from tests.conftest import asyncps_processes
from tests.test_chief_restart import finish, role_pid, start_local

pytestmark = pytest.mark.slow

ARGS = ("--num-workers", "3", "--num-ps", "2", "--max-training-s", "30", "--checkpoint-every-s", "3",
        "--eval-every-s", "2",
        "--seed", "5")


def wait_for(what: str, ready: object, proc: object, timeout_s: float = 120) -> None:
    """Wait until `ready()` (the launcher alive throughout)."""
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None, f"asyncps local ended while waiting for {what}"  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.1)


def kill_during_cut(run_dir: Path, gate: Path, proc: object, what: str, shard: str, worker: str | None) -> None:
    """Hold the next `what` cut, SIGKILL shard `shard` (and `worker`) while it is held, wait until the
    launcher restarted the shard, then let the cut go on."""
    (gate / f"hold-{what}").touch()
    wait_for(f"a held {what} cut", (gate / f"held-{what}").exists, proc, timeout_s=180)
    old = role_pid(run_dir, "ps", shard)
    os.kill(old, signal.SIGKILL)
    if worker is not None:
        os.kill(worker_pid(run_dir, worker), signal.SIGKILL)

    def restarted() -> bool:
        try:
            return role_pid(run_dir, "ps", shard) != old
        except AssertionError:
            return False

    wait_for(f"ps-{shard} restarted", restarted, proc)
    (gate / f"go-{what}").touch()


def worker_pid(run_dir: Path, index: str) -> int:
    """The pid of the live worker process of this run with `--index index`."""
    chief = str(RunDir(run_dir).port_file("chief"))  # asyncps local's workers find the chief through its port file
    for pid, argv in asyncps_processes():
        if argv[:1] == ["worker"] and chief in argv and argv[argv.index("--index") + 1] == index:
            return pid
    raise AssertionError(f"no live worker {index} of {run_dir}")


def test_a_shard_killed_during_a_checkpoint_and_an_evaluation_cut_is_restored_and_the_run_finishes(
        tmp_path: Path) -> None:
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    started = time.monotonic()
    proc = start_local(run_dir, *ARGS, env={CUT_GATE_ENV: str(gate)})
    try:
        # as in issue 24: shard 0 and worker 1 at once, while the chief holds a checkpoint cut (after the
        # first checkpoint: with none, a shard that lost its state cannot be restored)
        wait_for("a checkpoint", CheckpointDir(RunDir(run_dir).checkpoints).complete, proc)
        kill_during_cut(run_dir, gate, proc, "checkpoint", "0", "1")
        kill_during_cut(run_dir, gate, proc, "evaluation", "1", None)
        out = finish(proc, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    chief_log = RunDir(run_dir).log("chief").read_text()
    print(f"two shards killed during cuts; the run took {time.monotonic() - started:.1f}s")
    assert "ps-0 died; restarted it" in out and "ps-1 died; restarted it" in out, out[-3000:]
    for what, shard in (("checkpoint", 0), ("evaluation", 1)):
        assert f"{what}: the cut failed (attempt 1 of" in chief_log, chief_log[-4000:]
        assert f"shard {shard} at" in chief_log and "restored from ckpt-" in chief_log, chief_log[-4000:]
    assert "abandoned" not in chief_log, chief_log[-4000:]
    assert "the chief died" not in out, out[-3000:]  # the chief never failed: no restart was needed
    summary = RunSummary.load(run_dir)
    assert summary.stop_reason == "reached 30 s", summary.stop_reason
    assert summary.final_eval.accuracy > 0.5, summary.final_eval
    for i in range(2):  # each shard process told once, and only at the run's end, that training finished
        assert RunDir(run_dir).log(f"ps-{i}").read_text().count("shutdown requested: training finished") == 1
    assert not list(SHM_DIR.glob(f"asyncps-run{proc.pid}x*")), "shared-memory segments left behind"
