"""gRPC adapter for the chief's Coordinator service."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from asyncps.chief.membership import Membership
from asyncps.chief.recorder import Recorder
from asyncps.chief.reportlog import ReportLog
from asyncps.chief.startgate import StartGate
from asyncps.chief.tasks import TaskLedger

from asyncps.net.rpc import handles_errors
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc

log = logging.getLogger(__name__)

#: The longest a WaitStart call is held before it answers "not yet" (the caller asks again).
MAX_START_WAIT_S = 10.0


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Registration, heartbeats, telemetry and status, over the chief's state objects."""

    def __init__(self, membership: Membership, recorder: Recorder, ps_addresses: Sequence[str],
                 run_config_json: str, status: Callable[[], cpb.ClusterStatus], ledger: TaskLedger,
                 gate: StartGate | None = None, reports: ReportLog | None = None) -> None:
        self._membership = membership
        self._gate = gate or StartGate(membership.num_workers, False, membership.index_of)
        self._reports = reports or ReportLog()
        self._ledger = ledger
        self._recorder = recorder
        self._ps_addresses = list(ps_addresses)
        self._run_config_json = run_config_json
        self._status = status

    def _command(self) -> tuple[int, str]:
        reason = self._membership.stop_reason
        return (cpb.STOP, reason) if reason is not None else (cpb.CONTINUE, "")

    @handles_errors
    def Register(self, request: cpb.RegisterRequest, context: grpc.ServicerContext) -> cpb.RegisterResponse:
        """Admit a worker and hand it the plan."""
        index = self._membership.register(request.worker_id, request.role or "worker",
                                          request.requested_index)
        log.info("registered %s as worker %d", request.worker_id, index)
        return cpb.RegisterResponse(index=index, num_workers=self._membership.num_workers,
                                    ps_addresses=self._ps_addresses,
                                    run_config_json=self._run_config_json)

    @handles_errors
    def Heartbeat(self, request: cpb.HeartbeatRequest, context: grpc.ServicerContext) -> cpb.HeartbeatResponse:
        """Record liveness; answer continue or stop."""
        self._membership.heartbeat(request.worker_id, request.step)
        command, reason = self._command()
        return cpb.HeartbeatResponse(command=command, reason=reason)  # type: ignore[arg-type]

    @handles_errors
    def Report(self, request: cpb.ReportRequest, context: grpc.ServicerContext) -> cpb.ReportResponse:
        """Record a worker's telemetry, once per report number; a final report marks it finished."""
        index = self._membership.index_of(request.worker_id)
        self._ledger.check_ids(request.completed_tasks)  # INVALID_ARGUMENT before anything is recorded
        with self._reports.once(request.worker_id, request.seq, request.completed_tasks) as fresh:
            if fresh:
                # the rows, then the tasks (their ids were checked above): a chief killed in between leaves
                # a report whose rows are whole and that the next chief completes (asyncps.chief.reportlog)
                self._recorder.add(index, request.pushes, request.steps)
                self._reports.rows_written(request.worker_id, request.seq)
                for task_id in request.completed_tasks:
                    if not self._ledger.complete(request.worker_id, task_id):
                        log.info("task %d completed again by worker %d (it was re-queued, or rolled back with "
                                 "the shards)", task_id, index)
            else:
                log.info("report %d of worker %d (%s) was recorded before: not again", request.seq, index,
                         request.worker_id)
        if request.final:
            self._membership.finish(request.worker_id)
            # a task it still holds (told to stop between being handed it and finishing it) goes back to the
            # queue now: neither done nor in flight with a worker that is gone
            returned = self._ledger.requeue(request.worker_id)
            log.info("worker %d (%s) finished", index, request.worker_id)
            if returned:
                log.info("worker %d handed back %d data task(s) it held unfinished: re-queued", index, returned)
        return cpb.ReportResponse(command=self._command()[0])  # type: ignore[arg-type]

    @handles_errors
    def GetTask(self, request: cpb.TaskRequest, context: grpc.ServicerContext) -> cpb.TaskReply:
        """Hand out the next data task (none once the run is stopping or the data is done)."""
        self._membership.index_of(request.worker_id)  # registered members only
        if self._membership.stop_reason is not None:
            return cpb.TaskReply(has_task=False, finished=True)
        task = self._ledger.next_task(request.worker_id, request.seq)
        if task is None:
            return cpb.TaskReply(has_task=False, finished=self._ledger.finished())
        return cpb.TaskReply(has_task=True, task_id=task.task_id, epoch=task.epoch, start=task.start,
                             stop=task.stop)

    @handles_errors
    def WaitStart(self, request: cpb.StartRequest, context: grpc.ServicerContext) -> cpb.StartReply:
        """The start barrier: mark the members ready, hold the call until the run is released (at most
        MAX_START_WAIT_S, so a waiting process cannot pin a server thread for long)."""
        self._gate.mark_ready(request.worker_ids)
        released = self._gate.wait(min(max(request.wait_s, 0.0), MAX_START_WAIT_S))
        command, _ = self._command()
        return cpb.StartReply(released=released and command == cpb.CONTINUE, command=command,  # type: ignore[arg-type]
                              ready=self._gate.ready_count(), planned=self._gate.planned,
                              start_at=self._gate.start_at)

    @handles_errors
    def GetStatus(self, request: cpb.StatusRequest, context: grpc.ServicerContext) -> cpb.ClusterStatus:
        """Progress of the run."""
        return self._status()
