"""asyncps.rules.optimizers against keras 3, plus sparse-update and config-validation properties."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable, Mapping

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncps.rules.optimizers import (
    _BLOCK,
    Optimizer,
    OptimizerConfig,
    make_optimizer,
)

STEPS = 20
SHAPES = [(17,), (6, 5)]
ALL_NAMES = ["sgd", "momentum", "nesterov", "adam", "adagrad", "delayed-nesterov"]

# (our config, factory for the equivalent keras optimizer)
KERAS_CASES: dict[str, tuple[OptimizerConfig, Callable[[], keras.optimizers.Optimizer]]] = {
    "sgd": (
        OptimizerConfig("sgd", 0.05),
        lambda: keras.optimizers.SGD(learning_rate=0.05),
    ),
    "momentum-default": (
        OptimizerConfig("momentum", 0.05),
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    ),
    "momentum-0.5": (
        OptimizerConfig("momentum", 0.1, {"momentum": 0.5}),
        lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.5),
    ),
    "nesterov-default": (
        OptimizerConfig("nesterov", 0.05),
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
    ),
    "nesterov-0.7": (
        OptimizerConfig("nesterov", 0.02, {"momentum": 0.7}),
        lambda: keras.optimizers.SGD(learning_rate=0.02, momentum=0.7, nesterov=True),
    ),
    "adam-default": (
        OptimizerConfig("adam", 0.01),
        lambda: keras.optimizers.Adam(learning_rate=0.01),
    ),
    "adam-custom": (
        OptimizerConfig("adam", 0.003, {"beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-3}),
        lambda: keras.optimizers.Adam(learning_rate=0.003, beta_1=0.8, beta_2=0.99, epsilon=1e-3),
    ),
    # A large epsilon makes its placement (outside sqrt(v), not bias-corrected) matter.
    "adam-large-epsilon": (
        OptimizerConfig("adam", 0.01, {"epsilon": 0.5}),
        lambda: keras.optimizers.Adam(learning_rate=0.01, epsilon=0.5),
    ),
    "adagrad-default": (
        OptimizerConfig("adagrad", 0.1),
        lambda: keras.optimizers.Adagrad(learning_rate=0.1),
    ),
    "adagrad-custom": (
        OptimizerConfig("adagrad", 0.2, {"initial_accumulator_value": 0.5, "epsilon": 1e-4}),
        lambda: keras.optimizers.Adagrad(
            learning_rate=0.2, initial_accumulator_value=0.5, epsilon=1e-4
        ),
    ),
    # Keras' decoupled weight decay, applied before each update at its rate (AdamW is Adam with it)
    "sgd-weight-decay": (
        OptimizerConfig("sgd", 0.05, {"weight_decay": 0.1}),
        lambda: keras.optimizers.SGD(learning_rate=0.05, weight_decay=0.1),
    ),
    "momentum-weight-decay": (
        OptimizerConfig("momentum", 0.05, {"weight_decay": 0.2}),
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, weight_decay=0.2),
    ),
    "adamw": (
        OptimizerConfig("adam", 0.01, {"weight_decay": 0.004}),
        lambda: keras.optimizers.AdamW(learning_rate=0.01),
    ),
    "adagrad-weight-decay": (
        OptimizerConfig("adagrad", 0.1, {"weight_decay": 0.05}),
        lambda: keras.optimizers.Adagrad(learning_rate=0.1, weight_decay=0.05),
    ),
    # Zero initial accumulator plus a large epsilon: epsilon inside vs outside sqrt differs.
    "adagrad-epsilon-inside-sqrt": (
        OptimizerConfig("adagrad", 0.1, {"initial_accumulator_value": 0.0, "epsilon": 0.25}),
        lambda: keras.optimizers.Adagrad(
            learning_rate=0.1, initial_accumulator_value=0.0, epsilon=0.25
        ),
    ),
}


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", sorted(KERAS_CASES))
def test_matches_keras(case: str, shape: tuple[int, ...]) -> None:
    config, keras_factory = KERAS_CASES[case]
    rng = np.random.default_rng(1234)
    initial = _random(rng, shape)

    reference = keras.Variable(initial.copy(), dtype="float32")
    keras_opt = keras_factory()
    ours = make_optimizer(config)
    value = initial.copy()
    slots = ours.init_slots(value)

    for step in range(1, STEPS + 1):
        grad = _random(rng, shape)
        keras_opt.apply_gradients([(tf.constant(grad), reference)])
        ours.apply_dense(value, grad, slots, config.learning_rate, step)
        assert value.dtype == np.float32
        np.testing.assert_allclose(
            value, reference.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"step {step}"
        )


@pytest.mark.parametrize("period", [1, 3])
def test_delayed_nesterov_is_one_keras_nesterov_step_of_the_mean_per_period(period: int) -> None:
    """Every `period` updates land where keras' Nesterov lands with one step of their mean gradient
    (async local SGD with n workers and no staleness = sync Nesterov averaging), and in between the
    value has moved by lr/period of each gradient, with no momentum."""
    rng = np.random.default_rng(7)
    lr, mu = 0.3, 0.9
    initial = _random(rng, (6, 5))
    reference = keras.Variable(initial.copy(), dtype="float32")
    keras_opt = keras.optimizers.SGD(learning_rate=lr, momentum=mu, nesterov=True)
    ours = make_optimizer(OptimizerConfig("delayed-nesterov", lr, {"momentum": mu, "period": period}))
    value = initial.copy()
    slots = ours.init_slots(value)
    step = 0
    for _ in range(5):
        grads = [_random(rng, (6, 5)) for _ in range(period)]
        for k, grad in enumerate(grads):
            before = value.copy()
            step += 1
            ours.apply_dense(value, grad, slots, lr, step)
            if k < period - 1:
                np.testing.assert_allclose(value, before - np.float32(lr / period) * grad, rtol=1e-6, atol=1e-7)
        keras_opt.apply_gradients([(tf.constant(np.mean(grads, axis=0, dtype=np.float32)), reference)])
        np.testing.assert_allclose(value, reference.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"after {step} updates")


def test_delayed_nesterov_period_must_be_a_whole_number() -> None:
    with pytest.raises(ValueError, match=r"period must be an integer >= 1, got 2\.5"):
        make_optimizer(OptimizerConfig("delayed-nesterov", 0.1, {"period": 2.5}))
    with pytest.raises(ValueError, match=r"period must be in \[1.0, inf\)"):
        OptimizerConfig("delayed-nesterov", 0.1, {"period": 0})


@pytest.mark.parametrize("name", ALL_NAMES)
def test_dense_update_keeps_float32_and_leaves_grad_alone(name: str) -> None:
    rng = np.random.default_rng(0)
    opt = make_optimizer(OptimizerConfig(name, 0.1))
    value = _random(rng, (4, 3))
    slots = opt.init_slots(value)
    grad = _random(rng, (4, 3))
    grad_before = grad.copy()
    opt.apply_dense(value, grad, slots, 0.1, 1)
    assert value.dtype == np.float32
    assert all(slot.dtype == np.float32 for slot in slots.values())
    np.testing.assert_array_equal(grad, grad_before)


def test_sparse_sgd_sums_duplicate_indices() -> None:
    rng = np.random.default_rng(1)
    opt = make_optimizer(OptimizerConfig("sgd", 0.1))
    initial = _random(rng, (8, 3))
    indices = np.array([5, 1, 5, 7, 1, 5], dtype=np.int64)
    rows = _random(rng, (indices.size, 3))
    scattered = np.zeros_like(initial)
    np.add.at(scattered, indices, rows)

    sparse_value = initial.copy()
    opt.apply_sparse(sparse_value, indices, rows, {}, 0.1, 1)
    dense_value = initial.copy()
    opt.apply_dense(dense_value, scattered, {}, 0.1, 1)
    np.testing.assert_allclose(sparse_value, dense_value, rtol=1e-6, atol=0)


@settings(max_examples=50, deadline=None)
@given(
    indices=st.lists(st.integers(min_value=0, max_value=9), max_size=30),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_sparse_sgd_equals_dense_scattered_property(indices: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt = make_optimizer(OptimizerConfig("sgd", 0.3))
    initial = _random(rng, (10, 2))
    index_array = np.array(indices, dtype=np.int64)
    rows = _random(rng, (index_array.size, 2))
    scattered = np.zeros_like(initial)
    np.add.at(scattered, index_array, rows)

    sparse_value = initial.copy()
    opt.apply_sparse(sparse_value, index_array, rows, {}, 0.3, 1)
    dense_value = initial.copy()
    opt.apply_dense(dense_value, scattered, {}, 0.3, 1)
    np.testing.assert_allclose(sparse_value, dense_value, rtol=1e-6, atol=1e-7)


def _warmed_up(
    opt: Optimizer, rng: np.random.Generator, shape: tuple[int, ...]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A value and slots after two dense steps, so every slot holds non-trivial state."""
    value = _random(rng, shape)
    slots = opt.init_slots(value)
    for step in (1, 2):
        opt.apply_dense(value, _random(rng, shape), slots, 0.05, step)
    return value, slots


@pytest.mark.parametrize("name", ALL_NAMES)
def test_sparse_leaves_untouched_rows_exactly_unchanged(name: str) -> None:
    rng = np.random.default_rng(2)
    opt = make_optimizer(OptimizerConfig(name, 0.05))
    value, slots = _warmed_up(opt, rng, (9, 4))
    value_before = value.copy()
    slots_before = {key: slot.copy() for key, slot in slots.items()}
    indices = np.array([6, 2, 6, 0], dtype=np.int64)
    touched = np.unique(indices)
    untouched = np.setdiff1d(np.arange(9), touched)

    opt.apply_sparse(value, indices, _random(rng, (indices.size, 4)), slots, 0.05, 3)

    np.testing.assert_array_equal(value[untouched], value_before[untouched])
    assert not np.array_equal(value[touched], value_before[touched])
    for key, slot in slots.items():
        np.testing.assert_array_equal(slot[untouched], slots_before[key][untouched])
    changed = [key for key, slot in slots.items() if not np.array_equal(slot[touched], slots_before[key][touched])]
    # delayed Nesterov moves its running sum at this update (3) and its momentum at every second one
    assert changed == (["sum"] if name == "delayed-nesterov" else list(slots)), changed


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ALL_NAMES)
def test_sparse_touching_every_row_once_equals_dense(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    opt = make_optimizer(OptimizerConfig(name, 0.05))
    initial = _random(rng, shape)
    dense_value, sparse_value = initial.copy(), initial.copy()
    dense_slots, sparse_slots = opt.init_slots(dense_value), opt.init_slots(sparse_value)

    for step in range(1, 6):
        grad = _random(rng, shape)
        order = rng.permutation(shape[0]).astype(np.int64)
        opt.apply_dense(dense_value, grad, dense_slots, 0.05, step)
        opt.apply_sparse(sparse_value, order, grad[order], sparse_slots, 0.05, step)

    np.testing.assert_allclose(sparse_value, dense_value, rtol=1e-6, atol=0)
    for key in dense_slots:
        np.testing.assert_allclose(sparse_slots[key], dense_slots[key], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_empty_sparse_update_is_a_no_op(name: str) -> None:
    rng = np.random.default_rng(4)
    opt = make_optimizer(OptimizerConfig(name, 0.05))
    value, slots = _warmed_up(opt, rng, (5, 2))
    value_before = value.copy()
    opt.apply_sparse(value, np.zeros(0, np.int64), np.zeros((0, 2), np.float32), slots, 0.05, 3)
    np.testing.assert_array_equal(value, value_before)


def test_sparse_rejects_bad_indices_and_shapes() -> None:
    opt = make_optimizer(OptimizerConfig("sgd", 0.1))
    value = np.zeros((4, 2), np.float32)
    rows = np.ones((1, 2), np.float32)
    with pytest.raises(IndexError):
        opt.apply_sparse(value, np.array([4]), rows, {}, 0.1, 1)
    with pytest.raises(IndexError):
        opt.apply_sparse(value, np.array([-1]), rows, {}, 0.1, 1)
    with pytest.raises(ValueError, match="rows shape"):
        opt.apply_sparse(value, np.array([0, 1]), rows, {}, 0.1, 1)
    with pytest.raises(ValueError, match="gradient shape"):
        opt.apply_dense(value, np.ones((2, 4), np.float32), {}, 0.1, 1)
    with pytest.raises(ValueError, match="step"):
        opt.apply_dense(value, np.ones((4, 2), np.float32), {}, 0.1, 0)


def test_adagrad_slots_start_at_initial_accumulator_value() -> None:
    default = make_optimizer(OptimizerConfig("adagrad", 0.1))
    custom = make_optimizer(OptimizerConfig("adagrad", 0.1, {"initial_accumulator_value": 0.3}))
    value = np.zeros(3, np.float32)
    np.testing.assert_array_equal(default.init_slots(value)["accumulator"], np.float32(0.1))
    np.testing.assert_array_equal(custom.init_slots(value)["accumulator"], np.float32(0.3))


def test_config_copies_params() -> None:
    params = {"momentum": 0.5}
    config = OptimizerConfig("momentum", 0.1, params)
    params["momentum"] = 0.99
    assert config.params == {"momentum": 0.5}
    assert config == OptimizerConfig("momentum", 0.1, {"momentum": 0.5})


@pytest.mark.parametrize(
    ("name", "lr", "params", "message"),
    [
        ("rmsprop", 0.1, {}, "unknown optimizer"),
        ("SGD", 0.1, {}, "unknown optimizer"),
        ("adam", 0.1, {"beta1": 0.9}, "unknown parameter"),
        ("sgd", 0.1, {"momentum": 0.9}, "unknown parameter"),
        ("adagrad", 0.1, {"beta_1": 0.9}, "unknown parameter"),
        ("sgd", 0.0, {}, "learning_rate"),
        ("sgd", -0.1, {}, "learning_rate"),
        ("sgd", float("nan"), {}, "learning_rate"),
        ("sgd", "0.1", {}, "learning_rate"),
        ("momentum", 0.1, {"momentum": 1.5}, "momentum"),
        ("adam", 0.1, {"beta_1": 1.0}, "beta_1"),
        ("adam", 0.1, {"epsilon": 0.0}, "epsilon"),
        ("adagrad", 0.1, {"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
    ],
)
def test_config_rejects_bad_input(
    name: str, lr: float, params: Mapping[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(name, lr, params)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_a_large_dense_update_in_blocks_gives_the_bits_of_one_whole_update(name: str) -> None:
    """Large variables are updated block by block (cache-sized temporaries); every rule is
    elementwise, so the result must be bit-identical to one whole-array update."""
    rng = np.random.default_rng(7)
    size = 3 * _BLOCK + 5
    value = rng.standard_normal((size // 5, 5)).astype(np.float32)
    blocked, whole = make_optimizer(OptimizerConfig(name, 0.01)), make_optimizer(OptimizerConfig(name, 0.01))
    v_blocked, v_whole = value.copy(), value.copy()
    s_blocked, s_whole = blocked.init_slots(value), whole.init_slots(value)
    for step in range(1, 4):
        grad = rng.standard_normal(value.shape).astype(np.float32)
        blocked.apply_dense(v_blocked, grad, s_blocked, 0.01, step)
        whole._apply(v_whole, grad, s_whole, np.float32(0.01), step)
    assert v_blocked.tobytes() == v_whole.tobytes()
    assert all(s_blocked[k].tobytes() == s_whole[k].tobytes() for k in s_whole)
    assert not np.array_equal(v_blocked, value)


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("shape", [(4, 3), (3, _BLOCK // 2 + 7)])  # one block, and several
def test_an_update_from_a_source_equals_copy_then_update(name: str, shape: tuple[int, ...]) -> None:
    """The shard's copy-on-write: reading the old values from `source` and writing the result to a new
    array gives the same bits (values and slots) as copying first and updating in place, and leaves the
    source as it was (a reader may still be sending it)."""
    rng = np.random.default_rng(3)
    opt = make_optimizer(OptimizerConfig(name, 0.1))
    source = _random(rng, shape)
    source_before = source.copy()
    slots_a, slots_b = opt.init_slots(source), opt.init_slots(source)
    for step in (1, 2):
        grad = _random(rng, shape)
        copied = source.copy()
        opt.apply_dense(copied, grad, slots_a, 0.1, step)
        written = np.empty_like(source)
        opt.apply_dense(written, grad, slots_b, 0.1, step, source=source)
        np.testing.assert_array_equal(written, copied)
        for slot in slots_a:
            np.testing.assert_array_equal(slots_b[slot], slots_a[slot])
        np.testing.assert_array_equal(source, source_before)
    with pytest.raises(ValueError, match="source"):
        opt.apply_dense(np.empty_like(source), grad, slots_b, 0.1, 3, source=source[:1])


def test_an_exponential_decay_schedule_rides_beside_the_hyperparameters() -> None:
    """Keras' ExponentialDecay: lr * rate ** (t / steps), floored with staircase; its keys parse from a spec or
    arrive among the hyperparameters, leave them, and round-trip through the spec."""
    config = OptimizerConfig.parse("adam:lr=0.1,beta_1=0.8,decay_steps=100,decay_rate=0.5")
    assert config.params == {"beta_1": 0.8} and (config.decay_steps, config.decay_rate) == (100.0, 0.5)
    assert config.rate_at(0) == 0.1 and config.rate_at(100) == pytest.approx(0.05)
    assert config.rate_at(50) == pytest.approx(0.1 * 0.5 ** 0.5)
    assert OptimizerConfig.parse(config.spec) == config
    stairs = OptimizerConfig("sgd", 0.1, {"decay_steps": 10, "decay_rate": 0.5, "staircase": 1})
    assert stairs.params == {} and stairs.staircase
    assert [stairs.rate_at(t) for t in (0, 9, 10, 25)] == pytest.approx([0.1, 0.1, 0.05, 0.025])
    assert OptimizerConfig.parse(stairs.spec) == stairs
    assert OptimizerConfig("sgd", 0.1).rate_at(10**9) == 0.1  # no schedule: a constant rate


@pytest.mark.parametrize("params", [{"decay_steps": 10}, {"decay_rate": 0.5}, {"decay_steps": 10, "decay_rate": 1.5},
                                    {"decay_steps": -1, "decay_rate": 0.5}])
def test_a_half_given_or_growing_schedule_is_refused(params: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="decay_steps > 0 and decay_rate in"):
        OptimizerConfig("sgd", 0.1, params)


def test_weight_decay_rides_beside_the_hyperparameters_and_decays_only_touched_rows() -> None:
    config = OptimizerConfig.parse("adam:lr=0.01,beta_1=0.8,weight_decay=0.004")
    assert config.weight_decay == 0.004 and "weight_decay" not in config.params
    assert OptimizerConfig.parse(config.spec) == config and "weight_decay=0.004" in config.spec
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        OptimizerConfig("sgd", 0.1, {"weight_decay": -1.0})
    sgd = make_optimizer(OptimizerConfig("sgd", 0.5, {"weight_decay": 0.1}))
    value = np.ones((3, 2), np.float32)
    sgd.apply_sparse(value, np.array([1], np.int64), np.zeros((1, 2), np.float32), sgd.init_slots(value), 0.5, 1)
    np.testing.assert_array_equal(value, np.array([[1, 1], [0.95, 0.95], [1, 1]], np.float32))  # lazy, as the update
