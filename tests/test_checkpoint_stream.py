"""Checkpoints written and restored part by part (asyncps.chief.checkpoint: TensorWriter, part_slices).

Real shard processes: the shards' snapshot streams, written chunk by chunk into one .npy file per whole
tensor, hold exactly what the whole snapshots assemble (a table sliced over two shards, its optimizer
slots); restored chunk by chunk from those files onto three shards and onto one, the shards hold the
same values and slots; a checkpoint of the format before (one model.npz) still loads; a stream that
does not fit the placement is refused and leaves no checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import (
    CheckpointDir,
    TensorWriter,
    assemble,
    part_slices,
    split_counters,
)

from asyncps.placement import VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import CheckpointNames, RunDir
from asyncps.transport import connect_model
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import PushRequest

RULE = UpdateRuleConfig(OptimizerConfig("adagrad", 0.1))
SPECS = [VariableSpec("table", (1000, 8), "float32"), VariableSpec("dense/kernel", (8, 2), "float32"),
         VariableSpec("dense/bias", (2,), "float32")]
SLICE = 4096  # bytes: the table is sliced
CHUNK = 1000  # bytes a chunk: every part streams in several


def _trained(addresses: list[str]) -> dict[str, np.ndarray]:
    """Two shards holding SPECS after a few sparse and dense pushes; the initial values."""
    placement = place(SPECS, len(addresses), SLICE)
    rng = np.random.default_rng(3)
    values = {s.name: rng.normal(size=s.shape).astype(np.float32) for s in SPECS}
    client = connect_model("w", addresses, placement, chunk_bytes=CHUNK)
    try:
        for shard in range(len(addresses)):
            part = {p.name: values[p.variable][p.rows()] if p.sliced else values[p.variable]
                    for p in placement.parts_on(shard)}
            client.shards[shard].initialize("chief", shard, len(addresses), RULE, part)
        client.pull()
        for step in range(3):
            ids = np.unique(rng.integers(0, 1000, 40)).astype(np.int64)
            grads = {"table": SparseRows(ids, rng.normal(size=(ids.size, 8)).astype(np.float32)),
                     "dense/kernel": rng.normal(size=(8, 2)).astype(np.float32),
                     "dense/bias": rng.normal(size=(2,)).astype(np.float32)}
            for shard, part in enumerate(client.split(grads)):
                client.shards[shard].push(PushRequest("w", client.versions[shard], part, step, 0.0))
            client.pull()
    finally:
        client.close()
    return values


def _write(root: Path, addresses: list[str]) -> Path:
    placement = place(SPECS, len(addresses), SLICE)
    client = connect_model("chief", addresses, placement, chunk_bytes=CHUNK)
    try:
        streams = [shard.snapshot_stream() for shard in client.shards]
        snaps = [s.header for s in streams]

        def write(tmp: Path) -> None:
            writer = TensorWriter(tmp, placement)
            for stream in streams:
                writer.add_all(stream.slices)
            writer.close()

        return CheckpointDir(root).save_with(1, write, {
            "shard_versions": [s.version for s in snaps],
            "shard_counters": [{"accepted": s.accepted, "dropped": s.dropped} for s in snaps],
            "updates": {n: u for s in snaps for n, u in s.updates.items()}, "variable_updates": {}})
    finally:
        client.close()


def _whole(addresses: list[str]) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    placement = place(SPECS, len(addresses), SLICE)
    client = connect_model("chief", addresses, placement)
    try:
        return assemble(placement, [s.snapshot() for s in client.shards])
    finally:
        client.close()


def _restore(ckpt_path: Path, addresses: list[str]) -> None:
    ckpt = CheckpointDir.load(ckpt_path)
    placement = place(SPECS, len(addresses), SLICE)
    client = connect_model("chief", addresses, placement)
    try:
        for shard, snap in enumerate(split_counters(placement, ckpt, RULE)):
            client.shards[shard].restore_stream(snap, shard, lambda s=shard: part_slices(placement, ckpt, s, CHUNK))
    finally:
        client.close()


def test_a_checkpoint_streamed_part_by_part_restores_onto_any_shard_count(
        tmp_path: Path, start_shards: Callable[[int], list[str]]) -> None:
    two = start_shards(2)
    _trained(two)
    expected_values, expected_slots = _whole(two)
    assert place(SPECS, 2, SLICE).parts_of("table")[0].sliced
    path = _write(RunDir(tmp_path).checkpoints, two)
    ckpt = CheckpointDir.load(path)
    assert ckpt.files and isinstance(ckpt.values["table"], np.memmap)  # read from the files, not into memory
    for name, value in expected_values.items():
        np.testing.assert_array_equal(ckpt.values[name], value)
        assert set(ckpt.slots[name]) == set(expected_slots[name])
        for slot, array in expected_slots[name].items():
            np.testing.assert_array_equal(ckpt.slots[name][slot], array)
    for count in (3, 1):
        shards = start_shards(count)
        _restore(path, shards)
        values, slots = _whole(shards)
        for name, value in expected_values.items():
            np.testing.assert_array_equal(values[name], value)
            for slot, array in expected_slots[name].items():
                np.testing.assert_array_equal(slots[name][slot], array)


def test_a_model_npz_checkpoint_still_loads(tmp_path: Path) -> None:
    path = CheckpointNames(tmp_path).final(1)
    path.mkdir()
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.savez(CheckpointNames.arrays(path), **{"value/table": table, "slot/accumulator/table": table * 2})
    CheckpointNames.manifest(path).write_text('{"number": 1}')
    ckpt = CheckpointDir.load(path)
    assert not ckpt.files
    np.testing.assert_array_equal(ckpt.values["table"], table)
    np.testing.assert_array_equal(ckpt.slots["table"]["accumulator"], table * 2)


def test_a_stream_that_does_not_fit_the_placement_leaves_no_checkpoint(
        tmp_path: Path, start_shards: Callable[[int], list[str]]) -> None:
    two = start_shards(2)
    _trained(two)
    other = place([VariableSpec("table", (1000, 8), "float32")], 2, SLICE)  # the dense variables unknown
    client = connect_model("chief", two, place(SPECS, 2, SLICE))
    root = RunDir(tmp_path).checkpoints
    try:
        streams = [shard.snapshot_stream() for shard in client.shards]

        def write(tmp: Path) -> None:
            writer = TensorWriter(tmp, other)
            try:
                for stream in streams:
                    writer.add_all(stream.slices)
            finally:
                writer.close(complete=False)

        with pytest.raises(ValueError, match="not value/PART"):
            CheckpointDir(root).save_with(1, write, {})
        for stream in streams:
            stream.cancel()
    finally:
        client.close()
    assert CheckpointDir(root).complete() == [] and list(root.iterdir()) == []  # no staging directory left
