"""A user's Keras model for shapes_data: a small ConvNet with LayerNormalization, softmax output.

asyncps calls `build` with the keyword arguments it takes (`input_shape`, `num_classes`, `seed`).
LayerNormalization, not BatchNormalization: every variable must be trainable (moving statistics
would differ between processes; asyncps rejects such a model). The output is probabilities, so
the run uses the Keras loss `sparse_categorical_crossentropy` (`--loss`).
"""

from __future__ import annotations

from typing import Any

import keras


def build(input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> keras.Model:
    """Conv(16) -> LayerNorm -> Conv(16) -> global max pool -> Dense(softmax)."""
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([
        keras.Input(shape=input_shape),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init, name="conv_a"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init, name="conv_b"),
        keras.layers.GlobalMaxPooling2D(name="pool"),
        keras.layers.Dense(num_classes, activation="softmax", kernel_initializer=init, name="probs"),
    ], name="shapes_cnn")


def build_with_batchnorm(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """The same idea with BatchNormalization: its moving statistics live on the shards beside the weights."""
    return keras.Sequential([
        keras.Input(shape=input_shape),
        keras.layers.Flatten(),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(num_classes),
    ])


def true_class_probability(y_true: Any, y_pred: Any) -> Any:
    """A metric (`--eval-metrics shapes_model:true_class_probability`): the probability given to the right class."""
    return keras.ops.take_along_axis(y_pred, keras.ops.expand_dims(keras.ops.cast(y_true, "int32"), -1), axis=-1)[:, 0]
