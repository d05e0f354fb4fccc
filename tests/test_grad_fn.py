"""The worker's gradient function: same loss and gradients as a tape over the model's variables,
at values it is given (not the variables'), with embeddings' IndexedSlices as SparseRows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from asyncps.worker.trainer import make_grad_fn

from asyncps.ml.models import build_model, loss_fn
from asyncps.wire.codec import SparseRows


def perturbed(spec: str) -> tuple[Any, list[np.ndarray], np.ndarray, np.ndarray]:
    """A seeded model of `spec` over 12 ids and 3 classes, values away from its own, and a batch of 8."""
    model = build_model(spec, 12, 3, seed=1)
    rng = np.random.default_rng(0)
    values = [(v.numpy() + rng.standard_normal(v.shape).astype(np.float32)) for v in model.trainable_variables]
    x = rng.integers(0, 12, (8, 12)).astype(np.float32)
    return model, values, x, rng.integers(0, 3, 8)


@pytest.mark.parametrize("spec", ["mlp:16", "embedding"])
def test_gradients_at_given_values_match_a_tape_over_assigned_variables(spec: str) -> None:
    import tensorflow as tf

    model, values, x, y = perturbed(spec)
    loss, grads = make_grad_fn(model, loss_fn)(values, x, y)

    reference = build_model(spec, 12, 3, seed=1)
    for var, value in zip(reference.trainable_variables, values, strict=True):
        var.assign(value)
    with tf.GradientTape() as tape:
        expected_loss = loss_fn(reference(x, training=True), y)
    expected = tape.gradient(expected_loss, reference.trainable_variables)
    assert loss == pytest.approx(float(expected_loss), rel=1e-6)
    kinds = []
    for got, want in zip(grads, expected, strict=True):
        if isinstance(want, tf.IndexedSlices):
            assert isinstance(got, SparseRows)
            # one row per touched row: each distinct index once (the gather named rows many times)
            assert got.indices.tolist() == sorted(set(want.indices.numpy().tolist()))
            dense = np.zeros(want.dense_shape, np.float32)
            np.add.at(dense, got.indices, got.values)
            want = tf.convert_to_tensor(want)
            kinds.append("sparse")
        else:
            dense = got
            kinds.append("dense")
        np.testing.assert_allclose(dense, want.numpy(), rtol=1e-5, atol=1e-6)
    assert ("sparse" in kinds) == (spec == "embedding")
    # the model's own variables were not touched: the values went in as inputs
    for var, original in zip(model.trainable_variables, build_model(spec, 12, 3, seed=1).trainable_variables,
                             strict=True):
        np.testing.assert_array_equal(var.numpy(), original.numpy())


def test_aligned_writable_values_enter_the_computation_without_a_copy() -> None:
    """ModelClient's buffers are aligned, so TensorFlow reads them in place (DLPack); an unaligned or
    read-only array is handed over as it is (TensorFlow copies it)."""
    from asyncps.worker.trainer import shared_input

    from asyncps.wire.codec import aligned_zeros, is_aligned

    buffer = aligned_zeros((256, 64), np.float32)
    assert is_aligned(buffer) and buffer.flags.writeable
    tensor = shared_input(buffer)
    assert not isinstance(tensor, np.ndarray)
    buffer[3, 5] = 7.0  # written after the tensor was made: seen through it
    assert float(tensor[3, 5]) == 7.0
    unaligned = aligned_zeros((256 * 64 + 1,), np.float32)[1:].reshape(256, 64)
    assert not is_aligned(unaligned)
    assert shared_input(unaligned) is unaligned
    frozen = aligned_zeros((4, 4), np.float32)
    frozen.flags.writeable = False
    assert shared_input(frozen) is frozen


def test_gradients_are_the_same_from_shared_and_copied_values() -> None:
    from asyncps.wire.codec import aligned_zeros

    model = build_model("mlp:32", 12, 3, seed=2)
    grad_fn = make_grad_fn(model, loss_fn)
    rng = np.random.default_rng(1)
    copied = [rng.standard_normal(v.shape).astype(np.float32) for v in model.trainable_variables]
    shared = [aligned_zeros(v.shape, np.float32) for v in copied]
    for dst, src in zip(shared, copied, strict=True):
        np.copyto(dst, src)
    unaligned = [aligned_zeros((v.size + 1,), np.float32)[1:].reshape(v.shape) for v in copied]
    for dst, src in zip(unaligned, copied, strict=True):
        np.copyto(dst, src)
    x = rng.standard_normal((8, 12)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    results = [grad_fn(values, x, y) for values in (copied, shared, unaligned)]
    for loss, grads in results[1:]:
        assert loss == results[0][0]
        for got, want in zip(grads, results[0][1], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("spec", ["mlp:16", "embedding"])
@pytest.mark.parametrize("clip", ["norm", "global_norm", "value"])
def test_clipping_bounds_the_gradients_as_keras_options_do(spec: str, clip: str) -> None:
    """Clip(norm=c): each variable's gradient at most c in L2 norm, its direction kept; Clip(global_norm=c): all
    of them jointly; Clip(value=c): every element in [-c, c]. An embedding's gradient stays rows (SparseRows)."""
    from asyncps.worker.trainer import Clip

    model, values, x, y = perturbed(spec)
    _, plain = make_grad_fn(model, loss_fn)(values, x, y)
    dense = [g.values if isinstance(g, SparseRows) else g for g in plain]
    bound = 0.1 * min(float(np.linalg.norm(g)) for g in dense)  # below every norm: each one is clipped
    _, clipped = make_grad_fn(model, loss_fn, clip=Clip(**{clip: bound}))(values, x, y)
    got = [g.values if isinstance(g, SparseRows) else g for g in clipped]
    assert [type(g) for g in clipped] == [type(g) for g in plain]
    if clip == "norm":
        for before, after in zip(dense, got, strict=True):
            assert float(np.linalg.norm(after)) == pytest.approx(bound, rel=1e-4)
            np.testing.assert_allclose(after, before * (bound / np.linalg.norm(before)), rtol=1e-4, atol=1e-7)
    elif clip == "global_norm":
        joint = float(np.sqrt(sum(np.sum(np.square(g)) for g in dense)))
        assert float(np.sqrt(sum(np.sum(np.square(g)) for g in got))) == pytest.approx(bound, rel=1e-4)
        for before, after in zip(dense, got, strict=True):
            np.testing.assert_allclose(after, before * (bound / joint), rtol=1e-4, atol=1e-7)
    else:
        for before, after in zip(dense, got, strict=True):
            np.testing.assert_allclose(after, np.clip(before, -bound, bound), rtol=1e-6)
            assert float(np.max(np.abs(after))) <= bound * (1 + 1e-6)


def test_the_runs_clipping_reaches_the_workers_gradient_function() -> None:
    from asyncps.worker.build import run_grad_fn

    from asyncps.config import RunConfig

    model = build_model("mlp:16", 12, 3, seed=1)
    values = [v.numpy() * 50.0 for v in model.trainable_variables]  # large weights: large gradients
    x = np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32)
    y = np.arange(8) % 3
    _, grads = run_grad_fn(RunConfig(model="mlp:16", clipvalue=1e-3), model)(values, x, y)
    assert max(float(np.max(np.abs(g))) for g in grads) == pytest.approx(1e-3)
