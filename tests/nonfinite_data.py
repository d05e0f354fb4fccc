"""A dataset function for tests/test_numerics.py: the digits with a few training examples whose features
are NaN, so the steps whose batch holds one are non-finite (skipped) while every other step trains."""

from __future__ import annotations

import numpy as np

from asyncps.ml.datasets import load_dataset

#: Training examples poisoned: each spoils one batch per epoch, a few steps of a run's hundreds.
POISONED = 3


def load(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(x_train, y_train), (x_test, y_test) of the digits, the first POISONED training rows NaN."""
    data = load_dataset("digits", seed)
    x_train = data.x_train.copy()
    x_train[:POISONED] = np.nan
    return (x_train, data.y_train), (data.x_test, data.y_test)
