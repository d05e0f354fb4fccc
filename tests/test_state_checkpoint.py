"""Checkpoints round-trip non-trainable state parts (UpdateRuleConfig.state): real shard processes hold a
state variable sliced over two shards beside a trained kernel; its snapshot streams into a checkpoint with
no optimizer slots, restores onto three shards and onto one, and the restored shards still add deltas. A
misshapen, mistyped or non-finite delta over gRPC is INVALID_ARGUMENT and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir, TensorWriter, assemble, part_slices, split_counters

from asyncps.errors import InvalidArgumentError
from asyncps.placement import Placement, VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import RunDir
from asyncps.transport import connect_model
from asyncps.wire.shard import PushRequest

SPECS = [VariableSpec("dense/kernel", (8, 2), "float32"), VariableSpec("bn/moving_mean", (600,), "float32")]
SLICE = 1024  # bytes: the moving mean is sliced
CHUNK = 500


def placed(count: int) -> tuple[Placement, UpdateRuleConfig]:
    placement = place(SPECS, count, SLICE)
    state = tuple(p.name for p in placement.parts_of("bn/moving_mean"))
    return placement, UpdateRuleConfig(OptimizerConfig("adam", 0.1), state=state)


def whole(addresses: list[str]) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    placement, _ = placed(len(addresses))
    client = connect_model("chief", addresses, placement)
    try:
        return assemble(placement, [s.snapshot() for s in client.shards])
    finally:
        client.close()


def push_delta(addresses: list[str], delta: float) -> None:
    placement, _ = placed(len(addresses))
    client = connect_model("w", addresses, placement)
    try:
        client.pull()
        grads = {"dense/kernel": np.ones((8, 2), np.float32), "bn/moving_mean": np.full(600, delta, np.float32)}
        for shard, part in enumerate(client.split(grads)):
            if part:
                client.shards[shard].push(PushRequest("w", client.versions[shard], part, 0, 0.0))
    finally:
        client.close()


def test_state_parts_round_trip_a_checkpoint_onto_any_shard_count(
        tmp_path: Path, start_shards: Callable[[int], list[str]]) -> None:
    two = start_shards(2)
    placement, rule = placed(2)
    assert len(rule.state) == 2, "the state variable is sliced over both shards"
    values = {"dense/kernel": np.zeros((8, 2), np.float32), "bn/moving_mean": np.linspace(0, 1, 600, dtype=np.float32)}
    client = connect_model("chief", two, placement, chunk_bytes=CHUNK)
    for shard in range(2):
        part = {p.name: values[p.variable][p.rows()] if p.sliced else values[p.variable]
                for p in placement.parts_on(shard)}
        client.shards[shard].initialize("chief", shard, 2, rule, part)
    for delta in (0.5, -0.25, 1.0):
        push_delta(two, delta)
    expected, expected_slots = whole(two)
    np.testing.assert_allclose(expected["bn/moving_mean"], values["bn/moving_mean"] + 1.25, rtol=1e-6)
    assert not expected_slots.get("bn/moving_mean") and set(expected_slots["dense/kernel"]) == {"momentum", "velocity"}

    streams = [shard.snapshot_stream() for shard in client.shards]
    snaps = [s.header for s in streams]
    assert all(s.rule.state == rule.state for s in snaps)

    def write(tmp: Path) -> None:
        writer = TensorWriter(tmp, placement)
        for stream in streams:
            writer.add_all(stream.slices)
        writer.close()

    path = CheckpointDir(RunDir(tmp_path).checkpoints).save_with(1, write, {
        "shard_versions": [s.version for s in snaps],
        "shard_counters": [{"accepted": s.accepted, "dropped": s.dropped} for s in snaps],
        "updates": {n: u for s in snaps for n, u in s.updates.items()}, "variable_updates": {}})
    client.close()
    ckpt = CheckpointDir.load(path)
    np.testing.assert_array_equal(ckpt.values["bn/moving_mean"], expected["bn/moving_mean"])
    assert not ckpt.slots.get("bn/moving_mean")

    for count in (3, 1):
        shards = start_shards(count)
        target, target_rule = placed(count)
        restorer = connect_model("chief", shards, target)
        for shard, snap in enumerate(split_counters(target, ckpt, target_rule)):
            assert snap.rule.state == target_rule.state
            restorer.shards[shard].restore_stream(snap, shard,
                                                  lambda s=shard, t=target: part_slices(t, ckpt, s, CHUNK))
        restorer.close()
        got, slots = whole(shards)
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value)
        assert not slots.get("bn/moving_mean")
        for slot, array in expected_slots["dense/kernel"].items():
            np.testing.assert_array_equal(slots["dense/kernel"][slot], array)
        push_delta(shards, 2.0)  # still state after the restore: the delta is added as is
        np.testing.assert_allclose(whole(shards)[0]["bn/moving_mean"], expected["bn/moving_mean"] + 2.0, rtol=1e-6)


def test_a_bad_state_delta_over_grpc_is_invalid_argument_and_changes_nothing(
        start_shards: Callable[[int], list[str]]) -> None:
    addresses = start_shards(1)
    placement, rule = placed(1)
    values = {"dense/kernel": np.zeros((8, 2), np.float32), "bn/moving_mean": np.ones(600, np.float32)}
    client = connect_model("w", addresses, placement)
    try:
        client.shards[0].initialize("chief", 0, 1, rule, {p.name: values[p.variable] for p in placement.parts_on(0)})
        (name,) = rule.state
        for bad in (np.ones(599, np.float32), np.ones(600, np.float64), np.full(600, np.nan, np.float32)):
            with pytest.raises(InvalidArgumentError):
                client.shards[0].push(PushRequest("w", 0, {"dense/kernel": np.ones((8, 2), np.float32), name: bad},
                                                  0, 0.0))
        before, _ = whole(addresses)
        assert client.shards[0].stats().version == 0
        np.testing.assert_array_equal(before["bn/moving_mean"], values["bn/moving_mean"])
        np.testing.assert_array_equal(before["dense/kernel"], values["dense/kernel"])
    finally:
        client.close()
