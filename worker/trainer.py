"""The worker's training loop: pull -> gradients (TensorFlow) -> push with base versions."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from asyncps.worker.local import LocalModel

from asyncps.delays import StepDelay
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rules.drops import DropReason
from asyncps.transport import ModelClient, ShardPush
from asyncps.transport.rowcache import RowCacheCounts
from asyncps.wire.codec import (
    Array,
    Gradient,
    IndexArray,
    SparseRows,
    aligned_zeros,
    all_finite,
    coalesce_rows,
    is_aligned,
)
from asyncps.wire.proto import push_record
from asyncps.wire.shard import PushOutcome

if TYPE_CHECKING:
    from asyncps.ml.sparse import SparseModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """One minibatch; `completes` names the data task this batch finishes, if any."""

    x: Array
    y: Array
    completes: int | None = None
    w: Array | None = None  # per-example loss weights (sample_weight, class_weight), None: all 1


class BatchStream:
    """Endless minibatches from one worker's data shard, reshuffled (seeded) every pass."""

    def __init__(self, x: Array, y: Array, batch_size: int, seed: int) -> None:
        if len(x) == 0:
            raise ValueError("this worker's data shard is empty")
        self._x, self._y = x, y
        self._batch = batch_size
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(x))
        self._pos = 0

    def next(self) -> tuple[Array, Array]:
        """The next batch of exactly batch_size examples (wrapping into the next pass)."""
        picks = []
        need = self._batch
        while need:
            take = self._order[self._pos:self._pos + need]
            picks.append(take)
            need -= len(take)
            self._pos += len(take)
            if self._pos >= len(self._order):
                self._order = self._rng.permutation(len(self._x))
                self._pos = 0
        idx = np.concatenate(picks) if len(picks) > 1 else picks[0]
        return self._x[idx], self._y[idx]

    def next_batch(self, stop: threading.Event, wait: bool = True) -> Batch | None:
        """The BatchSource interface: a static shard never runs out."""
        x, y = self.next()
        return Batch(x, y)


class TaskBatches:
    """Minibatches from data tasks handed out by the chief (exactly-once data accounting).

    A task is a range of an epoch's seeded permutation of the whole training set; its last batch
    carries the task id so the trainer reports the task done only after pushing that batch.
    """

    def __init__(self, get_task: Callable[[], cpb.TaskReply], x: Array, y: Array, batch_size: int,
                 seed: int, poll_s: float = 0.1, w: Array | None = None) -> None:
        from asyncps.ml.datasets import epoch_order

        self._get_task = get_task
        self._x, self._y, self._w = x, y, w
        self._batch = batch_size
        self._seed = seed
        self._poll_s = poll_s
        self._order_of = epoch_order
        self._orders: dict[int, Array] = {}
        self._queue: list[tuple[Array, int | None]] = []

    def _order(self, epoch: int) -> Array:
        if epoch not in self._orders:
            self._orders = {epoch: self._order_of(len(self._x), self._seed, epoch)}  # keep one epoch
        return self._orders[epoch]

    def next_batch(self, stop: threading.Event, wait: bool = True) -> Batch | None:
        """The next batch, fetching a task when the current one is used up; None when stopping (or,
        unless `wait`, when no task is to be had now)."""
        while not self._queue:
            if stop.is_set():
                return None
            reply = self._get_task()
            if not reply.has_task:
                if not wait:
                    return None
                stop.wait(self._poll_s)  # all remaining tasks are in flight elsewhere (or done)
                continue
            positions = self._order(reply.epoch)[reply.start:reply.stop]
            pieces = [positions[i:i + self._batch] for i in range(0, len(positions), self._batch)]
            self._queue = [(p, reply.task_id if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
        rows, completes = self._queue.pop(0)
        return Batch(self._x[rows], self._y[rows], completes, None if self._w is None else self._w[rows])


def nonfinite_detail(loss: float, names: Sequence[str], grads: Sequence[Gradient]) -> str | None:
    """What is not finite in one step (its loss, the first variable whose gradient holds NaN/Inf), or
    None when everything is: the worker's check_numerics before a push."""
    bad = next((name for name, g in zip(names, grads, strict=True)
                if not all_finite(g.values if isinstance(g, SparseRows) else g)), None)
    if bad is None and math.isfinite(loss):
        return None
    return f"loss {loss:g}; " + (f"first non-finite gradient: {bad}" if bad else "every gradient finite")


class BatchSource(Protocol):
    """Where a trainer's minibatches come from."""

    def next_batch(self, stop: threading.Event, wait: bool = True) -> Batch | None:
        """The next batch, or None when the trainer should stop (or, unless `wait`, when none is to be
        had now: the remaining data is in flight elsewhere)."""


class _Prepended:
    """A batch source that yields `first`, then the rest of `source`."""

    def __init__(self, first: Batch, source: BatchSource) -> None:
        self._first: Batch | None = first
        self._source = source

    def next_batch(self, stop: threading.Event, wait: bool = True) -> Batch | None:
        """`first` once, then the source's batches."""
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        return self._source.next_batch(stop, wait)


class GradFn(Protocol):
    """(loss, gradients) of a model at `values` on one batch; `fed`: the values of the non-trainable
    variables make_grad_fn was told to take per call (a local table's row ids), in its order."""

    def __call__(self, values: list[Array], x: Array, y: Array, fed: Sequence[Array] = (),
                 w: Array | None = None) -> tuple[float, list[Gradient]]:
        """(loss, gradients); `w`: the examples' loss weights (None: unweighted)."""


def shared_input(value: Array) -> Any:
    """`value` as a TensorFlow tensor sharing its memory (DLPack) when it is writable and aligned, else
    `value` itself (TensorFlow copies it when it enters a computation)."""
    if not (value.flags.writeable and is_aligned(value)):  # DLPack refuses read-only arrays
        return value
    import tensorflow as tf

    try:
        return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
    except (BufferError, TypeError, ValueError):  # a dtype or layout DLPack cannot carry
        return value


@dataclass(frozen=True)
class Clip:
    """Gradient clipping before a push, as Keras' optimizer options (0: off; RunConfig allows one): each
    variable's gradient to an L2 norm (`norm`), all of a step's jointly (`global_norm`), or every element to
    [-value, value]."""

    norm: float = 0.0
    global_norm: float = 0.0
    value: float = 0.0

    def apply(self, grads: list[Any]) -> list[Any]:
        """The clipped gradients (TensorFlow ops, inside the step's function; IndexedSlices kept sparse)."""
        import tensorflow as tf

        def rows_once(g: Any) -> Any:  # a gather's gradient names a row once per lookup: sum them first, so
            if not isinstance(g, tf.IndexedSlices):  # norms and element bounds are the whole gradient's
                return g
            rows, at = tf.unique(g.indices)
            return tf.IndexedSlices(tf.math.unsorted_segment_sum(g.values, at, tf.size(rows)), rows, g.dense_shape)

        grads = [rows_once(g) for g in grads]
        if self.norm:
            grads = [tf.clip_by_norm(g, self.norm) for g in grads]
        if self.global_norm:
            grads = list(tf.clip_by_global_norm(grads, self.global_norm)[0])
        if self.value:
            grads = [tf.IndexedSlices(tf.clip_by_value(g.values, -self.value, self.value), g.indices, g.dense_shape)
                     if isinstance(g, tf.IndexedSlices) else tf.clip_by_value(g, -self.value, self.value)
                     for g in grads]
        return grads


def make_grad_fn(model: Any, loss_fn: Callable[..., Any], fed: Sequence[Any] = (), clip: Clip = Clip()) -> GradFn:
    """A tf.function that computes (loss, gradients) of the model at the given values.

    The pulled values go straight into the computation through Keras' stateless call: no
    variable is assigned, so a step costs no copy into TensorFlow variables beyond turning the
    pulled buffers into tensors (measured: assigning 2.7 MB of weights before the gradient added
    1.2 ms to a 3.6 ms step). Models with non-trainable state (e.g. BatchNormalization
    statistics) keep it in their own variables, updated from the stateless call's result.
    IndexedSlices gradients (embeddings) come back as SparseRows, one row per touched row.

    No copy on either side where it can be avoided: an aligned, writable buffer (ModelClient's are)
    enters the computation through DLPack, sharing its memory (converting a numpy array copies it:
    3.2 ms against 0.55 ms for a 16 MB tensor, measured); the gradients leave as read-only numpy views
    of TensorFlow's results (`.numpy()` copies them again). Sharing is safe because a worker never
    writes its values while it computes from them (the exchange follows the gradient; a pipelined
    worker computes from a private copy).

    `fed`: non-trainable variables whose values each call passes (`run(..., fed=[...])`; their current
    values when it passes none) and that are never assigned: the row ids of a local table
    (asyncps.ml.sparse), so that threads sharing the model (logical workers) each compute from their own.

    State the shards hold (asyncps.ml.models.state_variables: BatchNormalization's moving statistics)
    comes after the trainable values in `values` (the order of shard_variables), and its "gradient" is
    its delta: the value the training-mode call leaves minus the value read, which the shard adds. It is
    never clipped, and never assigned here (the next pull brings it). Random generators' state stays in
    the model's variables, advanced each call.
    """
    import tensorflow as tf

    from asyncps.ml.models import state_variables

    non_trainable = list(model.non_trainable_variables)
    fed_vars = list(fed)
    fed_paths = [v.path for v in fed_vars]
    position = {path: i for i, path in enumerate(fed_paths)}
    trainable = len(model.trainable_variables)
    held = {v.path: i for i, v in enumerate(state_variables(model, fed_vars))}

    @tf.function(reduce_retracing=True)  # type: ignore[untyped-decorator]
    def step(values: list[Any], fed_values: list[Any], x: Any, y: Any, w: Any) -> tuple[Any, list[Any]]:
        weights, read = values[:trainable], values[trainable:]
        state = [fed_values[position[v.path]] if v.path in position else read[held[v.path]] if v.path in held
                 else v.value for v in non_trainable]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            logits, new_state = model.stateless_call(weights, state, x, training=True)
            loss = loss_fn(logits, y) if w is None else loss_fn(logits, y, w)
        deltas: list[Any] = [None] * len(held)
        for var, value in zip(non_trainable, new_state, strict=True):
            if var.path in held:
                deltas[held[var.path]] = tf.cast(value, read[held[var.path]].dtype) - read[held[var.path]]
            elif var.path not in position:
                var.assign(value)
        grads = tape.gradient(loss, weights)
        return loss, [*(clip.apply(grads) if clip != Clip() else grads), *deltas]

    # One concrete function per kind of batch (dtypes and trailing shapes; any batch size): calling it
    # skips the polymorphic function's per-call signature matching (measured: 0.38 -> 0.16 ms a call).
    concrete: dict[tuple[Any, ...], Any] = {}

    def run(values: list[Array], x: Array, y: Array, fed: Sequence[Array] = (),
            w: Array | None = None) -> tuple[float, list[Gradient]]:
        x, y = np.asarray(x), np.asarray(y)
        given = list(fed) or [np.asarray(v.value) for v in fed_vars]
        key = (x.dtype, x.shape[1:], y.dtype, y.shape[1:], w is None, *(v.shape for v in values))
        fn = concrete.get(key)
        if fn is None:
            fn = concrete[key] = step.get_concrete_function(
                [tf.TensorSpec(v.shape, v.dtype) for v in values], [tf.TensorSpec(v.shape, v.dtype) for v in given],
                tf.TensorSpec((None, *x.shape[1:]), x.dtype), tf.TensorSpec((None, *y.shape[1:]), y.dtype),
                None if w is None else tf.TensorSpec((None,), tf.float32))
        weights = None if w is None else np.asarray(w, dtype=np.float32)  # None: traced as a constant
        loss, grads = fn([shared_input(v) for v in values], given, x, y, weights)
        out: list[Gradient] = []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                out.append(coalesce_rows(np.asarray(g.indices), np.asarray(g.values)))
            else:
                out.append(np.asarray(g))
        return float(loss), out

    return run


@dataclass
class Telemetry:
    """Push records and step timings waiting to be reported to the chief (thread-safe)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pushes: list[cpb.PushRecord] = field(default_factory=list)
    steps: list[cpb.StepTiming] = field(default_factory=list)
    completed_tasks: list[int] = field(default_factory=list)

    def add(self, pushes: list[cpb.PushRecord], step: cpb.StepTiming, completed_tasks: Sequence[int] = ()) -> None:
        """Queue one step's records (and the data tasks it finished)."""
        with self.lock:
            self.pushes.extend(pushes)
            self.steps.append(step)
            self.completed_tasks.extend(completed_tasks)

    def drain(self) -> tuple[list[cpb.PushRecord], list[cpb.StepTiming]]:
        """Take the push records and step timings queued so far."""
        with self.lock:
            pushes, steps = self.pushes, self.steps
            self.pushes, self.steps = [], []
            return pushes, steps

    def drain_tasks(self) -> list[int]:
        """Take the data tasks completed since the last call."""
        with self.lock:
            tasks, self.completed_tasks = self.completed_tasks, []
            return tasks


class Trainer:
    """Runs steps until told to stop."""

    def __init__(
        self,
        client: ModelClient,
        variable_names: list[str],
        grad_fn: GradFn,
        batches: BatchSource,
        delay: StepDelay,
        telemetry: Telemetry,
        sleep: Callable[[float], None] = time.sleep,
        read_wait_s: float = 30.0,
        on_step: Callable[[int], None] | None = None,
        pipeline: bool = False,
        local: LocalModel | None = None,
        sparse: SparseModel | None = None,
    ) -> None:
        self._client = client
        self._names = variable_names
        self._grad_fn = grad_fn
        self._batches = batches
        self._delay = delay
        self._telemetry = telemetry
        self._sleep = sleep
        self._read_wait_s = read_wait_s
        self._on_step = on_step
        self._pipeline = pipeline
        if local is not None and pipeline:
            raise ValueError("a pipelined trainer pushes every gradient: no local steps")
        self._local = local
        if sparse is not None and (pipeline or local is not None):
            raise ValueError("tables read by rows need a step's rows before its gradient: no pipeline, no local SGD")
        self._sparse = sparse
        self._stop = threading.Event()
        self._peeked: Batch | None = None  # the next batch, taken early to ask its rows with this step's push
        self.step = 0
        self.examples = 0
        self.nonfinite_steps = 0  # skipped (or refused by a shard) for a NaN/Inf loss or gradient
        self._nonfinite_streak = 0
        self._cache_counted = RowCacheCounts()  # the row cache's counts already in a step's timing

    def run(self, stop: threading.Event, max_steps: int = 0, pulled: bool = False) -> None:
        """Pull once (unless the caller just did: `pulled`), then loop: compute gradients,
        push-and-pull, until stop (or max_steps)."""
        self._stop = stop
        t0 = time.time()
        if not pulled:
            self._client.pull()
        pull_s = time.time() - t0
        first = self._batches.next_batch(stop)
        if first is None:
            return
        # Trace the gradient function once, untimed: injected delays scale the measured compute
        # time, and a 40x straggler must not sleep 40 times TensorFlow's tracing.
        self._grad_fn(self._values_for(first), first.x, first.y, w=first.w)
        self._batches = _Prepended(first, self._batches)
        if self._pipeline:
            self._run_pipelined(stop, max_steps, pull_s)
            return
        while not stop.is_set() and (max_steps == 0 or self.step < max_steps):
            if self._local is not None:
                if not self.run_round(self._local, stop, pull_s):
                    return
                pull_s = 0.0
                continue
            batch = self._next_batch(stop)
            if batch is None:
                return
            pull_s = self.run_step(batch, pull_s)

    def _compute(self, batch: Batch, values: list[Array], then_push: bool = True, fed: Sequence[Array] = ()
                 ) -> tuple[float, list[Gradient], float, float]:
        """Gradients of one batch at `values` (`fed`: the local tables' row ids; with the injected delays;
        the round trip's latency when `then_push`); (loss, grads, start, computed)."""
        start = time.time()
        loss, grads = self._grad_fn(values, batch.x, batch.y, fed, batch.w)
        extra = self._delay.extra_compute_s(time.time() - start)
        if extra > 0:
            self._sleep(extra)
        computed = time.time()
        if then_push and self._delay.rpc_latency_s > 0:
            self._sleep(self._delay.rpc_latency_s)
        return loss, grads, start, computed

    def run_round(self, local: LocalModel, stop: threading.Event, pull_s: float = 0.0) -> bool:
        """One round of local SGD: H steps of the local optimizer from the pulled center, then push the
        change of the local model, w_pulled - w_local, with the versions of w_pulled. A round ends early,
        pushing the local steps it took, when no batch is to be had now: the last data of a run is in
        flight with other workers, which may in turn wait for this worker's tasks to be done (pushed).
        False when told to stop first (the unfinished round is not pushed, its data tasks not reported)."""
        if not local.values:
            local.start(self._client.values)
        base = list(self._client.versions)
        batches: list[Batch] = []
        losses: list[float] = []
        start = time.time()
        computed = start
        for k in range(local.steps_per_push):
            batch = self._batches.next_batch(stop, wait=k == 0)
            if batch is None and k > 0 and not stop.is_set():
                break
            if batch is None:
                return False
            loss, grads, started, computed = self._compute(batch, local.values, then_push=False)
            start = started if k == 0 else start
            local.step(grads)
            batches.append(batch)
            losses.append(loss)
        if self._delay.rpc_latency_s > 0:
            self._sleep(self._delay.rpc_latency_s)
        delta = local.delta(self._client.values)
        pushed = self._exchange(batches, float(np.mean(losses)), delta, base, None, start, computed, pull_s)
        local.follow(self._client.values, delta if pushed else None)
        return True

    def _exchange(self, batches: Batch | list[Batch], loss: float, grads: list[Gradient], base: list[int],
                  incarnations: list[int] | None, start: float, computed: float, pull_s: float,
                  rows: dict[str, IndexArray] | None = None) -> bool:
        """Push one step's gradient (or a round's model change) computed from `base` and receive the new
        values; record it (one push per shard, carrying len(batches) local steps). A step with a
        non-finite loss or gradient is not pushed: every shard's record says it was dropped (False)."""
        batches = batches if isinstance(batches, list) else [batches]
        detail = nonfinite_detail(loss, self._names, grads)
        sent = list(self._client.incarnations if incarnations is None else incarnations)  # before the reply
        if detail is None:
            results = self._client.push_pull(dict(zip(self._names, grads, strict=True)), self.step, loss,
                                              self._read_wait_s, base, incarnations, rows)
        else:
            results = [ShardPush(s, PushOutcome(False, 0, base[s], 0.0, DropReason.NONFINITE, detail), base[s])
                       for s in range(len(base))]
        done = time.time()
        waited = max((r.waited_s for r in results), default=0.0)
        self.step += 1
        self._count_nonfinite(results)
        examples = sum(len(b.x) for b in batches)
        self.examples += examples
        records = [
            push_record(r.outcome, done, r.shard, base[r.shard], loss, self.step, len(batches), sent[r.shard])
            for r in results if r.outcome is not None
        ]
        cache = self._cache_counts()
        timing = cpb.StepTiming(step=self.step, start=start, pull_s=pull_s, compute_s=computed - start,
                                push_s=done - computed - waited, wait_s=waited, examples=examples, rows=cache.rows,
                                rows_cached=cache.hits, row_bytes_saved=cache.bytes_saved)
        self._telemetry.add(records, timing, [b.completes for b in batches if b.completes is not None])
        if self._on_step is not None:
            self._on_step(self.step)
        return detail is None

    def _cache_counts(self) -> RowCacheCounts:
        """The row cache's counts since the last step's (zeros without a cache)."""
        cache = self._client.row_cache
        if cache is None:
            return RowCacheCounts()
        now = dataclasses.replace(cache.counts)
        since, self._cache_counted = now.minus(self._cache_counted), now
        return since

    def _count_nonfinite(self, results: Sequence[ShardPush]) -> None:
        """Count and log a step skipped (or refused by a shard) for a NaN/Inf: its step and what was not finite."""
        refused = [r for r in results if r.outcome is not None and r.outcome.drop is DropReason.NONFINITE]
        if not refused:
            self._nonfinite_streak = 0
            return
        self.nonfinite_steps += 1
        self._nonfinite_streak += 1
        streak = self._nonfinite_streak
        if streak <= 3 or streak % 100 == 0:  # the start of a streak, then now and then: not every step
            log.warning("step %d not applied: non-finite (%s); %d such step(s) in a row, %d in all", self.step,
                        refused[0].outcome.detail if refused[0].outcome else "", streak, self.nonfinite_steps)

    def _next_batch(self, stop: threading.Event) -> Batch | None:
        """The batch taken early, else the source's next."""
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        return self._batches.next_batch(stop)

    def _values_for(self, batch: Batch) -> list[Array]:
        """The values a gradient is computed from: the model's buffers (tables read by rows: whatever
        their local tables hold, for tracing)."""
        if self._sparse is None:
            return [self._client.values[n] for n in self._names]
        return [self._client.values[n] if n in self._client.values else np.asarray(v.value)
                for n, v in zip(self._names, self._sparse.model.trainable_variables, strict=True)]

    def run_step(self, batch: Batch, pull_s: float = 0.0) -> float:
        """One step: gradients at the current values, then push them with their base versions."""
        if self._sparse is not None:
            return self._run_rows_step(self._sparse, batch, pull_s)
        values = [self._client.values[n] for n in self._names]
        loss, grads, start, computed = self._compute(batch, values)
        self._exchange(batch, loss, grads, list(self._client.versions), None, start, computed, pull_s)
        return 0.0

    def _run_rows_step(self, sparse: SparseModel, batch: Batch, pull_s: float) -> float:
        """One step of a model whose tables are read by rows: the batch's rows (asked with the previous
        push, else pulled now with the newer dense values), the gradient on the local tables, pushed as
        rows of the whole tables with the clocks they were read at, and the next batch's rows asked with it."""
        ids = sparse.batch_ids(batch.x)
        rows = self._client.rows
        if set(rows) != set(ids) or any(not np.array_equal(rows[n].indices, i) for n, i in ids.items()):
            started = time.time()
            self._client.pull(only_if_newer=True, rows=ids)
            pull_s += time.time() - started
        local = sparse.step(self._client.rows)
        values = [local.tables[n] if n in local.tables else self._client.values[n] for n in self._names]
        loss, grads, start, computed = self._compute(batch, values, fed=local.fed)
        grads = [local.whole(n, g) for n, g in zip(self._names, grads, strict=True)]
        self._peeked = self._batches.next_batch(self._stop, wait=False)
        following = sparse.batch_ids(self._peeked.x) if self._peeked is not None else None
        self._exchange(batch, loss, grads, list(self._client.versions), None, start, computed, pull_s, following)
        return 0.0

    def _run_pipelined(self, stop: threading.Event, max_steps: int, pull_s: float) -> None:
        """Compute step k on a private copy of the values while step k-1's push-pull is in flight.

        The copy is taken between two exchanges (nothing is being received then), so a gradient is
        computed from one consistent set of values, pushed with exactly their versions, and the
        extra step of staleness shows in what the shards measure.
        """
        private = {n: aligned_zeros(v.shape, v.dtype) for n, v in self._client.values.items()}

        def snapshot() -> tuple[list[int], list[int]]:
            for name, value in self._client.values.items():
                np.copyto(private[name], value)
            return list(self._client.versions), list(self._client.incarnations)

        values = [private[n] for n in self._names]
        base, incarnations = snapshot()
        inflight: concurrent.futures.Future[bool] | None = None
        submitted = self.step
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="exchange") as pool:
            try:
                while not stop.is_set() and (max_steps == 0 or submitted < max_steps):
                    batch = self._batches.next_batch(stop)
                    if batch is None:
                        break
                    loss, grads, start, computed = self._compute(batch, values)
                    if inflight is not None:
                        inflight.result()
                    pushed_base, pushed_incarnations = base, incarnations
                    base, incarnations = snapshot()
                    inflight = pool.submit(self._exchange, batch, loss, grads, pushed_base, pushed_incarnations,
                                           start, computed, pull_s)
                    submitted += 1
                    pull_s = 0.0
            finally:
                if inflight is not None:
                    inflight.result()
