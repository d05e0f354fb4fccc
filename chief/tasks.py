"""Exactly-once data accounting: the chief hands out data tasks (ranges of an epoch's order).

Every epoch has a seeded permutation of the training set, cut into tasks of `task_size`
positions. A task is pending, in flight (held by a worker) or done. A worker's in-flight tasks go
back to pending when it dies, so no range is lost; a completion of a task already done is counted
as a duplicate (only tasks that were in flight when a worker died can be processed twice).
A re-queued task completed by another worker is counted as re-run (its examples were trained on
twice where the dead worker had pushed some of its batches before it died).

Every change can be handed to a journal (`journal`, called under the lock, in order): the chief
appends them to a file so that a restarted chief continues the accounting where the dead one was,
with the tasks workers still hold in flight for them (chief/ledgerlog.py).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncps.errors import InvalidArgumentError

Journal = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Task:
    """Positions [start, stop) of epoch `epoch`'s permutation."""

    task_id: int
    epoch: int
    start: int
    stop: int


class TaskLedger:
    """Hands out, tracks and re-queues data tasks; one lock, no grpc."""

    def __init__(self, num_examples: int, task_size: int, epochs: float) -> None:
        if num_examples < 1 or task_size < 1:
            raise ValueError("num_examples and task_size must be >= 1")
        self.num_examples = num_examples
        self.task_size = task_size
        self.tasks_per_epoch = math.ceil(num_examples / task_size)
        # epochs == 0: no epoch limit (another stop condition ends the run)
        self.total_tasks = math.ceil(epochs * self.tasks_per_epoch) if epochs > 0 else None
        self._lock = threading.Lock()
        self._next = 0  # the next never-issued task id
        self._pending: deque[int] = deque()  # re-queued ids, issued before new ones
        self._in_flight: dict[int, str] = {}
        self._done: set[int] = set()
        self.duplicates = 0
        self.stale_completions = 0  # completions of tasks issued past the checkpoint this ledger went back to
        self.tasks_rewound = 0  # done before a restarted chief went back to a checkpoint, not in it: done again
        self.examples_rewound = 0
        self.requeued = 0
        self.examples_done = 0
        self.journal: Journal | None = None  # told every change, under the lock
        self._lost_by: dict[int, str] = {}  # re-queued task -> the worker that died holding it
        self.tasks_rerun = 0
        self.examples_rerun = 0
        self._last_request: dict[str, tuple[int, int]] = {}  # worker -> (request number, task issued)

    def task(self, task_id: int) -> Task:
        """The range of a task id."""
        epoch, index = divmod(task_id, self.tasks_per_epoch)
        start = index * self.task_size
        return Task(task_id, epoch, start, min(start + self.task_size, self.num_examples))

    def next_task(self, worker: str, seq: int = 0) -> Task | None:
        """Issue a task to a worker, or None when nothing is left to issue right now. A request
        number `seq` > 0 that repeats the worker's last one gets the task that request was given, while
        the worker still holds it (the reply was lost and the call sent again): nothing is issued twice."""
        with self._lock:
            last = self._last_request.get(worker)
            if seq > 0 and last is not None and last[0] == seq and self._in_flight.get(last[1]) == worker:
                return self.task(last[1])
            if self._pending:
                task_id = self._pending.popleft()
            elif self.total_tasks is None or self._next < self.total_tasks:
                task_id = self._next
                self._next += 1
            else:
                return None
            self._in_flight[task_id] = worker
            self._record({"issue": task_id, "to": worker})
            if seq > 0:
                self._last_request[worker] = (seq, task_id)
            return self.task(task_id)

    def check_ids(self, task_ids: Iterable[int]) -> None:
        """InvalidArgumentError naming the first id that no ledger of this run can have issued."""
        for task_id in task_ids:
            if task_id < 0 or (self.total_tasks is not None and task_id >= self.total_tasks):
                raise InvalidArgumentError(f"task {task_id} is not a task of this run (0 to "
                                           f"{'unbounded' if self.total_tasks is None else self.total_tasks - 1})")

    def complete(self, worker: str, task_id: int) -> bool:
        """Record a finished task; False if it was already done (a duplicate), or if this ledger never
        issued it (a stale completion: see below).

        A ledger that went back to a checkpoint (a chief restarted and restored the shards from one)
        has not issued the tasks an earlier chief issued after that checkpoint; their pushes were
        rolled back with the shards, and the tasks will be issued again. A worker still reporting
        one done is counted (stale_completions) and changes nothing else: raising here made the
        chief answer the report with an internal error, and every re-send recorded its rows again."""
        with self._lock:
            if task_id in self._done:
                self.duplicates += 1
                self._record({"duplicate": task_id})
                return False
            if task_id >= self._next:
                self.stale_completions += 1
                self._record({"stale": task_id})
                return False
            self._in_flight.pop(task_id, None)
            if task_id in self._pending:  # its worker was declared dead but finished it after all
                self._pending.remove(task_id)
            self._done.add(task_id)
            t = self.task(task_id)
            self.examples_done += t.stop - t.start
            if task_id in self._lost_by and self._lost_by.pop(task_id) != worker:
                self.tasks_rerun += 1
                self.examples_rerun += t.stop - t.start
            self._record({"done": task_id, "by": worker})
            return True

    def is_done(self, task_id: int) -> bool:
        """Whether the task is done."""
        with self._lock:
            return task_id in self._done

    def requeue(self, worker: str) -> int:
        """A worker died: its in-flight tasks become pending again; returns how many."""
        with self._lock:
            lost = sorted(t for t, w in self._in_flight.items() if w == worker)
            for task_id in lost:
                del self._in_flight[task_id]
                self._pending.append(task_id)
                self._lost_by[task_id] = worker
            self.requeued += len(lost)
            if lost:
                self._record({"requeue": worker})
            return len(lost)

    def workers_with_work(self) -> set[str] | None:
        """The workers that can still push for the planned epochs: those holding a task, once nothing
        is left to hand out (no task pending, every task issued); None while there is (any worker may
        get one) or when the run has no epoch limit."""
        with self._lock:
            if self.total_tasks is None or self._pending or self._next < self.total_tasks:
                return None
            return set(self._in_flight.values())

    def rewound_from(self, previous: TaskLedger) -> int:
        """This ledger went back to a checkpoint (a restarted chief restored the shards from it) and
        `previous` is where the dead chief's ledger was (its journal): the tasks it had done that the
        checkpoint has not are counted rewound (their pushes were rolled back with the shards, and they
        will be issued and trained again); the counts of what happened (re-queues, re-runs, duplicate and
        stale completions) are the previous ledger's, which the checkpoint is behind. Returns how many."""
        with previous._lock:
            done, p = set(previous._done), previous
            counts = (p.duplicates, p.stale_completions, p.requeued, p.tasks_rerun, p.examples_rerun,
                      p.tasks_rewound, p.examples_rewound)
        with self._lock:
            lost = sorted(done - self._done)
            (self.duplicates, self.stale_completions, self.requeued, self.tasks_rerun, self.examples_rerun,
             self.tasks_rewound, self.examples_rewound) = (
                max(mine, theirs) for mine, theirs in zip(
                    (self.duplicates, self.stale_completions, self.requeued, self.tasks_rerun, self.examples_rerun,
                     self.tasks_rewound, self.examples_rewound), counts, strict=True))
            self.tasks_rewound += len(lost)
            self.examples_rewound += sum(self.task(t).stop - self.task(t).start for t in lost)
            return len(lost)

    def holders(self) -> set[str]:
        """The workers holding tasks in flight."""
        with self._lock:
            return set(self._in_flight.values())

    def _record(self, event: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal(event)

    def finished(self) -> bool:
        """Every task of the planned epochs is done."""
        with self._lock:
            return self.total_tasks is not None and len(self._done) >= self.total_tasks

    def fraction_done(self) -> float:
        """Share of the planned tasks done (0 when no epochs are planned)."""
        with self._lock:
            return len(self._done) / self.total_tasks if self.total_tasks else 0.0

    def epochs_done(self) -> float:
        """Completed examples in units of epochs."""
        with self._lock:
            return self.examples_done / self.num_examples

    def summary(self) -> dict[str, Any]:
        """Counts for summary.json."""
        with self._lock:
            return {
                "task_size": self.task_size,
                "tasks_planned": self.total_tasks,
                "tasks_issued": self._next,
                "tasks_done": len(self._done),
                "tasks_in_flight": len(self._in_flight),
                "tasks_pending": len(self._pending),
                "tasks_requeued": self.requeued,
                "duplicate_completions": self.duplicates,
                # completions of tasks issued after the checkpoint this ledger went back to (rolled back)
                "stale_completions": self.stale_completions,
                # tasks done before a restarted chief went back to a checkpoint without them: done again
                "tasks_rewound": self.tasks_rewound,
                "examples_rewound": self.examples_rewound,
                "examples_done": self.examples_done,
                # tasks a dead worker held, completed again by another worker, and their examples
                "tasks_rerun": self.tasks_rerun,
                "examples_rerun": self.examples_rerun,
                # planned tasks never completed (0 whenever the run stopped because its epochs were done)
                "tasks_not_done": None if self.total_tasks is None else self.total_tasks - len(self._done),
            }

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the accounting (in-flight tasks count as pending)."""
        with self._lock:
            return {"next": self._next, "done": sorted(self._done), "examples_done": self.examples_done,
                    "pending": sorted({*self._pending, *self._in_flight}), "tasks_rerun": self.tasks_rerun,
                    "examples_rerun": self.examples_rerun, "tasks_rewound": self.tasks_rewound,
                    "examples_rewound": self.examples_rewound}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (or a journal's, with its in-flight tasks and counts)."""
        with self._lock:
            self._next = int(state["next"])
            self._done = {int(t) for t in state["done"]}
            self._pending = deque(int(t) for t in state["pending"])
            self._in_flight = {int(t): str(w) for t, w in state.get("in_flight", {}).items()}
            self.examples_done = int(state["examples_done"])
            self.duplicates = int(state.get("duplicates", 0))
            self.stale_completions = int(state.get("stale_completions", 0))
            self.tasks_rewound = int(state.get("tasks_rewound", 0))  # absent in older checkpoints and journals
            self.examples_rewound = int(state.get("examples_rewound", 0))
            self.requeued = int(state.get("requeued", 0))
            self.tasks_rerun = int(state.get("tasks_rerun", 0))  # absent in older checkpoints
            self.examples_rerun = int(state.get("examples_rerun", 0))
            self._lost_by = {int(t): str(w) for t, w in state.get("lost_by", {}).items()}

    def full_state(self) -> dict[str, Any]:
        """Everything, in-flight tasks with their holders and the counts included (a journal's start)."""
        with self._lock:
            return {"next": self._next, "done": sorted(self._done), "examples_done": self.examples_done,
                    "pending": list(self._pending), "in_flight": {str(t): w for t, w in self._in_flight.items()},
                    "duplicates": self.duplicates, "stale_completions": self.stale_completions,
                    "requeued": self.requeued, "tasks_rerun": self.tasks_rerun,
                    "examples_rerun": self.examples_rerun, "lost_by": {str(t): w for t, w in self._lost_by.items()},
                    "tasks_rewound": self.tasks_rewound, "examples_rewound": self.examples_rewound}

    def replay(self, event: dict[str, Any]) -> None:
        """Apply one journaled change (the same change the call that journaled it made)."""
        if "issue" in event:
            task_id, worker = int(event["issue"]), str(event["to"])
            with self._lock:
                if self._pending and self._pending[0] == task_id:
                    self._pending.popleft()
                elif task_id in self._pending:
                    self._pending.remove(task_id)
                else:
                    self._next = max(self._next, task_id + 1)
                self._in_flight[task_id] = worker
        elif "done" in event:
            self.complete(str(event.get("by", "")), int(event["done"]))
        elif "duplicate" in event:
            with self._lock:
                self.duplicates += 1
        elif "stale" in event:
            with self._lock:
                self.stale_completions += 1
        elif "requeue" in event:
            self.requeue(str(event["requeue"]))
        else:
            raise ValueError(f"unknown ledger event {event}")
