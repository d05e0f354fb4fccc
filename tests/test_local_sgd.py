"""Local SGD (--local-steps H): workers against real shard processes push the change of their
model after H local steps, and the shards apply it once by the outer rule (average, EASGD, Nesterov),
each checked against a numpy replay of the same gradients."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from asyncps.worker.local import LocalModel
from asyncps.worker.trainer import BatchStream, GradFn, TaskBatches, Telemetry, Trainer, make_grad_fn

from asyncps.config import RunConfig
from asyncps.delays import NoDelay, StepDelay
from asyncps.ml.datasets import epoch_order, load_dataset
from asyncps.ml.models import build_model, loss_fn
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OUTER_RULES, OptimizerConfig, UpdateRuleConfig
from asyncps.rules.outer import LocalRule
from asyncps.transport import ModelClient, connect_model

H = 4
LR = 0.1
ROUNDS = 3


@dataclass
class Cluster:
    """Two fresh shards holding a seeded MLP (hidden kernels sliced over both), and its gradients."""

    addresses: list[str]
    names: list[str]
    initial: dict[str, np.ndarray]
    grad_fn: GradFn
    x: np.ndarray
    y: np.ndarray

    def client(self, worker: int, rule: UpdateRuleConfig, coordinated: bool = False) -> ModelClient:
        specs = [VariableSpec(n, v.shape, "float32") for n, v in self.initial.items()]
        placement = place(specs, 2, slice_threshold_bytes=16 * 1024)
        client = connect_model(f"worker-{worker}", self.addresses, placement, worker_index=worker,
                               coordinated=coordinated)
        if worker == 0:
            for shard, values in enumerate(split_for_shards(placement, self.initial)):
                client.shards[shard].initialize("test", shard, 2, rule, values)
        client.pull()
        return client

    def trainer(self, client: ModelClient, local: LocalModel, seed: int) -> tuple[Trainer, Telemetry]:
        telemetry = Telemetry()
        return Trainer(client, self.names, self.grad_fn, BatchStream(self.x, self.y, 32, seed=seed),
                       StepDelay(NoDelay()), telemetry, local=local), telemetry

    def local_round(self, start: Sequence[np.ndarray], batches: BatchStream, lr: float = LR) -> list[np.ndarray]:
        """The replay: H steps of plain SGD from `start` on the next H batches."""
        w = [v.copy() for v in start]
        for _ in range(H):
            _, grads = self.grad_fn(w, *batches.next())
            w = [v - np.float32(lr) * np.asarray(g) for v, g in zip(w, grads, strict=True)]
        return w


@pytest.fixture
def cluster(start_shards: Callable[[int], list[str]]) -> Cluster:
    data = load_dataset("digits", 0)
    model = build_model("mlp", data.num_features, data.num_classes, seed=3)
    initial = {v.path: np.array(v.numpy()) for v in model.trainable_variables}
    return Cluster(start_shards(2), list(initial), initial, make_grad_fn(model, loss_fn),
                   data.x_train[:600], data.y_train[:600])


def local_rule(outer: str) -> LocalRule:
    return LocalRule(H, OptimizerConfig("sgd", LR), OUTER_RULES.parse(outer))


def assert_close(got: Sequence[np.ndarray], want: Sequence[np.ndarray], names: Sequence[str]) -> None:
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_worker_pushes_its_model_change_after_h_local_steps_and_the_shards_apply_it_once(cluster: Cluster) -> None:
    """Outer `average` with one worker: each round's center is the worker's local model (center -
    (center - local)); a delta applied twice would leave 2 * local - center."""
    rule = local_rule("average")
    client = cluster.client(0, UpdateRuleConfig(rule.outer.shard_optimizer()))
    trainer, telemetry = cluster.trainer(client, LocalModel(rule, cluster.names), seed=5)
    trainer.run(threading.Event(), max_steps=ROUNDS)

    pushes, steps = telemetry.drain()
    assert client.versions == [ROUNDS, ROUNDS]  # one version per push: staleness counts outer versions
    assert len(pushes) == 2 * ROUNDS and all(p.accepted and p.staleness == 0 and p.local_steps == H for p in pushes)
    assert [s.examples for s in steps] == [H * 32] * ROUNDS and trainer.examples == ROUNDS * H * 32

    batches = BatchStream(cluster.x, cluster.y, 32, seed=5)
    center = [cluster.initial[n] for n in cluster.names]
    for _ in range(ROUNDS):
        local = cluster.local_round(center, batches)
        delta = [c - w for c, w in zip(center, local, strict=True)]  # what the worker pushes
        center = [c - d for c, d in zip(center, delta, strict=True)]  # outer SGD, lr 1
    client.pull()
    assert_close([client.values[n] for n in cluster.names], center, cluster.names)
    moved = max(float(np.abs(client.values[n] - cluster.initial[n]).max()) for n in cluster.names)
    assert moved > 1e-2, "training did not move the parameters"
    client.close()


def test_easgd_moves_the_center_and_the_worker_toward_each_other_by_alpha(cluster: Cluster) -> None:
    """EASGD: center += alpha (local - center pulled); local -= alpha (local - center pulled); the
    worker keeps its own model between rounds."""
    alpha = 0.25
    rule = local_rule(f"easgd:alpha={alpha}")
    client = cluster.client(0, UpdateRuleConfig(rule.outer.shard_optimizer()))
    local = LocalModel(rule, cluster.names)
    trainer, _ = cluster.trainer(client, local, seed=7)
    trainer.run(threading.Event(), max_steps=ROUNDS)

    batches = BatchStream(cluster.x, cluster.y, 32, seed=7)
    center = [cluster.initial[n] for n in cluster.names]
    worker = [v.copy() for v in center]
    for _ in range(ROUNDS):
        worker = cluster.local_round(worker, batches)
        center, worker = ([c + np.float32(alpha) * (w - c) for c, w in zip(center, worker, strict=True)],
                          [w - np.float32(alpha) * (w - c) for c, w in zip(center, worker, strict=True)])
    client.pull()
    assert_close([client.values[n] for n in cluster.names], center, cluster.names)
    assert_close(local.values, worker, cluster.names)
    assert max(float(np.abs(w - c).max()) for w, c in zip(worker, center, strict=True)) > 1e-3  # they differ
    client.close()


def outer_rounds(cluster: Cluster, outer: str,
                 step: Callable[[int, list[np.ndarray], list[np.ndarray]], list[np.ndarray]]) -> None:
    """ROUNDS rounds of one worker's local SGD under `outer` on the shard, against the same rounds
    replayed by hand: `step(round, center, delta)` is the outer rule's new center (1-based rounds)."""
    rule = local_rule(outer)
    client = cluster.client(0, UpdateRuleConfig(rule.outer.shard_optimizer()))
    trainer, _ = cluster.trainer(client, LocalModel(rule, cluster.names), seed=9)
    trainer.run(threading.Event(), max_steps=ROUNDS)

    batches = BatchStream(cluster.x, cluster.y, 32, seed=9)
    center = [cluster.initial[n] for n in cluster.names]
    for r in range(1, ROUNDS + 1):
        local = cluster.local_round(center, batches)
        center = step(r, center, [c - w for c, w in zip(center, local, strict=True)])
    client.pull()
    assert_close([client.values[n] for n in cluster.names], center, cluster.names)
    client.close()


def test_nesterov_outer_applies_the_deltas_with_outer_momentum(cluster: Cluster) -> None:
    """DiLoCo's outer rule: keras' SGD(lr, momentum, nesterov=True) on the deltas, the momentum
    kept on the shards across rounds."""
    lr, mu = np.float32(0.7), np.float32(0.9)
    velocity = [np.zeros_like(cluster.initial[n]) for n in cluster.names]

    def step(_: int, center: list[np.ndarray], delta: list[np.ndarray]) -> list[np.ndarray]:
        velocity[:] = [mu * v - lr * d for v, d in zip(velocity, delta, strict=True)]
        return [c + mu * v - lr * d for c, v, d in zip(center, velocity, delta, strict=True)]

    outer_rounds(cluster, "nesterov:lr=0.7,momentum=0.9", step)


def test_delayed_nesterov_outer_steps_the_momentum_once_per_period(cluster: Cluster) -> None:
    """Async local SGD's outer rule (Liu et al. 2024): each delta moves the center by lr/period of
    itself at once, the momentum steps with the mean of every `period` deltas; kept across rounds."""
    lr, mu, period = np.float32(0.7), np.float32(0.9), 2
    velocity = [np.zeros_like(cluster.initial[n]) for n in cluster.names]
    total = [np.zeros_like(v) for v in velocity]

    def step(r: int, center: list[np.ndarray], delta: list[np.ndarray]) -> list[np.ndarray]:
        center = [c - lr / period * d for c, d in zip(center, delta, strict=True)]
        total[:] = [t + d for t, d in zip(total, delta, strict=True)]
        if r % period == 0:
            velocity[:] = [mu * v - lr / period * t for v, t in zip(velocity, total, strict=True)]
            center = [c + mu * v for c, v in zip(center, velocity, strict=True)]
            total[:] = [np.zeros_like(t) for t in total]
        return center

    outer_rounds(cluster, "delayed-nesterov:lr=0.7,momentum=0.9,period=2", step)


def test_sync_averaging_of_two_workers_gives_the_mean_of_their_local_models(cluster: Cluster) -> None:
    """Sync over two shards with outer `average`: every round both workers start from one center
    and the next center is the mean of their two local models (periodic model averaging)."""
    rule = local_rule("average")
    update = UpdateRuleConfig(rule.outer.shard_optimizer(), mode="sync", num_workers=2)
    clients = [cluster.client(w, update, coordinated=True) for w in range(2)]
    trainers = [cluster.trainer(c, LocalModel(rule, cluster.names), seed=11 + w) for w, c in enumerate(clients)]
    failures: list[BaseException] = []

    def train(trainer: Trainer) -> None:
        try:
            trainer.run(threading.Event(), max_steps=ROUNDS)
        except BaseException as exc:  # the assertion below reports it
            failures.append(exc)

    threads = [threading.Thread(target=train, args=(t,)) for t, _ in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures and not any(t.is_alive() for t in threads)

    streams = [BatchStream(cluster.x, cluster.y, 32, seed=11 + w) for w in range(2)]
    center = [cluster.initial[n] for n in cluster.names]
    for _ in range(ROUNDS):
        locals_ = [cluster.local_round(center, s) for s in streams]
        center = [(a + b) / np.float32(2) for a, b in zip(*locals_, strict=True)]
    for client in clients:
        assert client.versions == [ROUNDS, ROUNDS]
        client.pull()
        assert_close([client.values[n] for n in cluster.names], center, cluster.names)
        client.close()
    for _, telemetry in trainers:
        pushes, _ = telemetry.drain()
        assert len(pushes) == 2 * ROUNDS and all(p.accepted and p.local_steps == H for p in pushes)


def test_a_round_ends_early_when_the_last_data_is_in_flight_elsewhere(cluster: Cluster) -> None:
    """The chief has no task left to hand out (the rest is held by workers that wait for this one's
    tasks to be done): the round pushes the local steps it took instead of waiting for a batch that
    would never come, and reports its data task done."""
    rule = local_rule("average")
    client = cluster.client(0, UpdateRuleConfig(rule.outer.shard_optimizer()))
    tasks = [cpb.TaskReply(has_task=True, task_id=7, epoch=0, start=0, stop=3 * 32)]  # 3 batches < H
    source = TaskBatches(lambda: tasks.pop() if tasks else cpb.TaskReply(has_task=False), cluster.x, cluster.y,
                         32, seed=1, poll_s=0.01)
    stop = threading.Event()
    telemetry = Telemetry()
    trainer = Trainer(client, cluster.names, cluster.grad_fn, source, StepDelay(NoDelay()), telemetry,
                      on_step=lambda step: stop.set(), local=LocalModel(rule, cluster.names))
    trainer.run(stop)

    pushes, steps = telemetry.drain()
    assert [p.local_steps for p in pushes] == [3, 3] and [s.examples for s in steps] == [3 * 32]
    assert telemetry.drain_tasks() == [7] and client.versions == [1, 1]
    rows = epoch_order(len(cluster.x), 1, 0)[:3 * 32]
    center = [cluster.initial[n] for n in cluster.names]
    w = [v.copy() for v in center]
    for k in range(3):
        _, grads = cluster.grad_fn(w, cluster.x[rows[32 * k:32 * k + 32]], cluster.y[rows[32 * k:32 * k + 32]])
        w = [v - np.float32(LR) * np.asarray(g) for v, g in zip(w, grads, strict=True)]
    client.pull()
    assert_close([client.values[n] for n in cluster.names], w, cluster.names)
    client.close()


def test_local_sgd_flags_are_validated_and_choose_the_shards_rule() -> None:
    run = RunConfig(local_steps=4, outer="nesterov", local_optimizer="adam:lr=0.001")
    assert run.update_rule().optimizer == OptimizerConfig("nesterov", 0.7, {"momentum": 0.9})
    local = run.local_rule()
    assert local is not None and local.steps == 4 and local.optimizer == OptimizerConfig("adam", 0.001)
    plain = RunConfig(local_steps=2, optimizer="momentum", learning_rate=0.05)
    assert plain.local_rule() == LocalRule(2, OptimizerConfig("momentum", 0.05), OUTER_RULES.parse("average"))
    assert plain.update_rule().optimizer == OptimizerConfig("sgd", 1.0)
    assert RunConfig().local_rule() is None and RunConfig().update_rule().optimizer == OptimizerConfig("sgd", 0.1)
    assert RunConfig.from_json(run.to_json()) == run
    for settings, message in [
        ({"local_steps": 0}, r"local_steps \(--local-steps\) must be an integer >= 1"),
        ({"outer": "easgd"}, "--local-optimizer and --outer apply to local SGD only"),
        ({"local_steps": 2, "outer": "mean"}, "--outer: unknown outer rule 'mean'"),
        ({"local_steps": 2, "outer": "easgd:alpha=1.5"}, r"alpha must be in \(0, 1\]"),
        ({"local_steps": 2, "local_optimizer": "adam"}, "--local-optimizer: .*lr=FLOAT is required"),
        ({"local_steps": 2, "pipeline": True}, "leave --pipeline off"),
    ]:
        with pytest.raises(ValueError, match=message):
            RunConfig(**settings)  # type: ignore[arg-type]
