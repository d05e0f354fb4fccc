"""`asyncps export CKPT_DIR`: a checkpoint as model.keras and a SavedModel, at any time.

The chief exports the model only when a run ends; a checkpoint carries the whole variables and the
run's settings (its manifest's `run`), which is all it takes to build the model again and fill it.
The model is built as the chief built it (asyncps.runmodel); a user model's code is imported from
`--user-path`/ASYNCPS_USER_PATH, else from the directories the chief had (the manifest's `user_path`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncps.chief.checkpoint import Checkpoint, CheckpointDir
from asyncps.chief.lifecycle import save_model
from asyncps.config import RunConfig, coerce_settings, read_settings_file
from asyncps.ml.userfns import add_user_path, user_path_from_env
from asyncps.rundir import CheckpointNames, RunDir


def find_checkpoint(path: Path) -> Path:
    """The checkpoint at `path`: a ckpt-NNNNNNNN directory, or the newest one in a checkpoint root or in
    a run directory's ckpt/ (a run directory has a manifest.json of its own, but no tensors/ or model.npz)."""
    if CheckpointNames.manifest(path).exists() and (CheckpointNames.tensors(path).is_dir()
                                                    or CheckpointNames.arrays(path).exists()):
        return path
    for root in (path, RunDir(path).checkpoints):
        complete = CheckpointDir(root).complete()
        if complete:
            return complete[-1]
    raise FileNotFoundError(f"no complete checkpoint (ckpt-NNNNNNNN/ with a manifest.json) at or in {path}")


def checkpoint_run_config(ckpt: Checkpoint, run_config: Path | None = None) -> RunConfig:
    """The run's settings: `run_config` if given, else the checkpoint manifest's own record."""
    if run_config is not None:
        return RunConfig.from_layers(read_settings_file(run_config))
    recorded = ckpt.manifest.get("run")
    if not isinstance(recorded, dict):
        raise ValueError(f"{CheckpointNames.manifest(ckpt.path)} records no run settings: give --run-config")
    return RunConfig.from_layers(coerce_settings(recorded, str(CheckpointNames.manifest(ckpt.path))))


def use_recorded_user_path(ckpt: Checkpoint) -> list[str]:
    """With no user path given (--user-path, ASYNCPS_USER_PATH), put the directories the run's chief
    imported user code from (the manifest's `user_path`) on sys.path, those that exist here; return them."""
    if user_path_from_env():
        return []
    recorded = ckpt.manifest.get("user_path", [])
    return add_user_path(d for d in recorded if isinstance(d, str) and Path(d).is_dir())


def model_from_checkpoint(ckpt: Checkpoint, run: RunConfig) -> Any:
    """The run's Keras model with every trainable variable set from the checkpoint."""
    from asyncps.ml.tfutil import quiet_tensorflow
    from asyncps.runmodel import build_run_model

    quiet_tensorflow()
    use_recorded_user_path(ckpt)
    _, model = build_run_model(run)
    from asyncps.ml.models import shard_variables
    from asyncps.ml.sparse import has_keyed_table, with_kept_rows

    if has_keyed_table(model):  # each HashEmbedding as a KeyedTable of the rows the shards kept, by key
        return with_kept_rows(model, ckpt.values, ckpt.policy_state)
    names = {v.path for v in shard_variables(model)}
    missing = sorted(names - set(ckpt.values))
    if missing:
        raise ValueError(f"{ckpt.path} has no values for {missing[:5]} of model {run.model!r}")
    for variable in shard_variables(model):
        value = ckpt.values[variable.path]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"{ckpt.path}: {variable.path} has shape {value.shape}, the model wants "
                             f"{tuple(variable.shape)}")
        variable.assign(value)
    return model


def export_checkpoint(path: Path, out: Path | None = None, run_config: Path | None = None) -> Path:
    """Write model.keras and saved_model/ from the checkpoint at `path` into `out` (default: the
    checkpoint's directory); return where they went."""
    ckpt = CheckpointDir.load(find_checkpoint(path))
    model = model_from_checkpoint(ckpt, checkpoint_run_config(ckpt, run_config))
    target = out or ckpt.path
    save_model(model, target)
    return target
