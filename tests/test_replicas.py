"""Replicated shards end to end: `asyncps local --replicas 2` (a backup per shard, fed every state change before
the shard answers: asyncps.ps.replica), and SIGKILLs of primaries while it trains: each time the backup takes
over the primary's port with every push it answered, a new backup is seeded from it, and the run ends with no
push row taken back, no checkpoint restored, no backup let go, and every answer of the shards accounted. In
async and in sync, where the later takeovers are by backups seeded live (asyncps.ps.live_state).

Prints, for each kill, the time from the primary's death to the first push its shard answered after it (the
takeover table). Each next kill waits for that answer, so every backup that took over is shown serving."""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.rundir import PushRow, RunConfigRecord, RunDir, RunDirError, RunSummary, iter_rows
from tests.test_chief_restart import finish, listening_pid, start_local
from tests.test_cut_survives import wait_for

pytestmark = pytest.mark.slow

ARGS = ("--num-workers", "3", "--num-ps", "2", "--epochs", "200", "--checkpoint-every-s", "3", "--eval-every-s", "5",
        "--replicas", "2", "--seed", "1")
SETTLE_S = 0.5  # after a kill, the answers a worker takes in are the backup's (the primary's last ones are past)


def first_answer(run_dir: Path, shard: int, after: float) -> float | None:
    """When `shard` first answered a push after `after` (Unix time), from the pushes the workers reported (None:
    none yet, or the chief is writing the file's last line now)."""
    try:
        return min((r.wall_time for r in iter_rows(RunDir(run_dir).pushes, PushRow)
                    if r.shard == shard and r.wall_time > after), default=None)
    except RunDirError:  # a line read while the chief writes it: the next look reads it whole
        return None


def takeover_s(rows: list[PushRow], shard: int, killed: float) -> float:
    """The longest `shard` answered no push from its primary's death (`killed`) to its first answer SETTLE_S
    after: the time to the backup's first answer, past any answer the primary sent just before it died (which
    a worker may take in a little after)."""
    end = min(r.wall_time for r in rows if r.shard == shard and r.wall_time > killed + SETTLE_S)
    answered = sorted(r.wall_time for r in rows if r.shard == shard and killed < r.wall_time <= end)
    return max(b - a for a, b in itertools.pairwise([killed, *answered]))


def seeded(run_dir: Path) -> int:
    """How many times a shard of the run began forwarding to a backup (its log says so once seeded)."""
    return sum(log.read_text(errors="replace").count("every state change goes to its backup")
               for log in RunDir(run_dir).logs.glob("ps-*.log"))


# sync: each shard killed twice, the second time holding the state its backup was seeded with live (a sync
# follower's staged gradients, the coordinator's pending step and decisions: asyncps.ps.live_state)
# recsys: tables read by rows, whose row clocks a live seeding carries (a checkpoint starts them over)
RECSYS = ("--model", "recsys", "--dataset", "recsys:rows=2000", "--optimizer", "adagrad", "--learning-rate", "0.1",
          "--epochs", "15")


@pytest.mark.parametrize(("mode", "schedule", "extra"), [("async", (0, 1, 0), ()), ("sync", (0, 1, 1, 0), ()),
                                                         ("async", (1, 1), RECSYS)],
                         ids=["async", "sync", "recsys"])
def test_killed_primaries_are_taken_over_by_their_backups_with_nothing_taken_back(
        tmp_path: Path, mode: str, schedule: tuple[int, ...], extra: tuple[str, ...]) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, *ARGS, "--mode", mode, *extra)
    kills: list[tuple[int, float]] = []  # (shard, when)
    try:
        wait_for("a checkpoint", CheckpointDir(RunDir(run_dir).checkpoints).complete, proc, timeout_s=180)
        ports = [int(a.rsplit(":", 1)[1]) for a in RunConfigRecord.load(run_dir).ps]
        for shard in schedule:
            # each kill once the shard's backup is seeded (the launcher seeds a new one after each takeover)
            want = 2 + len(kills)
            wait_for("every shard's backup seeded", lambda want=want: seeded(run_dir) >= want, proc, timeout_s=60)
            primary = listening_pid(ports[shard])
            os.kill(primary, signal.SIGKILL)
            kills.append((shard, time.time()))

            def taken_over(port: int = ports[shard], dead: int = primary) -> bool:
                try:
                    return listening_pid(port) != dead
                except AssertionError:
                    return False

            wait_for(f"ps-{shard}'s backup on its port", taken_over, proc, timeout_s=60)
            # the next kill once the backup answered a push (a reported row, half a second after this kill: an
            # answer the dead primary sent just before it is past by then): every backup is shown serving
            wait_for(f"a push ps-{shard} answered after its kill",
                     lambda s=shard, w=kills[-1][1]: first_answer(run_dir, s, w + SETTLE_S) is not None, proc,
                     timeout_s=180)
            time.sleep(2.0)  # the schedule's pause, not an ordering of threads: training goes on between kills
        out = finish(proc, timeout_s=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = RunSummary.load(run_dir)
    chief_log = RunDir(run_dir).log("chief").read_text()
    # the takeover table: from each primary's death to the first push its backup answered
    rows = list(iter_rows(RunDir(run_dir).pushes, PushRow))
    takeovers = [takeover_s(rows, shard, when) for shard, when in kills]
    print(f"\n{len(kills)} primaries killed; from each one's death to its backup's first answer: "
          + ", ".join(f"ps-{s} {t:.2f}s" for (s, _), t in zip(kills, takeovers, strict=True))
          + f" (median {statistics.median(takeovers):.2f}s, max {max(takeovers):.2f}s)")
    for i, counts in enumerate(summary.shards):
        print(f"ps-{i}: {counts.rows} push rows, {counts.rows_taken_back} taken back; {counts.answers} answers, "
              f"unreported {counts.unreported}")
    print(f"final accuracy {summary.final_eval.accuracy:.4f}, {summary.updates_applied} updates")
    assert out.count("its backup took over its port") == len(kills), out[-3000:]
    assert "restored from ckpt" not in chief_log, chief_log[-3000:]  # no shard went back to a checkpoint
    for log in RunDir(run_dir).logs.glob("ps-*.log"):  # every backup, those seeded live included, stayed exact
        assert "its backup is let go" not in log.read_text(errors="replace"), log.name
    for counts in summary.shards:  # no worker was killed: every answer a row, none taken back
        assert counts.rows_taken_back == 0 and counts.answers == counts.rows and not counts.unreported, counts
    assert summary.final_eval.accuracy > (0.65 if extra else 0.9)  # recsys: 0/1 labels of a hidden rule
    assert max(takeovers) < 30
