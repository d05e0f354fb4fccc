"""Each worker report is recorded once, across chief restarts: the same report sent twice to a real
Coordinator server on a run directory, before and after a new chief starts on that directory, and a
worker's own path (outbox, link, client retry) when the chief recorded a report but its answer was lost."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from asyncps.chief.ledgerlog import LedgerLog, replay
from asyncps.chief.membership import Membership
from asyncps.chief.recorder import Recorder
from asyncps.chief.reportlog import ReportLog, drop_torn_report, read_last_reports
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.chief.tasks import TaskLedger
from asyncps.worker.chieflink import ChiefLink
from asyncps.worker.outbox import ReportOutbox
from asyncps.worker.trainer import Telemetry

from asyncps.config import RunConfig
from asyncps.errors import InvalidArgumentError
from asyncps.net.rpc import Unreachable, create_server
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc
from asyncps.rundir import PUSHES_CSV, TIMELINE_CSV, PushRow, RunDir, StepRow, read_rows
from asyncps.transport.coordinator import CoordinatorClient


@dataclass
class ChiefState:
    """The parts of a chief that a report touches, serving Coordinator on a run directory."""

    server: grpc.Server
    port: int
    recorder: Recorder
    ledger: TaskLedger
    ledger_log: LedgerLog
    reports: ReportLog

    def stop(self) -> None:
        """The chief goes away (its files stay as it left them)."""
        self.server.stop(0).wait()
        self.recorder.close()
        self.ledger_log.close()
        self.reports.close()


def start_chief(run_dir: Path, port: int = 0, resume: bool = False,
                servicer_type: type[CoordinatorServicer] = CoordinatorServicer) -> ChiefState:
    """A chief on `run_dir`; `resume`: continue its files as a restarted chief does (chief/main.py)."""
    ledger = TaskLedger(100, 10, 1)
    if resume:
        assert replay(RunDir(run_dir).ledger, ledger)
    ledger_log = LedgerLog(RunDir(run_dir).ledger, ledger)
    if resume:  # as chief/main.py does, before the recorder reads
        drop_torn_report(RunDir(run_dir).reports, run_dir, lambda w, t: ledger.is_done(t) or ledger.complete(w, t))
    recorder = Recorder(run_dir, append=resume)
    reports = ReportLog(RunDir(run_dir).reports, resume=resume, sizes=recorder.sizes)
    servicer = servicer_type(Membership(2, 10), recorder, ["127.0.0.1:1"], RunConfig().to_json(),
                             lambda: cpb.ClusterStatus(), ledger, reports=reports)
    server, bound, _ = create_server(f"127.0.0.1:{port}",
                                     [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)])
    return ChiefState(server, bound, recorder, ledger, ledger_log, reports)


def push(step: int, shard: int) -> cpb.PushRecord:
    return cpb.PushRecord(wall_time=time.time(), shard=shard, step=step, base_version=step, version=step + 1,
                          accepted=True, effective_lr=0.1, loss=0.5)


def timing(step: int) -> cpb.StepTiming:
    return cpb.StepTiming(step=step, start=time.time(), compute_s=0.01, push_s=0.01, examples=10)


def rows(run_dir: Path) -> tuple[list[tuple[int, int]], list[int]]:
    """(worker step, shard) of every pushes.csv row and the step of every timeline.csv row."""
    return ([(r.step, r.shard) for r in read_rows(run_dir / PUSHES_CSV, PushRow)],
            [r.step for r in read_rows(run_dir / TIMELINE_CSV, StepRow)])


def test_the_same_report_is_recorded_once_before_and_after_a_chief_restart(tmp_path: Path) -> None:
    chief = start_chief(tmp_path)
    client = CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20)
    try:
        assert client.register("worker-a", "worker", 0).index == 0
        task = client.get_task("worker-a")
        report: dict[str, Any] = {"pushes": [push(1, 0), push(1, 1)], "steps": [timing(1)],
                                  "completed_tasks": [task.task_id]}
        client.report("worker-a", 0, seq=1, **report)
        client.report("worker-a", 0, seq=1, **report)  # its answer was lost: the worker sends it again
        assert rows(tmp_path) == ([(1, 0), (1, 1)], [1])
        assert chief.ledger.summary()["tasks_done"] == 1 and chief.ledger.summary()["duplicate_completions"] == 0

        chief.stop()  # killed after recording report 1, before the worker heard the answer
        chief = start_chief(tmp_path, chief.port, resume=True)
        assert read_last_reports(RunDir(tmp_path).reports) == {"worker-a": 1}  # the new chief's file starts from it
        assert client.register("worker-a", "worker", 0).index == 0  # the link registers again (NOT_FOUND)
        client.report("worker-a", 0, seq=1, **report)  # ... and sends the unanswered report again
        assert rows(tmp_path) == ([(1, 0), (1, 1)], [1])
        summary = chief.ledger.summary()
        assert summary["tasks_done"] == 1 and summary["duplicate_completions"] == 0
        assert chief.recorder.pushes_recorded == 2 and chief.recorder.examples == 10

        client.report("worker-a", 0, seq=2, pushes=[push(2, 0)], steps=[timing(2)])  # the next one is new
        assert rows(tmp_path) == ([(1, 0), (1, 1), (2, 0)], [1, 2])
        assert chief.reports.last("worker-a") == 2
        # an unnumbered report (a worker of an earlier version) is recorded every time, as before
        client.report("worker-a", 0, pushes=[push(3, 0)], steps=[])
        client.report("worker-a", 0, pushes=[push(3, 0)], steps=[])
        assert rows(tmp_path)[0][-2:] == [(3, 0), (3, 0)]
    finally:
        client.close()
        chief.stop()


def test_report_numbers_are_per_member_and_a_torn_journal_line_is_ignored(tmp_path: Path) -> None:
    log = ReportLog(RunDir(tmp_path).reports)
    for member, seq in (("a", 1), ("b", 1), ("a", 2)):
        with log.once(member, seq) as fresh:
            assert fresh
    with log.once("b", 1) as fresh:
        assert not fresh
    with pytest.raises(RuntimeError), log.once("b", 2) as fresh:  # recording failed: not marked
        assert fresh
        raise RuntimeError("disk full")
    assert log.last("b") == 1
    log.close()
    with open(RunDir(tmp_path).reports, "a") as f:
        f.write('{"member": "a", "se')  # a line torn by a kill: its report was never answered
    assert read_last_reports(RunDir(tmp_path).reports) == {"a": 2, "b": 1}
    again = ReportLog(RunDir(tmp_path).reports, resume=True)
    again.close()
    assert [json.loads(line) for line in RunDir(tmp_path).reports.read_text().splitlines()] == [
        {"state": {"a": 2, "b": 1}}]
    assert ReportLog(tmp_path / "fresh.jsonl").last("a") == 0  # a new run remembers nothing


class AnswerLost(CoordinatorServicer):
    """A chief that records the first numbered report and then fails before answering it, as a chief
    killed between its record and its answer does (UNAVAILABLE: the worker's client tries again)."""

    lost = 0

    def Report(self, request: cpb.ReportRequest, context: grpc.ServicerContext) -> cpb.ReportResponse:
        reply = super().Report(request, context)
        if request.seq > 0 and AnswerLost.lost == 0:
            AnswerLost.lost += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "chief going away")
        return reply


def test_a_worker_resends_an_unanswered_report_unchanged_and_it_is_recorded_once(tmp_path: Path) -> None:
    AnswerLost.lost = 0
    chief = start_chief(tmp_path, servicer_type=AnswerLost)
    link = ChiefLink(CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20), "worker#0-x", 0)
    telemetry = Telemetry()
    outbox = ReportOutbox(link, telemetry)
    try:
        link.register()
        task = link.get_task()
        telemetry.add([push(1, 0)], timing(1), [task.task_id])
        assert outbox.send() is not None
        assert AnswerLost.lost == 1 and outbox.unanswered is None and outbox.seq == 1
        telemetry.add([push(2, 0)], timing(2))
        outbox.send(final=True)
        assert rows(tmp_path) == ([(1, 0), (2, 0)], [1, 2])
        assert chief.ledger.summary()["duplicate_completions"] == 0 and chief.reports.last("worker#0-x") == 2

        # the chief is gone: the report stays unanswered, and is sent first, whole, to the next chief
        chief.stop()
        telemetry.add([push(3, 0)], timing(3))
        with pytest.raises(Unreachable):
            outbox.send(deadline_s=0.5)
        assert outbox.unanswered is not None and outbox.unanswered.seq == 3
        telemetry.add([push(4, 0)], timing(4))  # queued since: it goes into a report of its own
        chief = start_chief(tmp_path, chief.port, resume=True)
        outbox.send()  # the new chief does not know the worker: the link registers again, then 3, then 4
        assert outbox.unanswered is None and outbox.seq == 4
        assert rows(tmp_path) == ([(1, 0), (2, 0), (3, 0), (4, 0)], [1, 2, 3, 4])
        journal = [event for line in RunDir(tmp_path).reports.read_text().splitlines()
                   if "begin" not in (event := json.loads(line)) and "rows" not in event]  # the number lines
        assert journal == [{"state": {"worker#0-x": 2}}, {"worker_id": "worker#0-x", "seq": 3},
                           {"worker_id": "worker#0-x", "seq": 4}]
    finally:
        link.coord.close()
        chief.stop()


class TaskReplyLate(CoordinatorServicer):
    """A chief whose first answer to a numbered task request arrives after the worker's call timed out,
    as an answer lost in a network partition does (DEADLINE_EXCEEDED: the worker's client tries again)."""

    late = 0
    hold_s = 1.5

    def GetTask(self, request: cpb.TaskRequest, context: grpc.ServicerContext) -> cpb.TaskReply:
        reply = super().GetTask(request, context)
        if request.seq > 0 and TaskReplyLate.late == 0:
            TaskReplyLate.late += 1
            time.sleep(TaskReplyLate.hold_s)  # the task is issued; its answer misses the call's deadline
        return reply


def test_a_task_request_that_timed_out_is_sent_again_and_gets_the_same_task(tmp_path: Path) -> None:
    TaskReplyLate.late = 0
    chief = start_chief(tmp_path, servicer_type=TaskReplyLate)
    link = ChiefLink(CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20, call_timeout_s=0.5), "worker#0-x", 0)
    try:
        link.register()
        first = link.get_task()  # timed out once, sent again under the same number
        assert TaskReplyLate.late == 1 and first.has_task
        summary = chief.ledger.summary()
        assert summary["tasks_in_flight"] == 1, summary  # one task issued, not one lost to nobody
        second = link.get_task()  # the next request is new
        assert second.task_id != first.task_id and chief.ledger.summary()["tasks_in_flight"] == 2
        # an unnumbered request (a worker of an earlier version) gets a new task every time, as before
        third, fourth = (link.coord.get_task("worker#0-x") for _ in range(2))
        assert len({first.task_id, second.task_id, third.task_id, fourth.task_id}) == 4
    finally:
        link.coord.close()
        chief.stop()


def test_a_repeated_task_request_gets_its_task_only_while_the_worker_holds_it() -> None:
    ledger = TaskLedger(100, 10, 1)
    task = ledger.next_task("w", seq=1)
    assert task is not None and ledger.next_task("w", seq=1) == task  # the same request: the same task
    assert ledger.next_task("other", seq=1) != task  # request numbers are per worker
    assert ledger.requeue("w") == 1  # declared dead: its task went back to the queue ...
    again = ledger.next_task("w", seq=1)  # ... so a late repeat gets a task like any request
    assert again is not None and again.task_id == task.task_id and ledger.summary()["tasks_in_flight"] == 2
    ledger.complete("w", again.task_id)
    assert ledger.next_task("w", seq=1) != again  # done: a repeat does not hand it out again


def test_a_task_completed_past_the_checkpoint_the_ledger_went_back_to_is_recorded_once(tmp_path: Path) -> None:
    """A chief that restored the shards from a checkpoint took its ledger from it too: a worker that trained
    a task issued after that checkpoint reports it done. The report is answered and its rows recorded once;
    the completion is counted stale and the task is issued again. (Before, the ledger raised "never
    issued", the chief answered INTERNAL, and each re-send wrote the report's rows again: the chaos run
    had one 172-step report eight times in timeline.csv.)"""
    chief = start_chief(tmp_path)
    client = CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=5)
    try:
        client.register("worker-a", "worker", 0)
        at_checkpoint = chief.ledger.state()
        task = client.get_task("worker-a")  # issued after the checkpoint
        chief.ledger.load(at_checkpoint)  # the next chief's ledger, from the checkpoint
        report: dict[str, Any] = {"pushes": [push(1, 0)], "steps": [timing(1)], "completed_tasks": [task.task_id]}
        client.report("worker-a", 0, seq=1, **report)
        client.report("worker-a", 0, seq=1, **report)  # sent again: not recorded again
        assert rows(tmp_path) == ([(1, 0)], [1])
        summary = chief.ledger.summary()
        assert summary["stale_completions"] == 1 and summary["tasks_done"] == 0, summary
        assert client.get_task("worker-a").task_id == task.task_id  # issued again
        # a task id no ledger of this run can have issued is refused before anything is recorded
        with pytest.raises(InvalidArgumentError) as refused:
            client.report("worker-a", 0, seq=2, pushes=[push(2, 0)], steps=[timing(2)], completed_tasks=[10])
        assert refused.value.code == "INVALID_ARGUMENT"
        assert "task 10 is not a task of this run (0 to 9)" in refused.value.detail
        assert rows(tmp_path) == ([(1, 0)], [1]) and chief.reports.last("worker-a") == 1
    finally:
        client.close()
        chief.stop()


class Killed(BaseException):
    """The chief's process killed (SIGKILL) at this point: nothing after it runs."""


def test_a_report_torn_by_a_killed_chief_is_cut_back_and_recorded_once_when_sent_again(tmp_path: Path) -> None:
    """A chief killed while writing a report's rows (its first rows reached pushes.csv, the rest and its
    timeline rows did not): the next chief cuts the files back to where the report began, and the
    re-sent report is recorded once, whole."""
    chief = start_chief(tmp_path)
    client = CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20)
    try:
        assert client.register("worker-a", "worker", 0).index == 0
        client.report("worker-a", 0, seq=1, pushes=[push(1, 0), push(1, 1)], steps=[timing(1)])
        with pytest.raises(Killed), chief.reports.once("worker-a", 2) as fresh:  # the chief's Report, in part
            assert fresh
            chief.recorder.add(0, [push(2, 0)], [])  # the rows' first piece is written and flushed ...
            raise Killed  # ... and the chief dies before the rest and the report's number line
        assert rows(tmp_path) == ([(1, 0), (1, 1), (2, 0)], [1])
        chief.stop()
        chief = start_chief(tmp_path, chief.port, resume=True)
        assert rows(tmp_path) == ([(1, 0), (1, 1)], [1])  # cut back to where report 2 began
        assert read_last_reports(RunDir(tmp_path).reports) == {"worker-a": 1}
        assert client.register("worker-a", "worker", 0).index == 0
        client.report("worker-a", 0, seq=2, pushes=[push(2, 0), push(2, 1)], steps=[timing(2)])  # sent again
        client.report("worker-a", 0, seq=2, pushes=[push(2, 0), push(2, 1)], steps=[timing(2)])  # answer lost
        assert rows(tmp_path) == ([(1, 0), (1, 1), (2, 0), (2, 1)], [1, 2])
        assert chief.recorder.pushes_recorded == 4 and chief.recorder.examples == 20
        chief.stop()
        assert drop_torn_report(RunDir(tmp_path).reports, tmp_path) is None  # every report whole: nothing cut
        chief = start_chief(tmp_path, chief.port, resume=True)
        assert rows(tmp_path) == ([(1, 0), (1, 1), (2, 0), (2, 1)], [1, 2])
    finally:
        client.close()
        chief.stop()


@pytest.mark.parametrize("completed_before_kill", [0, 1])
def test_a_report_cut_short_after_its_rows_is_completed_by_the_next_chief(tmp_path: Path,
                                                                          completed_before_kill: int) -> None:
    """A chief killed after a report's rows are whole, before all its tasks are completed and its number
    written: the next chief completes the tasks the ledger does not hold done and numbers the report, so the
    ledger and the rows agree even if the worker dies before sending it again (the chaos suite found tasks
    done with their rows cut away); a re-send after all is recorded before, nothing twice."""
    chief = start_chief(tmp_path)
    client = CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20)
    try:
        assert client.register("worker-a", "worker", 0).index == 0
        tasks = [chief.ledger.next_task("worker-a"), chief.ledger.next_task("worker-a")]
        ids = [t.task_id for t in tasks if t is not None]
        assert len(ids) == 2
        with pytest.raises(Killed), chief.reports.once("worker-a", 1, ids) as fresh:  # the chief's Report, in part
            assert fresh
            chief.recorder.add(0, [push(1, 0), push(2, 0)], [timing(1), timing(2)])
            chief.reports.rows_written("worker-a", 1)
            for task_id in ids[:completed_before_kill]:
                chief.ledger.complete("worker-a", task_id)
            raise Killed  # ... and the chief dies before the rest of its tasks and its number line
        chief.stop()
        chief = start_chief(tmp_path, chief.port, resume=True)  # the worker died too: it never sends it again
        assert all(chief.ledger.is_done(t) for t in ids) and chief.ledger.duplicates == 0
        assert chief.ledger.examples_done == 20 and rows(tmp_path) == ([(1, 0), (2, 0)], [1, 2])
        assert read_last_reports(RunDir(tmp_path).reports) == {"worker-a": 1}
        assert client.register("worker-a", "worker", 0).index == 0
        client.report("worker-a", 0, seq=1, pushes=[push(1, 0), push(2, 0)], steps=[timing(1), timing(2)],
                      completed_tasks=ids)  # sent again after all: recorded before
        assert rows(tmp_path) == ([(1, 0), (2, 0)], [1, 2]) and chief.ledger.duplicates == 0
        chief.stop()
        assert drop_torn_report(RunDir(tmp_path).reports, tmp_path) is None
        chief = start_chief(tmp_path, chief.port, resume=True)
        assert chief.ledger.examples_done == 20
    finally:
        client.close()
        chief.stop()


def test_a_task_held_unfinished_at_a_workers_final_report_goes_back_to_the_queue(tmp_path: Path) -> None:
    """Told to stop between being handed a task and finishing it (the chief's stop reaching it by heartbeat), a
    worker's final report leaves the task neither done nor in flight with a worker that is gone: it is pending
    again, at once; a task completed in that same report stays done."""
    chief = start_chief(tmp_path)
    link = ChiefLink(CoordinatorClient(f"127.0.0.1:{chief.port}", deadline_s=20), "worker#0-x", 0)
    try:
        link.register()
        done, held = link.get_task(), link.get_task()
        assert done.has_task and held.has_task and chief.ledger.summary()["tasks_in_flight"] == 2
        link.report([], [], final=True, completed_tasks=[done.task_id], seq=1)
        summary = chief.ledger.summary()
        assert (summary["tasks_done"], summary["tasks_in_flight"], summary["tasks_pending"]) == (1, 0, 1), summary
    finally:
        link.coord.close()
        chief.stop()
