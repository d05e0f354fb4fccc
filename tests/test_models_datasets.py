"""Fast, offline tests for asyncps.ml.datasets and asyncps.ml.models."""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from asyncps.ml.datasets import (
    DATASET_NAMES,
    Dataset,
    binary_cross_entropy,
    load_dataset,
    load_digits,
    logreg_optimum,
    worker_shard,
)
from asyncps.ml.models import MODEL_NAMES, build_model, loss_fn

ALL_SPECS = ("logreg", "mlp", "mlp:32,16", "cnn", "embedding")


# ----------------------------------------------------------------------------- datasets


def test_digits_shapes_and_dtypes() -> None:
    ds = load_dataset("digits")
    assert ds.name == "digits"
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert ds.x_train.shape[1] == ds.x_test.shape[1] == ds.num_features == 64
    assert len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_test) == pytest.approx(0.2 * 1797, abs=10)
    assert ds.num_classes == 10 and ds.image_shape == (8, 8, 1)
    assert ds.optimal_loss is None
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() <= 1.0
    # Stratified: every class is present in both splits in roughly equal shares.
    assert np.bincount(ds.y_train, minlength=10).min() > 100
    assert np.bincount(ds.y_test, minlength=10).min() > 25
    # Shuffled: a contiguous worker shard is not class-sorted.
    assert len(np.unique(ds.y_train[worker_shard(len(ds.y_train), 0, 4)])) == 10


#: sha256 of scikit-learn 1.x's load_digits() (data as float64, then target as int64), recorded when the file
#: moved into asyncps/ml/data: the shipped table must give the same rows in the same order, so every seeded run
#: and experiment splits it as before
DIGITS_SHA256 = "f6d9e39f37dc45d327f6db33428ee58970ccceabb2535a5c179de35886b70443"


def test_shipped_digits_are_scikit_learns_rows_in_its_order() -> None:
    data, target = load_digits()
    assert data.shape == (1797, 64) and data.dtype == np.float64 and target.dtype == np.int64
    assert data.min() == 0 and data.max() == 16 and set(target.tolist()) == set(range(10))
    assert hashlib.sha256(data.tobytes() + target.tobytes()).hexdigest() == DIGITS_SHA256


def test_digits_deterministic_cached_and_read_only() -> None:
    a = load_dataset("digits", seed=0)
    assert load_dataset("digits", seed=0) is a
    b = load_dataset("digits", seed=1)
    assert not np.array_equal(a.y_train, b.y_train)
    with pytest.raises(ValueError):
        a.x_train[0, 0] = 1.0  # cached arrays are shared, hence frozen


@pytest.mark.parametrize(
    ("n", "workers"), [(0, 1), (1, 1), (5, 3), (10, 4), (1438, 3), (7, 7), (3, 5), (100, 1)]
)
def test_worker_shards_disjoint_and_covering(n: int, workers: int) -> None:
    shards = [worker_shard(n, i, workers) for i in range(workers)]
    expected = np.array_split(np.arange(n), workers)
    for shard, exp in zip(shards, expected, strict=True):
        np.testing.assert_array_equal(shard, exp)
        if len(shard):
            # contiguous ranges
            np.testing.assert_array_equal(shard, np.arange(shard[0], shard[-1] + 1))
    joined = np.concatenate(shards)
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))
    assert len(joined) == n  # no overlap


@pytest.mark.parametrize(("index", "workers"), [(-1, 3), (3, 3), (0, 0)])
def test_worker_shard_bad_index(index: int, workers: int) -> None:
    with pytest.raises(ValueError):
        worker_shard(10, index, workers)


def test_npz_round_trip_images(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "imgs.npz"
    x_train = rng.integers(0, 256, size=(12, 5, 4), dtype=np.uint8)
    x_test = rng.integers(0, 256, size=(6, 5, 4), dtype=np.uint8)
    y_train = rng.integers(0, 3, size=12)
    y_test = rng.integers(0, 3, size=(6, 1)).astype(np.int32)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)

    ds = load_dataset(f"npz:{path}")
    assert ds.image_shape == (5, 4, 1) and ds.num_features == 20
    assert ds.x_train.dtype == np.float32 and ds.y_test.dtype == np.int64
    np.testing.assert_allclose(ds.x_train, x_train.reshape(12, -1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.y_test, y_test[:, 0])
    assert ds.num_classes == int(max(y_train.max(), y_test.max())) + 1


def test_npz_flat_and_channels(tmp_path: Path) -> None:
    flat = tmp_path / "flat.npz"
    x = np.arange(24, dtype=np.float64).reshape(6, 4)
    y = np.array([0, 1, 2, 0, 1, 2])
    np.savez(flat, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
    ds = load_dataset(f"npz:{flat}")
    assert ds.image_shape is None and ds.num_classes == 3
    np.testing.assert_array_equal(ds.x_train, x.astype(np.float32))  # floats are not rescaled

    rgb = tmp_path / "rgb.npz"
    xi = np.zeros((3, 4, 4, 3), dtype=np.float32)
    np.savez(rgb, x_train=xi, y_train=np.arange(3), x_test=xi, y_test=np.arange(3))
    assert load_dataset(f"npz:{rgb}").image_shape == (4, 4, 3)


def test_npz_missing_keys_named(tmp_path: Path) -> None:
    path = tmp_path / "partial.npz"
    np.savez(path, x_train=np.zeros((2, 3)), y_train=np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match=r"x_test.*y_test"):
        load_dataset(f"npz:{path}")


def test_synthetic_logreg_optimum() -> None:
    ds = load_dataset("synthetic-logreg")
    assert ds.num_classes == 2 and ds.image_shape is None
    assert ds.x_train.shape == (4000, 20) and ds.x_test.shape == (1000, 20)
    assert set(np.unique(ds.y_train)) == {0, 1}
    assert ds.optimal_loss is not None and np.isfinite(ds.optimal_loss)
    # Non-separable (label noise), so the optimum is well away from zero.
    assert 0.1 < ds.optimal_loss < np.log(2)

    # Regenerate w*, b* exactly as the loader does: the optimum must not exceed their loss.
    rng = np.random.default_rng(0)
    w_star = rng.normal(size=20) * (2.0 / np.sqrt(20))
    generating_loss = binary_cross_entropy(ds.x_train, ds.y_train, w_star, 0.5)
    assert ds.optimal_loss <= generating_loss

    # And it is a stationary point: perturbing the optimum only increases the loss.
    w, b, loss = logreg_optimum(ds.x_train, ds.y_train)
    assert loss == pytest.approx(ds.optimal_loss, abs=1e-12)
    for delta in (1e-3, -1e-3):
        assert binary_cross_entropy(ds.x_train, ds.y_train, w + delta, b) > loss


def test_synthetic_logreg_optimum_matches_two_class_softmax() -> None:
    ds = load_dataset("synthetic-logreg")
    assert ds.optimal_loss is not None
    w, b, _ = logreg_optimum(ds.x_train, ds.y_train)
    # The 2-class softmax with logits (0, x.w + b) is the same model as the binary sigmoid.
    z = ds.x_train.astype(np.float64) @ w + b
    logits = np.stack([np.zeros_like(z), z], axis=1)
    softmax_loss = float(loss_fn(tf.constant(logits), tf.constant(ds.y_train)))
    assert softmax_loss == pytest.approx(ds.optimal_loss, abs=1e-6)


@pytest.mark.parametrize("spec", ["nope", "npz:", "digits:3", "MNIST", ""])
def test_unknown_dataset_spec_raises(spec: str) -> None:
    with pytest.raises(ValueError):
        load_dataset(spec)


def test_unknown_dataset_error_lists_names() -> None:
    with pytest.raises(ValueError) as info:
        load_dataset("nope")
    for name in DATASET_NAMES:
        assert name in str(info.value)


def test_dataset_validates_dtypes() -> None:
    x = np.zeros((2, 3), dtype=np.float64)
    y = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError):
        Dataset("bad", x, y, x, y, num_classes=2, image_shape=None)


# ----------------------------------------------------------------------------- models


def _build(spec: str, seed: int = 0) -> keras.Model:
    ds = load_dataset("digits")
    return build_model(spec, ds.num_features, ds.num_classes, ds.image_shape, seed=seed)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_model_shapes_and_names_stable(spec: str) -> None:
    a = _build(spec)
    b = _build(spec)
    ds = load_dataset("digits")
    out = a(ds.x_test[:5])
    assert tuple(out.shape) == (5, 10) and out.dtype == tf.float32
    paths_a = [v.path for v in a.trainable_variables]
    paths_b = [v.path for v in b.trainable_variables]
    assert paths_a == paths_b
    assert len(set(paths_a)) == len(paths_a)
    # The trainable variables are the whole model state.
    assert len(a.weights) == len(a.trainable_variables)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_same_seed_same_weights(spec: str) -> None:
    a = _build(spec, seed=3)
    b = _build(spec, seed=3)
    c = _build(spec, seed=4)
    wa = [v.numpy() for v in a.trainable_variables]
    wb = [v.numpy() for v in b.trainable_variables]
    wc = [v.numpy() for v in c.trainable_variables]
    for x, y in zip(wa, wb, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(wa, wc, strict=True))


def test_same_shaped_layers_differ() -> None:
    m = build_model("mlp:16,16,16", 16, 2)
    kernels = [v.numpy() for v in m.trainable_variables if v.path.endswith("kernel")]
    assert not np.array_equal(kernels[1], kernels[2])


def test_mlp_hidden_sizes() -> None:
    m = build_model("mlp:512,512", 784, 10)
    shapes = [tuple(v.shape) for v in m.trainable_variables]
    assert shapes == [(784, 512), (512,), (512, 512), (512,), (512, 10), (10,)]


def test_embedding_gradient_is_indexed_slices() -> None:
    ds = load_dataset("digits")
    m = build_model("embedding", ds.num_features, ds.num_classes)
    with tf.GradientTape() as tape:
        loss = loss_fn(m(ds.x_train[:8]), ds.y_train[:8])
    grads = tape.gradient(loss, m.trainable_variables)
    kinds = {v.path: type(g) for v, g in zip(m.trainable_variables, grads, strict=True)}
    assert kinds["token_embedding/embeddings"] is tf.IndexedSlices
    assert all(g is not None for g in grads)


def test_cnn_needs_image_shape() -> None:
    with pytest.raises(ValueError, match="image_shape"):
        build_model("cnn", 64, 10)
    with pytest.raises(ValueError):
        build_model("cnn", 64, 10, image_shape=(7, 7, 1))


@pytest.mark.parametrize("spec", ["nope", "mlp:abc", "mlp:0", "logreg:3", "cnn:1", ""])
def test_unknown_model_spec_raises(spec: str) -> None:
    with pytest.raises(ValueError):
        build_model(spec, 64, 10, (8, 8, 1))


def test_model_names() -> None:
    assert set(MODEL_NAMES) == {"logreg", "mlp", "cnn", "embedding", "recsys"}
    for name in MODEL_NAMES:
        build_model(name, 64, 10, (8, 8, 1), id_rows=17)  # recsys: its table's rows from the data's id space


def test_loss_fn_matches_numpy() -> None:
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    labels = np.array([0, 2])
    expected = np.mean(
        [
            -np.log(np.exp(2.0) / (np.exp(2.0) + 1.0 + np.exp(-1.0))),
            np.log(3.0),
        ]
    )
    assert float(loss_fn(tf.constant(logits), tf.constant(labels))) == pytest.approx(expected)


def test_mlp_learns_digits_quickly() -> None:
    ds = load_dataset("digits")
    m = build_model("mlp", ds.num_features, ds.num_classes)
    opt = keras.optimizers.SGD(0.1)

    @tf.function  # type: ignore[untyped-decorator]
    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(m(x), y)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables, strict=True))

    for epoch in range(5):
        for idx in np.array_split(np.random.default_rng(epoch).permutation(len(ds.y_train)), 45):
            step(tf.constant(ds.x_train[idx]), tf.constant(ds.y_train[idx]))
    acc = np.mean(np.argmax(m(ds.x_test).numpy(), axis=1) == ds.y_test)
    assert acc > 0.9
