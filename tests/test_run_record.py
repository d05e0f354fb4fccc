"""Runs keep their record: a resume takes the run's recorded settings and refuses a changed run-defining one,
config.json and summary.json record versions, host and commit, and a run directory has one chief (an flock
that dies with its holder). And the mistakes a user makes at start get a message naming what was wrong,
within seconds, with a non-zero exit: a chief without shards, a process that dies before it serves (its last
log lines, not a port file's name), a peer that cannot be reached (a warning while the retries go on)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from asyncps.chief.config import ChiefConfig
from asyncps.chief.lifecycle import check_resume, prepare_run_dir

from asyncps.config import RunConfig
from asyncps.net import health
from asyncps.net.retry import RetryPolicy
from asyncps.net.rpc import Unreachable, make_channel, raising_domain_errors
from asyncps.rundir import (
    ChiefLock,
    Provenance,
    RunConfigRecord,
    RunDir,
    RunDirError,
    RunDirLocked,
    RunManifest,
    RunSummary,
)
from asyncps.rundir.provenance import source_commit
from asyncps.tools.cli import resumable_config
from tests.conftest import REPO_ROOT, child_env
from tests.test_rundir import summary as make_summary

RECORDED = RunConfig(model="mlp", optimizer="momentum", learning_rate=0.05, num_ps=1, num_workers=1, epochs=0,
                     max_updates=300, seed=4)
MISTAKE_S = 10.0  # each mistake gets its message and a non-zero exit within this


def recorded_run(run_dir: Path, run: RunConfig = RECORDED) -> Path:
    """A run directory as a chief leaves it at start: its manifest and config.json, by the chief's writers."""
    run_dir.mkdir(parents=True, exist_ok=True)
    RunManifest.new().save(run_dir)
    prepare_run_dir(ChiefConfig(ps=("127.0.0.1:1",) * run.num_ps, run=run, run_dir=run_dir), Provenance.collect())
    return run_dir


def cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    """`asyncps ARGS` as a user runs it; the result and its seconds."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", *args], cwd=REPO_ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - t0


def layers(**flags: object) -> list[dict[str, object]]:
    return [{}, {}, dict(flags)]  # file, environment, flags: as run_settings gives them


# -- a resume takes the recorded run -------------------------------------------------------------
@pytest.mark.parametrize("command", ["chief", "local"])
def test_a_resume_with_a_changed_model_is_refused_naming_the_flag_and_both_values(tmp_path: Path,
                                                                                     command: str) -> None:
    run_dir = recorded_run(tmp_path / "run")
    before = RunDir(run_dir).config.read_text()
    # the chief continues the run its directory holds; `local` is told to (else it refuses the directory)
    given = ["--ps", "127.0.0.1:1"] if command == "chief" else ["--resume"]
    done, seconds = cli(command, *given, "--run-dir", str(run_dir), "--model", "cnn", "--learning-rate", "0.05",
                        "--max-updates", "900")
    assert done.returncode == 2, done.stderr
    assert seconds < MISTAKE_S
    assert "--model 'mlp' -> 'cnn'" in done.stderr, done.stderr
    assert "--learning-rate" not in done.stderr  # 0.05 is what the run recorded: no change
    assert str(RunDir(run_dir).config) in done.stderr
    assert RunDir(run_dir).config.read_text() == before  # the record is untouched


def test_a_resume_takes_the_recorded_settings_and_may_change_its_stop_conditions(tmp_path: Path) -> None:
    run_dir = recorded_run(tmp_path / "run")
    run = resumable_config(run_dir, False, *layers(max_training_s=60.0, eval_every_s=5.0))
    assert (run.model, run.optimizer, run.learning_rate, run.seed, run.num_workers) == ("mlp", "momentum", 0.05, 4, 1)
    # the new stop condition replaces the recorded ones, as for a new run (no epochs: max_training_s only)
    assert (run.max_training_s, run.max_updates, run.epochs, run.eval_every_s) == (60.0, 0, 0.0, 5.0)
    same = resumable_config(run_dir, False, *layers())
    assert same == RECORDED
    # a new run directory (no manifest) takes the flags alone
    assert resumable_config(tmp_path / "new", False, *layers(model="cnn")).model == "cnn"


def test_several_changes_are_all_named_and_a_reshard_is_allowed(tmp_path: Path) -> None:
    run_dir = recorded_run(tmp_path / "run", RunConfig(mode="sync:backup=1", num_workers=3, num_ps=2))
    with pytest.raises(ValueError) as refused:
        resumable_config(run_dir, False, *layers(mode="async", optimizer="adam", staleness_policy="drop:bound=2"))
    message = str(refused.value)
    for change in ("--mode 'sync:backup=1' -> 'async'", "--optimizer 'sgd' -> 'adam'",
                   "--staleness-policy 'none' -> 'drop:bound=2'"):
        assert change in message, message
    resharded = resumable_config(run_dir, False, *layers(num_ps=3))  # a reshard: the checkpoint into 3 shards
    assert resharded.num_ps == 3
    assert check_resume(ChiefConfig(ps=("a:1", "b:1", "c:1"), run=resharded, run_dir=run_dir), resuming=True)


def test_the_chief_itself_refuses_a_changed_run_whoever_started_it(tmp_path: Path) -> None:
    """run_chief's own check (a program, a compose restart), not only the command line's."""
    run_dir = recorded_run(tmp_path / "run")
    changed = RunConfig(**{**RECORDED.__dict__, "dataset": "synthetic-logreg", "max_updates": 900})
    with pytest.raises(ValueError, match="--dataset 'digits' -> 'synthetic-logreg'"):
        check_resume(ChiefConfig(ps=("127.0.0.1:1",), run=changed, run_dir=run_dir), resuming=True)
    more = RunConfig(**{**RECORDED.__dict__, "max_updates": 900, "heartbeat_timeout_s": 20.0})
    assert not check_resume(ChiefConfig(ps=("127.0.0.1:1",), run=more, run_dir=run_dir), resuming=True)
    # --resume of a directory without a manifest (an earlier version's) is checked as well
    RunDir(run_dir).manifest.unlink()
    with pytest.raises(ValueError, match="--dataset"):
        check_resume(ChiefConfig(ps=("127.0.0.1:1",), run=changed, run_dir=run_dir, resume=True), resuming=False)


# -- what the run ran with --------------------------------------------------------------------------
def test_config_and_summary_record_versions_host_and_commit(tmp_path: Path) -> None:
    provenance = Provenance.collect()
    for name in ("python", "asyncps", "tensorflow", "keras", "numpy", "grpcio", "protobuf"):
        assert provenance.versions.get(name), (name, provenance.versions)
    assert provenance.host == socket.gethostname()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert provenance.commit == head.stdout.strip() and provenance.dirty is not None
    run_dir = recorded_run(tmp_path / "run")
    assert RunConfigRecord.load(run_dir).provenance == provenance
    summary = make_summary(provenance=provenance)
    summary.save(run_dir)
    assert RunSummary.load(run_dir).provenance == provenance
    assert make_summary().to_dict().get("provenance") is None  # an older run's summary: none, and it reads


def test_no_commit_outside_a_checkout_and_a_bad_record_names_its_field(tmp_path: Path) -> None:
    assert source_commit(tmp_path) == (None, None)
    (tmp_path / ".git").mkdir()  # a .git that git cannot read: no commit, no error
    assert source_commit(tmp_path) == (None, None)
    run_dir = recorded_run(tmp_path / "run")
    text = RunDir(run_dir).config.read_text().replace('"numpy": "', '"numpy": 1, "x": "')
    RunDir(run_dir).config.write_text(text)
    with pytest.raises(RunDirError, match=r"field 'provenance\.versions\.numpy': expected a string"):
        RunConfigRecord.load(run_dir)


# -- one chief per run directory ----------------------------------------------------------------------
HOLDER = """
import sys, time
from pathlib import Path
from asyncps.rundir import ChiefLock
lock = ChiefLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_chief_is_refused_and_a_dead_holders_lock_is_free_at_once(tmp_path: Path) -> None:
    run_dir = recorded_run(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=child_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} "):
            ChiefLock.acquire(run_dir)
        done, seconds = cli("chief", "--ps", "127.0.0.1:1", "--run-dir", str(run_dir), "--max-updates", "900")
        assert done.returncode == 2 and seconds < MISTAKE_S, (done.returncode, seconds, done.stderr)
        assert f"run directory {run_dir} is in use by another chief (pid {holder.pid} " in done.stderr, done.stderr
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: nothing released by hand
        holder.wait()
    with ChiefLock.acquire(run_dir) as lock:  # never stale
        assert lock.held
        with pytest.raises(RunDirLocked):  # in one process too: the lock is the open file's, not the pid's
            ChiefLock.acquire(run_dir)
    assert not lock.held
    ChiefLock.acquire(run_dir).release()


# -- the mistakes: a message within seconds, a non-zero exit ----------------------------------------------
def test_a_chief_without_shards_names_the_missing_flag(tmp_path: Path) -> None:
    done, seconds = cli("chief", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and seconds < MISTAKE_S, (done.returncode, seconds)
    assert "--ps HOST:PORT" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_local_shows_the_last_lines_of_a_process_that_died_before_it_served(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with ChiefLock.acquire(run_dir):  # the launcher's chief finds the directory in use and exits 2
        done, seconds = cli("local", "--run-dir", str(run_dir), "--max-updates", "50", "--num-ps", "1",
                            "--num-workers", "1", "--quiet")
    assert done.returncode == 2 and seconds < MISTAKE_S, (done.returncode, seconds, done.stderr)
    assert "chief exited with status 2 before it served" in done.stderr, done.stderr
    assert f"    asyncps chief: error: run directory {run_dir} is in use by another chief" in done.stderr
    assert ".port" not in done.stderr


def counted_health_check(on_attempt: Callable[[int], None] = lambda n: None
                          ) -> tuple[str, Callable[[], object], Callable[[], int], Callable[[], None]]:
    """An address nobody listens on, a health check of it that counts its attempts (calling
    `on_attempt` with each number), the count so far, and the channel's close."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    channel = make_channel(address)
    attempts = [0]

    def check() -> object:
        attempts[0] += 1
        on_attempt(attempts[0])
        return health.check(channel, timeout_s=1.0)

    return address, check, lambda: attempts[0], channel.close


def test_an_unreachable_peer_is_reported_once_while_the_retries_go_on(caplog: pytest.LogCaptureFixture) -> None:
    address, check, attempts, close = counted_health_check()
    caplog.set_level(logging.WARNING, logger="asyncps.net.retry")
    t0 = time.time()  # log records carry wall-clock times
    with pytest.raises(Unreachable, match=f"could not reach the peer at {address} within 2s"):
        RetryPolicy(deadline_s=2.0, max_backoff_s=0.2, warn_after_s=0.5).call(raising_domain_errors(check),
                                                                              f"the peer at {address}")
    close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"cannot reach the peer at {address}" in warnings[0].getMessage()
    assert "still trying" in warnings[0].getMessage()
    assert warnings[0].created - t0 < 1.5 < time.time() - t0  # well before the end of the retries
    assert attempts() > 3  # the retries went on after the warning



def test_a_stopping_caller_gives_up_on_an_unreachable_peer_at_once() -> None:
    """The policy's `stop` set (a worker told to stop, or that lost its chief): the next failed attempt ends the
    retries with Unreachable, long before the deadline."""
    import threading

    stop = threading.Event()

    def stop_at_third(n: int) -> None:
        if n == 3:
            stop.set()  # from inside the third attempt: that attempt fails, and no fourth is made

    address, check, attempts, close = counted_health_check(stop_at_third)
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match=f"gave up on the peer at {address} after .*: stopping"):
        RetryPolicy(deadline_s=60.0, max_backoff_s=0.2, stop=stop).call(raising_domain_errors(check),
                                                                        f"the peer at {address}")
    close()
    assert attempts() == 3 and time.monotonic() - t0 < 10.0
    # without the event set, the same call goes on retrying (the control: it is the event that ended it)
    address, count, calls, close = counted_health_check()
    with pytest.raises(Unreachable, match="within 1s"):
        RetryPolicy(deadline_s=1.0, max_backoff_s=0.1, stop=threading.Event()).call(
            raising_domain_errors(count), f"the peer at {address}")
    close()
    assert calls() > 3

# -- end to end: a real chief holds its run, a killed one gives it to its successor, a resume keeps it ---------
@pytest.mark.slow
def test_a_running_chief_holds_its_run_dir_and_a_resume_keeps_the_recorded_run(tmp_path: Path) -> None:
    from tests.test_chief_restart import finish, role_pid, start_local, wait_for_updates

    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "--num-ps", "1", "--num-workers", "1", "--optimizer", "momentum",
                       "--learning-rate", "0.05", "--max-updates", "1500", "--checkpoint-every-updates", "200",
                       "--checkpoint-every-s", "off", "--eval-every-s", "30")
    try:
        wait_for_updates(run_dir, 50, proc)
        ps = ",".join(RunConfigRecord.load(run_dir).ps)
        done, seconds = cli("chief", "--ps", ps, "--run-dir", str(run_dir))
        assert done.returncode == 2 and seconds < MISTAKE_S, (done.returncode, seconds, done.stderr)
        assert "is in use by another chief" in done.stderr, done.stderr
        holder = role_pid(run_dir, "chief")
        assert f"pid {holder} " in RunDir(run_dir).chief_lock.read_text()
        os.kill(holder, signal.SIGKILL)  # the launcher restarts it: its lock died with it
        finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert "(chief start 2)" in chief_log, chief_log[-3000:]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    for provenance in (RunConfigRecord.load(run_dir).provenance, RunSummary.load(run_dir).provenance):
        assert provenance is not None and provenance.commit == head and provenance.versions["tensorflow"]

    done, seconds = cli("local", "--run-dir", str(run_dir), "--max-updates", "2500", "--quiet")
    assert done.returncode == 2 and seconds < MISTAKE_S and "give --resume" in done.stderr, done.stderr
    done, seconds = cli("local", "--run-dir", str(run_dir), "--resume", "--model", "cnn", "--max-updates", "2500",
                        "--quiet")
    assert done.returncode == 2 and seconds < MISTAKE_S and "--model 'mlp' -> 'cnn'" in done.stderr, done.stderr
    done, _ = cli("local", "--run-dir", str(run_dir), "--resume", "--max-updates", "2500", "--quiet", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = RunConfigRecord.load(run_dir).run  # the recorded run, not the defaults (2 shards, 2 workers, sgd 0.1)
    assert (run["num_ps"], run["num_workers"], run["optimizer"], run["learning_rate"]) == (1, 1, "momentum", 0.05)
    assert run["max_updates"] == 2500 and RunSummary.load(run_dir).updates_applied >= 2500
