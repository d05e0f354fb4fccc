"""What a model, dataset or loss spec may say, checked without TensorFlow: a typo in a spec is an
error of the run configuration (every role, at once), not a crash inside a started process.

`spec_problems` checks the syntax (RunConfig runs it); `load_problems` also imports the user's
`package.module:function` specs and looks for `npz:` and `keras:` files (the launchers run it before starting
any process, with the user's path in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncps.ml.userfns import is_function_spec, load_function

MODEL_NAMES: tuple[str, ...] = ("logreg", "mlp", "cnn", "embedding", "recsys")
DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion_mnist", "synthetic-logreg", "recsys")
NPZ_PREFIX = "npz:"
SYNTHETIC_PREFIX = "synthetic:"
#: `recsys[:rows=R,...]`: the synthetic recommendation data (int64 ids) and the model with one id table over it.
RECSYS = "recsys"
#: `validation:SEED:DATASET`: DATASET's training split as seed SEED splits it, a stratified share of it
#: (VALIDATION_FRACTION) held out as the evaluation split; its test split is never loaded (tuning runs).
VALIDATION_PREFIX = "validation:"
VALIDATION_FRACTION = 0.2
#: the dataset names that take `name:args` (not a `package.module:function`)
DATASET_PREFIXES: tuple[str, ...] = ("npz", "synthetic", RECSYS, VALIDATION_PREFIX[:-1])
#: `keras:PATH`: a model saved by Keras (`model.save("m.keras")`), weights and all (what asyncps.train sends).
KERAS_PREFIX = "keras:"
DEFAULT_MLP_HIDDEN: tuple[int, ...] = (128, 128)


def parse_hidden(arg: str, spec: str) -> tuple[int, ...]:
    """Hidden sizes from the ``H1,H2,...`` part of an ``mlp:`` spec (empty -> default)."""
    if not arg:
        return DEFAULT_MLP_HIDDEN
    try:
        sizes = tuple(int(part) for part in arg.split(","))
    except ValueError:
        raise ValueError(f"bad mlp spec {spec!r}: expected mlp:H1,H2,... with integers") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"bad mlp spec {spec!r}: hidden sizes must be positive")
    return sizes


@dataclass(frozen=True)
class RecsysData:
    """`recsys:rows=R,features=F,zipf=A,train=N,test=M,hashed=0|1`: categorical ids, Zipf-distributed over
    [0, rows); with hashed=1 each id is sent as a 64-bit hash of it (any int64: a hashed user or item id)."""

    rows: int = 100_000
    features: int = 8
    zipf: float = 1.1
    train: int = 20_000
    test: int = 2_000
    hashed: int = 0


@dataclass(frozen=True)
class RecsysModel:
    """`recsys:rows=R,dim=D,keyed=0|1`: one id table of `rows` rows (0: the data's id space) of width `dim`;
    keyed=1: a HashEmbedding (rows by key on the shards, at most `rows` kept)."""

    rows: int = 0
    dim: int = 32
    keyed: int = 0


def _recsys_fields(spec: str, allowed: dict[str, type]) -> dict[str, int | float]:
    """The `key=value` settings of a `recsys:...` spec, typed as `allowed` says; ValueError for anything else."""
    name, _, arg = spec.partition(":")
    if name != RECSYS:
        raise ValueError(f"not a {RECSYS} spec: {spec!r}")
    fields: dict[str, int | float] = {}
    for part in filter(None, arg.split(",")):
        key, eq, value = part.partition("=")
        kind = allowed.get(key.strip())
        try:
            if kind is None or not eq:
                raise ValueError
            fields[key.strip()] = kind(value)
        except ValueError:
            raise ValueError(f"bad spec {spec!r}: expected {RECSYS}:KEY=VALUE,... with keys "
                             f"{', '.join(allowed)}") from None
    return fields


def parse_recsys_data(spec: str) -> RecsysData:
    """The settings of a `recsys[:rows=R,features=F,zipf=A,train=N,test=M,hashed=0|1]` dataset spec (defaults for
    the rest)."""
    data = RecsysData(**_recsys_fields(spec, {"rows": int, "features": int, "zipf": float, "train": int,
                                              "test": int, "hashed": int}))  # type: ignore[arg-type]
    if data.rows < 2 or data.features < 1 or data.train < 1 or data.test < 1 or not 1.0 < data.zipf <= 5.0 \
            or data.hashed not in (0, 1):
        raise ValueError(f"bad dataset spec {spec!r}: needs rows >= 2, features, train, test >= 1, zipf in (1, 5] "
                         "and hashed 0 or 1")
    return data


def parse_recsys_model(spec: str) -> RecsysModel:
    """The settings of a `recsys[:rows=R,dim=D,keyed=0|1]` model spec (rows 0: the data's id space)."""
    model = RecsysModel(**_recsys_fields(spec, {"rows": int, "dim": int, "keyed": int}))  # type: ignore[arg-type]
    if model.rows < 0 or model.dim < 1 or model.keyed not in (0, 1):
        raise ValueError(f"bad model spec {spec!r}: needs rows >= 1 (or none: the data's), dim >= 1 and keyed 0 or 1")
    return model


def model_problem(spec: str) -> str | None:
    """Why `spec` names no model (None: it does, as far as can be told without building it)."""
    if spec.startswith(KERAS_PREFIX):
        path = spec[len(KERAS_PREFIX):]
        return None if path.endswith(".keras") else f"bad model spec {spec!r}: expected {KERAS_PREFIX}PATH.keras"
    if is_function_spec(spec, MODEL_NAMES):
        return None
    name, _, arg = spec.partition(":")
    if name in ("mlp", RECSYS):
        try:
            parse_hidden(arg, spec) if name == "mlp" else parse_recsys_model(spec)
        except ValueError as exc:
            return str(exc)
        return None
    if name in MODEL_NAMES and not arg:
        return None
    return (f"unknown model spec {spec!r}; valid: {', '.join(MODEL_NAMES)}, mlp:H1,H2,..., recsys:rows=R,dim=D, "
            f"{KERAS_PREFIX}PATH.keras, package.module:function")


def parse_validation(spec: str) -> tuple[int, str]:
    """(split seed, inner dataset spec) of a `validation:SEED:DATASET` spec; ValueError when it is not one."""
    seed, sep, inner = spec[len(VALIDATION_PREFIX):].partition(":")
    if not spec.startswith(VALIDATION_PREFIX) or not sep or not seed.isdigit() or not inner:
        raise ValueError(f"bad dataset spec {spec!r}: expected {VALIDATION_PREFIX}SEED:DATASET, e.g. "
                         f"{VALIDATION_PREFIX}0:digits")
    if inner.startswith(VALIDATION_PREFIX):
        raise ValueError(f"bad dataset spec {spec!r}: a validation split of a validation split")
    return int(seed), inner


def dataset_problem(spec: str) -> str | None:
    """Why `spec` names no dataset (None: it does, as far as its syntax tells)."""
    if spec.startswith(VALIDATION_PREFIX):
        try:
            return dataset_problem(parse_validation(spec)[1])
        except ValueError as exc:
            return str(exc)
    if spec in DATASET_NAMES or is_function_spec(spec, DATASET_PREFIXES):
        return None
    if spec.partition(":")[0] == RECSYS:
        try:
            parse_recsys_data(spec)
        except ValueError as exc:
            return str(exc)
        return None
    if spec.startswith(NPZ_PREFIX) and spec[len(NPZ_PREFIX):]:
        return None
    if spec.startswith(SYNTHETIC_PREFIX):
        features, x, classes = spec[len(SYNTHETIC_PREFIX):].partition("x")
        if x and features.isdigit() and classes.isdigit() and int(features) >= 1 and int(classes) >= 2:
            return None
        return f"bad dataset spec {spec!r}: expected {SYNTHETIC_PREFIX}FEATURESxCLASSES, e.g. synthetic:20x4"
    return f"unknown dataset spec {spec!r}; valid: {valid_datasets()}"


def valid_datasets() -> str:
    """Every kind of dataset spec, for error messages."""
    return ", ".join((*DATASET_NAMES, f"{NPZ_PREFIX}PATH", f"{SYNTHETIC_PREFIX}FEATURESxCLASSES",
                      f"{RECSYS}:rows=R,features=F,zipf=A,train=N,test=M", f"{VALIDATION_PREFIX}SEED:DATASET",
                      "package.module:function"))


def spec_problems(model: str, dataset: str) -> list[str]:
    """The syntax problems of a run's model and dataset specs."""
    return [p for p in (model_problem(model), dataset_problem(dataset)) if p is not None]


def load_problems(model: str, dataset: str, loss: str, metrics: str = "") -> list[str]:
    """spec_problems, then what only loading tells: user functions that do not import, npz files that
    are not there. Call it with the user's path in place (asyncps.ml.userfns.add_user_path)."""
    problems = spec_problems(model, dataset)
    if dataset.startswith(VALIDATION_PREFIX) and not problems:
        dataset = parse_validation(dataset)[1]  # the inner dataset is what loads
    named = [("model", model, (*MODEL_NAMES, KERAS_PREFIX[:-1])), ("dataset", dataset, DATASET_PREFIXES),
             ("loss", loss, ())]
    named += [("metric", m.strip(), ()) for m in metrics.split(",") if m.strip()]
    for what, spec, builtins in named:
        if is_function_spec(spec, builtins):
            try:
                load_function(spec, what)
            except ValueError as exc:
                problems.append(str(exc))
    if dataset.startswith(NPZ_PREFIX) and not Path(dataset[len(NPZ_PREFIX):]).is_file():
        problems.append(f"dataset {dataset!r}: no file {dataset[len(NPZ_PREFIX):]!r}")
    if model.startswith(KERAS_PREFIX) and not Path(model[len(KERAS_PREFIX):]).is_file():
        problems.append(f"model {model!r}: no file {model[len(KERAS_PREFIX):]!r}")
    return problems


__all__ = [
    "DATASET_NAMES",
    "DATASET_PREFIXES",
    "DEFAULT_MLP_HIDDEN",
    "KERAS_PREFIX",
    "MODEL_NAMES",
    "NPZ_PREFIX",
    "RECSYS",
    "SYNTHETIC_PREFIX",
    "VALIDATION_FRACTION",
    "VALIDATION_PREFIX",
    "RecsysData",
    "RecsysModel",
    "dataset_problem",
    "load_problems",
    "model_problem",
    "parse_hidden",
    "parse_recsys_data",
    "parse_recsys_model",
    "parse_validation",
    "spec_problems",
    "valid_datasets",
]
