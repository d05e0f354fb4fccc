"""The Python API: train a model on a local cluster from a script or a notebook.

    import asyncps
    result = asyncps.train(model=keras_model, x=x_train, y=y_train, validation_data=(x_test, y_test),
                           num_workers=2, num_ps=1, epochs=5)
    result.model            # the trained keras.Model: keras_model itself, trained in place
    result.summary          # the RunSummary (summary.json)
    result.history.history  # like Keras' History: val_loss, val_accuracy, loss, ... per evaluation

A model object (or a builder that cannot travel by name: a lambda, a function in `__main__` or a
notebook) is saved into the run directory as a .keras file that every process loads (`keras:PATH`);
arrays are saved as an .npz (`npz:PATH`). Specs and importable functions travel by name as before.

The pieces it is built from are public too: `run_ps`, `run_worker` and `run_chief` run one role
in the calling process until stopped (what `asyncps ps|worker|chief` run), and `LocalCluster`
starts a whole cluster as OS processes (what `asyncps local` and `train` run).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncps.chief.main import ChiefConfig, run_chief
from asyncps.config import RunConfig, coerce_settings
from asyncps.ml.specs import KERAS_PREFIX, NPZ_PREFIX
from asyncps.ml.userfns import (
    USER_PATH_ENV,
    add_user_path,
    call_with_accepted,
    is_function_spec,
    load_function,
    user_path_from_env,
)
from asyncps.ps.main import PsConfig, run_ps
from asyncps.rundir import EvalRow, PushRow, RunDir, RunSummary, atomic_write, iter_rows, read_rows
from asyncps.tools import datainput, kerasdata
from asyncps.tools.local import LocalCluster, default_run_dir, run_local
from asyncps.tools.progress import EvalLineDisplay, StatusSink, display_for
from asyncps.worker.config import WorkerConfig
from asyncps.worker.main import run_worker


class TrainingFailed(RuntimeError):
    """A run ended without a summary, or its chief exited with an error (see the run's logs/)."""


class RunDiverged(TrainingFailed):
    """The run ended as diverged (the chief's exit status 5): `summary` (summary.json) says why in `verdict`."""

    def __init__(self, message: str, summary: RunSummary) -> None:
        super().__init__(message)
        self.summary = summary


def spec_of(target: str | Callable[..., Any], what: str) -> str:
    """A spec string for a model/dataset/loss given as a spec or as an importable function.

    A function travels to the other processes by name (`module:qualname`), so it must be defined
    at the top level of an importable module, not in `__main__` or as a lambda.
    """
    if isinstance(target, str):
        return target
    module, name = getattr(target, "__module__", ""), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or not name or "<" in name:
        raise ValueError(f"{what} {target!r}: pass a function defined in an importable module (not __main__, "
                         "not a lambda), or a 'package.module:function' spec")
    return f"{module}:{name}"


class History(list[EvalRow]):
    """The run's evaluations on the validation data (eval.csv's rows, oldest first), and like Keras'
    `History`: `.history`, a dict of lists with one entry per evaluation — `val_loss`, `val_accuracy`
    (NaN when the task measures none), `loss` (the workers' mean training loss over the pushes since the
    evaluation before; with none since, the last one before), `updates` (applied) and `elapsed_s` (training
    time) — and `.epoch`, their numbers."""

    def __init__(self, rows: list[EvalRow], pushes: Iterable[PushRow] = ()) -> None:
        super().__init__(rows)
        losses = sorted((p.wall_time, p.loss) for p in pushes if p.accepted and np.isfinite(p.loss))
        train, start = [], float("-inf")
        for row in rows:
            window = [loss for at, loss in losses if start < at <= row.wall_time]
            before = [loss for at, loss in losses if at <= row.wall_time]
            # no push since the evaluation before (the final one, after training ended): the last loss before it
            train.append(float(np.mean(window)) if window else float(before[-1]) if before else float("nan"))
            start = row.wall_time
        self.history: dict[str, list[float]] = {
            "loss": train, "val_loss": [r.loss for r in rows], "val_accuracy": [r.accuracy for r in rows],
            "updates": [float(r.updates) for r in rows], "elapsed_s": [r.elapsed_s for r in rows]}
        self.epoch = list(range(len(rows)))


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns: the trained Keras model, the run's summary and its evaluation history.

    Attributes the result lacks are looked up on `summary` (`result.final_eval`, `result.workers`):
    code written when `train` returned the RunSummary keeps working, except `.model`, which is now the
    trained model (the spec is `result.summary.model`).
    """

    model: Any  # keras.Model: the caller's architecture (compiled as the caller compiled it) with the final weights
    summary: RunSummary
    # eval.csv's rows, one per evaluation on the validation data, with Keras' `.history` dict (History)
    history: History = field(default_factory=lambda: History([]))
    run_dir: Path | None = None

    def __getattr__(self, name: str) -> Any:
        # only called for attributes the dataclass lacks; dunder lookups must not reach the summary
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.summary, name)


#: What a model argument may be: a spec, a builder function or a keras.Model (Any: keras is untyped).
ModelArg = Any


def train(model: ModelArg = "mlp", dataset: str | Callable[..., Any] | None = None, *,
          x: Any = None, y: Any = None, validation_data: tuple[Any, Any] | None = None,
          validation_split: float = 0.0, loss: str | Callable[..., Any] | None = None,
          run_dir: str | Path | None = None, user_path: Iterable[str] = (), progress: bool | None = None,
          secure: bool = False, callbacks: Iterable[Any] = (), sample_weight: Any = None,
          class_weight: Mapping[int, float] | None = None, verbose: int | str = "auto",
          dataset_fn: Callable[..., Any] | None = None, steps_per_epoch: int | None = None,
          **settings: Any) -> TrainResult:
    """Train on a local cluster to completion; return the trained model, the summary and the history.

    `model`: a keras.Model (compiled or not; its weights are the start, and it is trained in place, as
    `model.fit` trains it: afterwards its weights are the run's final ones), a builder function, or a
    spec (`mlp`, `keras:PATH.keras`, `package.module:function`). A builder importable by name travels
    by name; a lambda or one defined in `__main__`/a notebook is called once here (with those of
    `input_shape`, `num_classes`, `seed` it takes) and its model saved like a model object. Custom
    layers/losses must be registered (`keras.saving.register_keras_serializable`) in an importable
    module (on `user_path`).
    Data: `dataset` (a spec or importable function; default `digits`), or arrays `x`, `y` with
    `validation_data=(x, y)` or a `validation_split` (the last fraction, like Keras); evaluations run on
    the validation arrays. `x` of any shape per example, sent as float32 (integer arrays as int64 ids, exact);
    for a model object of several inputs, a list of arrays in its input order or a dict keyed by its input names
    (validation x too), packed into one array (asyncps.ml.multiio); of several outputs, `y` likewise, the model
    compiled with a loss per output (its loss_weights and metrics per output come with it: asyncps.ml.heads);
    `y`: integer class ids [n] or [n, 1] (classification), or targets of any shape per example (float
    regression targets, 0/1 multi-label matrices), whatever the loss takes. `x` (and `validation_data`) may
    also be what `model.fit` reads batches of (x, y) from: a `tf.data.Dataset`, a `keras.utils.PyDataset`,
    a generator or a function returning one; finite ones, read here to their end into arrays
    (asyncps.tools.kerasdata), so each example is trained once per epoch. `dataset_fn` (instead of x, y):
    TF's parameter-server habit, a function (or `package.module:function` spec) of a worker's context
    (`worker_index`, `num_workers`) returning its tf.data.Dataset of batches; called here once per worker and read
    into arrays (asyncps.tools.datainput).
    `steps_per_epoch`: the batches read from `x`'s source or (in total) the workers' datasets; needed for endless
    ones, whose first `steps_per_epoch` batches are then trained once every epoch.
    `sample_weight` (one weight >= 0 per example of `x`) and `class_weight` ({class id: weight}, class ids
    only) weight each example's loss on the workers as `model.fit` weights it (the weighted sum over the batch
    size; both given: multiplied); a `validation_split` leaves the validation examples' weights out.
    `loss`: a spec or importable function; by default the loss the model was compiled with (its
    metrics too: the chief reports them, and accuracy only for class ids or when they name it), else
    `crossentropy` of logits over class ids.
    `settings` are RunConfig fields (`num_workers=2`, `num_ps=1`, `epochs=5`, `optimizer="adam"`, ...). Without
    `optimizer=`, a compiled model's optimizer is the shards' when they implement it (SGD with or without
    momentum or Nesterov, Adam, Adagrad: its rate and hyperparameters), else a ValueError says what to give.
    `callbacks`: Keras callbacks. `keras.callbacks.EarlyStopping` becomes the chief's `early_stop` rule (its
    monitor, patience, min_delta and mode: the run ends there, and the summary says why); the others run
    here, on each evaluation as an epoch's end (`on_epoch_end(i, logs)` with `val_loss`, `val_accuracy`,
    `updates`), with the caller's model set: with a ModelCheckpoint among them, the model holds the weights each
    evaluation measured when the callbacks see it (the chief writes them: `eval_weights`), so the checkpoint
    saves what its `monitor` judged (a model object's only; not for Embedding tables read by rows, which only
    the shards hold: give `row_pull="off"`); otherwise the start's until the run ends.
    `user_path`: directories every process (this one too) imports user code from. `verbose` as Keras': 0
    silent, 1 a live progress display (a bar on a terminal, status lines elsewhere), 2 one line per evaluation;
    "auto" (the default) 1 where a person watches (a terminal or a notebook), else 0. `progress` (True/False)
    is the older spelling of 1/0. Raises ValueError
    for bad inputs (before any process starts), RunDiverged (a TrainingFailed) when the run ended as
    diverged (its summary's `verdict` says why), TrainingFailed when the run ends without a summary or
    with a failed chief.
    """
    dirs = add_user_path([*user_path_from_env(), *user_path])  # first: a dataset_fn spec may import from it
    workers = settings.get("num_workers", RunConfig.__dataclass_fields__["num_workers"].default)
    x, y, sample_weight = datainput.read_inputs(x, y, sample_weight, dataset_fn, steps_per_epoch, workers)
    if kerasdata.kind(x) is not None:
        if y is not None:
            raise ValueError("asyncps.train: x= is a dataset of (x, y) batches; do not give y= as well")
        x, y, weighted = kerasdata.read(x, "x")
        if weighted is not None:
            if sample_weight is not None:
                raise ValueError("asyncps.train: x= yields (x, y, sample_weight) batches; do not give sample_weight=")
            sample_weight = weighted
    if kerasdata.kind(validation_data) is not None:
        x_val, y_val, weighted = kerasdata.read(validation_data, "validation_data")
        if weighted is not None:
            raise ValueError("asyncps.train: validation_data yields sample weights; the chief's evaluation is "
                             "unweighted (give (x, y) batches)")
        validation_data = (x_val, y_val)
    model, x, y, validation_data = _pack_several(model, x, y, validation_data, int(settings.get("seed", 0)))
    if _is_keras_model(model) and len(model.outputs) > 1 and (loss is not None or class_weight is not None):
        raise ValueError("asyncps.train: the model has several outputs: compile it with a loss per output "
                         "(model.compile(loss={name: loss}, loss_weights=...)) instead of loss=; class_weight= "
                         "weighs class ids of one output")
    weights = _weights(sample_weight, class_weight, y, dataset)
    level = _verbosity(verbose, progress)
    if _is_keras_model(model):
        _refuse_keyed(model)
    others, derived = _split_callbacks(callbacks, model, settings)
    arrays = _split_arrays(dataset, x, y, validation_data, validation_split)
    if arrays is not None and loss is None:
        _check_default_loss(arrays[1], model)
    where = (Path(run_dir) if run_dir is not None else default_run_dir()).resolve()
    files = RunDir(where)
    dataset_spec = spec_of(dataset if dataset is not None else "digits", "dataset")
    if arrays is not None:
        files.root.mkdir(parents=True, exist_ok=True)
        saved_arrays = {"x_train": arrays[0], "y_train": arrays[1], "x_test": arrays[2], "y_test": arrays[3]}
        if weights is not None:
            saved_arrays["w_train"] = weights[:len(arrays[0])]  # a validation split's weights cut off
        # numpy's stub types **arrays as its allow_pickle keyword (numpy 2.x), which numpy 1.26 has not
        np.savez(files.input_data, **saved_arrays)  # type: ignore[arg-type]
        dataset_spec = f"{NPZ_PREFIX}{files.input_data}"
    saved = _saveable_model(model, arrays, dataset_spec, int(settings.get("seed", 0)))
    if saved is not None and "optimizer" not in settings:
        settings = {**compiled_optimizer(saved, keep_rate="learning_rate" in settings), **settings}
    if saved is not None:
        files.root.mkdir(parents=True, exist_ok=True)
        saved.save(files.input_model)
        model_spec = f"{KERAS_PREFIX}{files.input_model}"
    else:
        model_spec = spec_of(model, "model")
    loss_spec = spec_of(loss, "loss") if loss is not None else _compiled_loss(saved)
    if saved is not None and len(saved.outputs) == 1:
        _warn_logits_mismatch(saved, loss_spec)
    fields = {"model": model_spec, "dataset": dataset_spec, "loss": loss_spec, **derived, **settings}
    run = RunConfig.from_layers(coerce_settings(fields, "asyncps.train"))
    env = {USER_PATH_ENV: os.pathsep.join(dict.fromkeys(dirs))} if dirs else None
    display = None if level == 0 else display_for(sys.stdout) if level == 1 else EvalLineDisplay(sys.stdout)
    sink = EvaluationCallbacks(others, files, model if _is_keras_model(model) else None, display,
                               run.eval_weights) if others else display
    code = run_local(run, where, progress=display is not None, env=env, secure=secure, sink=sink, quiet=level == 0)
    if code != 0 and files.summary.exists() and (summary := RunSummary.load(where)).diverged:
        raise RunDiverged(f"asyncps.train: {summary.verdict}; logs in {files.logs}", summary)
    if code != 0 or not files.summary.exists():
        raise TrainingFailed(f"asyncps.train: the chief exited with {code}; logs in {files.logs}"
                             + _last_error(files.log("chief")))
    into = model if saved is not None and _is_keras_model(model) else None
    history = History(read_rows(files.evals, EvalRow), iter_rows(files.pushes, PushRow))
    return TrainResult(model=_trained_model(files, saved is not None, into), summary=RunSummary.load(where),
                       history=history, run_dir=where)


def _split_callbacks(callbacks: Iterable[Any], model: Any, settings: Mapping[str, Any]) -> tuple[list[Any],
                                                                                              dict[str, Any]]:
    """The callbacks to run here, and the settings they become: EarlyStopping the early_stop rule, a
    ModelCheckpoint eval_weights (refused without a model object, or with Embedding tables read by rows)."""
    import keras

    others: list[Any] = []
    derived: dict[str, Any] = {}
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.EarlyStopping):
            mode = "auto" if callback.mode == "auto" else callback.mode
            derived["early_stop"] = (f"{callback.monitor}:patience={max(1, callback.patience)},"
                                     f"min_delta={abs(callback.min_delta):g},mode={mode}")
        elif isinstance(callback, keras.callbacks.Callback):
            if isinstance(callback, keras.callbacks.ModelCheckpoint):
                _check_model_checkpoint(model, settings)
                derived["eval_weights"] = True
            if isinstance(callback, keras.callbacks.TensorBoard) and getattr(model, "optimizer", None) is None:
                raise ValueError("asyncps.train: keras.callbacks.TensorBoard logs the compiled optimizer's rate: "
                                 "compile the model object, or read the run's own TensorBoard events "
                                 "(tensorboard --logdir RUN_DIR/tb)")
            others.append(callback)
        else:
            raise ValueError(f"asyncps.train: callbacks are keras.callbacks.Callback objects, not {callback!r}")
    return others, derived


def _check_model_checkpoint(model: Any, settings: Mapping[str, Any]) -> None:
    """ValueError when a ModelCheckpoint cannot save the weights each evaluation measured."""
    if not _is_keras_model(model):
        raise ValueError("asyncps.train: ModelCheckpoint saves the model object it is given: pass model= a "
                         "keras.Model (a spec or a builder has none here), or use the run's checkpoints "
                         "(checkpoint_every_s, asyncps export)")
    from asyncps.ml.sparse import table_layers

    tables = table_layers(model)
    if tables and settings.get("row_pull", "auto") != "off":
        raise ValueError(f"asyncps.train: ModelCheckpoint saves every weight, but the tables of {tables} are read by "
                         "rows (only the shards hold them): give row_pull='off' to hold them in the chief, or use "
                         "the run's checkpoints (checkpoint_every_s, asyncps export)")


class EvaluationCallbacks:
    """A run's status sink that runs Keras callbacks on each new evaluation (eval.csv's rows) as the end of an
    epoch, and shows the status on `inner` (a progress display) if any."""

    def __init__(self, callbacks: list[Any], files: RunDir, model: Any, inner: StatusSink | None,
                 load_weights: bool = False) -> None:
        """`load_weights`: before the callbacks see an evaluation, `model` is given the values it measured (the
        chief's eval-weights/ file of it, removed once read: eval_weights)."""
        self._callbacks, self._files, self._inner = callbacks, files, inner
        self._model = model
        self._load_weights = load_weights
        self._seen = 0
        self._stop_asked = False
        for callback in callbacks:
            if model is not None:
                callback.set_model(model)
            callback.on_train_begin({})

    def show(self, status: Any) -> None:
        """Show the status; run the callbacks on the evaluations recorded since the last call."""
        if self._inner is not None:
            self._inner.show(status)
        self._catch_up()

    def _catch_up(self) -> None:
        rows = read_rows(self._files.evals, EvalRow)
        for epoch, row in enumerate(rows[self._seen:], start=self._seen):
            logs = {"val_loss": row.loss, "val_accuracy": row.accuracy, "updates": float(row.updates)}
            weights = self._files.eval_weights(row.updates)
            if self._load_weights and self._model is not None and weights.exists():
                with np.load(weights) as values:
                    for variable in self._model.variables:
                        if variable.path in values:
                            variable.assign(values[variable.path])
                weights.unlink()
            for callback in self._callbacks:
                callback.on_epoch_end(epoch, logs)
            if getattr(self._model, "stop_training", False) and not self._stop_asked:
                # as in model.fit: a callback ends the run (the chief reads the request: RunDir.stop_request)
                atomic_write(self._files.stop_request, f"a callback set model.stop_training at evaluation {epoch}")
                self._stop_asked = True
        self._seen = len(rows)

    def close(self) -> None:
        """The run is over: the last evaluations, then on_train_end."""
        if self._inner is not None:
            self._inner.close()
        self._catch_up()
        for callback in self._callbacks:
            callback.on_train_end({})


def _verbosity(verbose: int | str, progress: bool | None) -> int:
    """Keras' `verbose` (or the older `progress`) as 0, 1 or 2; ValueError for anything else."""
    if progress is not None:
        if verbose != "auto":
            raise ValueError("asyncps.train: give verbose= or progress=, not both")
        return 1 if progress else 0
    if verbose == "auto":
        return 1 if _watched() else 0
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"asyncps.train: verbose is 0, 1, 2 or 'auto', not {verbose!r}")
    return int(verbose)


def _watched() -> bool:
    """Whether a person watches this process's output: a terminal, or a notebook's kernel."""
    return sys.stdout.isatty() or "ipykernel" in sys.modules


def _refuse_keyed(model: Any) -> None:
    """ValueError for a model with a HashEmbedding: its rows cannot come back into the caller's model."""
    from asyncps.ml.sparse import has_keyed_table

    if has_keyed_table(model):
        raise ValueError("asyncps.train: the model has a HashEmbedding, whose rows live on the shards by key and "
                         "cannot come back into a Keras model; train it with `asyncps local --model "
                         "package.module:function` (its rows stay in the run's checkpoints)")


def _is_keras_model(model: Any) -> bool:
    """Whether `model` is a keras.Model object (not a spec or a builder)."""
    import keras

    return isinstance(model, keras.Model)


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _split_arrays(dataset: Any, x: Any, y: Any, validation_data: tuple[Any, Any] | None,
                  validation_split: float) -> Arrays | None:
    """(x_train, y_train, x_test, y_test) from the caller's arrays, checked; None when no arrays were given."""
    if x is None and y is None and validation_data is None:
        return None
    if dataset is not None:
        raise ValueError("asyncps.train: give either dataset= or arrays (x=, y=), not both")
    if x is None or y is None:
        raise ValueError("asyncps.train: arrays need both x= and y=")
    x_train, y_train = _features(x, "x"), _labels(y, "y")
    if len(x_train) != len(y_train):
        raise ValueError(f"asyncps.train: x has {len(x_train)} examples but y has {len(y_train)}")
    if validation_data is not None:
        if validation_split:
            raise ValueError("asyncps.train: give either validation_data= or validation_split=, not both")
        try:
            x_val, y_val = validation_data
        except (TypeError, ValueError):
            raise ValueError("asyncps.train: validation_data must be a pair (x_val, y_val)") from None
        x_test, y_test = _features(x_val, "validation x"), _labels(y_val, "validation y")
        if len(x_test) != len(y_test):
            raise ValueError(f"asyncps.train: validation x has {len(x_test)} examples but validation y has "
                             f"{len(y_test)}")
    elif 0.0 < validation_split < 1.0:
        # the last fraction, as keras.Model.fit takes it
        cut = len(x_train) - max(1, round(len(x_train) * validation_split))
        x_train, x_test, y_train, y_test = x_train[:cut], x_train[cut:], y_train[:cut], y_train[cut:]
    else:
        raise ValueError("asyncps.train: arrays need validation_data=(x_val, y_val) or a validation_split "
                         "in (0, 1): the chief evaluates the model on them")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"asyncps.train: x has examples of shape {x_train.shape[1:]} but validation x "
                         f"{x_test.shape[1:]}")
    if len(x_train) == 0:
        raise ValueError("asyncps.train: no training examples")
    return x_train, y_train, x_test, y_test


def _weights(sample_weight: Any, class_weight: Mapping[int, float] | None, y: Any, dataset: Any) -> np.ndarray | None:
    """The training examples' loss weights (float32 [n], >= 0) from `sample_weight` and `class_weight`, or None."""
    if sample_weight is None and class_weight is None:
        return None
    if dataset is not None or y is None:
        raise ValueError("asyncps.train: sample_weight= and class_weight= weight the examples of x=, y= (arrays "
                         "or a dataset of batches), not a dataset= spec")
    labels = np.asarray(y)
    out = np.ones(len(labels), dtype=np.float32)
    if sample_weight is not None:
        given = np.asarray(sample_weight)
        if given.ndim == 2 and given.shape[1] == 1:
            given = given[:, 0]
        if given.shape != (len(labels),) or not np.issubdtype(given.dtype, np.number):
            raise ValueError(f"asyncps.train: sample_weight must be one number per example ({len(labels)}), got "
                             f"{given.dtype} {given.shape}")
        out *= given.astype(np.float32)
    if class_weight is not None:
        ids = labels[:, 0] if labels.ndim == 2 and labels.shape[1] == 1 else labels
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("asyncps.train: class_weight= needs integer class ids in y")
        table = np.ones(int(ids.max(initial=0)) + 1, dtype=np.float32)
        for cls, weight in dict(class_weight).items():
            if int(cls) != cls or cls < 0:
                raise ValueError(f"asyncps.train: class_weight has {cls!r}, not a class id")
            if int(cls) < len(table):
                table[int(cls)] = weight
        out *= table[ids]
    if not np.isfinite(out).all() or (out < 0).any():
        raise ValueError("asyncps.train: sample and class weights must be finite and >= 0")
    return out


def _features(x: Any, what: str) -> np.ndarray:
    """The caller's inputs as float32 [n, ...], integers as int64 ids (float32 would round ids above 2**24 onto a
    neighbour's); no scaling: the model sees what Keras' fit would."""
    try:
        array = np.asarray(x)
        array = array.astype(np.int64 if np.issubdtype(array.dtype, np.integer) else np.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"asyncps.train: {what} is not a numeric array ({error})") from None
    if array.ndim < 2:
        raise ValueError(f"asyncps.train: {what} must be [examples, features...], got shape {array.shape}")
    return array


def _labels(y: Any, what: str) -> np.ndarray:
    """The caller's labels: int64 class ids [n] (from [n] or [n, 1] integers), else targets of any shape
    per example (float32; int64 for other integer arrays such as 0/1 multi-label matrices)."""
    array = np.asarray(y)
    if array.ndim == 0:
        raise ValueError(f"asyncps.train: {what} must have one label per example, got a scalar")
    if np.issubdtype(array.dtype, np.integer):
        if array.ndim == 2 and array.shape[1] == 1:
            array = array[:, 0]
        if array.ndim == 1 and array.size and array.min() < 0:
            raise ValueError(f"asyncps.train: {what} has negative class ids")
        return array.astype(np.int64)
    if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.floating):
        targets = array.astype(np.float32)
        if not np.isfinite(targets).all():
            raise ValueError(f"asyncps.train: {what} holds NaN or infinite values")
        return targets
    raise ValueError(f"asyncps.train: {what} must be numeric (integer class ids or float targets), got {array.dtype}")


#: Keras optimizers the shards implement: class name -> the asyncps optimizer and the hyperparameters it takes
_SHARD_OPTIMIZERS = {"SGD": ("sgd", ()), "Adam": ("adam", ("beta_1", "beta_2", "epsilon")),
                     "AdamW": ("adam", ("beta_1", "beta_2", "epsilon")),
                     "Adagrad": ("adagrad", ("initial_accumulator_value", "epsilon"))}
#: Keras optimizer settings the shards do not apply: a compiled optimizer with one of them set is refused
_NOT_ON_SHARDS = ("use_ema", "amsgrad", "gradient_accumulation_steps", "loss_scale_factor")
#: Keras optimizer settings the workers apply before a push (run settings of the same names)
_CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")


def compiled_optimizer(model: Any, keep_rate: bool = False) -> dict[str, Any]:
    """The run settings (optimizer, learning_rate, optimizer_params; clipnorm, global_clipnorm, clipvalue, which
    the workers apply) of a compiled model's optimizer, when the shards implement it ({} for an uncompiled
    model; an ExponentialDecay learning rate as the optimizer's schedule, asyncps.rules.optimizers); ValueError
    naming what they do not (another optimizer, weight decay with exclusions, another learning-rate schedule).
    `keep_rate`: the caller gives learning_rate itself."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(model, "compiled", False):
        return {}
    kind = type(optimizer).__name__
    config = optimizer.get_config()
    known = _SHARD_OPTIMIZERS.get(kind)
    problems = [f"{key}={config[key]}" for key in _NOT_ON_SHARDS if config.get(key)]
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_pattern", None):
        problems.append("variables excluded from weight decay (the shards decay every variable)")
    rate = config.get("learning_rate")
    schedule: dict[str, float] = {}
    if isinstance(rate, dict):  # a schedule: Keras' ExponentialDecay runs on the shards, by their version
        if rate.get("class_name") == "ExponentialDecay" and not keep_rate:
            decay = rate["config"]
            rate = decay["initial_learning_rate"]
            schedule = {"decay_steps": float(decay["decay_steps"]), "decay_rate": float(decay["decay_rate"]),
                        **({"staircase": 1.0} if decay.get("staircase") else {})}
        elif not keep_rate:
            problems.append(f"a {rate.get('class_name', 'learning-rate')} schedule (ExponentialDecay runs on the "
                            "shards)")
    if known is None or problems:
        what = f"{kind}" + (f" with {', '.join(problems)}" if problems else "")
        raise ValueError(f"asyncps.train: the model is compiled with {what}, which the shards do not implement "
                         "(RMSprop is Keras' default when compile names no optimizer); give optimizer= (sgd, "
                         "momentum, nesterov, adam or adagrad) and learning_rate=, or compile with SGD, Adam or "
                         "Adagrad")
    name, keys = known
    params = {key: float(f"{float(config[key]):.7g}") for key in keys}
    if kind == "SGD" and config.get("momentum"):
        name = "nesterov" if config.get("nesterov") else "momentum"
        params = {"momentum": float(f"{float(config['momentum']):.7g}")}
    if config.get("weight_decay"):  # decoupled, before each update, as Keras (asyncps.rules.optimizers)
        params["weight_decay"] = float(f"{float(config['weight_decay']):.7g}")
    out: dict[str, Any] = {"optimizer": name, "optimizer_params": {**params, **schedule}}
    out.update({key: float(config[key]) for key in _CLIPPING if config.get(key)})
    if not keep_rate:
        out["learning_rate"] = float(f"{float(rate):.7g}")  # Keras keeps it as float32: 0.05 -> 0.0500000007
    return out


def _check_default_loss(y: np.ndarray, model: ModelArg) -> None:
    """Labels that are not class ids need a loss: the default (crossentropy over class ids) does not fit them.
    Refused here for a built-in model or an uncompiled model object; a builder's model may come compiled
    (the chief checks it)."""
    from asyncps.ml.specs import MODEL_NAMES
    from asyncps.ml.task import is_class_ids

    if is_class_ids(y):
        return
    if isinstance(model, str):
        if model.startswith(KERAS_PREFIX) or is_function_spec(model, MODEL_NAMES):
            return
    elif callable(model) and getattr(model, "loss", None) is None and not hasattr(model, "compiled"):
        return  # a builder function
    elif getattr(model, "loss", None) is not None:
        return
    raise ValueError(f"asyncps.train: labels {y.dtype} of shape {y.shape[1:]} per example are not class ids: "
                     "compile the model with a loss for them (e.g. model.compile(loss='mse')) or pass loss=")


def _saveable_model(model: ModelArg, arrays: Arrays | None, dataset_spec: str, seed: int) -> Any:
    """The keras.Model to save into the run directory (a model object, or what a builder that cannot
    travel by name builds here); None for a spec or an importable builder."""
    if isinstance(model, str):
        return None
    import keras

    if callable(model) and not isinstance(model, keras.Model):
        try:
            spec_of(model, "model")
            return None  # importable: every process calls it by name
        except ValueError:
            model = _build_here(model, arrays, dataset_spec, seed)
    if not isinstance(model, keras.Model):
        raise ValueError(f"asyncps.train: model must be a keras.Model, a builder function or a spec, "
                         f"got {type(model).__name__}")
    _refuse_keyed(model)
    if len(model.outputs) > 1:
        from asyncps.ml.heads import output_specs

        try:
            output_specs(model, model.get_compile_config() if model.compiled else None)
        except ValueError as error:
            raise ValueError(f"asyncps.train: {error}") from None
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError("asyncps.train: the model has no inputs yet; build it with an Input "
                         "(keras.Input(shape=...) first, or model.build(input_shape))")
    return model


def _pack_several(model: ModelArg, x: Any, y: Any, validation_data: Any,
                  seed: int) -> tuple[ModelArg, Any, Any, Any]:
    """(model, x, y, validation_data) with x and y (validation ones too) given as several arrays (a list, or a
    dict keyed by input or output name, as `model.fit` takes them) packed into one array each (asyncps.ml.multiio);
    a list or dict of one array for a model of one input or output, that array. A builder is called here to learn
    its model's inputs and outputs (`_probe`); one that cannot travel by name is replaced by the model it built.
    ValueError for names, counts, shapes or lengths that do not fit the model's."""
    from asyncps.ml.multiio import is_several

    pair = isinstance(validation_data, (tuple, list)) and len(validation_data) == 2
    val_x, val_y = (validation_data[0], validation_data[1]) if pair else (None, None)
    several = _is_keras_model(model) and (len(_inputs_or_none(model) or []) > 1 or len(model.outputs) > 1)
    if not any(is_several(a) for a in (x, y, val_x, val_y)) and not several:
        return model, x, y, validation_data
    probe = model if _is_keras_model(model) else _probe(model, x, y, seed)
    if not _is_keras_model(model) and not _travels(model):
        model = probe
    x, y = (_packed(probe, x, "x") if x is not None else x), (_labels_of(probe, y, "y") if y is not None else y)
    if pair:
        validation_data = (_packed(probe, val_x, "validation x"), _labels_of(probe, val_y, "validation y"))
    return model, x, y, validation_data


def _travels(model: ModelArg) -> bool:
    """Whether a builder (a function or a spec) travels to the other processes by name."""
    try:
        spec_of(model, "model")
    except ValueError:
        return False
    return True


def _probe(model: ModelArg, x: Any, y: Any, seed: int) -> Any:
    """The model a builder (a function, or a package.module:function spec) builds, called as every process calls
    it for packed data: `input_shape` (the packed features' width), `num_classes` and `output_shape` (the packed
    labels' width: asyncps.ml.models.build_user_model); ValueError for a spec that names no builder."""
    from asyncps.ml.multiio import is_several
    from asyncps.ml.specs import MODEL_NAMES

    if isinstance(model, str) and not is_function_spec(model, MODEL_NAMES):
        raise ValueError(f"asyncps.train: x or y of several arrays (a list or dict) needs a model of several inputs "
                         f"or outputs: a keras.Model object or a builder, not {model!r}")
    fn = load_function(model, "model") if isinstance(model, str) else model
    if not callable(fn):
        raise ValueError(f"asyncps.train: model must be a keras.Model, a builder function or a spec, "
                         f"got {type(model).__name__}")
    width = _width(x) if is_several(x) else int(np.prod(np.shape(x)[1:]))
    labels = _width(y) if is_several(y) else None
    if labels is None:
        ids = np.asarray(y)
        labels = int(ids.max(initial=1)) + 1 if np.issubdtype(ids.dtype, np.integer) else int(np.prod(ids.shape[1:]))
    built = call_with_accepted(fn, input_shape=(width,), num_classes=labels, output_shape=(labels,), seed=seed)
    if not _is_keras_model(built):
        raise ValueError(f"asyncps.train: model {model!r} must return a keras.Model, got {type(built).__name__}")
    return built


def _width(arrays: Any) -> int:
    """The packed width of several arrays: the values per example of them all."""
    values = arrays.values() if isinstance(arrays, Mapping) else arrays
    return sum(int(np.prod(np.shape(a)[1:])) if np.ndim(a) > 1 else 1 for a in values)


def _labels_of(model: Any, y: Any, what: str) -> Any:
    """One output's labels, or the packed labels of several (asyncps.ml.multiio.pack_labels)."""
    from asyncps.ml.heads import output_specs
    from asyncps.ml.multiio import arrange, is_several, pack_labels

    names = [str(n) for n in model.output_names]
    if not is_several(y):
        if len(names) > 1:
            raise ValueError(f"asyncps.train: the model has {len(names)} outputs: give {what} as a list of arrays "
                             f"in their order or a dict keyed by their names ({names})")
        return y
    try:
        if len(names) == 1:
            return arrange(y, names, what)[0]
        return pack_labels(y, output_specs(model, model.get_compile_config() if model.compiled else None), what)
    except ValueError as error:
        raise ValueError(f"asyncps.train: {error}") from None


def _inputs_or_none(model: Any) -> list[Any] | None:
    """The model's Inputs, None while it has none (a Sequential not built yet)."""
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        return None


def _packed(model: Any, x: Any, what: str) -> Any:
    """One input's array or the packed arrays of several (asyncps.ml.multiio), with the caller's name in errors."""
    from asyncps.ml.multiio import arrange, input_specs, is_several, pack

    if not is_several(x):
        if len(model.inputs) > 1:
            raise ValueError(f"asyncps.train: the model has {len(model.inputs)} inputs: give {what} as a list of "
                             f"arrays in their order or a dict keyed by their names ({[t.name for t in model.inputs]})")
        return x
    try:
        specs = input_specs(model)
        return arrange(x, [s.name for s in specs], what)[0] if len(specs) == 1 else pack(x, specs, what)
    except ValueError as error:
        raise ValueError(f"asyncps.train: {error}") from None


def _build_here(builder: Callable[..., Any], arrays: Arrays | None, dataset_spec: str, seed: int) -> Any:
    """Call a builder that cannot travel by name in this process, as build_user_model would call it."""
    if arrays is not None:
        from asyncps.ml.task import is_class_ids

        input_shape = tuple(int(d) for d in arrays[0].shape[1:])
        if is_class_ids(arrays[1]):
            num_classes = max(int(max(arrays[1].max(initial=-1), arrays[3].max(initial=-1))) + 1, 2)
            output_shape: tuple[int, ...] = (num_classes,)
        else:
            output_shape = tuple(int(d) for d in arrays[1].shape[1:]) or (1,)
            num_classes = int(np.prod(output_shape))
        return call_with_accepted(builder, input_shape=input_shape, num_classes=num_classes,
                                  output_shape=output_shape, seed=seed)
    from asyncps.ml.datasets import load_dataset

    data = load_dataset(dataset_spec, seed)
    input_shape = tuple(data.image_shape) if data.image_shape is not None else (data.num_features,)
    output_shape = (data.num_classes,) if data.targets is None else (data.targets or (1,))
    return call_with_accepted(builder, input_shape=input_shape, num_classes=data.num_classes,
                              output_shape=output_shape, seed=seed)


def _compiled_loss(model: Any) -> str:
    """The loss setting for the loss `model` was compiled with: `auto` when the saved model carries it (a
    Keras loss name or object: every process reads it from the file, with its metrics), or when it was
    not compiled (then `crossentropy` of logits); an importable function travels by name."""
    compiled = getattr(model, "loss", None) if model is not None else None
    # a loss per output (a dict or list): every process compiles the wrapper with it (asyncps.ml.heads)
    if compiled is None or isinstance(compiled, (str, dict, list, tuple)):
        return "auto"
    import keras

    if isinstance(compiled, keras.losses.Loss) or getattr(compiled, "__module__", "").startswith("keras."):
        return "auto"
    try:
        return spec_of(compiled, "loss")
    except ValueError:
        raise ValueError(f"asyncps.train: the model was compiled with loss {compiled!r}, which cannot travel to "
                         "the other processes; pass loss= (a Keras loss name or package.module:function)") from None


def _warn_logits_mismatch(model: Any, loss_spec: str) -> None:
    """Log here too (the caller's process, where a notebook shows it) what the chief warns of at start:
    a softmax/sigmoid output under a loss of logits."""
    from asyncps.ml.task import Task, logits_mismatch, resolve_loss

    fn, name, from_logits = resolve_loss(loss_spec, model)
    mismatch = logits_mismatch(model, Task(fn, name, from_logits))
    if mismatch is not None:
        logging.getLogger("asyncps.train").warning("%s", mismatch)


def _trained_model(files: RunDir, from_object: bool, into: Any = None) -> Any:
    """The trained model: the caller's own model object `into` with the weights of the chief's final export
    (trained in place), else (a builder's model) that model reloaded, compiled as it was, with them; for a
    spec, the exported model itself (it takes flat features)."""
    import keras

    from asyncps.ml.models import import_registered_modules

    if not files.exported_model.exists():
        raise TrainingFailed(f"asyncps.train: the chief exported no model ({files.exported_model} is missing)")
    if from_object:
        import_registered_modules(str(files.input_model))
    exported = keras.saving.load_model(files.exported_model, compile=False)
    if not from_object:
        return exported
    model = into if into is not None else keras.saving.load_model(files.input_model)
    from asyncps.ml.models import shard_variables

    trained = shard_variables(exported)
    # the export wraps the caller's model behind a flat input, which adds no variables: same order (the
    # trainable ones, then the state the shards held: BatchNormalization's moving statistics)
    if [tuple(v.shape) for v in trained] != [tuple(v.shape) for v in shard_variables(model)]:
        raise TrainingFailed("asyncps.train: the exported model's variables do not match the model handed in")
    for target, source in zip(shard_variables(model), trained, strict=True):
        target.assign(source)
    return model


def _last_error(log: Path) -> str:
    """The chief log's last ERROR or exception line (why a user's model or data failed), if any."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines
             if " ERROR " in line or line.startswith(("asyncps chief: error:", "ValueError", "TypeError"))]
    return f"; the chief said: {found[-1].strip()}" if found else ""


__all__ = ["ChiefConfig", "LocalCluster", "PsConfig", "RunConfig", "RunDiverged", "RunSummary", "TrainResult",
           "TrainingFailed", "WorkerConfig",
           "run_chief", "run_local", "run_ps", "run_worker", "spec_of", "train"]
