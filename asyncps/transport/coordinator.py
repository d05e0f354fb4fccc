"""Client of the chief's Coordinator service (workers, the launcher, health tools). Its calls fail with
asyncps.errors (converted at this edge), never a grpc.RpcError."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

from asyncps.errors import AsyncpsError, DeadlineExceededError, UnavailableError
from asyncps.net.retry import RetryPolicy
from asyncps.net.rpc import make_channel, raising_domain_errors
from asyncps.net.security import SecurityConfig, secure_channel
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc

T = TypeVar("T")


# Every call to the chief may be sent again: Register (one worker id, one member), Heartbeat and
# GetStatus read or refresh, Report is recorded once per report number, GetTask repeats its answer
# to a repeated request number. So an attempt that timed out (DEADLINE_EXCEEDED: its request or reply
# was lost in a network partition, the connection behind it gone) is retried like UNAVAILABLE.
_RETRY: tuple[type[AsyncpsError], ...] = (UnavailableError, DeadlineExceededError)


class CoordinatorClient:
    """Typed calls to the chief with deadlines; UNAVAILABLE and a timed-out attempt are retried until
    deadline_s."""

    def __init__(
        self, address: str, deadline_s: float = 60.0, security: SecurityConfig | None = None,
        call_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self._policy = RetryPolicy(deadline_s, retry_on=_RETRY)
        self._call_timeout_s = call_timeout_s
        self._channel = secure_channel(address, security) if security else make_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._rng = random.Random()

    def _retry(self, fn: Callable[[], T], deadline_s: float | None) -> T:
        return self._policy.within(deadline_s).call(raising_domain_errors(fn), f"the chief at {self.address}",
                                                    self._rng)

    def register(self, worker_id: str, role: str = "worker", requested_index: int = -1,
                 address: str = "") -> cpb.RegisterResponse:
        """Join the run; returns this member's index and the plan."""
        request = cpb.RegisterRequest(worker_id=worker_id, role=role, requested_index=requested_index,
                                      address=address)
        return self._retry(lambda: self._stub.Register(request, timeout=self._call_timeout_s), None)

    def heartbeat(self, worker_id: str, role: str, step: int, deadline_s: float | None = None) -> cpb.HeartbeatResponse:
        """Say this member is alive; the reply says continue or stop."""
        request = cpb.HeartbeatRequest(worker_id=worker_id, role=role, step=step)
        return self._retry(lambda: self._stub.Heartbeat(request, timeout=self._call_timeout_s), deadline_s)

    def report(self, worker_id: str, worker_index: int, pushes: Sequence[cpb.PushRecord],
               steps: Sequence[cpb.StepTiming], final: bool = False,
               deadline_s: float | None = None, completed_tasks: Sequence[int] = (),
               seq: int = 0) -> cpb.ReportResponse:
        """Send telemetry (push records, step timings, completed data tasks) as report number `seq`
        (0: unnumbered)."""
        request = cpb.ReportRequest(worker_id=worker_id, worker_index=worker_index, pushes=pushes,
                                    steps=steps, final=final, completed_tasks=completed_tasks, seq=seq)
        return self._retry(lambda: self._stub.Report(request, timeout=self._call_timeout_s), deadline_s)

    def get_task(self, worker_id: str, deadline_s: float | None = None, seq: int = 0) -> cpb.TaskReply:
        """The next data task for this worker; `seq`: the worker's request number (TaskRequest.seq)."""
        request = cpb.TaskRequest(worker_id=worker_id, seq=seq)
        return self._retry(lambda: self._stub.GetTask(request, timeout=self._call_timeout_s), deadline_s)

    def wait_start(self, worker_ids: Sequence[str], wait_s: float,
                   deadline_s: float | None = None) -> cpb.StartReply:
        """Say these members are ready and wait (up to wait_s) for the chief to release the run."""
        request = cpb.StartRequest(worker_ids=list(worker_ids), wait_s=wait_s)
        return self._retry(lambda: self._stub.WaitStart(request, timeout=wait_s + self._call_timeout_s), deadline_s)

    def status(self, deadline_s: float | None = None) -> cpb.ClusterStatus:
        """Progress of the run."""
        return self._retry(lambda: self._stub.GetStatus(cpb.StatusRequest(), timeout=self._call_timeout_s),
                           deadline_s)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
