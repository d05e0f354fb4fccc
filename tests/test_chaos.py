"""A seeded chaos run: `asyncps local` on 2 shards, async and sync (one decision for both shards), with checkpoints
every 3 s, and a seeded schedule of SIGKILLs of shards, workers and the chief: two at once, a shard
during a checkpoint cut (held by the chief's test gate, asyncps.chief.cut.CUT_GATE_ENV), the chief
during its own restart. The run must finish by itself (exit 0, summary.json) with an accuracy within
1 point of an unfaulted run of the same seed, and leave no process or shared-memory segment behind.
Every push row is accounted per shard against the shard's own numbered count of its answers (kept,
taken back by a restore, and answers no row reports: only killed workers' last steps).
With `--replicas 2` (async and sync), every shard kill is a takeover by the shard's backup (each once the backup of
the process it kills is seeded: two copies survive one fault at a time; from the second kill of a shard on, a
backup seeded live, mid-step), and the run ends with no checkpoint restored and no push row taken back.

The schedule and the figures are printed; ASYNCPS_CHAOS_SEED=N replays a seed's schedule (the same
faults in the same order at the same offsets; the processes' own timing is the machine's)."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir
from asyncps.chief.cut import CUT_GATE_ENV

from asyncps.rundir import PushRow, RunDir, RunSummary, StepRow, iter_rows
from asyncps.transport.shmseg import SHM_DIR, TAG_ENV
from tests.test_chief_restart import finish, role_pid, start_local
from tests.test_cut_survives import kill_during_cut, wait_for, worker_pid
from tests.test_replicas import seeded

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SEED = int(os.environ.get("ASYNCPS_CHAOS_SEED", "1"))
ARGS = ("--num-workers", "3", "--num-ps", "2", "--epochs", "300", "--checkpoint-every-s", "3", "--eval-every-s", "5")


@dataclass(frozen=True)
class Fault:
    """One step of the schedule: what it kills, and how."""

    name: str
    kills: int  # processes killed
    act: Callable[[Path, Path, subprocess.Popen[str]], None]
    workers: int = 0  # of them, worker processes (each may leave one data task partly trained)
    shards: int = 0  # of them, shard processes (with --replicas 2: primaries, each taken over by its backup)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def live_pid(what: str, find: Callable[[], int], proc: subprocess.Popen[str]) -> int:
    """The pid `find()` gives once it finds one (the process may be restarting)."""
    found: list[int] = []

    def ready() -> bool:
        try:
            found.append(find())
            return True
        except (AssertionError, OSError, ValueError):
            return False

    wait_for(what, ready, proc, timeout_s=120)
    return found[-1]


def shard(i: str) -> Callable[[Path, Path, subprocess.Popen[str]], None]:
    return lambda run_dir, _, proc: kill(live_pid(f"ps-{i}", lambda: role_pid(run_dir, "ps", i), proc))


def worker(i: str) -> Callable[[Path, Path, subprocess.Popen[str]], None]:
    return lambda run_dir, _, proc: kill(live_pid(f"worker {i}", lambda: worker_pid(run_dir, i), proc))


def chief(run_dir: Path, _: Path, proc: subprocess.Popen[str]) -> None:
    kill(live_pid("the chief", lambda: role_pid(run_dir, "chief"), proc))


def at_once(*acts: Callable[[Path, Path, subprocess.Popen[str]], None]
            ) -> Callable[[Path, Path, subprocess.Popen[str]], None]:
    def act(run_dir: Path, gate: Path, proc: subprocess.Popen[str]) -> None:
        for one in acts:
            one(run_dir, gate, proc)
    return act


def chief_during_restart(run_dir: Path, _: Path, proc: subprocess.Popen[str]) -> None:
    """Kill the chief, then its replacement as soon as the launcher started it (before it resumed)."""
    first = live_pid("the chief", lambda: role_pid(run_dir, "chief"), proc)
    kill(first)

    def replacement() -> int:
        pid = role_pid(run_dir, "chief")
        assert pid != first
        return pid

    kill(live_pid("the restarted chief", replacement, proc))


def shard_during_checkpoint(i: str) -> Callable[[Path, Path, subprocess.Popen[str]], None]:
    return lambda run_dir, gate, proc: kill_during_cut(run_dir, gate, proc, "checkpoint", i, None)


FAULTS = [
    Fault("kill ps-0", 1, shard("0"), shards=1),
    Fault("kill worker 1 and ps-1 at once", 2, at_once(worker("1"), shard("1")), workers=1, shards=1),
    Fault("kill ps-0 during a checkpoint cut", 1, shard_during_checkpoint("0"), shards=1),
    Fault("kill the chief", 1, chief),
    Fault("kill the chief, then the restarted chief during its restart", 2, chief_during_restart),
    Fault("kill worker 0", 1, worker("0"), workers=1),
    Fault("kill ps-1 and worker 2 at once", 2, at_once(shard("1"), worker("2")), workers=1, shards=1),
    Fault("kill ps-1 during a checkpoint cut", 1, shard_during_checkpoint("1"), shards=1),
    Fault("kill the chief and ps-0 at once", 2, at_once(chief, shard("0")), shards=1),
]


def schedule(seed: int) -> list[tuple[float, Fault]]:
    """The seed's order of FAULTS, each with the pause (s) before it."""
    rng = random.Random(seed)
    return [(round(rng.uniform(1.0, 4.0), 1), fault) for fault in rng.sample(FAULTS, len(FAULTS))]


def leftovers(launcher: subprocess.Popen[str]) -> tuple[list[int], list[str]]:
    """Processes of this launcher's run still alive (by its shm tag in their environment), and its
    shared-memory segments still in SHM_DIR."""
    tag = f"{TAG_ENV}=run{launcher.pid}x".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids, [p.name for p in SHM_DIR.glob(f"asyncps-run{launcher.pid}x*")]


def run(run_dir: Path, faults: list[tuple[float, Fault]], mode: str = "async", args: tuple[str, ...] = ARGS,
        seed: int = SEED, finish_s: float = 400, replicas: int = 1) -> tuple[RunSummary, float, str]:
    gate = run_dir.parent / f"{run_dir.name}-gate"
    gate.mkdir()
    started = time.monotonic()
    proc = start_local(run_dir, *args, "--mode", mode, "--seed", str(seed), "--replicas", str(replicas),
                       env={CUT_GATE_ENV: str(gate)})
    shards_killed = 0
    try:
        if faults:  # from the first checkpoint on: a shard that lost its state is restored from one
            wait_for("a checkpoint", CheckpointDir(RunDir(run_dir).checkpoints).complete, proc, timeout_s=180)
        for pause, fault in faults:
            time.sleep(pause)  # the schedule's offsets, not an ordering of threads
            assert proc.poll() is None, f"the run ended before {fault.name!r}"
            if replicas > 1 and fault.shards:
                # two copies survive one fault at a time: a shard's next kill waits until the launcher seeded the
                # backup of the process that took over (one seeding per shard at the start, one per takeover)
                want = 2 + shards_killed
                wait_for("every shard's backup seeded", lambda want=want: seeded(run_dir) >= want, proc,
                         timeout_s=60)
                shards_killed += fault.shards
            print(f"  t={time.monotonic() - started:5.1f}s  {fault.name}", flush=True)
            fault.act(run_dir, gate, proc)
        out = finish(proc, timeout_s=finish_s)
    except AssertionError:
        if proc.poll() is not None and proc.stdout is not None:  # the launcher ended: what it said
            print("asyncps local's output:\n" + proc.stdout.read()[-6000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - started
    pids, segments = leftovers(proc)
    assert not pids and not segments, f"left behind: processes {pids}, shared-memory segments {segments}"
    return RunSummary.load(run_dir), took, out


def trained(summary: RunSummary) -> int:
    """The examples of every step recorded (timeline.csv), by what became of their gradient."""
    return sum(int(summary.data[f"examples_{k}"]) for k in ("applied", "dropped", "partially_applied", "not_pushed",
                                                            "nonfinite", "rolled_back"))


def assert_examples_identity(summary: RunSummary, workers_killed: int) -> None:
    """The examples identity: trained = done + rewound + extra attempts, 0 <= extra <= task_size x (stale and
    duplicate completions + workers killed). Exact without faults (extra 0).

    Why each term, and why the bound is not zero. A worker's batches never span two data tasks, and it
    reports a task done in the report of the task's last step, after every earlier report was answered
    (asyncps.worker.outbox): so each completion the ledger counts (done; or done before a restarted chief
    went back to a checkpoint: rewound, then done again) is a whole task's steps in timeline.csv, once
    (the test checks no report's rows were recorded twice). What else was trained is whole tasks
    completed again (stale: issued by a dead chief past its checkpoint; duplicate), at most task_size
    each, and the part of its one task a killed worker trained and reported before it died (it fetches
    its next task only once the current one's batches are used up): 0 to task_size, which no file records
    (its unreported steps died with it), so this part is a bound. re-run (a re-queued task finished by
    another worker) counts whole tasks of which the killed worker trained some part: it is inside the
    extra, not a term of its own."""
    d = summary.data
    done, rewound, task_size = int(d["examples_done"]), int(d["examples_rewound"]), int(d["task_size"])
    whole = int(d["stale_completions"]) + int(d["duplicate_completions"])
    extra = trained(summary) - done - rewound
    bound = task_size * (whole + workers_killed)
    print(f"examples identity: trained {trained(summary)} = done {done} + rewound {rewound} + {extra} extra "
          f"(bound {bound}: {whole} stale or duplicate task(s), {workers_killed} worker(s) killed, tasks of "
          f"{task_size}; {extra / max(1, done):.2%} of done)")
    assert 0 <= extra <= bound, d


@pytest.mark.parametrize(("mode", "replicas"), [("async", 1), ("sync", 1), ("async", 2), ("sync", 2)],
                         ids=["async", "sync", "async-replicas", "sync-replicas"])
def test_a_seeded_schedule_of_kills_ends_as_an_unfaulted_run(tmp_path: Path, mode: str, replicas: int) -> None:
    faults = schedule(SEED)
    print(f"\nchaos seed {SEED} (replay: ASYNCPS_CHAOS_SEED={SEED} pytest -m chaos tests/test_chaos.py): "
          f"{len(faults)} faults, {sum(f.kills for _, f in faults)} processes killed")
    for pause, fault in faults:
        print(f"  after {pause:.1f}s: {fault.name}")
    assert len(faults) >= 8
    base, base_s, _ = run(tmp_path / "unfaulted", [], mode, replicas=replicas)
    print(f"faulted run ({mode}, replicas {replicas}):")
    faulted, faulted_s, out = run(tmp_path / "faulted", faults, mode, replicas=replicas)
    chief_log = RunDir(tmp_path / "faulted").log("chief").read_text()
    print(f"unfaulted: accuracy {base.final_eval.accuracy:.4f}, {base.updates_applied} updates, {base_s:.0f}s; "
          f"faulted: accuracy {faulted.final_eval.accuracy:.4f}, {faulted.updates_applied} updates, "
          f"{faulted_s:.0f}s; chief starts {chief_log.count('chief serving on port')}, "
          f"restores {chief_log.count('restored from ckpt-')}, cuts retried {chief_log.count('the cut failed')}")
    d = faulted.data
    fates = trained(faulted)
    print(f"examples trained {fates} = done {d['examples_done']} + re-run {d['examples_rerun']} + rewound "
          f"{d['examples_rewound']} + {d['stale_completions']} stale task(s) + partial attempts "
          f"{fates - int(d['examples_done']) - int(d['examples_rerun']) - int(d['examples_rewound'])}")
    assert_examples_identity(base, 0)
    assert_examples_identity(faulted, sum(f.workers for _, f in faults))
    for name, summary in (("unfaulted", base), ("faulted", faulted)):
        for i, counts in enumerate(summary.shards):
            print(f"{name} ps-{i}: {counts.rows} push rows = {counts.rows - counts.rows_taken_back} kept + "
                  f"{counts.rows_taken_back} taken back by restores; the shard's {counts.answers} answers = the rows "
                  f"kept + {sum(counts.unreported.values())} no worker reported {counts.unreported or ''}")
    # no report's rows recorded twice, whole or in part (a chief killed while writing them: asyncps.chief.reportlog)
    files = RunDir(tmp_path / "faulted")
    steps = collections.Counter((s.worker, s.step, s.start) for s in iter_rows(files.timeline, StepRow))
    assert not [k for k, n in steps.items() if n > 1], "a report's timeline rows were recorded more than once"
    pushes = collections.Counter((p.worker, p.shard, p.step, p.wall_time, p.incarnation, p.seq)
                                 for p in iter_rows(files.pushes, PushRow))
    assert not [k for k, n in pushes.items() if n > 1], "a report's push rows were recorded more than once"
    # every push row against the shard's own count of its answers (numbered, restored with its state):
    # exact without faults; after them, the only answers without a row are of killed workers' last steps
    assert all(not c.unreported and not c.rows_taken_back and c.answers == c.rows for c in base.shards), base.shards
    for counts in faulted.shards:
        assert counts.answers == sum(counts.answers_by_worker.values()), counts
        assert all(n > 0 for n in counts.unreported.values()), f"rows the shard never answered: {counts}"
        assert counts.answers == counts.rows - counts.rows_taken_back + sum(counts.unreported.values()), counts
    assert "abandoned" not in chief_log, chief_log[-4000:]
    assert "Traceback" not in chief_log, chief_log[-4000:]  # every report answered (a refused one was re-sent)
    assert faulted.data["tasks_done"] == faulted.data["tasks_planned"], faulted.data
    assert abs(faulted.final_eval.accuracy - base.final_eval.accuracy) <= 0.01, (
        base.final_eval.accuracy, faulted.final_eval.accuracy, out[-3000:])
    if replicas > 1:  # every shard kill a takeover: nothing went back to a checkpoint, no push row taken back
        assert out.count("its backup took over its port") == sum(f.shards for _, f in faults), out[-3000:]
        assert "restored from ckpt" not in chief_log, chief_log[-3000:]
        assert all(c.rows_taken_back == 0 for c in faulted.shards), faulted.shards
