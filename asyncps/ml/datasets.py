"""Dataset loading shared by workers and the chief: flat float32 features (or int64 ids, one per categorical
feature), labels as the task has them: int64 class ids [n] (classification), or float32 / int64 arrays [n, ...] of
any shape (regression targets, multi-label 0/1 matrices).

Importing this module is cheap on purpose: keras is imported only inside the loaders that
download MNIST-style data, so processes that train on ``digits`` never pay for it here.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from asyncps.ml.specs import DATASET_NAMES as DATASET_NAMES  # re-exported: the names load_dataset takes
from asyncps.ml.specs import (
    DATASET_PREFIXES,
    NPZ_PREFIX,
    RECSYS,
    SYNTHETIC_PREFIX,
    VALIDATION_FRACTION,
    VALIDATION_PREFIX,
    parse_recsys_data,
    parse_validation,
    valid_datasets,
)
from asyncps.ml.userfns import call_with_accepted, is_function_spec, load_function
from asyncps.placement import mix64

# the dataset specs accepted by load_dataset are checked in asyncps.ml.specs (no TensorFlow)
#: the digits table in asyncps/ml/data: 64 pixel columns (0..16) and the label, one row per image
DIGITS_FILE = "digits.csv.gz"
_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")

# synthetic-logreg geometry: enough rows per feature that the maximum-likelihood fit exists
# (label noise makes the data non-separable) and is cheap to compute exactly.
_SYN_FEATURES = 20
_SYN_TRAIN = 4000
_SYN_TEST = 1000


@dataclass(frozen=True, eq=False)  # eq=False: arrays make field-wise == ambiguous
class Dataset:
    """A train/test split with flat float32 features (or int64 ids: integers kept exact, which float32 is not
    above 2**24) and labels: int64 class ids [n], or targets (float32 or int64 [n, ...], or float32 [n]) of one
    shape per example."""

    name: str
    x_train: np.ndarray  # float32 [n, features] (images flattened row-major (h, w, c)), or int64 ids [n, features]
    y_train: np.ndarray  # int64 [n] class ids; or targets [n, ...]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # class ids: the number of classes; targets: the values per example (at least 1)
    image_shape: tuple[int, ...] | None  # (h, w, c) for images, None otherwise
    optimal_loss: float | None = None  # synthetic-logreg only: min mean training cross-entropy
    num_ids: int | None = None  # int64 x: the id space [0, num_ids) (None: one past the largest id present)
    keyed_ids: bool = False  # int64 x are keys of any value (hashed ids; num_ids: how many distinct there are)
    w_train: np.ndarray | None = None  # float32 [n] loss weights of the training examples (None: all 1)

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x: np.ndarray = getattr(self, f"x_{split}")
            y: np.ndarray = getattr(self, f"y_{split}")
            if x.dtype not in (np.float32, np.int64) or x.ndim != 2:
                raise ValueError(
                    f"x_{split} must be float32 [n, features] or int64 ids [n, features], got {x.dtype} {x.shape}"
                )
            if y.dtype not in (np.int64, np.float32) or y.ndim < 1 or len(y) != len(x):
                raise ValueError(f"y_{split} must be int64 or float32 [{x.shape[0]}, ...], got {y.dtype} {y.shape}")
            if self.has_class_ids and y.size and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(f"y_{split} has labels outside [0, {self.num_classes})")
        if self.y_train.dtype != self.y_test.dtype or self.y_train.shape[1:] != self.y_test.shape[1:]:
            raise ValueError(f"y_train {self.y_train.dtype} {self.y_train.shape[1:]} and y_test {self.y_test.dtype} "
                             f"{self.y_test.shape[1:]} differ per example")
        if self.x_train.shape[1] != self.x_test.shape[1]:
            raise ValueError("x_train and x_test have different feature counts")
        if self.x_train.dtype != self.x_test.dtype:
            raise ValueError(f"x_train is {self.x_train.dtype} but x_test {self.x_test.dtype}")
        self._check_ids()
        if self.w_train is not None and (self.w_train.dtype != np.float32 or self.w_train.shape != (len(self.x_train),)
                                         or not np.isfinite(self.w_train).all() or (self.w_train < 0).any()):
            raise ValueError(f"w_train must be float32 [{len(self.x_train)}] of finite weights >= 0, got "
                             f"{self.w_train.dtype} {self.w_train.shape}")
        if self.image_shape is not None and int(np.prod(self.image_shape)) != self.num_features:
            raise ValueError(f"image_shape {self.image_shape} != {self.num_features} features")

    def _check_ids(self) -> None:
        """Integer features are ids: none negative, all inside num_ids when it is given."""
        if self.x_train.dtype != np.int64:
            if self.num_ids is not None or self.keyed_ids:
                raise ValueError("num_ids and keyed_ids are for int64 ids; x is float32")
            return
        if self.keyed_ids:  # keys: any int64
            return
        low = min(int(self.x_train.min(initial=0)), int(self.x_test.min(initial=0)))
        if low < 0:
            raise ValueError(f"int64 x holds a negative id ({low})")
        high = _largest_id(self.x_train, self.x_test)
        if self.num_ids is not None and high >= self.num_ids:
            raise ValueError(f"int64 x holds id {high}, outside num_ids {self.num_ids}")

    @property
    def id_rows(self) -> int:
        """Rows an id table needs for int64 x: num_ids, else one past the largest id present (0 for float x)."""
        if self.x_train.dtype != np.int64:
            return 0
        if self.keyed_ids:  # keys have no id space: the distinct ids there are (0: unknown)
            return self.num_ids or 0
        return self.num_ids if self.num_ids is not None else 1 + _largest_id(self.x_train, self.x_test)

    @property
    def has_class_ids(self) -> bool:
        """True when the labels are integer class ids [n] (classification), not targets."""
        return self.y_train.ndim == 1 and self.y_train.dtype == np.int64

    @property
    def targets(self) -> tuple[int, ...] | None:
        """One example's label shape when the labels are targets (`()` for [n] floats); None for class ids."""
        return None if self.has_class_ids else tuple(int(d) for d in self.y_train.shape[1:])

    @property
    def num_features(self) -> int:
        """Number of flat input features per example."""
        return int(self.x_train.shape[1])


def _largest_id(*arrays: np.ndarray) -> int:
    """The largest value over `arrays` (-1 when all are empty)."""
    return max(int(a.max(initial=-1)) for a in arrays)


def load_dataset(spec: str, seed: int = 0) -> Dataset:
    """Load the dataset named by ``spec``; cached per (spec, seed), arrays are read-only."""
    return _load_cached(spec, seed)


@functools.lru_cache(maxsize=16)
def _load_cached(spec: str, seed: int) -> Dataset:
    # The cached arrays are shared by every caller in the process, so freeze them: an in-place
    # edit by one component would otherwise silently change the data seen by another.
    ds = _load_uncached(spec, seed)
    for arr in (ds.x_train, ds.y_train, ds.x_test, ds.y_test):
        arr.setflags(write=False)
    return ds


def _load_uncached(spec: str, seed: int) -> Dataset:
    if spec.startswith(VALIDATION_PREFIX):
        return validation_split(spec)
    if spec == "digits":
        return _load_digits(seed)
    if spec in ("mnist", "fashion_mnist"):
        return _load_keras_images(spec, seed)
    if spec == "synthetic-logreg":
        return _make_synthetic_logreg(seed)
    if spec.startswith(NPZ_PREFIX):
        return _load_npz(spec[len(NPZ_PREFIX) :])
    if spec.startswith(SYNTHETIC_PREFIX):
        return _make_synthetic_classification(spec, seed)
    if spec.partition(":")[0] == RECSYS:
        return make_recsys(spec, seed)
    if is_function_spec(spec, DATASET_PREFIXES):
        return _load_user_dataset(spec, seed)
    raise ValueError(f"unknown dataset spec {spec!r}; valid: {valid_datasets()}")


def validation_split(spec: str) -> Dataset:
    """`validation:SEED:DATASET`: DATASET as seed SEED loads it (the split a run of that seed trains and tests
    on), its training examples split again, VALIDATION_FRACTION held out (stratified by class for class ids,
    seeded by SEED) as the evaluation split; the rest is the training split. The test split is dropped: a
    tuning run of any seed evaluates on data the measured run of seed SEED trains on, never on its test set."""
    split_seed, inner = parse_validation(spec)
    data = load_dataset(inner, split_seed)
    rng = np.random.default_rng([split_seed, 0x7A1])  # not the inner split's stream
    if data.has_class_ids:
        train, held = _stratified_split(data.y_train, VALIDATION_FRACTION, rng)
    else:
        order = rng.permutation(len(data.y_train))
        n_held = round(len(order) * VALIDATION_FRACTION)
        train, held = order[n_held:], order[:n_held]
    if not len(train) or not len(held):
        raise ValueError(f"dataset {spec!r}: {len(data.y_train)} training examples are too few to hold some out")
    return dataclasses.replace(
        data, name=spec, x_train=data.x_train[train], y_train=data.y_train[train], x_test=data.x_train[held],
        y_test=data.y_train[held], optimal_loss=None,
        num_ids=data.num_ids if data.num_ids is not None or data.x_train.dtype != np.int64 else data.id_rows,
        w_train=None if data.w_train is None else data.w_train[train])


def worker_shard(n: int, index: int, num_workers: int) -> np.ndarray:
    """Indices of worker ``index``'s contiguous shard of ``range(n)`` (np.array_split sizes)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not 0 <= index < num_workers:
        raise ValueError(f"worker index {index} out of range [0, {num_workers})")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # np.array_split gives the first n % num_workers shards one extra element.
    base, extra = divmod(n, num_workers)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return np.arange(start, stop, dtype=np.int64)


def _stratified_split(
    y: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle within each class and split every class by ``test_fraction``."""
    train_parts: list[np.ndarray] = []
    test_parts: list[np.ndarray] = []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        n_test = round(len(idx) * test_fraction)
        test_parts.append(idx[:n_test])
        train_parts.append(idx[n_test:])
    # Shuffle across classes too: workers take contiguous shards, which must not be class-sorted.
    return rng.permutation(np.concatenate(train_parts)), rng.permutation(np.concatenate(test_parts))


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 UCI handwritten digits shipped with asyncps: (x [1797, 64] float64 in 0..16, y [1797] int64).

    The same file, rows and order as scikit-learn's `load_digits` (asyncps/ml/data/README.md), read with numpy:
    a 57 KB table did not justify scikit-learn and scipy (164 MB) in every process, shards included.
    """
    source = resources.files("asyncps.ml") / "data" / DIGITS_FILE
    with source.open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float64)
    return table[:, :-1], table[:, -1].astype(np.int64)


def _load_digits(seed: int) -> Dataset:
    """The 8x8 UCI digits shipped with the package (offline), scaled to [0, 1]."""
    data, target = load_digits()
    x = (data / 16.0).astype(np.float32)
    y = target
    train, test = _stratified_split(y, 0.2, np.random.default_rng(seed))
    return Dataset(
        name="digits",
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=10,
        image_shape=(8, 8, 1),
    )


def _load_keras_images(name: str, seed: int) -> Dataset:
    """MNIST or Fashion-MNIST through keras.datasets (downloads on first use), scaled to [0, 1]."""
    import keras  # lazy: keeps `import asyncps.ml.datasets` free of TensorFlow

    loader = keras.datasets.mnist if name == "mnist" else keras.datasets.fashion_mnist
    (x_train, y_train), (x_test, y_test) = loader.load_data()
    # Seeded shuffle of the training set so that contiguous worker shards differ only by seed.
    order = np.random.default_rng(seed).permutation(len(y_train))
    return Dataset(
        name=name,
        x_train=_flatten_images(np.asarray(x_train)[order]),
        y_train=np.asarray(y_train, dtype=np.int64)[order],
        x_test=_flatten_images(np.asarray(x_test)),
        y_test=np.asarray(y_test, dtype=np.int64),
        num_classes=10,
        image_shape=(28, 28, 1),
    )


def _flatten_images(x: np.ndarray) -> np.ndarray:
    """uint8 [n, h, w] -> float32 [n, h*w] in [0, 1]."""
    return (x.reshape(len(x), -1).astype(np.float32) / np.float32(255.0)).astype(np.float32)


def _load_npz(path: str) -> Dataset:
    """A local .npz with x_train, y_train, x_test, y_test; images are flattened."""
    if not path:
        raise ValueError(f"npz spec needs a path: {NPZ_PREFIX}PATH")
    with np.load(Path(path), allow_pickle=False) as data:
        missing = [k for k in _NPZ_KEYS if k not in data.files]
        if missing:
            raise ValueError(
                f"{path}: missing keys {missing}; need {list(_NPZ_KEYS)}, found {data.files}"
            )
        x_train, y_train, x_test, y_test = (np.asarray(data[k]) for k in _NPZ_KEYS)
        weights = np.asarray(data["w_train"]) if "w_train" in data.files else None
    loaded = _from_arrays(f"{NPZ_PREFIX}{path}", x_train, y_train, x_test, y_test, where=path)
    if weights is None:
        return loaded
    if weights.shape != (len(loaded.x_train),) or not np.issubdtype(weights.dtype, np.number):
        raise ValueError(f"{path}: w_train must be [{len(loaded.x_train)}] numbers (one weight per training "
                         f"example), got {weights.dtype} {weights.shape}")
    return dataclasses.replace(loaded, w_train=weights.astype(np.float32))


def _load_user_dataset(spec: str, seed: int) -> Dataset:
    """`package.module:function` returning `(x_train, y_train), (x_test, y_test)` like
    keras.datasets.*.load_data(); it is called with `seed` if it takes one."""
    loaded = call_with_accepted(load_function(spec, "dataset"), seed=seed)
    try:
        (x_train, y_train), (x_test, y_test) = loaded
    except (TypeError, ValueError):
        raise ValueError(f"dataset {spec!r} must return (x_train, y_train), (x_test, y_test), "
                         f"got {type(loaded).__name__}") from None
    return _from_arrays(spec, np.asarray(x_train), np.asarray(y_train), np.asarray(x_test), np.asarray(y_test),
                        where=f"dataset {spec}")


def _from_arrays(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                 where: str) -> Dataset:
    """A Dataset of loaded arrays: images flattened (their layout kept); integer labels [n] or [n, 1] as int64
    class ids, other labels as targets (float32, or int64 for integer arrays such as multi-label 0/1)."""
    path = where
    image_shape = _npz_image_shape(x_train, path)
    if _npz_image_shape(x_test, path) != image_shape or x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{path}: x_train {x_train.shape} and x_test {x_test.shape} differ")
    y_train = _npz_labels(y_train, len(x_train), "y_train", path)
    y_test = _npz_labels(y_test, len(x_test), "y_test", path)
    if y_train.dtype != y_test.dtype or y_train.shape[1:] != y_test.shape[1:]:
        raise ValueError(f"{path}: y_train {y_train.dtype} {y_train.shape} and y_test {y_test.dtype} {y_test.shape} "
                         "differ per example")
    if y_train.ndim == 1 and y_train.dtype == np.int64:
        num_classes = int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1
    else:
        num_classes = int(np.prod(y_train.shape[1:], dtype=np.int64))
    return Dataset(
        name=name,
        x_train=_npz_features(x_train),
        y_train=y_train,
        x_test=_npz_features(x_test),
        y_test=y_test,
        num_classes=max(num_classes, 2) if y_train.ndim == 1 and y_train.dtype == np.int64 else max(num_classes, 1),
        image_shape=image_shape,
    )


def _npz_image_shape(x: np.ndarray, path: str) -> tuple[int, ...] | None:
    """(h, w, c) for [n, h, w] / [n, h, w, c] arrays, None for flat [n, f]."""
    if x.ndim == 2:
        return None
    if x.ndim == 3:
        return (int(x.shape[1]), int(x.shape[2]), 1)
    if x.ndim == 4:
        return (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
    raise ValueError(f"{path}: features must be [n,f], [n,h,w] or [n,h,w,c], got {x.shape}")


def _npz_features(x: np.ndarray) -> np.ndarray:
    """Flatten to [n, f]: uint8 pixels scaled to float32 in [0, 1] like the keras loaders, other integers kept as
    int64 ids (float32 would round ids above 2**24 onto a neighbour's), the rest as float32."""
    flat = x.reshape(len(x), -1)
    if flat.dtype == np.uint8:
        return (flat.astype(np.float32) / np.float32(255.0)).astype(np.float32)
    if np.issubdtype(flat.dtype, np.integer):
        return flat.astype(np.int64)
    return flat.astype(np.float32)


def _npz_labels(y: np.ndarray, n: int, key: str, path: str) -> np.ndarray:
    """Labels: integer [n] or [n, 1] -> int64 class ids [n]; other integer arrays -> int64, bool and floating
    ones -> float32 (targets of any shape per example)."""
    if y.ndim == 0 or len(y) != n:
        raise ValueError(f"{path}: {key} must have {n} labels (one per example), got shape {y.shape}")
    if np.issubdtype(y.dtype, np.integer):
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim == 1 and y.size and y.min() < 0:
            raise ValueError(f"{path}: {key} has negative class ids")
        return y.astype(np.int64)
    if y.dtype == np.bool_ or np.issubdtype(y.dtype, np.floating):
        out = y.astype(np.float32)
        if not np.isfinite(out).all():
            raise ValueError(f"{path}: {key} holds NaN or infinite values")
        return out
    raise ValueError(f"{path}: {key} must be numeric (integer class ids or float targets), got {y.dtype}")


def _make_synthetic_logreg(seed: int) -> Dataset:
    """Binary logistic data with label noise: convex, non-separable, known optimum."""
    rng = np.random.default_rng(seed)
    # ||w*|| ~ 2 keeps P(y=1|x) away from 0/1 for most rows, so noise keeps it non-separable.
    w_star = rng.normal(size=_SYN_FEATURES) * (2.0 / np.sqrt(_SYN_FEATURES))
    b_star = 0.5
    x = rng.normal(size=(_SYN_TRAIN + _SYN_TEST, _SYN_FEATURES))
    p = _sigmoid(x @ w_star + b_star)
    y = (rng.random(len(p)) < p).astype(np.int64)
    x32 = x.astype(np.float32)
    x_train, y_train = x32[:_SYN_TRAIN], y[:_SYN_TRAIN]
    # Optimum over the float32 features the model actually sees.
    _, _, opt = logreg_optimum(x_train.astype(np.float64), y_train)
    return Dataset(
        name="synthetic-logreg",
        x_train=x_train,
        y_train=y_train,
        x_test=x32[_SYN_TRAIN:],
        y_test=y[_SYN_TRAIN:],
        num_classes=2,
        image_shape=None,
        optimal_loss=opt,
    )


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function."""
    out: np.ndarray = np.exp(-np.logaddexp(0.0, -z))
    return out


def binary_cross_entropy(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: float) -> float:
    """Mean binary cross-entropy of labels y in {0, 1} under logits x @ w + b (float64)."""
    z = x.astype(np.float64) @ w + b
    # log(1 + e^z) - y z, computed stably.
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def logreg_optimum(
    x: np.ndarray, y: np.ndarray, iters: int = 50, tol: float = 1e-12
) -> tuple[np.ndarray, float, float]:
    """Unregularised logistic-regression minimiser (w, b, loss) by damped Newton in float64."""
    xa = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
    yf = y.astype(np.float64)
    theta = np.zeros(xa.shape[1])

    def loss(t: np.ndarray) -> float:
        z = xa @ t
        return float(np.mean(np.logaddexp(0.0, z) - yf * z))

    current = loss(theta)
    for _ in range(iters):
        p = _sigmoid(xa @ theta)
        grad = xa.T @ (p - yf) / len(yf)
        if float(np.max(np.abs(grad))) < tol:
            break
        hess = (xa * (p * (1.0 - p))[:, None]).T @ xa / len(yf)
        step = np.linalg.solve(hess + 1e-12 * np.eye(len(theta)), grad)
        # Backtracking keeps Newton monotone even from a poor start.
        t = 1.0
        while t > 1e-10:
            candidate = loss(theta - t * step)
            if candidate <= current:
                theta, current = theta - t * step, candidate
                break
            t *= 0.5
        else:
            break  # no descent possible at float64 precision: converged
    return theta[:-1], float(theta[-1]), current
    return theta[:-1], float(theta[-1]), current


def _make_synthetic_classification(spec: str, seed: int) -> Dataset:
    """`synthetic:784x10`: Gaussian features labelled by a random linear teacher (benchmarks).

    It has the shape of MNIST without a download, so throughput runs need no network.
    """
    try:
        features, classes = (int(v) for v in spec[len(SYNTHETIC_PREFIX):].split("x"))
    except ValueError:
        raise ValueError(f"bad dataset spec {spec!r}: expected {SYNTHETIC_PREFIX}FEATURESxCLASSES") from None
    if features < 1 or classes < 2:
        raise ValueError(f"bad dataset spec {spec!r}: needs >= 1 feature and >= 2 classes")
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    x = rng.standard_normal((6000, features)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    return Dataset(name=spec, x_train=x[:5000], y_train=y[:5000], x_test=x[5000:], y_test=y[5000:],
                   num_classes=classes, image_shape=None)


#: recsys: the scale of the hidden per-id weights (uniform in [-1, 1]): with 8 features the summed logit has a
#: standard deviation near 2.4, so labels follow the ids clearly (Bayes accuracy ~0.8) and stay noisy.
RECSYS_WEIGHT_SCALE = 1.5
_MASK64 = (1 << 64) - 1
#: recsys with hashed=1: the salt of the ids' hash (any constant: the keys only need to look like hashes)
HASHED_SALT = 0x5DEECE66D


def make_recsys(spec: str, seed: int) -> Dataset:
    """`recsys:rows=R`: int64 ids [n, features], Zipf-distributed over [0, rows), with 0/1 labels of a hidden rule.

    Each id has a hidden weight (a hash of the id and the seed); a row's label is drawn (with the seed) from the
    logistic of its ids' weights summed, so only a model that learns per-id values can beat chance. Nothing of
    size `rows` is made: 10M rows cost what 10K do (a recommendation table's shape, offline).
    """
    cfg = parse_recsys_data(spec)
    rng = np.random.default_rng(seed)
    n = cfg.train + cfg.test
    ranks = zipf_ranks(rng, (n, cfg.features), cfg.rows, cfg.zipf)
    ids = scatter_ranks(ranks, cfg.rows)
    logits = RECSYS_WEIGHT_SCALE * hidden_id_weights(ids, seed).sum(axis=1)
    y = (rng.random(n) < _sigmoid(logits)).astype(np.int64)
    if cfg.hashed:  # each id as a 64-bit hash of it (a bijection: as many distinct keys as ids)
        ids = mix64(ids.astype(np.uint64) ^ np.uint64(HASHED_SALT)).view(np.int64)
    return Dataset(name=spec, x_train=ids[:cfg.train], y_train=y[:cfg.train], x_test=ids[cfg.train:],
                   y_test=y[cfg.train:], num_classes=2, image_shape=None, num_ids=cfg.rows,
                   keyed_ids=bool(cfg.hashed))


def zipf_ranks(rng: np.random.Generator, shape: tuple[int, ...], rows: int, exponent: float) -> np.ndarray:
    """Popularity ranks in [0, rows), P(rank k) close to Zipf's (k + 1) ** -exponent: the inverse CDF of a
    continuous power law bounded to [1, rows + 1), floored (no table of `rows` probabilities to sample from)."""
    u = rng.random(shape)
    power = 1.0 - exponent
    x = (1.0 + u * ((rows + 1.0) ** power - 1.0)) ** (1.0 / power)
    ranks: np.ndarray = np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)
    return ranks


def scatter_ranks(ranks: np.ndarray, rows: int) -> np.ndarray:
    """Ids from ranks: an affine bijection of [0, rows) per feature (column), so each feature's popular ids are
    its own and spread over the table (as hashed ids are), not packed at its start."""
    multiplier = 2_654_435_761 % rows or 1
    while math.gcd(multiplier, rows) != 1:
        multiplier += 1
    offsets = (np.arange(ranks.shape[1], dtype=np.int64) * 1_000_003 + 12_345) % rows
    # ranks < rows <= 2**31 keep rank * multiplier below 2**63
    return (ranks * multiplier + offsets) % rows


def hidden_id_weights(ids: np.ndarray, seed: int) -> np.ndarray:
    """Each id's hidden weight, uniform in [-1, 1): splitmix64 of the id and the seed (no table of all ids)."""
    z = ids.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64)
    with np.errstate(over="ignore"):  # the hash wraps around 2**64 on purpose
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    unit = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return 2.0 * unit - 1.0


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of the training set for one epoch (the same in chief and workers)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)
