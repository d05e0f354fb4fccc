"""Child-process entry points for the TensorFlow contenders of the bench's sparse section (benchmarks.sparse).

Run as a script (``python benchmarks/_tf_sparse_child.py ROLE JSON``) for the reasons benchmarks/_tf_child.py
gives (fresh thread pools and allocator settings, no remote eager context leaking into the caller). The model is
asyncps' ``recsys`` (int64 ids -> one shared id table -> Flatten -> Dense(64, relu) -> Dense(2)) on the
``recsys:rows=R`` data, trained with Adagrad:

``local``
    The plain Keras loop in one process: asyncps' own recsys model (its table in this process), a tf.function
    step with ``keras.optimizers.Adagrad``; prints ``RESULT {"values": [...], "rss_mb": peak}``.
``coordinator``
    TF's ParameterServerStrategy over the ``tf.distribute.Server`` tasks the parent started (its ``server``
    role is benchmarks/_tf_child.py's). Keras 3 variables cannot be ShardedVariables, so the model is plain TF:
    a tf.Module whose table is created under the strategy's scope with a MinSizePartitioner (one part per PS
    task for any table of 2 x 256 KB or more), its lookups (``tf.nn.embedding_lookup``) and Adagrad updates on
    the shards holding the rows, a hand-written MLP and Adagrad in TF ops (Keras' rule: accumulator from 0.1, epsilon
    1e-7). Prints ``RESULT {"values": [...], "rss_mb": peak}`` with aggregate steps/s per repetition.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run as a script: the checkout's root goes last on the path, so `benchmarks` imports from it while asyncps stays
# the installed package (the checkout never shadows it).
sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks._tf_child import (
    IN_FLIGHT_PER_WORKER,
    WARMUP_SECONDS,
    _configure_threads,
    _timed_repeats,
)

EMBEDDING_DIM = 32
HIDDEN = 64
CLASSES = 2
INITIAL_ACCUMULATOR = 0.1  # keras.optimizers.Adagrad's
EPSILON = 1e-7


def peak_rss_mb() -> float:
    """This process' peak resident set (VmHWM), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _recsys_data(rows: int) -> tuple[Any, Any]:
    """The training ids and labels of asyncps' ``recsys:rows=R`` dataset (seed 0)."""
    from asyncps.ml.datasets import load_dataset

    data = load_dataset(f"recsys:rows={rows}", 0)
    return data.x_train, data.y_train


def _batches(rows: int, batch: int) -> Any:
    """An endless shuffled tf.data pipeline of (ids, labels) batches of the recsys data."""
    import tensorflow as tf

    x, y = _recsys_data(rows)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat()
    return data.batch(batch, drop_remainder=True).prefetch(2)


def run_local(rows: int, batch: int, learning_rate: float, repeats: int, seconds: float, warmup_steps: int,
              intra_op: int, inter_op: int) -> dict[str, Any]:
    """The plain Keras loop on asyncps' recsys model; steps/s per repetition and this process' peak RSS."""
    _configure_threads(intra_op, inter_op)
    import keras
    import tensorflow as tf

    from asyncps.ml.models import build_model

    x, _ = _recsys_data(rows)
    model = build_model("recsys", x.shape[1], CLASSES, seed=0, id_rows=rows)
    optimizer = keras.optimizers.Adagrad(learning_rate=learning_rate)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function  # type: ignore[untyped-decorator]
    def step(ids: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(ids, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    batches = iter(_batches(rows, batch))
    return {"values": _loop(lambda: step(*next(batches)), repeats, seconds, warmup_steps), "rss_mb": peak_rss_mb()}


def _loop(step: Callable[[], Any], repeats: int, seconds: float, warmup_steps: int) -> list[float]:
    """Warm up, then steps/s of `step` over `repeats` windows of `seconds`."""

    def run_for(duration: float) -> tuple[int, float]:
        steps, loss = 0, None
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            loss = step()
            steps += 1
        if loss is not None:
            float(loss)  # the last step has really finished
        return steps, time.perf_counter() - start

    for _ in range(warmup_steps):
        step()
    run_for(WARMUP_SECONDS)
    return _timed_repeats(run_for, repeats, seconds)


def _uniform(limit: float, seed: int) -> Callable[..., Any]:
    """A variable initializer, uniform in (-limit, limit), that makes only its part of a partitioned variable."""
    import tensorflow as tf

    def init(shape: Sequence[int], partition_shape: Sequence[int] | None = None,
             partition_offset: Sequence[int] | None = None) -> Any:
        part = partition_shape or shape
        return tf.random.stateless_uniform(part, seed=(seed, (partition_offset or (0,))[0]), minval=-limit,
                                           maxval=limit)

    return init


def _ps_model(strategy: Any, rows: int, features: int) -> Any:
    """The recsys model as a tf.Module under `strategy`: a table (and its Adagrad accumulator) in parts over the
    shards (the strategy's partitioner), the dense layers whole."""
    import functools

    import tensorflow as tf

    def variable(name: str, shape: tuple[int, ...], init: Callable[..., Any]) -> Any:
        return tf.Variable(functools.partial(init, shape), shape=shape, dtype=tf.float32, name=name)

    def ones(shape: Sequence[int], partition_shape: Sequence[int] | None = None,
             partition_offset: Sequence[int] | None = None) -> Any:
        return tf.fill(partition_shape or shape, INITIAL_ACCUMULATOR)

    zeros = functools.partial(_uniform, 0.0)
    module = tf.Module(name="recsys")
    with strategy.scope():
        module.table = variable("table", (rows, EMBEDDING_DIM), _uniform(0.05, 1))
        module.table_acc = variable("table_acc", (rows, EMBEDDING_DIM), ones)
    dense_shapes = {"w1": (features * EMBEDDING_DIM, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, CLASSES),
                    "b2": (CLASSES,)}
    with strategy.scope():  # the dense parts are small: whole variables, round-robin over the PS tasks
        module.dense = [variable(n, s, _uniform((6.0 / sum(s)) ** 0.5, 2 + i) if n[0] == "w" else zeros(i))
                        for i, (n, s) in enumerate(dense_shapes.items())]
        module.dense_acc = [variable(n + "_acc", s, ones) for n, s in dense_shapes.items()]
    return module


def _parts(variable: Any) -> list[Any]:
    """The variables a (possibly partitioned) variable is made of."""
    return list(getattr(variable, "variables", [variable]))


def _ps_train_step(module: Any, learning_rate: float) -> Callable[[Any, Any], None]:
    """One step: lookups on the shards holding the rows, a hand-written MLP, Adagrad applied on the shards."""
    import tensorflow as tf

    lr = tf.constant(learning_rate)

    def adagrad_dense(var: Any, acc: Any, grad: Any) -> None:
        acc.assign_add(tf.square(grad))
        var.assign_sub(lr * grad / (tf.sqrt(acc) + EPSILON))

    def adagrad_rows(part: Any, acc: Any, grad: Any) -> None:
        unique, position = tf.unique(grad.indices)
        summed = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
        acc.scatter_add(tf.IndexedSlices(tf.square(summed), unique))
        step = lr * summed / (tf.sqrt(tf.gather(acc, unique)) + EPSILON)
        part.scatter_sub(tf.IndexedSlices(step, unique))

    variables = [_parts(v) for v in (module.table, *module.dense)]
    accumulators = [_parts(a) for a in (module.table_acc, *module.dense_acc)]

    def train_step(ids: Any, labels: Any) -> None:
        with tf.GradientTape() as tape:
            embedded = tf.nn.embedding_lookup(module.table, ids)  # each part's gather runs on its shard
            flat = tf.reshape(embedded, [tf.shape(ids)[0], -1])
            w1, b1, w2, b2 = module.dense
            logits = tf.matmul(tf.nn.relu(tf.matmul(flat, w1) + b1), w2) + b2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        parts = [p for v in variables for p in v]
        grads = tape.gradient(loss, parts)  # a ShardedVariable has no handle: its parts are the sources
        for part, acc, grad in zip(parts, [a for v in accumulators for a in v], grads, strict=True):
            if isinstance(grad, tf.IndexedSlices):
                adagrad_rows(part, acc, grad)
            else:
                adagrad_dense(part, acc, grad)

    return train_step


def run_coordinator(cluster: dict[str, list[str]], rows: int, batch: int, learning_rate: float, repeats: int,
                    seconds: float, warmup_steps: int, intra_op: int, inter_op: int) -> dict[str, Any]:
    """Drive ParameterServerStrategy training of the plain-TF recsys model; aggregate steps/s per repetition."""
    _configure_threads(intra_op, inter_op)
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(cluster), rpc_layer="grpc")
    num_ps = len(cluster["ps"])
    # parts of at least 256 KB, at most one per shard: the table is split over every shard, the dense layers
    # (64 KB at most) stay whole
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(256 << 10, max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    features = _recsys_data(rows)[0].shape[1]
    module = _ps_model(strategy, rows, features)
    train_step = _ps_train_step(module, learning_rate)
    per_worker = iter(coordinator.create_per_worker_dataset(lambda: _batches(rows, batch)))

    @tf.function  # type: ignore[untyped-decorator]
    def worker_fn(iterator: Any) -> None:
        ids, labels = next(iterator)
        strategy.run(train_step, args=(ids, labels))

    max_in_flight = IN_FLIGHT_PER_WORKER * len(cluster["worker"])
    for _ in range(warmup_steps):
        coordinator.schedule(worker_fn, args=(per_worker,))
    coordinator.join()

    def run_for(duration: float) -> tuple[int, float]:
        in_flight: deque[Any] = deque()
        steps = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            if len(in_flight) >= max_in_flight:
                in_flight.popleft().fetch()
            in_flight.append(coordinator.schedule(worker_fn, args=(per_worker,)))
            steps += 1
        coordinator.join()
        return steps, time.perf_counter() - start

    run_for(WARMUP_SECONDS)
    return {"values": _timed_repeats(run_for, repeats, seconds), "rss_mb": peak_rss_mb()}


def main(argv: Sequence[str]) -> int:
    """Dispatch ``ROLE JSON`` from the command line; see the module docstring."""
    role, kwargs = argv[0], json.loads(argv[1])
    runners: dict[str, Callable[..., dict[str, Any]]] = {"local": run_local, "coordinator": run_coordinator}
    result = runners[role](**kwargs)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip interpreter teardown, as benchmarks/_tf_child.py does


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
