"""The one place a worker is assembled: its shard clients, its gradient function and its Trainer.

A worker process (asyncps.worker.main) and each logical worker of one (asyncps.worker.logical) build
theirs here, so a new way of training (a setting of the run that changes the Trainer, as local SGD
did) is wired once for both.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
from asyncps.worker.chieflink import ChiefLink
from asyncps.worker.local import local_model
from asyncps.worker.trainer import Clip, GradFn, TaskBatches, Telemetry, Trainer, make_grad_fn

from asyncps.config import RunConfig
from asyncps.ml.datasets import Dataset
from asyncps.ml.task import make_loss
from asyncps.net.security import SecurityConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.placement import VariableSpec, place
from asyncps.transport import ModelClient, connect_model

if TYPE_CHECKING:
    from asyncps.ml.sparse import SparseModel

#: The row cache's memory per table when --row-cache-rows is auto.
ROW_CACHE_AUTO_BYTES = 64 << 20


def connect_worker(worker_id: str, reg: cpb.RegisterResponse, model: Any, run: RunConfig,
                   security: SecurityConfig, stop: threading.Event | None = None,
                   sparse: SparseModel | None = None) -> ModelClient:
    """A worker's client to every shard, as the run says: placement, transport, its index, and for a
    sync run over several shards shard 0 deciding each step (every worker of a process or a logical one).
    Once `stop` is set (the chief said stop, or is gone) a failing shard call is not retried: shards
    that lost the chief exit too, and the worker must not wait out rpc_deadline_s for them."""
    from asyncps.ml.models import shard_variables

    specs = sparse.specs() if sparse is not None else [
        VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in shard_variables(model)]
    placement = place(specs, len(reg.ps_addresses), run.slice_threshold_bytes)
    client = connect_model(worker_id, list(reg.ps_addresses), placement, run.rpc_deadline_s, run.chunk_bytes,
                           security, transport=run.transport, worker_index=reg.index,
                           coordinated=run.update_rule().consistency().coordinated, abort=stop,
                           row_variables=[t.variable for t in sparse.tables] if sparse is not None else ())
    if sparse is not None and run.row_cache_staleness > 0:
        client.use_row_cache(run.row_cache_staleness, row_cache_rows(sparse, run.row_cache_rows))
    return client


def row_cache_rows(sparse: SparseModel, rows: int = 0) -> dict[str, int]:
    """The rows the row cache keeps per table: `rows` (0: as many as ROW_CACHE_AUTO_BYTES hold), at least
    the most distinct ids of one batch (a step's rows are never evicted), at most the table's."""
    out = {}
    for table in sparse.tables:
        row_bytes = math.prod(table.shape[1:]) * np.dtype(table.dtype).itemsize
        wanted = rows or ROW_CACHE_AUTO_BYTES // max(1, row_bytes)
        out[table.variable] = min(table.shape[0], max(table.capacity, wanted))
    return out


def run_grad_fn(run: RunConfig, model: Any, sparse: SparseModel | None = None) -> GradFn:
    """The gradient function of the run's loss for `model` (one per process: logical workers share it)."""
    return make_grad_fn(model, make_loss(run.loss, model), fed=sparse.fed if sparse is not None else (),
                        clip=Clip(run.clipnorm, run.global_clipnorm, run.clipvalue))


def build_trainer(run: RunConfig, link: ChiefLink, reg: cpb.RegisterResponse, client: ModelClient, *,
                  model: Any, data: Dataset, grad_fn: GradFn, telemetry: Telemetry,
                  steps_done: list[int], sparse: SparseModel | None = None) -> Trainer:
    """The Trainer of one worker, as the run says: its data tasks from the chief, its injected delays
    (by its index), read wait, pipelining and local SGD; each step it takes is written to steps_done[0]
    (for its heartbeats)."""
    from asyncps.ml.models import shard_variables, state_variables

    if state_variables(model, sparse.fed if sparse is not None else ()) and (
            sparse is not None or run.local_rule() is not None):
        raise ValueError("a model with non-trainable state on the shards (BatchNormalization's statistics) trains "
                         "with neither local_steps > 1 nor tables read by rows")
    names = [v.path for v in shard_variables(model)]
    batches = TaskBatches(link.get_task, data.x_train, data.y_train, run.batch_size, run.seed, w=data.w_train)
    return Trainer(client, names, grad_fn, batches, run.step_delay(reg.index), telemetry,
                   read_wait_s=run.read_wait_s, on_step=lambda step: steps_done.__setitem__(0, step),
                   pipeline=run.pipeline, local=local_model(run, names), sparse=sparse)
