"""The start barrier (chief.startgate over the real Coordinator service) and steady-state staleness."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from asyncps.chief.membership import Membership
from asyncps.chief.recorder import Recorder
from asyncps.chief.servicer import CoordinatorServicer
from asyncps.chief.startgate import StartGate
from asyncps.chief.steady import SteadyStaleness
from asyncps.chief.tasks import TaskLedger

from asyncps.errors import AsyncpsError, InvalidArgumentError, NotFoundError
from asyncps.net.rpc import create_server
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import coordinator_pb2_grpc
from asyncps.transport.coordinator import CoordinatorClient


class Chief:
    """A real Coordinator server (membership, gate, recorder) on port 0, and a client of it."""

    def __init__(self, tmp_path: Path, planned: int, enabled: bool = True) -> None:
        self.membership = Membership(planned, heartbeat_timeout_s=60)
        self.gate = StartGate(planned, enabled, self.membership.index_of)
        self.recorder = Recorder(tmp_path, planned_workers=planned)
        servicer = CoordinatorServicer(self.membership, self.recorder, ["127.0.0.1:1"], "{}",
                                       lambda: cpb.ClusterStatus(), TaskLedger(100, 10, 1), self.gate)
        self.server, port, _ = create_server(
            "127.0.0.1:0", [lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s)])
        self.client = CoordinatorClient(f"127.0.0.1:{port}", deadline_s=10)

    def register(self, n: int) -> list[str]:
        ids = [f"w{i}" for i in range(n)]
        for i, member in enumerate(ids):
            self.client.register(member, "worker", i)
        return ids

    def close(self) -> None:
        self.client.close()
        self.server.stop(0).wait()
        self.recorder.close()


@pytest.fixture
def chief(tmp_path: Path) -> Iterator[Chief]:
    c = Chief(tmp_path, planned=3)
    yield c
    c.close()


def test_not_released_until_every_planned_worker_is_ready(chief: Chief) -> None:
    ids = chief.register(3)
    reply = chief.client.wait_start(ids[:2], wait_s=0.05)
    assert not reply.released and reply.ready == 2 and reply.planned == 3
    result: list[cpb.StartReply] = []
    waiting = threading.Thread(target=lambda: result.append(chief.client.wait_start(ids[:1], wait_s=30)))
    waiting.start()
    reply = chief.client.wait_start(ids[2:], wait_s=30)  # the last one: releases everybody
    waiting.join(timeout=30)
    assert reply.released and result and result[0].released
    assert chief.gate.describe()["released_after_s"] is not None


def test_a_worker_joining_after_the_release_starts_at_once(chief: Chief) -> None:
    ids = chief.register(3)
    assert chief.client.wait_start(ids, wait_s=1).released
    chief.client.register("late", "worker")  # index 3: beyond the plan
    assert chief.client.wait_start(["late"], wait_s=0).released


def test_a_replacement_registered_beyond_the_plan_stands_in_for_a_lost_worker(chief: Chief) -> None:
    ids = chief.register(3)  # w2 is lost before it is ready; its replacement gets index 3
    chief.client.register("replacement", "worker")
    assert not chief.client.wait_start(ids[:2], wait_s=0.05).released
    assert chief.client.wait_start(["replacement"], wait_s=30).released


def test_switched_off_releases_each_worker_when_it_is_ready(tmp_path: Path) -> None:
    c = Chief(tmp_path, planned=3, enabled=False)
    try:
        ids = c.register(1)
        assert c.client.wait_start(ids, wait_s=0).released
    finally:
        c.close()


def test_stopping_before_the_release_tells_waiters_to_stop(chief: Chief) -> None:
    ids = chief.register(1)
    chief.membership.request_stop("test")
    chief.gate.cancel()
    reply = chief.client.wait_start(ids, wait_s=30)
    assert not reply.released and reply.command == cpb.STOP


@pytest.mark.parametrize(("worker_ids", "error"), [([], InvalidArgumentError), (["nobody"], NotFoundError)])
def test_bad_wait_start_is_refused_and_changes_nothing(chief: Chief, worker_ids: list[str],
                                                       error: type[AsyncpsError]) -> None:
    chief.register(1)
    with pytest.raises(error):
        chief.client.wait_start(worker_ids, wait_s=0)
    assert chief.gate.ready_count() == 0 and not chief.gate.released


def test_steady_staleness_counts_only_pushes_after_every_first_push() -> None:
    steady = SteadyStaleness(planned=2)
    steady.add(0, 0, 1.0, 0, 0)  # worker 0 alone: start-up
    steady.add(0, 0, 2.0, 1, 0)
    steady.add(1, 0, 2.5, 0, 2)  # worker 1's first push: the steady state starts after it
    steady.add(0, 0, 3.0, 2, 1)
    steady.add(1, 0, 2.4, 0, 9)  # reported late, made before: not steady
    steady.add(1, 0, 3.5, 3, 1)
    assert steady.snapshot() == {1: 2}
    assert steady.late_workers(round_size=2) == []
    assert SteadyStaleness(planned=2).late_workers(round_size=2) == [0, 1]  # never pushed


def test_a_worker_whose_first_read_is_a_round_late_is_late() -> None:
    steady = SteadyStaleness(planned=2)
    steady.add(0, 0, 1.0, 10, 0)  # a resumed run: versions start at 10
    steady.add(1, 0, 1.5, 12, 1)
    assert steady.late_workers(round_size=2) == [1]
    assert steady.late_workers(round_size=3) == []


def test_a_planned_worker_that_never_comes_holds_the_others_only_until_the_start_timeout() -> None:
    now = [0.0]
    gate = StartGate(3, True, lambda member: int(member[1:]), clock=lambda: now[0], timeout_s=60.0)
    gate.mark_ready(["w0", "w1"])  # w2 crashed while starting
    assert not gate.wait(0.0) and not gate.released
    now[0] = 59.0
    assert not gate.wait(0.0)
    now[0] = 60.0
    assert gate.wait(0.0) and gate.timed_out
    assert gate.describe()["timed_out"] is True and gate.describe()["ready"] == 2


def test_the_start_timeout_never_opens_a_gate_nobody_is_ready_at() -> None:
    now = [100.0]
    gate = StartGate(2, True, lambda member: int(member[1:]), clock=lambda: now[0], timeout_s=60.0)
    now[0] = 1000.0
    assert not gate.wait(0.0) and not gate.timed_out
