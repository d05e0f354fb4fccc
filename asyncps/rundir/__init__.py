"""The run directory: one owner per file format, shared by the chief (writer) and the tools (readers).

| file | type | written by |
|---|---|---|
| `config.json` | RunConfigRecord | the chief, at start |
| `summary.json` | RunSummary | the chief, at the end (`load_summary` rebuilds it from the CSVs without it) |
| `pushes.csv` | PushRow | the chief's recorder |
| `timeline.csv` | StepRow | the chief's recorder |
| `eval.csv` | EvalRow | the chief, every evaluation |
| `manifest.json` | RunManifest | the chief, at start and while it runs |
| `ledger.jsonl` | asyncps.chief.ledgerlog | the chief, at every data-task change |
| `reports.jsonl` | asyncps.chief.reportlog | the chief, at every worker report recorded |
| `memory.json` | PeakMemory | the local launcher, at the end |
| `chief.lock` | ChiefLock (flock, released when the chief ends) | the chief, for its life |
| `tb/` | TensorBoard events | the chief, every evaluation |
| `stop-request` | why the caller asks the run to end | asyncps.train (a callback's stop_training) |
| `eval-weights/at-N.npz` | an evaluation's values by variable path | the chief, with `eval_weights` |
| `ckpt/ckpt-NNNNNNNN/` | asyncps.chief.checkpoint (`manifest.json`, `tensors/`) | the chief, at a cut |
| `logs/` | role logs and port files | the local launcher |
| `model.keras`, `saved_model/` | the final model | the chief, at the end (`exported_model(dir)`) |
| `input-model.keras`, `input-data.npz` | the model object and arrays handed to `asyncps.train` | asyncps.train |

`RunDir(root)` names every one of these paths (and `CheckpointNames` those inside a checkpoints
directory): no file name is written outside this package (tests/test_rundir_names.py checks it).

Also the atomic writes and port files every role uses. Nothing outside this package reads these
files by key or column name.
"""

from asyncps.rundir.atomic import atomic_write, wait_port_file, write_json, write_npz, write_port_file
from asyncps.rundir.lock import ChiefLock, RunDirLocked
from asyncps.rundir.manifest import RunManifest
from asyncps.rundir.memory import PeakMemory
from asyncps.rundir.names import (
    CONFIG_JSON,
    EVAL_CSV,
    MANIFEST_JSON,
    PUSHES_CSV,
    RESTORES_CSV,
    SUMMARY_JSON,
    TIMELINE_CSV,
    CheckpointNames,
    RunDir,
    RunDirError,
    exported_model,
)
from asyncps.rundir.partial import UNFINISHED, is_run_dir, load_summary, summary_from_tables
from asyncps.rundir.provenance import Provenance
from asyncps.rundir.rollback import Rollbacks
from asyncps.rundir.summary import (
    INTERRUPTED,
    FinalEval,
    RunConfigRecord,
    RunSummary,
    ShardCounters,
    StalenessSummary,
)
from asyncps.rundir.tables import (
    CsvRow,
    EvalRow,
    PushRow,
    RestoreRow,
    RowWriter,
    StepRow,
    iter_rows,
    read_rows,
    write_rows,
)

__all__ = [
    "CONFIG_JSON",
    "EVAL_CSV",
    "INTERRUPTED",
    "MANIFEST_JSON",
    "PUSHES_CSV",
    "RESTORES_CSV",
    "SUMMARY_JSON",
    "TIMELINE_CSV",
    "UNFINISHED",
    "CheckpointNames",
    "ChiefLock",
    "CsvRow",
    "EvalRow",
    "FinalEval",
    "PeakMemory",
    "Provenance",
    "PushRow",
    "RestoreRow",
    "Rollbacks",
    "RowWriter",
    "RunConfigRecord",
    "RunDir",
    "RunDirError",
    "RunDirLocked",
    "RunManifest",
    "RunSummary",
    "ShardCounters",
    "StalenessSummary",
    "StepRow",
    "atomic_write",
    "exported_model",
    "is_run_dir",
    "iter_rows",
    "load_summary",
    "read_rows",
    "summary_from_tables",
    "wait_port_file",
    "write_json",
    "write_npz",
    "write_port_file",
    "write_rows",
]
