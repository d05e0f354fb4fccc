"""A user's dataset, generated offline: 8x8 grayscale images of a bar, a cross or a box, with noise.

`load` returns `(x_train, y_train), (x_test, y_test)` like keras.datasets.mnist.load_data():
uint8 images [n, 8, 8] and integer labels. asyncps flattens the images, scales them to [0, 1]
and hands the model their layout (8, 8, 1) as `input_shape`.
"""

from __future__ import annotations

import numpy as np

SIZE = 8
CLASSES = ("bar", "cross", "box")


def _draw(kind: int, rng: np.random.Generator) -> np.ndarray:
    """One image of the given kind at a random place and size."""
    img = np.zeros((SIZE, SIZE), dtype=np.float64)
    side = int(rng.integers(4, 7))
    top, left = (int(v) for v in rng.integers(0, SIZE - side + 1, size=2))
    mid_r, mid_c = top + side // 2, left + side // 2
    if kind == 0:  # a bar, horizontal or vertical
        if rng.random() < 0.5:
            img[mid_r, left:left + side] = 1.0
        else:
            img[top:top + side, mid_c] = 1.0
    elif kind == 1:  # a cross
        img[mid_r, left:left + side] = 1.0
        img[top:top + side, mid_c] = 1.0
    else:  # the outline of a box
        img[top, left:left + side] = img[top + side - 1, left:left + side] = 1.0
        img[top:top + side, left] = img[top:top + side, left + side - 1] = 1.0
    return img


def load(seed: int = 0, n_train: int = 2400, n_test: int = 600) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                         tuple[np.ndarray, np.ndarray]]:
    """Noisy shape images and their labels (0 bar, 1 cross, 2 box), the same for every process."""
    rng = np.random.default_rng(seed + 1234)
    n = n_train + n_test
    labels = rng.integers(0, len(CLASSES), size=n)
    images = np.stack([_draw(int(k), rng) for k in labels])
    images = np.clip(images * rng.uniform(0.6, 1.0, size=(n, 1, 1)) + rng.normal(0, 0.15, size=images.shape), 0, 1)
    pixels = (images * 255).astype(np.uint8)
    return (pixels[:n_train], labels[:n_train]), (pixels[n_train:], labels[n_train:])
