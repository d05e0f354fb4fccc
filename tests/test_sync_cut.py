"""Checkpoints and evaluations of a multi-shard sync run are one model: at every cut each follower
stands at shard 0's step (the cut commits shard 0's decided steps on the held followers), and the
values are those of exactly those steps. Real shard processes, three workers pushing throughout."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir, split
from asyncps.chief.checkpointer import Checkpointer
from asyncps.chief.config import ChiefConfig
from asyncps.chief.cut import at_cut
from asyncps.chief.membership import Membership
from asyncps.chief.progress import Progress
from asyncps.chief.tasks import TaskLedger

from asyncps.config import RunConfig
from asyncps.placement import Placement, VariableSpec, place
from asyncps.transport import connect_model

JOIN_S = 60.0
LR = 0.01
WORKERS = 3
SPECS = [VariableSpec("w", (64, 8), "float32"), VariableSpec("b", (8,), "float32"),
         VariableSpec("v", (16,), "float32")]


@dataclass
class Steps:
    """Per shard, per version: the gradient parts of the workers that step averaged."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_shard: dict[int, dict[int, dict[str, dict[str, np.ndarray]]]] = field(default_factory=dict)
    count: int = 0
    more: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, count: int) -> None:
        with self.more:
            assert self.more.wait_for(lambda: self.count >= count, timeout=JOIN_S), "workers stopped pushing"


def _worker(index: int, addresses: list[str], placement: Placement, steps: Steps, stop: threading.Event) -> None:
    """Push random dense gradients in sync steps as fast as the steps go."""
    name = f"worker-{index}"
    client = connect_model(name, addresses, placement, deadline_s=JOIN_S)
    client.coordinated = True  # as a worker of a sync run does
    rng = np.random.default_rng(index)
    try:
        client.pull()
        step = 0
        while not stop.is_set():
            grads = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}
            parts = client.split(grads)
            step += 1
            decided = client.versions[0] + 1  # the version the coordinator step of this gradient makes
            results = client.push_pull(grads, step, 0.0, read_wait_s=JOIN_S)  # until the step is decided
            # the read wait can end before shard 0 decides the step (at the end, when the others
            # stopped): the gradient is then accumulated there and staged on the followers, applied
            # nowhere, and a follower's commit answers it "accepted" at its current version
            applied = results if results[0].version >= decided else []
            with steps.lock:
                for r in applied:
                    if r.outcome is not None and r.outcome.accepted:
                        # shard 0 answers a vote before its step completes; a follower's commit, with it
                        version = decided if r.shard == 0 else r.outcome.version
                        steps.by_shard.setdefault(r.shard, {}).setdefault(version, {})[name] = parts[r.shard]
            with steps.more:
                steps.count += 1
                steps.more.notify_all()
    finally:
        client.close()


def _assert_model_at(placement: Placement, initial: dict[str, np.ndarray], steps: Steps, versions: list[int],
                     values: dict[str, np.ndarray]) -> None:
    """Every shard is at the same step and its values are the initial ones plus exactly the
    averaged steps 1..version (the same workers on every shard)."""
    assert len(set(versions)) == 1, f"the shards are at different sync steps: {versions}"
    for v in range(1, versions[0] + 1):
        sets = {s: sorted(steps.by_shard[s][v]) for s in steps.by_shard}
        assert len({tuple(x) for x in sets.values()}) == 1, f"step {v} averaged different workers: {sets}"
    for shard, version in enumerate(versions):
        for part in placement.parts_on(shard):
            expected = np.array(initial[part.variable][part.rows()] if part.sliced else initial[part.variable])
            for v in range(1, version + 1):
                grads = [g[part.name] for g in steps.by_shard[shard][v].values()]
                expected -= np.float32(LR) * (sum(grads) / np.float32(len(grads)))
            value = values[part.variable]
            np.testing.assert_allclose(value[part.rows()] if part.sliced else value, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_sync_checkpoints_under_continuous_steps_are_one_model(
    tmp_path: Path, start_shards: Callable[[int], list[str]]
) -> None:
    addresses = start_shards(2)
    placement = place(SPECS, 2, slice_threshold_bytes=1024)
    rng = np.random.default_rng(7)
    initial = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}
    run = RunConfig(num_workers=WORKERS, num_ps=2, learning_rate=LR, keep_checkpoints=10, mode="sync:backup=1")
    config = ChiefConfig(ps=tuple(addresses), run=run, run_dir=tmp_path)
    chief = connect_model("chief", addresses, placement, deadline_s=JOIN_S)
    checkpointer = Checkpointer(config, chief, placement, initial, TaskLedger(10**6, 1, 0.0),
                                Membership(WORKERS, 60.0), Progress(), 0.0)
    checkpointer.initialize_shards()
    steps = Steps()
    stop = threading.Event()
    paths, evaluations = [], []
    reader = connect_model("evaluator", addresses, placement, deadline_s=JOIN_S)
    with ThreadPoolExecutor(WORKERS) as pool:
        workers = [pool.submit(_worker, i, addresses, placement, steps, stop) for i in range(WORKERS)]
        try:
            for n in range(8):
                steps.wait_for(20 * (n + 1))  # the workers keep pushing between and during the cuts
                path = checkpointer.checkpoint(lambda: 0)
                assert path is not None
                paths.append(path)
                cut = at_cut(reader.shards, lambda _, __: None, reader.pull)  # what an evaluation reads
                assert cut.sync_steps is not None and len(set(cut.sync_steps)) == 1, cut.sync_steps
                evaluations.append((cut.record, {k: v.copy() for k, v in reader.values.items()}))
        finally:
            stop.set()
            for w in workers:
                # a worker may be in a step the stopped others never complete: the shard answers it
                # after its read wait (JOIN_S), so joining takes up to that long plus its exit
                w.result(timeout=2 * JOIN_S)
    # and the model the run ended with (every worker joined; a step left undecided is in none)
    evaluations.append((reader.pull(), {k: v.copy() for k, v in reader.values.items()}))
    reader.close()
    for versions, values in evaluations:
        _assert_model_at(placement, initial, steps, versions, values)
    for path in paths:
        ckpt = CheckpointDir.load(path)
        _assert_model_at(placement, initial, steps, ckpt.manifest["shard_versions"], ckpt.values)
    # restore the last checkpoint: every shard serves its values at its one step
    last = CheckpointDir.load(paths[-1])
    for shard, snap in enumerate(split(placement, last, run.update_rule())):
        chief.shards[shard].restore(snap, shard)
    assert chief.pull() == last.manifest["shard_versions"]
    for name, value in last.values.items():
        np.testing.assert_array_equal(chief.values[name], value)
    chief.close()
