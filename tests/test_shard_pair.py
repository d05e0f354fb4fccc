"""`asyncps ps --replicas 2` (asyncps.tools.shardpair): one shard as a primary and a backup process, for deployments
without `asyncps local`'s launcher. The test is the chief and the worker: it trains the shard, SIGKILLs its
primary process three times, each time once the new backup is seeded, and the shard, at the address it always
had, ends with the state of a shard that was never killed, bit for bit, every answer kept."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.tools.cli import main
from asyncps.transport import GrpcShardTransport
from asyncps.wire.shard import PushRequest
from tests.conftest import ShardLauncher
from tests.test_chief_restart import listening_pid

RULE = UpdateRuleConfig(OptimizerConfig("adam", 0.01), num_workers=2)


def seeded(log: Path) -> int:
    """How many backups the pair has seeded (its log says so each time)."""
    return log.read_text(errors="replace").count("is seeded at version")


def wait_until(what: str, ready: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.05)


def test_a_pair_keeps_its_shard_whole_through_kills_of_its_primary(shard_factory: ShardLauncher) -> None:
    [pair] = shard_factory(1, args=("--replicas", "2"))
    port = int(pair.address.rsplit(":", 1)[1])
    client = GrpcShardTransport(pair.address, deadline_s=30.0, call_timeout_s=10.0)
    rng = np.random.default_rng(3)
    values = {"w": rng.normal(size=(64, 32)).astype(np.float32), "b": np.zeros(32, np.float32)}
    client.initialize("chief", 0, 1, RULE, values)
    reference = ShardStore(shard_index=0)  # the same pushes on a shard nobody kills
    assert reference.initialize(RULE, values)
    step = 0
    for kill in range(4):
        for _ in range(25):
            step += 1
            grads = {"w": rng.normal(size=(64, 32)).astype(np.float32), "b": rng.normal(size=32).astype(np.float32)}
            worker = f"w{step % 2}"
            base = max(0, reference.version - step % 3)  # some stale: the answers carry staleness
            got = client.push(PushRequest(worker, base, grads, step))
            want = reference.push(worker, base, grads, step=step)
            assert (got.accepted, got.version, got.staleness, got.seq) == (want.accepted, want.version,
                                                                           want.staleness, want.seq)
        if kill == 3:
            break
        wait_until("seeded backup", lambda n=kill + 1: seeded(pair.log_path) >= n)
        primary = listening_pid(port)
        assert primary != pair.process.pid  # a child of the pair serves the port
        os.kill(primary, signal.SIGKILL)

        def taken_over(dead: int = primary) -> bool:
            try:
                return listening_pid(port) != dead
            except AssertionError:
                return False

        wait_until("takeover of the shard's port", taken_over)
    held = client.snapshot()
    want = reference.snapshot()
    assert (held.version, held.answers, held.accepted, held.dropped) == (want.version, want.answers, want.accepted,
                                                                         want.dropped) == (100, 100, 100, 0)
    for name in values:  # bit for bit: the backups applied every push the primaries answered, in their order
        np.testing.assert_array_equal(held.values[name], want.values[name])
        for slot, array in want.slots[name].items():  # adam's moments
            np.testing.assert_array_equal(held.slots[name][slot], array)
    log = pair.log_path.read_text(errors="replace")
    assert log.count("took over port") == 3, log[-3000:]
    client.shutdown("the test is done")  # the chief's Shutdown ends the pair, its backup with it
    assert pair.process.wait(timeout=30) == 0


def test_replicas_other_than_one_or_two_are_refused_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps", "--replicas", "3", "--port", "0"]) == 2
    assert "--replicas is 1 (the shard alone) or 2 (the shard and its backup), got 3" in capsys.readouterr().err
