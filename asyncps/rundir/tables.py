"""The run directory's CSV files: one row type per file, its column order, a writer and a reader.

Each row type is a frozen dataclass whose fields are the file's columns in order. A field's type
says how a cell is read (int, float, str, bool as 0/1, tuple[int, ...] as `a|b|c`); its metadata
`fmt` says how a number is written (so files stay byte-for-byte what earlier chiefs wrote).

Reading: a file that does not exist has no rows. A header that lacks a column of the row type is a
RunDirError naming the file and the columns (extra columns are ignored), except a column added
after the first version (a field with a default, e.g. pushes.csv's `drop_detail`): files of earlier
versions lack it and read with the default. A row with a different
number of cells than the header is skipped: that is a line torn by a process killed while writing
it (a resumed run appends after it). A row with the right cells that does not parse is a
RunDirError naming the file, the line, the column and the value.

Lines end in `\n` (the recorder's files ended in `\r\n` before; both read the same).
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Generic, TypeVar

from asyncps.rundir.names import EVAL_CSV, PUSHES_CSV, RESTORES_CSV, TIMELINE_CSV, RunDirError

# How numbers are written (a field's metadata): the formats earlier chiefs used.
_F3, _F6, _G6 = {"fmt": ".3f"}, {"fmt": ".6f"}, {"fmt": ".6g"}


class CsvRow:
    """Base of the row types: the columns, one row as cells, one row from cells."""

    FILE: ClassVar[str]

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        """The file's header, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def required_columns(cls) -> tuple[str, ...]:
        """The columns every file has had (the others were added later and have defaults)."""
        return tuple(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    def cells(self) -> list[str]:
        """This row as the file's cells."""
        out = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            spec = f.metadata.get("fmt")
            if isinstance(value, bool):
                out.append(str(int(value)))
            elif isinstance(value, tuple):
                out.append("|".join(str(v) for v in value))
            elif spec is not None:
                out.append(format(value, spec))
            else:
                out.append(str(value))
        return out

    @classmethod
    def from_cells(cls: type[R], record: dict[str, str], where: str) -> R:
        """A row from a header -> cell mapping; `where` (file:line) goes into the error."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in record:
                continue  # a later column a file of an earlier version lacks (checked by the reader)
            text = record[f.name]
            try:
                values[f.name] = _parse(str(f.type), text)
            except ValueError:
                raise RunDirError(f"{where}: column {f.name!r}: cannot read {text!r} as {f.type}") from None
        return cls(**values)


def _parse(kind: str, text: str) -> Any:
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        if text not in ("0", "1"):
            raise ValueError(text)
        return text == "1"
    if kind == "str":
        return text
    if kind == "tuple[int, ...]":
        return tuple(int(part) for part in text.split("|")) if text else ()
    raise TypeError(f"no CSV reader for a {kind} column")  # a row type with an unsupported field


R = TypeVar("R", bound=CsvRow)


@dataclass(frozen=True)
class PushRow(CsvRow):
    """pushes.csv: one push a worker reported (one row per shard the step pushed to)."""

    FILE: ClassVar[str] = PUSHES_CSV
    wall_time: float = field(metadata=_F6)  # when the shard answered (Unix time)
    worker: int
    shard: int
    step: int  # the worker's step
    base_version: int  # the shard version the gradient was computed from
    version: int  # the shard version after this push
    staleness: int
    accepted: bool
    drop_reason: str  # why the shard dropped it (a DropReason value), empty when accepted
    effective_lr: float = field(metadata=_G6)
    loss: float = field(metadata=_G6)  # the worker's training loss of this step
    drop_detail: str = ""  # the shard's words on the drop (added later: absent in older files)
    local_steps: int = 1  # local SGD steps the push carried: its examples are local_steps batches (added later)
    # the incarnation of the shard's state the push was sent to (an accepted push: applied to); 0 in older
    # files. A push is rolled back when a later restore of its shard (restores.csv) went back to a
    # version before it: asyncps.rundir.rollback.Rollbacks marks it (added later)
    incarnation: int = 0
    # the shard's number of its answer (asyncps.ps.store.Answers; 0: none, an older shard or worker): an
    # answer numbered above the count a later restore went back to was taken back (added later)
    seq: int = 0
    # per-row staleness (tables read by rows): the rows the push touched that carried their read clocks, and
    # the updates each had received since it was read: mean, 95th percentile and max over them (0 rows: none
    # measured; added later)
    rows: int = 0
    row_staleness_mean: float = field(default=0.0, metadata=_G6)
    row_staleness_p95: float = field(default=0.0, metadata=_G6)
    row_staleness_max: int = 0
    # of those rows: the ones a per-row staleness policy dropped, the hot ones (in at least 1 of 100 of their
    # table's updates: asyncps.ps.store.HOT_SHARE) and their mean staleness (added later)
    rows_dropped: int = 0
    hot_rows: int = 0
    hot_row_staleness_mean: float = field(default=0.0, metadata=_G6)


@dataclass(frozen=True)
class StepRow(CsvRow):
    """timeline.csv: one worker step, in wall-clock seconds."""

    FILE: ClassVar[str] = TIMELINE_CSV
    worker: int
    step: int
    start: float = field(metadata=_F6)  # when the gradient computation started (Unix time)
    pull_s: float = field(metadata=_F6)  # pulling parameters before the step (first step only, or a plain pull)
    compute_s: float = field(metadata=_F6)
    push_s: float = field(metadata=_F6)  # the push and the pull of the new values, one round trip
    wait_s: float = field(metadata=_F6)  # held back by the consistency model (sync barrier, SSP bound)
    examples: int

    @property
    def end(self) -> float:
        """When the step's round trip came back."""
        return self.start + self.compute_s + self.push_s + self.wait_s


@dataclass(frozen=True)
class RestoreRow(CsvRow):
    """restores.csv: the chief replaced a shard's state with a checkpoint's part (a crashed shard
    restarted empty, or the run resumed on shards behind its checkpoint), or re-initialized it."""

    FILE: ClassVar[str] = RESTORES_CSV
    wall_time: float = field(metadata=_F6)
    shard: int
    version: int  # the version the shard went back to (0: re-initialized): its later pushes are rolled back
    incarnation: int  # the incarnation the restore gave the shard's state
    checkpoint: str  # the checkpoint's directory name; empty when re-initialized
    # the answers to pushes the restored state had given (its pushes.csv rows numbered above were taken
    # back); -1 in older files: not known (added later)
    answers: int = -1


@dataclass(frozen=True)
class EvalRow(CsvRow):
    """eval.csv: one evaluation of the model on the test set."""

    FILE: ClassVar[str] = EVAL_CSV
    wall_time: float = field(metadata=_F3)
    elapsed_s: float = field(metadata=_F3)  # training time since the first update
    updates: int  # applied updates (mean over shards of their versions)
    shard_versions: tuple[int, ...]
    loss: float = field(metadata=_F6)
    accuracy: float = field(metadata=_F6)


class RowWriter(Generic[R]):
    """Writes one CSV file of rows of type `row_type`; `append` continues an existing file (a resumed run)."""

    def __init__(self, path: Path, row_type: type[R], append: bool = False) -> None:
        self.path, self.row_type = path, row_type
        continuing = append and path.exists() and path.stat().st_size > 0
        if continuing:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != row_type.columns():
                raise RunDirError(f"{path}: cannot append: its columns {header} are not "
                                  f"{list(row_type.columns())} (a run directory of another version)")
        self._file: IO[str] = open(path, "a" if continuing else "w", newline="")  # noqa: SIM115
        self._csv = csv.writer(self._file, lineterminator="\n")
        if continuing and not _ends_with_newline(path):
            self._file.write("\n")  # end the line torn by a killed writer: the next row starts clean
        if not continuing:
            self._csv.writerow(row_type.columns())

    def write(self, row: R) -> None:
        """Append one row."""
        self._csv.writerow(row.cells())

    def write_all(self, rows: Iterable[R]) -> None:
        """Append rows."""
        self._csv.writerows(r.cells() for r in rows)

    def flush(self) -> None:
        """Hand the rows written so far to the operating system (readers see them)."""
        self._file.flush()

    def size(self) -> int:
        """The file's size in bytes once the rows written so far are flushed."""
        self._file.flush()
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        """Flush and close."""
        self._file.close()

    def __enter__(self) -> RowWriter[R]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def iter_rows(path: Path, row_type: type[R]) -> Iterator[R]:
    """The rows of `path` as `row_type` (none when the file does not exist); see the module's doc."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return
        missing = [c for c in row_type.required_columns() if c not in header]
        if missing:
            raise RunDirError(f"{path}: no column(s) {missing}; a {row_type.FILE} has {list(row_type.columns())}")
        for cells in reader:
            if len(cells) != len(header):
                continue  # a torn line (see the module's doc)
            yield row_type.from_cells(dict(zip(header, cells, strict=True)), f"{path}:{reader.line_num}")


def read_rows(path: Path, row_type: type[R]) -> list[R]:
    """Every row of `path` as `row_type` (empty when the file does not exist)."""
    return list(iter_rows(path, row_type))


def write_rows(path: Path, rows: Sequence[R], row_type: type[R]) -> None:
    """Write a whole file: the header and `rows`."""
    with RowWriter(path, row_type) as writer:
        writer.write_all(rows)
