"""What a model, dataset or loss spec may say, checked without TensorFlow: a typo in a spec is an
error of the run configuration (every role, at once), not a crash inside a started process.

`spec_problems` checks the syntax (RunConfig runs it); `load_problems` also imports the user's
`package.module:function` specs and looks for `npz:` and `keras:` files (the launchers run it before starting
any process, with the user's path in place).
"""

from __future__ import annotations

from pathlib import Path

from asyncps.ml.userfns import is_function_spec, load_function

MODEL_NAMES: tuple[str, ...] = ("logreg", "mlp", "cnn", "embedding")
DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion_mnist", "synthetic-logreg")
NPZ_PREFIX = "npz:"
SYNTHETIC_PREFIX = "synthetic:"
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


def model_problem(spec: str) -> str | None:
    """Why `spec` names no model (None: it does, as far as can be told without building it)."""
    if spec.startswith(KERAS_PREFIX):
        path = spec[len(KERAS_PREFIX):]
        return None if path.endswith(".keras") else f"bad model spec {spec!r}: expected {KERAS_PREFIX}PATH.keras"
    if is_function_spec(spec, MODEL_NAMES):
        return None
    name, _, arg = spec.partition(":")
    if name == "mlp":
        try:
            parse_hidden(arg, spec)
        except ValueError as exc:
            return str(exc)
        return None
    if name in MODEL_NAMES and not arg:
        return None
    return (f"unknown model spec {spec!r}; valid: {', '.join(MODEL_NAMES)}, mlp:H1,H2,..., {KERAS_PREFIX}PATH.keras, "
            "package.module:function")


def dataset_problem(spec: str) -> str | None:
    """Why `spec` names no dataset (None: it does, as far as its syntax tells)."""
    if spec in DATASET_NAMES or is_function_spec(spec, ("npz", "synthetic")):
        return None
    if spec.startswith(NPZ_PREFIX) and spec[len(NPZ_PREFIX):]:
        return None
    if spec.startswith(SYNTHETIC_PREFIX):
        features, x, classes = spec[len(SYNTHETIC_PREFIX):].partition("x")
        if x and features.isdigit() and classes.isdigit() and int(features) >= 1 and int(classes) >= 2:
            return None
        return f"bad dataset spec {spec!r}: expected {SYNTHETIC_PREFIX}FEATURESxCLASSES, e.g. synthetic:20x4"
    valid = ", ".join((*DATASET_NAMES, f"{NPZ_PREFIX}PATH", f"{SYNTHETIC_PREFIX}FEATURESxCLASSES",
                       "package.module:function"))
    return f"unknown dataset spec {spec!r}; valid: {valid}"


def spec_problems(model: str, dataset: str) -> list[str]:
    """The syntax problems of a run's model and dataset specs."""
    return [p for p in (model_problem(model), dataset_problem(dataset)) if p is not None]


def load_problems(model: str, dataset: str, loss: str, metrics: str = "") -> list[str]:
    """spec_problems, then what only loading tells: user functions that do not import, npz files that
    are not there. Call it with the user's path in place (asyncps.ml.userfns.add_user_path)."""
    problems = spec_problems(model, dataset)
    named = [("model", model, (*MODEL_NAMES, KERAS_PREFIX[:-1])), ("dataset", dataset, ("npz", "synthetic")),
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


__all__ = ["DATASET_NAMES", "DEFAULT_MLP_HIDDEN", "KERAS_PREFIX", "MODEL_NAMES", "NPZ_PREFIX", "SYNTHETIC_PREFIX",
           "dataset_problem", "load_problems", "model_problem", "parse_hidden", "spec_problems"]
