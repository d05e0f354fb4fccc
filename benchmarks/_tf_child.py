"""Child-process entry points for the TensorFlow baselines in :mod:`benchmarks.baselines`.

This file is executed as a *script* (``python benchmarks/_tf_child.py ROLE JSON``), never
imported by the parent, so that every TensorFlow process starts fresh: thread-pool sizes and
the glibc ``MALLOC_*`` tunables are fixed at process start, and ParameterServerStrategy
installs a process-global remote eager context that should not leak into the caller.

Roles (``JSON`` is one object of keyword arguments):

``local``
    Plain single-process Keras training loop; prints ``RESULT {"values": [...]}``.
``server``
    A ``tf.distribute.Server`` for one ``ps``/``worker`` task; prints ``READY`` once it
    listens, then serves until killed or until its parent process is gone.
``coordinator``
    The ParameterServerStrategy coordinator (TF's "chief"): builds the model under the
    strategy, schedules training steps on the workers through ``ClusterCoordinator`` and
    prints ``RESULT {"values": [...]}`` with aggregate steps/s per repetition.

The child never decides thread counts on its own: the parent passes ``intra_op`` /
``inter_op`` (0 means TensorFlow's default).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

NUM_FEATURES = 784
NUM_CLASSES = 10
LEARNING_RATE = 0.01
#: Scheduled-but-unfinished PS steps allowed per worker (see ``run_coordinator``).
IN_FLIGHT_PER_WORKER = 4
#: After the fixed warm-up steps (tracing, first RPCs) keep stepping this long untimed, so
#: allocator/page-cache/CPU-frequency effects of the first second do not hit repetition 1.
WARMUP_SECONDS = 1.0


def _configure_threads(intra_op: int, inter_op: int) -> None:
    """Fix TensorFlow's thread pools for this (fresh) process; 0 keeps TF's default."""
    import tensorflow as tf

    if intra_op > 0:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
    if inter_op > 0:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def _build_model(hidden: Sequence[int]) -> Any:
    """Return the benchmark MLP ``784 -> hidden... -> 10`` (ReLU, logits out)."""
    import keras

    layers: list[Any] = [keras.Input((NUM_FEATURES,))]
    layers += [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers.append(keras.layers.Dense(NUM_CLASSES))
    return keras.Sequential(layers)


def _synthetic_batch(batch: int, seed: int = 0) -> tuple[Any, Any]:
    """Return one fixed random batch ``(x: float32[batch, 784], y: int32[batch])``."""
    import tensorflow as tf

    x = tf.random.stateless_normal((batch, NUM_FEATURES), seed=(seed, 1))
    y = tf.random.stateless_uniform(
        (batch,), seed=(seed, 2), minval=0, maxval=NUM_CLASSES, dtype=tf.int32
    )
    return x, y


def _make_train_step(model: Any, optimizer: Any) -> Callable[[Any, Any], Any]:
    """Return the (un-decorated) SGD step: forward, GradientTape backward, apply."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum_over_batch_size"
    )

    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def _timed_repeats(run_for: Callable[[float], tuple[int, float]], repeats: int,
                   seconds: float) -> list[float]:
    """Call ``run_for(seconds)`` -> (steps, elapsed) ``repeats`` times; return steps/s each."""
    values = []
    for _ in range(repeats):
        steps, elapsed = run_for(seconds)
        values.append(steps / elapsed)
    return values


def run_local(hidden: list[int], batch: int, repeats: int, seconds: float, warmup_steps: int,
              intra_op: int, inter_op: int) -> dict[str, Any]:
    """Plain single-process Keras loop; return ``{"values": steps/s per repetition}``."""
    _configure_threads(intra_op, inter_op)
    import keras
    import tensorflow as tf

    model = _build_model(hidden)
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    step = tf.function(_make_train_step(model, optimizer))
    x, y = _synthetic_batch(batch)

    def run_for(duration: float) -> tuple[int, float]:
        steps = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            loss = step(x, y)
            steps += 1
        if steps:
            float(loss)  # make sure the last step has really finished
        return steps, time.perf_counter() - start

    for _ in range(warmup_steps):
        step(x, y)
    run_for(WARMUP_SECONDS)
    return {"values": _timed_repeats(run_for, repeats, seconds)}


def run_server(cluster: dict[str, list[str]], job_name: str, task_index: int, intra_op: int,
               inter_op: int, parent_pid: int) -> None:
    """Start one ``tf.distribute.Server``, print ``READY``, serve until ``parent_pid`` exits.

    The parent normally kills us; watching it as well means a SIGKILLed benchmark cannot
    leave TF servers behind.
    """
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    if intra_op > 0:
        config.intra_op_parallelism_threads = intra_op
    if inter_op > 0:
        config.inter_op_parallelism_threads = inter_op
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job_name, task_index=task_index,
        protocol="grpc", config=config, start=True,
    )
    print("READY", flush=True)
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    del server
    os._exit(0)


def run_coordinator(cluster: dict[str, list[str]], hidden: list[int], batch: int, repeats: int,
                    seconds: float, warmup_steps: int, intra_op: int,
                    inter_op: int) -> dict[str, Any]:
    """Drive ParameterServerStrategy training; return ``{"values": aggregate steps/s}``.

    Variables are placed by TF's default: whole variables round-robin over the PS tasks in
    creation order, which for this MLP puts every kernel on ``ps:0`` and every bias on
    ``ps:1``. Sharding with a ``variable_partitioner`` is not an option with Keras 3: its
    variables cannot wrap a ``ShardedVariable`` (``tape.gradient`` fails with
    "'ShardedVariable' object has no attribute 'handle'").
    """
    _configure_threads(intra_op, inter_op)
    import keras
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    with strategy.scope():
        model = _build_model(hidden)
        optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
        # Create all model/optimizer variables on the PS tasks up front, not inside the
        # first scheduled function.
        model.build((None, NUM_FEATURES))
        optimizer.build(model.trainable_variables)
    train_step = _make_train_step(model, optimizer)

    def dataset_fn() -> Any:
        # Built on each worker, so no input data travels from the coordinator per step.
        return tf.data.Dataset.from_tensors(_synthetic_batch(batch)).repeat()

    per_worker_iter = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def one_step(iterator: Any) -> None:
        x, y = next(iterator)
        # Return nothing: a returned loss would cost the coordinator an extra RPC per step
        # when it waits on the step's RemoteValue.
        strategy.run(train_step, args=(x, y))

    worker_fn = tf.function(one_step)

    max_in_flight = IN_FLIGHT_PER_WORKER * len(cluster["worker"])
    for _ in range(warmup_steps):
        coordinator.schedule(worker_fn, args=(per_worker_iter,))
    coordinator.join()

    def run_for(duration: float) -> tuple[int, float]:
        # schedule() is non-blocking and its closure queue holds 256Ki entries, so keeping it
        # "fed" would just pile up minutes of backlog. Bound the steps in flight instead (a
        # few per worker keeps every worker busy), stop scheduling at the deadline and count
        # the time until every scheduled step has finished.
        in_flight: deque[Any] = deque()
        steps = 0
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            if len(in_flight) >= max_in_flight:
                in_flight.popleft().fetch()  # waits for that step; nothing to copy back
            in_flight.append(coordinator.schedule(worker_fn, args=(per_worker_iter,)))
            steps += 1
        coordinator.join()
        return steps, time.perf_counter() - start

    run_for(WARMUP_SECONDS)
    return {"values": _timed_repeats(run_for, repeats, seconds)}


def main(argv: Sequence[str]) -> int:
    """Dispatch ``ROLE JSON`` from the command line; see the module docstring."""
    role, kwargs = argv[0], json.loads(argv[1])
    if role == "server":
        run_server(**kwargs)
        return 0
    runners: dict[str, Callable[..., dict[str, Any]]] = {
        "local": run_local, "coordinator": run_coordinator,
    }
    runner = runners[role]
    result = runner(**kwargs)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    # Skip interpreter teardown: a PS coordinator can block in TF's atexit handlers while
    # the parent is already tearing the cluster down.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
