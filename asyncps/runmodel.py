"""The run's dataset and Keras model, built the one way every process that needs them builds them.

The chief, every worker and `asyncps export` must get the same variables (paths, shapes and, for
a seed, values), so they all build them here from the run's settings: a user model
(`package.module:function`, imported from `--user-path`) is rebuilt by export exactly as the chief
built it. Importing this module is cheap; TensorFlow loads only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncps.config import RunConfig
    from asyncps.ml.datasets import Dataset
    from asyncps.ml.sparse import SparseModel


def build_run_model(run: RunConfig) -> tuple[Dataset, Any]:
    """The run's dataset (`run.dataset`, seeded) and its model (`run.model`) built for that data."""
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model

    data = load_dataset(run.dataset, run.seed)
    model = build_model(run.model, data.num_features, data.num_classes, data.image_shape, run.seed, data.targets,
                        id_rows=data.id_rows)
    return data, model


def build_worker_model(run: RunConfig) -> tuple[Dataset, Any, SparseModel | None]:
    """A worker's dataset and model: with `row_pull` auto, the model's Embedding tables read by rows
    (asyncps.ml.sparse: the model built without making its tables, cloned with local tables; returned
    with its SparseModel), else (no Embedding, a model that cannot be cloned, pipelining or local SGD,
    which compute before the rows are known) the model as build_run_model builds it and None."""
    if run.row_pull == "off" or run.pipeline or run.local_steps > 1:
        data, model = build_run_model(run)
        return data, model, None
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model
    from asyncps.ml.sparse import build_deferred, initialize, plan

    data = load_dataset(run.dataset, run.seed)
    model = build_deferred(lambda: build_model(run.model, data.num_features, data.num_classes, data.image_shape,
                                               run.seed, data.targets, id_rows=data.id_rows))
    sparse = plan(model, run.batch_size, run.seed)
    if sparse is None:
        initialize(model)
        return data, model, None
    return data, sparse.model, sparse


__all__ = ["build_run_model", "build_worker_model"]
