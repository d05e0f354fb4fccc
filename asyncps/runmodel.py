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


def build_run_model(run: RunConfig) -> tuple[Dataset, Any]:
    """The run's dataset (`run.dataset`, seeded) and its model (`run.model`) built for that data."""
    from asyncps.ml.datasets import load_dataset
    from asyncps.ml.models import build_model

    data = load_dataset(run.dataset, run.seed)
    model = build_model(run.model, data.num_features, data.num_classes, data.image_shape, run.seed, data.targets,
                        id_rows=data.id_rows)
    return data, model


__all__ = ["build_run_model"]
