"""The files of a run directory, by name; `RunDir`, the one place their paths are joined; and the error
raised when one cannot be read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

CONFIG_JSON = "config.json"  # the run's settings, written by the chief when it starts
SUMMARY_JSON = "summary.json"  # the run's outcome, written by the chief when it finishes
PUSHES_CSV = "pushes.csv"  # one row per push a worker reported
TIMELINE_CSV = "timeline.csv"  # one row per worker step (pull, compute, push, wait)
RESTORES_CSV = "restores.csv"  # one row per shard the chief restored (pushes after its checkpoint are rolled back)
EVAL_CSV = "eval.csv"  # one row per evaluation of the model on the test set
MANIFEST_JSON = "manifest.json"  # the run's id and training time so far: a restarted chief resumes
LEDGER_JSONL = "ledger.jsonl"  # the data-task ledger's journal: a restarted chief continues its tasks
REPORTS_JSONL = "reports.jsonl"  # the worker reports recorded: none is recorded twice across chiefs
MEMORY_JSON = "memory.json"  # the local launcher's peak memory per process
CHIEF_LOCK = "chief.lock"  # held (flock) by the chief running the run: a second chief is refused
TENSORBOARD_DIR = "tb"  # the chief's TensorBoard event files
STOP_REQUEST = "stop-request"  # a reason to end the run, asked by the run's caller (a Keras callback's stop_training)
EVAL_WEIGHTS_DIR = "eval-weights"  # the values each evaluation measured (eval_weights: asyncps.train's callbacks)
CHECKPOINTS_DIR = "ckpt"  # the checkpoints, unless the chief was given another directory
LOGS_DIR = "logs"  # the local launcher's per-role logs and port files
LAUNCHER_LOG = "launcher.log"  # a sweep's point: the launcher's own lines
SECRETS_DIR = "secrets"  # the local launcher's development certificates and tokens
LAUNCH_CONFIG_JSON = "run-config.json"  # (in logs/) the settings the launcher hands the chief
EXPORTED_MODEL_KERAS = "model.keras"  # the chief's final model (and `asyncps export`'s, in any directory)
INPUT_MODEL_KERAS = "input-model.keras"  # asyncps.train: the caller's in-memory model, loaded by every process
INPUT_DATA_NPZ = "input-data.npz"  # asyncps.train: the caller's arrays (x_train, y_train, x_test, y_test)

# One checkpoint is a directory ckpt-NNNNNNNN/ under the checkpoints directory, written as
# ckpt-NNNNNNNN.tmp/ first; it holds its arrays and its own manifest, a different format from the
# run's MANIFEST_JSON (same file name: run directories written so far must still resume).
CHECKPOINT_MANIFEST_JSON = "manifest.json"  # the checkpoint's number, shard versions, counters and settings
CHECKPOINT_ARRAYS_NPZ = "model.npz"  # whole variables, optimizer slots and policy state (before tensors/)
CHECKPOINT_TENSORS = "tensors"  # the same, one .npy file each (written chunk by chunk as the shards stream)
_CHECKPOINT = re.compile(r"^ckpt-(\d{8})$")


class RunDirError(ValueError):
    """A run-directory file that is not in the format this version writes (names the file and the field)."""


def exported_model(directory: Path) -> Path:
    """The Keras file a model is exported as into `directory` (a run directory, a checkpoint, --out)."""
    return directory / EXPORTED_MODEL_KERAS


@dataclass(frozen=True)
class CheckpointNames:
    """The paths of the checkpoints under one checkpoints directory (a run's ckpt/ or --checkpoint-dir)."""

    root: Path

    def final(self, number: int) -> Path:
        """The directory of complete checkpoint `number`."""
        return self.root / f"ckpt-{number:08d}"

    def staging(self, number: int) -> Path:
        """Where checkpoint `number` is written before it is renamed to `final(number)`."""
        return self.root / f"ckpt-{number:08d}.tmp"

    @staticmethod
    def number_of(path: Path) -> int | None:
        """The number of a complete checkpoint's directory; None for any other name (a `.tmp` one too)."""
        match = _CHECKPOINT.match(path.name)
        return int(match.group(1)) if match else None

    @staticmethod
    def manifest(checkpoint: Path) -> Path:
        """A checkpoint directory's own manifest."""
        return checkpoint / CHECKPOINT_MANIFEST_JSON

    @staticmethod
    def arrays(checkpoint: Path) -> Path:
        """A checkpoint directory's arrays in one .npz (checkpoints written before tensors/)."""
        return checkpoint / CHECKPOINT_ARRAYS_NPZ

    @staticmethod
    def tensors(checkpoint: Path) -> Path:
        """A checkpoint directory's folder of tensors, one .npy file each (tensor_file names them)."""
        return checkpoint / CHECKPOINT_TENSORS

    @staticmethod
    def tensor_file(checkpoint: Path, key: str) -> Path:
        """The .npy file of tensor `key` (`value/NAME`, `slot/SLOT/NAME`, `policy/KEY/NAME`) in a checkpoint."""
        return checkpoint / CHECKPOINT_TENSORS / (quote(key, safe="") + ".npy")

    @staticmethod
    def tensor_key(file: Path) -> str:
        """The tensor key of a file tensor_file named."""
        return unquote(file.name.removesuffix(".npy"))


@dataclass(frozen=True)
class RunDir:
    """A run directory's paths: every writer and reader names its files through one of these."""

    root: Path

    @property
    def config(self) -> Path:
        """config.json (RunConfigRecord)."""
        return self.root / CONFIG_JSON

    @property
    def summary(self) -> Path:
        """summary.json (RunSummary)."""
        return self.root / SUMMARY_JSON

    @property
    def manifest(self) -> Path:
        """manifest.json (RunManifest): the run's identity; its presence makes a run to resume."""
        return self.root / MANIFEST_JSON

    @property
    def pushes(self) -> Path:
        """pushes.csv (PushRow)."""
        return self.root / PUSHES_CSV

    @property
    def restores(self) -> Path:
        """restores.csv (RestoreRow)."""
        return self.root / RESTORES_CSV

    @property
    def timeline(self) -> Path:
        """timeline.csv (StepRow)."""
        return self.root / TIMELINE_CSV

    @property
    def evals(self) -> Path:
        """eval.csv (EvalRow)."""
        return self.root / EVAL_CSV

    @property
    def ledger(self) -> Path:
        """ledger.jsonl: the data-task ledger's journal (asyncps.chief.ledgerlog)."""
        return self.root / LEDGER_JSONL

    @property
    def reports(self) -> Path:
        """reports.jsonl: the worker reports recorded (asyncps.chief.reportlog)."""
        return self.root / REPORTS_JSONL

    @property
    def memory(self) -> Path:
        """memory.json (PeakMemory)."""
        return self.root / MEMORY_JSON

    @property
    def chief_lock(self) -> Path:
        """chief.lock: the lock the running chief holds for its life (asyncps.rundir.lock)."""
        return self.root / CHIEF_LOCK

    @property
    def tensorboard(self) -> Path:
        """The TensorBoard event files' directory."""
        return self.root / TENSORBOARD_DIR

    @property
    def stop_request(self) -> Path:
        """A request to end the run (its text: why), written by asyncps.train, honoured and removed by the chief."""
        return self.root / STOP_REQUEST

    def eval_weights(self, updates: int) -> Path:
        """The values the evaluation at `updates` updates measured (an npz by variable path), with eval_weights."""
        return self.root / EVAL_WEIGHTS_DIR / f"at-{updates:012d}.npz"

    @property
    def checkpoints(self) -> Path:
        """The default checkpoints directory (CheckpointNames names what is inside)."""
        return self.root / CHECKPOINTS_DIR

    @property
    def logs(self) -> Path:
        """The local launcher's directory of role logs and port files."""
        return self.root / LOGS_DIR

    def log(self, role: str) -> Path:
        """The log of one role the launcher started (`chief`, `ps-0`, `workers-0`, ...)."""
        return self.logs / f"{role}.log"

    def port_file(self, role: str) -> Path:
        """Where a role the launcher started on port 0 writes its port (`chief.metrics` for the chief's metrics)."""
        return self.logs / f"{role}.port"

    @property
    def launch_config(self) -> Path:
        """The settings file the launcher hands the chief (--run-config)."""
        return self.logs / LAUNCH_CONFIG_JSON

    @property
    def launcher_log(self) -> Path:
        """launcher.log: a sweep point's launcher output."""
        return self.root / LAUNCHER_LOG

    @property
    def exported_model(self) -> Path:
        """model.keras: the chief's final model (a SavedModel beside it)."""
        return exported_model(self.root)

    @property
    def input_model(self) -> Path:
        """The model asyncps.train was handed as an object, saved for every process to load (`keras:PATH`)."""
        return self.root / INPUT_MODEL_KERAS

    @property
    def input_data(self) -> Path:
        """The arrays asyncps.train was handed, saved for every process to load (`npz:PATH`)."""
        return self.root / INPUT_DATA_NPZ

    @property
    def secrets(self) -> Path:
        """The launcher's development certificates and tokens (--secure)."""
        return self.root / SECRETS_DIR
