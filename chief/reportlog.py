"""Which worker reports the run has recorded (RUN_DIR/reports.jsonl): each report once, across chief restarts.

A worker numbers its reports (ReportRequest.seq: 1, 2, ... per worker id) and re-sends one, unchanged,
until the chief answers it. A chief killed after recording a report but before answering would
otherwise record it twice when the worker re-sends it to the next chief: its rows twice in
pushes.csv and timeline.csv, its completed tasks as duplicates. So every recorded report's number
is appended here (one JSON line, flushed before the answer) after its rows and its tasks, and a
report whose number is not above its worker's last recorded one is not recorded again.
Each chief start rewrites the file as one state line (atomically), as the ledger's journal does.

A report with number 0 (a worker of an earlier version) is always recorded.

A chief killed while writing one report's rows (a report's rows are written in several pieces, and
pushes.csv and timeline.csv are two files) would leave part of them, and record them again when the
worker re-sends the report. So a numbered report is journaled in three lines: "begin", with the sizes of
the files its rows go to and the tasks it completes, before its rows; "rows" once they are all written;
its number line once its tasks are completed in the ledger (whose own journal follows). A start that
finds the last report begun and not numbered (drop_torn_report) either cuts those files back to the
sizes (no "rows" line: no task of it was completed, and the report, never answered, is recorded once
when the worker sends it again), or, its rows whole, completes the tasks the ledger does not hold done
yet and numbers it (the worker's re-send is then recorded before). Completing tasks only after the rows
are whole keeps the ledger and the rows together when the worker dies before sending the report again:
before, its tasks stayed done with their rows cut away.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

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
            elif "begin" in event or "rows" in event:
                continue  # a report's rows begin, or are written: recorded once its number line follows
            else:
                # "member": the key before the vocabulary became worker_id
                worker, seq = str(event["worker_id"] if "worker_id" in event else event["member"]), int(event["seq"])
                last[worker] = max(last.get(worker, 0), seq)
        except (ValueError, KeyError, TypeError, AttributeError):
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a report record") from None
            log.warning("%s: ignoring a torn last line (its report was never answered)", path)
    return last


def drop_torn_report(path: Path, run_dir: Path,
                     complete: Callable[[str, int], object] | None = None) -> str | None:
    """If the journal at `path` ends in a report begun and not numbered (the chief was killed in between):
    with its rows not all written, cut the files its rows went to (in `run_dir`) back to their sizes
    before it; with its rows whole, `complete(worker_id, task)` each task it completes (the caller skips
    those the ledger holds done) and number it. What was done (None: nothing torn). Before the recorder
    reads the files and ReportLog reads the journal."""
    if not path.exists():
        return None
    begun: dict[str, Any] | None = None
    written = False
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn last line: read_last_reports says so
        if isinstance(event, dict) and isinstance(event.get("begin"), dict):
            begun, written = event, False
        elif isinstance(event, dict) and "rows" in event:
            written = begun is not None and event.get("rows") == begun.get("seq")
        elif isinstance(event, dict):
            begun = None  # the begun report's number line (one report at a time), or a state line
    if begun is None:
        return None
    worker, seq = str(begun.get("worker_id")), int(begun.get("seq", 0))
    if written:
        tasks = [int(t) for t in begun.get("tasks", ())]
        for task in tasks:
            if complete is not None:
                complete(worker, task)
        with open(path, "a") as journal:
            journal.write(json.dumps({"worker_id": worker, "seq": seq}) + "\n")
        return (f"report {seq} of {worker} was cut short by a killed chief after its rows: its {len(tasks)} "
                "completed task(s) recorded now; the worker's re-send is recorded before")
    cut = []
    for name, size in sorted(begun["begin"].items()):
        target = run_dir / Path(str(name)).name
        if target.exists() and target.stat().st_size > int(size):
            cut.append(f"{target.name} {target.stat().st_size - int(size)} bytes")
            os.truncate(target, int(size))
    return (f"report {seq} of {worker} was torn by a killed chief: "
            f"{', '.join(cut) or 'no row'} of it removed; the worker sends it again")


class ReportLog:
    """The last recorded report number per worker id; journaled to a file when given one, with the sizes
    `sizes()` gives (the files its rows go to, by name) before each report's rows."""

    def __init__(self, path: Path | None = None, resume: bool = False,
                 sizes: Callable[[], Mapping[str, int]] | None = None) -> None:
        self._sizes = sizes
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
    def once(self, worker_id: str, seq: int, tasks: Sequence[int] = ()) -> Iterator[bool]:
        """Yield whether report `seq` of `worker_id` (completing `tasks`) is new (record its rows, call
        `rows_written`, complete its tasks then); mark it recorded when the block ends without an error.
        One report at a time: a re-sent copy waits for the first."""
        with self._lock:
            fresh = seq <= 0 or seq > self._last.get(worker_id, 0)
            if fresh and seq > 0 and self._file is not None and self._sizes is not None:
                begin = {"worker_id": worker_id, "seq": seq, "begin": dict(self._sizes()), "tasks": list(tasks)}
                self._file.write(json.dumps(begin) + "\n")
                self._file.flush()
            yield fresh
            if fresh and seq > 0:
                self._last[worker_id] = seq
                if self._file is not None:
                    self._file.write(json.dumps({"worker_id": worker_id, "seq": seq}) + "\n")
                    self._file.flush()  # a kill -9 after the answer still finds it

    def rows_written(self, worker_id: str, seq: int) -> None:
        """Inside `once`: every row of the report is written (its tasks are completed next)."""
        if seq > 0 and self._file is not None and self._sizes is not None:
            self._file.write(json.dumps({"worker_id": worker_id, "rows": seq}) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Stop journaling (the numbers are still checked)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = ["ReportLog", "drop_torn_report", "read_last_reports"]
