"""Load: 32 concurrent pushers against one real shard for ~10 s, every update accounted exactly.

The run itself is benchmarks.load (also a command: `python -m benchmarks.load`); here it must
finish without a single error, with the shard's version equal to the number of accepted pushes and
its values equal to initial - sum(accepted gradients) bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest

import benchmarks.load as load
from asyncps.wire.shard import PushRequest
from benchmarks.load import LoadConfig, run_load

PUSHERS = 32
SECONDS = 10.0


@pytest.mark.slow
def test_concurrent_pushers_lose_and_invent_nothing(shard_server: str, pytestconfig: pytest.Config) -> None:
    result = run_load(shard_server, LoadConfig(pushers=PUSHERS, seconds=SECONDS))
    report = result.report()
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write("\n" + report + "\n")  # after the progress dots
    else:
        print(report)

    assert not result.errors, "\n".join(result.errors[:10])
    assert all(r.latencies_s for r in result.records), "a pusher never got a push through"
    assert result.pushes >= PUSHERS * 10, f"only {result.pushes} pushes in {result.wall_s:.1f}s"
    # async, no staleness policy: every push is applied
    assert result.accepted == result.pushes and result.stats_dropped == 0
    assert result.version_before == 0
    assert result.version_after == result.accepted == result.stats_accepted
    assert not result.mismatched, f"values differ from initial - sum(gradients): {result.mismatched}"
    assert result.exact
    assert SECONDS <= result.wall_s < SECONDS + 30  # bounded: nobody hung past the deadline


def test_the_accounting_catches_a_single_wrong_update(shard_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact check is not vacuous: one push that sends other values than it records is caught."""

    class OneBadPush(load.GrpcShardTransport):
        sabotaged = False
        lock = threading.Lock()

        def push(self, request: PushRequest) -> Any:
            with OneBadPush.lock:
                bad, OneBadPush.sabotaged = not OneBadPush.sabotaged, True
            if bad:
                grads = request.grads
                request = dataclasses.replace(request, grads={**grads, "b": grads["b"] + np.float32(1)})
            return super().push(request)

    monkeypatch.setattr(load, "GrpcShardTransport", OneBadPush)
    result = run_load(shard_server, LoadConfig(pushers=2, seconds=0.3, rows=4, cols=3))
    assert OneBadPush.sabotaged and not result.errors
    assert result.version_after == result.accepted  # the version alone cannot tell
    assert set(result.mismatched) == {"b"} and result.mismatched["b"] == 1.0
    assert not result.exact
