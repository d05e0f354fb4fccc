"""Storage that fails under a checkpoint (issue 36, item 5): a write the disk cannot hold (torn mid-file)
or a checkpoint directory made read-only leaves no checkpoint a restart would load half-written, and the
last complete one stays the latest; a real chief logs each failure, keeps training, tries again at the
next interval, a chief restarted meanwhile resumes from the last complete checkpoint, and the run ends
with the failures counted in summary.json.

The faults are real: a file-size limit (RLIMIT_FSIZE, EFBIG in the middle of the arrays file) in a child
process, and a read-only bind mount (root) or a directory without write permission (anyone else)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.rundir import CheckpointNames, RunDir, RunSummary
from tests.test_chief_restart import REPO_ROOT, finish, role_pid, start_local
from tests.test_cut_survives import wait_for

# a child that writes checkpoint 2 under a 64 KiB file-size limit: its 256 KiB arrays file is torn mid-way
_TORN_WRITE = """
import resource, signal, sys
from pathlib import Path
import numpy as np
from asyncps.chief.checkpoint import CheckpointDir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    CheckpointDir(Path(sys.argv[1])).save(2, {"w": np.ones(1 << 16, np.float32)}, {}, {"step": 2})
    print("written")
except OSError as exc:
    print("refused", exc.errno or "torn")  # numpy's tofile says "N requested and M written", without errno
"""


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` read-only for the chief: a read-only bind mount of it onto itself for root (whom permission
    bits do not stop), its write permission taken away for anyone else; skip where neither holds."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root, but no bind mount here ({mounted.stderr.strip()}): the read-only part needs one")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, text=True)
        if remount.returncode != 0:
            pytest.skip(f"no read-only remount here ({remount.stderr.strip()})")
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def save(ckpt: CheckpointDir, number: int) -> Path:
    return ckpt.save(number, {"w": np.full(4, number, np.float32)}, {}, {"step": number})


def test_a_checkpoint_the_disk_cannot_hold_leaves_the_last_complete_one_the_latest(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path / "checkpoints")
    save(ckpt, 1)
    child = subprocess.run([sys.executable, "-c", _TORN_WRITE, str(ckpt.root)], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
    assert child.stdout.split() in (["refused", str(errno.EFBIG)], ["refused", "torn"]), child.stdout + child.stderr
    assert [p.name for p in ckpt.root.iterdir()] == ["ckpt-00000001"]  # the torn staging removed
    latest = ckpt.latest()
    assert latest is not None and latest.number == 1 and latest.values["w"].tolist() == [1.0] * 4
    assert ckpt.last_number() == 1


def test_a_read_only_checkpoint_directory_refuses_the_write_and_keeps_the_last_one(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path / "checkpoints")
    save(ckpt, 1)
    with read_only(ckpt.root):
        with pytest.raises(OSError) as refused:
            save(ckpt, 2)
        assert refused.value.errno in (errno.EROFS, errno.EACCES)
    assert [p.name for p in ckpt.root.iterdir()] == ["ckpt-00000001"]
    assert save(ckpt, 3).name == "ckpt-00000003" and ckpt.latest().number == 3  # type: ignore[union-attr]


def test_a_write_torn_by_a_kill_is_never_loaded_and_is_removed_by_the_next_checkpoint(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path / "checkpoints")
    save(ckpt, 1)
    torn = ckpt.names.staging(2)  # what a chief killed during its fsync leaves: arrays cut short, no manifest
    torn.mkdir()
    CheckpointNames.arrays(torn).write_bytes(b"PK\x03\x04 cut short")
    assert ckpt.latest().number == 1 and ckpt.last_number() == 1  # type: ignore[union-attr]
    save(ckpt, 3)
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["ckpt-00000001", "ckpt-00000003"]


def complete(run_dir: Path) -> list[str]:
    return [p.name for p in CheckpointDir(RunDir(run_dir).checkpoints).complete()]


@pytest.mark.slow
def test_a_chief_whose_checkpoints_fail_trains_on_and_a_restart_resumes_from_the_last_complete(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "--epochs", "150", "--checkpoint-every-s", "1", "--eval-every-s", "30")
    chief_log = RunDir(run_dir).log("chief")
    try:
        wait_for("a checkpoint", lambda: bool(complete(run_dir)), proc, timeout_s=180)
        with read_only(RunDir(run_dir).checkpoints):
            before = complete(run_dir)
            wait_for("a failed checkpoint", lambda: "not written" in chief_log.read_text(), proc)
            os.kill(role_pid(run_dir, "chief"), signal.SIGKILL)  # and a shard: the restart restores
            os.kill(role_pid(run_dir, "ps", "0"), signal.SIGKILL)
            wait_for("the restarted chief's restore", lambda: "restored from ckpt-" in chief_log.read_text(), proc)
            log = chief_log.read_text()
            assert f"restored from {before[-1]}" in log, log[-3000:]
            failures = log.count("not written")
            wait_for("a failure of the restarted chief", lambda: chief_log.read_text().count("not written") > failures,
                     proc)
            held = time.monotonic()
            wait_for("another failure", lambda: chief_log.read_text().count("not written") > failures + 1, proc)
            assert time.monotonic() - held >= 0.5  # the next interval, not the next turn of the control loop
            assert complete(run_dir) == before
        wait_for("a checkpoint after the fault", lambda: complete(run_dir)[-1:] != before[-1:], proc)
        out = finish(proc, timeout_s=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = RunSummary.load(run_dir)
    # counted over both chiefs: the first one's failures (kept in manifest.json) and the restarted one's two
    assert summary.outcome == "finished" and summary.checkpoints_failed >= failures + 2, summary
    assert f"{summary.checkpoints_failed} checkpoint(s) not written" in out
    assert not [p.name for p in RunDir(run_dir).checkpoints.iterdir() if p.name.endswith(".tmp")]
    assert all(CheckpointDir.load(p).values for p in CheckpointDir(RunDir(run_dir).checkpoints).complete())
    assert "Traceback" not in chief_log.read_text()
