"""The recommendation-shaped synthetic dataset and built-in model (`recsys`): offline, seeded, int64 ids.

Fast: the data's shape, ids and determinism, its hidden rule (learnable, and only from the ids), a 10M-row
id space made without a table of that size, the model built over the data's id space, and the specs.
Slow: `asyncps local` trains the model on 10K rows above chance with 2 shards and 2 workers.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from asyncps.ml.datasets import hidden_id_weights, load_dataset, make_recsys
from asyncps.ml.specs import RecsysData, dataset_problem, model_problem, parse_recsys_data
from asyncps.rundir import RunDir, RunSummary
from tests.test_local_cluster import run_cli


def test_default_shape_and_ids() -> None:
    data = load_dataset("recsys:rows=1000")
    defaults = RecsysData()
    assert data.x_train.shape == (defaults.train, defaults.features) and data.x_train.dtype == np.int64
    assert data.x_test.shape == (defaults.test, defaults.features)
    assert data.y_train.dtype == np.int64 and set(np.unique(data.y_train)) == {0, 1}
    assert data.num_classes == 2 and data.id_rows == 1000
    assert data.x_train.min() >= 0 and data.x_train.max() < 1000
    assert 0.35 < data.y_train.mean() < 0.65  # near balanced: the hidden weights are centred


def test_ids_are_zipf_and_spread() -> None:
    data = load_dataset("recsys:rows=100000,train=50000,test=10")
    counts = np.sort(np.bincount(data.x_train[:, 0], minlength=100_000))[::-1]
    assert counts[0] > 20 * counts[100] > 0  # a heavy head: the top id far above the 101st
    hot = np.argsort(np.bincount(data.x_train[:, 0]))[-10:]
    assert hot.max() - hot.min() > 10_000  # popular ids are spread over the table, not packed at its start


def test_seeded_and_settings() -> None:
    a, b = make_recsys("recsys:rows=5000", 3), make_recsys("recsys:rows=5000", 3)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_train, b.y_train)
    assert not np.array_equal(a.x_train, make_recsys("recsys:rows=5000", 4).x_train)
    small = load_dataset("recsys:rows=50,features=3,zipf=1.5,train=100,test=20")
    assert small.x_train.shape == (100, 3) and small.x_test.shape == (20, 3) and small.id_rows == 50


def test_labels_follow_the_hidden_rule() -> None:
    """The rule is learnable from the ids (its own logits predict well above chance) and needs them (the labels
    are not constant)."""
    data = load_dataset("recsys:rows=10000")
    logits = hidden_id_weights(data.x_test, 0).sum(axis=1)
    assert np.mean((logits > 0) == data.y_test) > 0.75


def test_ten_million_rows_make_nothing_of_that_size() -> None:
    tracemalloc.start()
    try:
        data = make_recsys("recsys:rows=10000000", 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data.x_train.max() < 10_000_000 and data.id_rows == 10_000_000
    assert peak < 20e6  # a few arrays of [22000, 8]; 10M ids of 8 bytes alone would be 80 MB


@pytest.mark.parametrize(("spec", "problem"), [("recsys", None), ("recsys:rows=10", None),
                                               ("recsys:rows=1", "rows >= 2"), ("recsys:row=10", "keys rows"),
                                               ("recsys:zipf=1.0", "zipf in"), ("recsys:rows=x", "keys")])
def test_dataset_specs(spec: str, problem: str | None) -> None:
    found = dataset_problem(spec)
    assert found is None if problem is None else problem in (found or "")


def test_model_specs() -> None:
    assert model_problem("recsys") is None and model_problem("recsys:rows=100,dim=8") is None
    assert "dim >= 1" in (model_problem("recsys:dim=0") or "")
    assert "keys rows, dim" in (model_problem("recsys:width=3") or "")
    assert parse_recsys_data("recsys").rows == RecsysData().rows


def test_model_takes_ids_into_one_shared_table() -> None:
    from asyncps.ml.models import build_model

    data = load_dataset("recsys:rows=3000")
    model = build_model("recsys:dim=4", data.num_features, 2, seed=0, id_rows=data.id_rows)
    assert str(model.inputs[0].dtype) == "int64"
    shapes = {v.path: tuple(v.shape) for v in model.trainable_variables}
    assert shapes["id_embedding/embeddings"] == (3000, 4)
    assert shapes["hidden/kernel"] == (8 * 4, 64) and shapes["logits/kernel"] == (64, 2)
    again = build_model("recsys:dim=4", data.num_features, 2, seed=0, id_rows=data.id_rows)
    for mine, theirs in zip(model.trainable_variables, again.trainable_variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())  # seeded like the other built-ins
    assert model(data.x_test[:5]).shape == (5, 2)
    assert build_model("recsys:rows=5000", 8, 2, id_rows=3000).trainable_variables[0].shape[0] == 5000
    with pytest.raises(ValueError, match="ids need 3000"):
        build_model("recsys:rows=100", 8, 2, id_rows=3000)
    with pytest.raises(ValueError, match="needs rows=R"):
        build_model("recsys", 8, 2)


@pytest.mark.slow
def test_local_cluster_learns_recsys_above_chance(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--dataset", "recsys:rows=10000", "--model", "recsys",
                      "--num-workers", "2", "--num-ps", "2", "--epochs", "2", "--batch-size", "64",
                      "--optimizer", "adagrad", "--learning-rate", "0.05", "--eval-every-s", "30", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = RunSummary.from_json(RunDir(run_dir).summary.read_text())
    assert summary.final_eval.accuracy > 0.6, summary.final_eval  # chance is ~0.5; measured 0.7
