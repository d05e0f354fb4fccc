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
        why = ("--row-pull off" if run.row_pull == "off" else "--pipeline" if run.pipeline
               else f"--local-steps {run.local_steps}")
        _refuse_keyed(model, f"with {why}, which reads every table whole")
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


def build_chief_model(run: RunConfig, eval_batch: int) -> tuple[Dataset, Any, SparseModel | None, dict[str, Any]]:
    """The chief's dataset and model: with `row_pull` auto and Embedding tables the clone reads by rows, the
    model built without making its tables (asyncps.ml.sparse), cloned with local tables of capacity for
    `eval_batch` examples (the evaluation's batches), its other variables made, and its SparseModel;
    else the model as build_run_model builds it and None. The chief never makes a table the shards can
    make themselves (`RowTable.init`): the others (an initializer the shards cannot make) are made here,
    once, from the model as built, and returned by variable path (logged). A saved model (`keras:PATH`,
    what asyncps.train hands over) starts from its saved weights, tables included, so it is built whole."""
    from asyncps.ml.specs import KERAS_PREFIX

    if run.row_pull == "off" or run.model.startswith(KERAS_PREFIX):
        data, model = build_run_model(run)
        _refuse_keyed(model, "with --row-pull off, which reads every table whole" if run.row_pull == "off" else
                      "from a saved model (asyncps.train): give a model:function that builds it")
        return data, model, None, {}
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model
    from asyncps.ml.sparse import build_deferred, initialize, plan

    data = load_dataset(run.dataset, run.seed)
    model = build_deferred(lambda: build_model(run.model, data.num_features, data.num_classes, data.image_shape,
                                               run.seed, data.targets, id_rows=data.id_rows))
    sparse = plan(model, eval_batch, run.seed)
    if sparse is None:
        initialize(model)
        return data, model, None, {}
    return data, sparse.model, sparse, _unknown_tables(model, sparse)


def _refuse_keyed(model: Any, why: str) -> None:
    """ValueError when a model built whole has a HashEmbedding (its table lives on the shards by key only)."""
    from asyncps.ml.sparse import has_keyed_table

    if has_keyed_table(model):
        raise ValueError(f"a model with a HashEmbedding cannot train {why}: its table lives on the shards by key "
                         "and is read by rows only")


def _unknown_tables(model: Any, sparse: SparseModel) -> dict[str, Any]:
    """The values of the tables whose initializer the shards cannot make, made from the deferred model."""
    import logging

    import numpy as np

    unknown = {t.variable for t in sparse.tables if t.init is None}
    made: dict[str, Any] = {}
    for variable in model.variables:
        if variable.path in unknown:
            variable._deferred_initialize()
            made[variable.path] = np.array(variable.numpy())
            logging.getLogger("asyncps.chief").info(
                "table %s %s: its initializer is not one the shards make (asyncps.rules.initializers): made "
                "whole in the chief and sent", variable.path, list(made[variable.path].shape))
    return made


__all__ = ["build_chief_model", "build_run_model", "build_worker_model"]
