"""`asyncps export` of a run trained with a user model (examples/byo's `shapes_model:build`).

The checkpoint here is written by the chief's own checkpoint writer (CheckpointDir.save) with the
manifest fields export reads (`run`, `user_path`), into a run directory that has its run manifest
beside ckpt/; the values are random, so only a model rebuilt and filled from this checkpoint
reproduces them. The export runs as the real CLI in a process that cannot import the example until
it is told where it is. tests/test_byo.py exports a checkpoint of a real training run the same way.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.config import RunConfig
from asyncps.ml.userfns import add_user_path
from asyncps.rundir import RunDir, RunManifest, exported_model

ROOT = Path(__file__).resolve().parent.parent
BYO = ROOT / "examples" / "byo"
RUN = RunConfig(model="shapes_model:build", dataset="shapes_data:load", loss="sparse_categorical_crossentropy",
                seed=3)


def export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`asyncps export ...` with no user path in its environment (cwd: not the example's folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ASYNCPS_USER_PATH", "PYTHONPATH")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "export", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def byo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run directory (run manifest + ckpt/ckpt-00000002) of the byo model with random values."""
    add_user_path([str(BYO)])
    from asyncps.runmodel import build_run_model

    _, model = build_run_model(RUN)
    rng = np.random.default_rng(7)
    values = {v.path: rng.normal(0, 0.3, tuple(v.shape)).astype(np.float32) for v in model.trainable_variables}
    run_dir = tmp_path_factory.mktemp("byo-export") / "run"
    run_dir.mkdir()
    RunManifest.new().save(run_dir)  # a run directory has a manifest.json of its own
    ckpts = CheckpointDir(RunDir(run_dir).checkpoints)
    for number in (1, 2):  # export takes the newest
        ckpts.save(number, values if number == 2 else {k: np.zeros_like(v) for k, v in values.items()}, {},
                   {"run": dataclasses.asdict(RUN), "user_path": []})
    return run_dir, values


def test_a_user_model_without_its_code_is_a_clear_error(byo_run: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    run_dir, _ = byo_run
    result = export_cli(str(run_dir), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    # the model is built for its dataset, as the chief builds it: the dataset's code is the first missing
    assert "dataset 'shapes_data:load': cannot import 'shapes_data'" in result.stderr
    assert "--user-path" in result.stderr
    assert not (tmp_path / "out").exists()


def test_export_with_user_path_rebuilds_the_user_model_from_the_latest_checkpoint(
        byo_run: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    import keras
    import tensorflow as tf

    from asyncps.ml.datasets import load_dataset
    from asyncps.runmodel import build_run_model

    run_dir, values = byo_run
    out = tmp_path / "out"
    result = export_cli(str(run_dir), "--user-path", str(BYO), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    # the chief's model (built here as the chief builds it) with these values
    _, reference = build_run_model(RUN)
    for variable in reference.trainable_variables:
        variable.assign(values[variable.path])
    exported = keras.models.load_model(exported_model(out))
    # a reloaded nested model names its variables without the outer prefix: compare in order
    assert len(exported.trainable_variables) == len(reference.trainable_variables) == len(values)
    for loaded, built in zip(exported.trainable_variables, reference.trainable_variables, strict=True):
        assert built.path.endswith(loaded.path), (built.path, loaded.path)
        np.testing.assert_array_equal(loaded.numpy(), values[built.path])
    x = load_dataset(RUN.dataset, RUN.seed).x_test[:64]
    expected = reference(x).numpy()
    np.testing.assert_allclose(exported.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    saved = tf.saved_model.load(str(out / "saved_model"))  # keep it referenced: serve() uses its variables
    np.testing.assert_allclose(saved.serve(x).numpy(), expected, rtol=1e-5, atol=1e-6)
