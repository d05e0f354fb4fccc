"""A soak: one long `asyncps local` run (3 workers, 2 shards, checkpoints every 3 s) under a seeded schedule
of at least 60 faults: SIGKILL and SIGSTOP/SIGCONT (a pause of 1-12 s: a worker paused past the 10 s
heartbeat timeout is declared dead and comes back) of any role, two at a time, a shard killed during a
checkpoint cut, the chief killed during its own restart. It must end as an unfaulted run of the same
seed does: exit 0, accuracy within 1 point, every push row accounted per shard, the examples identity
within its bound, no process or shared-memory segment left behind. It prints its schedule and a table
of the faults by kind, the restores, and the push rows taken back per shard.

Opt-in (about 25 minutes here, loaded): marked `soak`, in no make target, skipped unless ASYNCPS_SOAK=1:

    ASYNCPS_SOAK=1 .venv/bin/pytest -m soak -s tests/test_soak.py

ASYNCPS_SOAK_SEED=N replays seed N's schedule; ASYNCPS_SOAK_ARGS adds flags to both runs (e.g. a
consistency mode). The schedule holds 90 faults and the run is long enough for most of them; the test
needs at least 60 to have happened before the run ended by itself.

With `ASYNCPS_SOAK_ARGS="--replicas 2"` every shard kill is a takeover by the shard's backup, each once the
backup of the process it kills is seeded (two copies survive one fault at a time, as in the chaos suite), and
the run must end with no checkpoint restored and no push row taken back (its runs are 2500 epochs: with nothing
rolled back, 1000 end before 60 faults have happened).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import random
import shlex
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir
from asyncps.chief.cut import CUT_GATE_ENV

from asyncps.rundir import RunDir, RunSummary
from tests.test_chaos import (
    Fault,
    assert_examples_identity,
    at_once,
    chief,
    chief_during_restart,
    leftovers,
    live_pid,
    shard,
    shard_during_checkpoint,
    worker,
)
from tests.test_chief_restart import finish, role_pid, start_local
from tests.test_cut_survives import wait_for, worker_pid
from tests.test_replicas import seeded

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(os.environ.get("ASYNCPS_SOAK") != "1", reason="opt-in: ASYNCPS_SOAK=1")]

SEED = int(os.environ.get("ASYNCPS_SOAK_SEED", "1"))
FAULTS_PLANNED, FAULTS_NEEDED = 90, 60
# --max-restarts: the schedule kills each role far more often than the launcher's default 5 restarts allow
ARGS = ("--num-workers", "3", "--num-ps", "2", "--epochs", "1000", "--checkpoint-every-s", "3", "--eval-every-s", "20",
        "--max-restarts", "1000",
        *shlex.split(os.environ.get("ASYNCPS_SOAK_ARGS", "")))
REPLICAS = int(ARGS[ARGS.index("--replicas") + 1]) if "--replicas" in ARGS else 1
if REPLICAS > 1 and ARGS.count("--epochs") == 1:  # nothing rolled back: a longer run for the faults to happen in
    ARGS = (*ARGS, "--epochs", "2500")


def pause(what: str, find: Callable[[Path], int], seconds: float) -> Callable[..., None]:
    """SIGSTOP the process `find(run_dir)` now, SIGCONT it `seconds` later (a timer: the schedule goes on)."""
    def act(run_dir: Path, _: Path, proc: object) -> None:
        pid = live_pid(what, lambda: find(run_dir), proc)  # type: ignore[arg-type]
        os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile (a pair, or the run's end)
                os.kill(pid, signal.SIGCONT)

        threading.Timer(seconds, resume).start()
    return act


def kinds(rng: random.Random) -> list[Fault]:
    """Every single fault, each pause with its own length; pairs are made of two of these."""
    out = [Fault(f"kill ps-{i}", 1, shard(i), shards=1) for i in "01"]
    out += [Fault(f"kill worker {i}", 1, worker(i), workers=1) for i in "012"]
    out += [Fault("kill the chief", 1, chief)]
    for i in "01":
        s = round(rng.uniform(1, 6), 1)
        out.append(Fault(f"pause ps-{i} {s}s", 0, pause(f"ps-{i}", functools.partial(role_pid, role="ps", index=i), s)))
    for i in "012":
        s = round(rng.uniform(1, 12), 1)
        out.append(Fault(f"pause worker {i} {s}s", 0, pause(f"worker {i}", functools.partial(worker_pid, index=i), s),
                         workers=1))  # past the heartbeat timeout its task is re-queued: a partial attempt's bound
    s = round(rng.uniform(1, 6), 1)
    out.append(Fault(f"pause the chief {s}s", 0, pause("the chief", lambda d: role_pid(d, "chief"), s)))
    return out


def schedule(seed: int) -> list[tuple[float, Fault]]:
    """FAULTS_PLANNED faults with the pause (s) before each: a third of them pairs at once, some shards
    killed during a checkpoint cut, some chiefs killed during their restart."""
    rng = random.Random(seed)
    out: list[tuple[float, Fault]] = []
    for _ in range(FAULTS_PLANNED):
        roll = rng.random()
        if roll < 0.08:
            i = rng.choice("01")
            fault = Fault(f"kill ps-{i} during a checkpoint cut", 1, shard_during_checkpoint(i), shards=1)
        elif roll < 0.12:
            fault = Fault("kill the chief, then the restarted chief during its restart", 2, chief_during_restart)
        elif roll < 0.45:
            a, b = rng.sample(kinds(rng), 2)
            fault = Fault(f"{a.name} + {b.name} at once", a.kills + b.kills, at_once(a.act, b.act),
                          a.workers + b.workers, a.shards + b.shards)
        else:
            fault = rng.choice(kinds(rng))
        out.append((round(rng.uniform(1.0, 4.0), 1), fault))
    return out


def kind(name: str) -> str:
    """The table's row of a fault: pairs, cuts and restarts by name, single faults by verb and role
    ("pause worker 2 5.3s" -> "pause worker")."""
    if " at once" in name:
        return "two at once"
    if "during" in name:
        return name.replace("ps-0", "a shard").replace("ps-1", "a shard")
    words = ["shard" if w.startswith("ps-") else w for w in name.split() if not w[0].isdigit()]
    return " ".join(words)


def soak(run_dir: Path, faults: list[tuple[float, Fault]]) -> tuple[RunSummary, float, list[str]]:
    """The run under `faults` until it ends by itself; its summary, duration and the faults that happened."""
    gate = run_dir.parent / f"{run_dir.name}-gate"
    gate.mkdir()
    started = time.monotonic()
    proc = start_local(run_dir, *ARGS, "--seed", str(SEED), env={CUT_GATE_ENV: str(gate)})
    done: list[str] = []
    shards_killed = 0
    try:
        if faults:
            wait_for("a checkpoint", CheckpointDir(RunDir(run_dir).checkpoints).complete, proc, timeout_s=180)
        for wait, fault in faults:
            time.sleep(wait)  # the schedule's offsets, not an ordering of threads
            if proc.poll() is not None:
                break
            if REPLICAS > 1 and fault.shards:  # a shard's next kill once the backup of what it kills is seeded
                want = 2 + shards_killed
                try:
                    wait_for("every shard's backup seeded", lambda want=want: seeded(run_dir) >= want, proc,
                             timeout_s=60)
                except AssertionError:
                    if proc.poll() is None:
                        raise
                    break
                shards_killed += fault.shards
            print(f"  t={time.monotonic() - started:6.1f}s  {fault.name}", flush=True)
            try:
                fault.act(run_dir, gate, proc)
            except AssertionError as exc:  # the run ended while the fault waited for its process
                if proc.poll() is None:
                    raise
                print(f"  (the run ended during it: {exc})")
                break
            done.append(fault.name)
        finish(proc, timeout_s=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pids, segments = leftovers(proc)
    assert not pids and not segments, f"left behind: processes {pids}, shared-memory segments {segments}"
    assert "Traceback" not in RunDir(run_dir).log("chief").read_text()
    return RunSummary.load(run_dir), time.monotonic() - started, done


def test_a_soak_of_sixty_faults_ends_as_an_unfaulted_run(tmp_path: Path) -> None:
    faults = schedule(SEED)
    print(f"\nsoak seed {SEED} (replay: ASYNCPS_SOAK=1 ASYNCPS_SOAK_SEED={SEED} pytest -m soak -s tests/test_soak.py), "
          f"args {' '.join(ARGS)}: {len(faults)} faults planned")
    base, base_s, _ = soak(tmp_path / "unfaulted", [])
    print(f"unfaulted: accuracy {base.final_eval.accuracy:.4f}, {base.updates_applied} updates, {base_s:.0f}s")
    print("faulted run:")
    faulted, faulted_s, done = soak(tmp_path / "faulted", faults)
    by_name = {f.name: f for _, f in faults}
    happened = [by_name[n] for n in done]
    chief_log = RunDir(tmp_path / "faulted").log("chief").read_text()
    print(f"\nfaulted: accuracy {faulted.final_eval.accuracy:.4f}, {faulted.updates_applied} updates, "
          f"{faulted_s:.0f}s; {len(done)} faults, {sum(f.kills for f in happened)} processes killed "
          f"({sum(f.shards for f in happened)} shards); chief starts {chief_log.count('chief serving on port')}, "
          f"shard restores {chief_log.count('restored from ckpt-')}")
    print("\n| fault | times |\n|---|---|")
    for name, n in sorted(collections.Counter(kind(n) for n in done).items()):
        print(f"| {name} | {n} |")
    print("\n| shard | push rows | kept | taken back by restores | answers no worker reported |\n|---|---|---|---|---|")
    for i, c in enumerate(faulted.shards):
        print(f"| ps-{i} | {c.rows} | {c.rows - c.rows_taken_back} | {c.rows_taken_back} "
              f"({c.rows_taken_back / max(1, c.rows):.1%}) | {sum(c.unreported.values())} |")
    assert len(done) >= FAULTS_NEEDED, f"only {len(done)} faults before the run ended: lengthen it (--epochs)"
    assert_examples_identity(base, 0)
    assert_examples_identity(faulted, sum(f.workers for f in happened))
    for counts in faulted.shards:
        assert counts.answers == sum(counts.answers_by_worker.values()), counts
        assert all(n > 0 for n in counts.unreported.values()), f"rows the shard never answered: {counts}"
        assert counts.answers == counts.rows - counts.rows_taken_back + sum(counts.unreported.values()), counts
    assert faulted.data["tasks_done"] == faulted.data["tasks_planned"], faulted.data
    if REPLICAS > 1:  # every shard kill a takeover: nothing went back to a checkpoint, no push row taken back
        assert "restored from ckpt" not in chief_log, chief_log[-3000:]
        assert all(c.rows_taken_back == 0 for c in faulted.shards), faulted.shards
    assert abs(faulted.final_eval.accuracy - base.final_eval.accuracy) <= 0.01, (base.final_eval.accuracy,
                                                                                 faulted.final_eval.accuracy)
