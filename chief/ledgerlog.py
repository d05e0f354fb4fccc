"""The data-task ledger's journal (RUN_DIR/ledger.jsonl): what a restarted chief continues from.

A checkpoint holds the ledger as it was at the cut, but a chief killed between checkpoints had
issued and completed tasks since, and workers still hold some in flight. So every change is
appended to this file (one JSON line, flushed before the worker hears the answer) and a new chief
replays it: the same tasks done, the same ones in flight with the same workers, which complete
them with the new chief. The first line is a whole state; each start rewrites the file as one
state line (atomically), so it never grows beyond one run of one chief.

A line torn by a kill is the last one and is ignored: its change was never answered.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import IO, Any

from asyncps.chief.tasks import TaskLedger

from asyncps.rundir import atomic_write

log = logging.getLogger("asyncps.chief")

def replay(path: Path, ledger: TaskLedger) -> bool:
    """Load the journal at `path` (RunDir.ledger) into `ledger`; False when there is none."""
    if not path.exists():
        return False
    lines = path.read_text().splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a ledger event") from None
            log.warning("%s: ignoring a torn last line (its change was never answered)", path)
    if not events or "state" not in events[0]:
        raise ValueError(f"{path}: does not start with the ledger's state")
    ledger.load(events[0]["state"])
    for event in events[1:]:
        ledger.replay(event)
    return True


class LedgerLog:
    """Appends every change of one ledger to its journal file, starting from its whole state."""

    def __init__(self, path: Path, ledger: TaskLedger) -> None:
        self.path = path
        self._lock = threading.Lock()
        atomic_write(path, json.dumps({"state": ledger.full_state()}) + "\n")
        self._file: IO[str] | None = open(path, "a")  # noqa: SIM115 - closed in close()
        ledger.journal = self._append

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")
                self._file.flush()  # a kill -9 after the answer still finds the change

    def close(self) -> None:
        """Stop journaling (the ledger keeps working)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = ["LedgerLog", "replay"]
