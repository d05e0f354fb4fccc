"""The Python API: train a model on a local cluster from a script or a notebook.

    import asyncps
    summary = asyncps.train(model="examples.byo.model:build", dataset="examples.byo.data:load",
                            num_workers=2, num_ps=1, epochs=5)
    print(summary.final_eval.accuracy)

The pieces it is built from are public too: `run_ps`, `run_worker` and `run_chief` run one role
in the calling process until stopped (what `asyncps ps|worker|chief` run), and `LocalCluster`
starts a whole cluster as OS processes (what `asyncps local` and `train` run).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from asyncps.chief.main import ChiefConfig, run_chief
from asyncps.config import RunConfig, coerce_settings
from asyncps.ml.userfns import USER_PATH_ENV, add_user_path, user_path_from_env
from asyncps.ps.main import PsConfig, run_ps
from asyncps.rundir import RunDir, RunSummary
from asyncps.tools.local import LocalCluster, default_run_dir, run_local
from asyncps.worker.main import WorkerConfig, run_worker


class TrainingFailed(RuntimeError):
    """A run ended without a summary, or its chief exited with an error (see the run's logs/)."""


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


def train(model: str | Callable[..., Any] = "mlp", dataset: str | Callable[..., Any] = "digits", *,
          loss: str | Callable[..., Any] = "crossentropy", run_dir: str | Path | None = None,
          user_path: Iterable[str] = (), progress: bool = False, secure: bool = False,
          **settings: Any) -> RunSummary:
    """Run a local cluster to completion and return its run summary (summary.json).

    `model`, `dataset` and `loss` are specs (`mlp`, `digits`, `package.module:function`) or
    importable functions; `settings` are RunConfig fields (`num_workers=2`, `num_ps=1`,
    `epochs=5`, `staleness_policy="drop:bound=4"`, ...), checked like a --run-config file.
    `user_path`: directories every process (this one too) imports user code from. Raises TrainingFailed when the
    run ends without a summary or with a failed chief, ValueError for a bad setting.
    """
    fields = {"model": spec_of(model, "model"), "dataset": spec_of(dataset, "dataset"), "loss": spec_of(loss, "loss"),
              **settings}
    dirs = add_user_path([*user_path_from_env(), *user_path])
    run = RunConfig.from_layers(coerce_settings(fields, "asyncps.train"))
    where = Path(run_dir) if run_dir is not None else default_run_dir()
    env = {USER_PATH_ENV: os.pathsep.join(dict.fromkeys(dirs))} if dirs else None
    code = run_local(run, where, progress=progress, env=env, secure=secure)
    files = RunDir(where)
    if code != 0 or not files.summary.exists():
        raise TrainingFailed(f"asyncps.train: the chief exited with {code}; logs in {files.logs}"
                             + _last_error(files.log("chief")))
    return RunSummary.load(where)


def _last_error(log: Path) -> str:
    """The chief log's last ERROR or exception line (why a user's model or data failed), if any."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines
             if " ERROR " in line or line.startswith(("asyncps chief: error:", "ValueError", "TypeError"))]
    return f"; the chief said: {found[-1].strip()}" if found else ""


__all__ = ["ChiefConfig", "LocalCluster", "PsConfig", "RunConfig", "RunSummary", "TrainingFailed", "WorkerConfig",
           "run_chief", "run_local", "run_ps", "run_worker", "spec_of", "train"]
