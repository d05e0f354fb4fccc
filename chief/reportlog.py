"""Which worker reports the run has recorded (RUN_DIR/reports.jsonl): each report once, across chief restarts.

A worker numbers its reports (ReportRequest.seq: 1, 2, ... per worker id) and re-sends one, unchanged,
until the chief answers it. A chief killed after recording a report but before answering would
otherwise record it twice when the worker re-sends it to the next chief: its rows twice in
pushes.csv and timeline.csv, its completed tasks as duplicates. So every recorded report's number
is appended here (one JSON line, flushed before the answer) after its rows and its tasks, and a
report whose number is not above its worker's last recorded one is not recorded again.
Each chief start rewrites the file as one state line (atomically), as the ledger's journal does.

A report with number 0 (a worker of an earlier version) is always recorded. A chief killed while
writing one report's parts (between its rows and this line) still records that report again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from asyncps.rundir import atomic_write

log = logging.getLogger("asyncps.chief")

def read_last_reports(path: Path) -> dict[str, int]:
    """The last recorded report number of every member in the journal at `path` (empty: no file)."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    last: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
            if "state" in event:
                last = {str(m): int(s) for m, s in event["state"].items()}
            else:
                # "member": the key before the vocabulary became worker_id
                worker, seq = str(event["worker_id"] if "worker_id" in event else event["member"]), int(event["seq"])
                last[worker] = max(last.get(worker, 0), seq)
        except (ValueError, KeyError, TypeError, AttributeError):
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a report record") from None
            log.warning("%s: ignoring a torn last line (its report was never answered)", path)
    return last


class ReportLog:
    """The last recorded report number per worker id; journaled to a file when given one."""

    def __init__(self, path: Path | None = None, resume: bool = False) -> None:
        self._lock = threading.Lock()
        self._last = read_last_reports(path) if path is not None and resume else {}
        self._file: IO[str] | None = None
        if path is not None:
            atomic_write(path, json.dumps({"state": self._last}) + "\n")
            self._file = open(path, "a")  # noqa: SIM115 - closed in close()

    def last(self, worker_id: str) -> int:
        """The number of the member's last recorded report (0: none)."""
        with self._lock:
            return self._last.get(worker_id, 0)

    @contextmanager
    def once(self, worker_id: str, seq: int) -> Iterator[bool]:
        """Yield whether report `seq` of `worker_id` is new (record it then); mark it recorded when the
        block ends without an error. One report at a time: a re-sent copy waits for the first."""
        with self._lock:
            fresh = seq <= 0 or seq > self._last.get(worker_id, 0)
            yield fresh
            if fresh and seq > 0:
                self._last[worker_id] = seq
                if self._file is not None:
                    self._file.write(json.dumps({"worker_id": worker_id, "seq": seq}) + "\n")
                    self._file.flush()  # a kill -9 after the answer still finds it

    def close(self) -> None:
        """Stop journaling (the numbers are still checked)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = ["ReportLog", "read_last_reports"]
