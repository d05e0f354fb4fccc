"""chief.lock: one chief per run directory.

The chief holds an exclusive `flock` on the run directory's chief.lock for its whole life. The
kernel releases it when the process ends, however it ends (a crash, SIGKILL, an OOM kill), so a
lock is never stale: a chief restarted after its predecessor died acquires it at once, and only
a second chief started while the first still runs is refused. The file's text (pid, host, start
time of the holder) is for the message that refusal gives; the lock is the flock, not the file.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from asyncps.rundir.names import RunDir, RunDirError


class RunDirLocked(RunDirError):
    """Another chief holds the run directory's lock (the message names the directory and the holder)."""


class ChiefLock:
    """The run directory's lock, held until `release` (or the process's end)."""

    def __init__(self, path: Path, file: IO[str]) -> None:
        self.path = path
        self._file: IO[str] | None = file

    @staticmethod
    def acquire(run_dir: Path) -> ChiefLock:
        """Take the lock of `run_dir` (created if need be) without waiting; RunDirLocked when another
        process holds it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = RunDir(run_dir).chief_lock
        # "a": never truncates what the holder wrote before we know we hold it; close-on-exec (PEP 446),
        # so no child process inherits it and outlives the chief holding it
        file = open(path, "a+")  # noqa: SIM115 - held for the chief's life, closed by release()
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read().strip() or "no holder recorded"
            file.close()
            raise RunDirLocked(
                f"run directory {run_dir} is in use by another chief ({holder}; lock {path}); one chief per run "
                "directory: stop that chief first, or give this one another --run-dir") from None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        file.flush()
        return ChiefLock(path, file)

    @property
    def held(self) -> bool:
        """True until released."""
        return self._file is not None

    def release(self) -> None:
        """Give the lock up (the file stays: removing it would race with a chief about to lock it)."""
        if self._file is not None:
            self._file.close()  # closing the last descriptor releases the flock
            self._file = None

    def __enter__(self) -> ChiefLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
