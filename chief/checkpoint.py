"""Checkpoints of the whole model: full variables and optimizer slots plus a manifest.

A checkpoint is written into `ckpt-NNNNNNNN.tmp/`, every file fsynced, then the directory is
renamed to `ckpt-NNNNNNNN/` and its parent fsynced: a reader sees a complete checkpoint or none.
A write that fails (the disk full, the directory read-only) raises its OSError after removing what
it staged (where it can): the complete checkpoints before it stay the latest.
Variables are stored whole (slices reassembled), so a checkpoint restores into any number of
shards (resharding) through the placement module.

Each tensor (`value/NAME`, `slot/SLOT/NAME`, `policy/KEY/NAME`) is one `.npy` file in `tensors/`
(CheckpointNames.tensor_file), written as the shards stream their parts (TensorWriter): a part is a
run of rows of its variable, so each chunk is written at its place in the whole tensor's file and the
chief never holds a tensor. A restore reads each part's rows from the files a chunk at a time
(part_slices), onto any shard count; a loaded checkpoint's arrays are memory maps of the files.
Checkpoints written before (one `model.npz`) still load, whole, and restore as before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncps.pb import tensor_pb2
from asyncps.placement import Part, Placement
from asyncps.rules import UpdateRuleConfig
from asyncps.rundir import CheckpointNames
from asyncps.wire.codec import Array, dtype_from_proto, dtype_to_proto
from asyncps.wire.frames import Slice
from asyncps.wire.shard import Snapshot


@dataclass(frozen=True)
class TensorFile:
    """One tensor of a checkpoint in its .npy file: where its data starts, its shape and dtype."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @staticmethod
    def open(path: Path) -> TensorFile:
        """The tensor a .npy file holds (its header read, not its data)."""
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            if fortran:
                raise ValueError(f"{path}: a Fortran-ordered array")
            return TensorFile(path, f.tell(), tuple(shape), np.dtype(dtype))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the whole tensor for a 0-d one)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    def array(self) -> Array:
        """The tensor, memory-mapped read-only (nothing read until used)."""
        if math.prod(self.shape) == 0:
            return np.empty(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, "r", self.offset, self.shape)

    def slices(self, name: str, part: Part | None, chunk_bytes: int) -> Iterator[Slice]:
        """The tensor's rows of `part` (None: all) as slices of a tensor `name`, read chunk by chunk."""
        start, stop = (part.row_start, part.row_stop) if part is not None else (0, self.shape[0] if self.shape else 1)
        shape = (stop - start, *self.shape[1:]) if part is not None else self.shape
        total = (stop - start) * self.row_bytes
        step = max(1, chunk_bytes)
        with open(self.path, "rb", buffering=0) as f:
            offset = 0
            while True:
                data = os.pread(f.fileno(), min(step, total - offset), self.offset + start * self.row_bytes + offset)
                yield Slice(name, tensor_pb2.DENSE, int(dtype_to_proto(self.dtype)), shape, offset, memoryview(data))
                offset += len(data)
                if offset >= total or not data:
                    return


class TensorWriter:
    """Whole tensors written as the shards stream their parts: each chunk straight to its place in its
    whole tensor's .npy file (a part is a run of rows of its variable, contiguous in the whole), so
    memory holds one chunk; a tensor's rows no part wrote read zeros (a policy's "no state").
    Thread-safe: the shards' streams are written at once."""

    def __init__(self, checkpoint: Path, placement: Placement) -> None:
        self._checkpoint = checkpoint
        self._parts = {p.name: p for p in placement.parts}
        self._specs = {v.name: v for v in placement.variables}
        self._files: dict[str, tuple[int, TensorFile]] = {}
        self._written: dict[tuple[str, str], int] = {}  # (tensor, part) -> bytes written
        self._lock = threading.Lock()
        CheckpointNames.tensors(checkpoint).mkdir(parents=True, exist_ok=True)

    def add(self, piece: Slice) -> None:
        """Write one streamed slice of `value/PART`, `slot/SLOT/PART` or `policy/KEY/PART`."""
        key, part = self._place(piece.name)
        fd, file = self._open(key, part, piece.shape, dtype_from_proto(piece.dtype))
        part_bytes = math.prod(piece.shape) * file.dtype.itemsize
        if piece.offset < 0 or piece.offset + piece.data.nbytes > part_bytes:
            raise ValueError(f"{piece.name}: bytes [{piece.offset}, {piece.offset + piece.data.nbytes}) outside "
                             f"its {part_bytes}")
        start = file.offset + (part.row_start * file.row_bytes if part.sliced else 0)
        os.pwrite(fd, piece.data, start + piece.offset)
        with self._lock:
            self._written[(key, part.name)] = self._written.get((key, part.name), 0) + piece.data.nbytes

    def add_all(self, pieces: Iterable[Slice]) -> None:
        """Write every slice of a stream."""
        for piece in pieces:
            self.add(piece)

    def _place(self, name: str) -> tuple[str, Part]:
        """The whole tensor's key and the part a streamed tensor's name says."""
        kind, _, rest = name.partition("/")
        label, _, part_name = rest.partition("/") if kind in ("slot", "policy") else ("", "", rest)
        part = self._parts.get(part_name)
        if kind not in ("value", "slot", "policy") or part is None or (kind != "value" and not label):
            raise ValueError(f"snapshot tensor {name!r}: not value/PART, slot/SLOT/PART or policy/KEY/PART of "
                             "this placement")
        return (f"value/{part.variable}" if kind == "value" else f"{kind}/{label}/{part.variable}"), part

    def _open(self, key: str, part: Part, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[int, TensorFile]:
        """The whole tensor's file (made at its full size on the first part: zeros until written)."""
        rows = self._specs[part.variable].shape[0] if part.sliced else None
        whole = (rows, *shape[1:]) if rows is not None and shape else shape
        if key.startswith("value/") and whole != tuple(self._specs[part.variable].shape):
            raise ValueError(f"{key}: part {part.name} of shape {list(shape)} does not fit "
                             f"{list(self._specs[part.variable].shape)}")
        with self._lock:
            known = self._files.get(key)
            if known is None:
                known = self._create(key, whole, dtype)
                self._files[key] = known
        if known[1].shape != whole or known[1].dtype != dtype:
            raise ValueError(f"{key}: part {part.name} is {dtype}{list(shape)}, another part made it "
                             f"{known[1].dtype}{list(known[1].shape)}")
        return known

    def _create(self, key: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[int, TensorFile]:
        path = CheckpointNames.tensor_file(self._checkpoint, key)
        with open(path, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_2_0(f, header)  # type: ignore[no-untyped-call]
            offset = f.tell()
            f.truncate(offset + math.prod(shape) * dtype.itemsize)
        return os.open(path, os.O_WRONLY), TensorFile(path, offset, shape, dtype)

    def close(self, complete: bool = True) -> None:
        """Flush and close every file; with `complete`, a ValueError unless every part's value was written
        whole and every part's other tensors too."""
        for fd, _ in self._files.values():
            os.fsync(fd)
            os.close(fd)
        if not complete:
            return
        for part in self._parts.values():
            if (f"value/{part.variable}", part.name) not in self._written:
                raise ValueError(f"shard {part.shard} sent nothing of {part.name}")
        for (key, name), written in self._written.items():
            part = self._parts[name]
            _, file = self._files[key]
            rows = part.row_stop - part.row_start if part.sliced else (file.shape[0] if file.shape else 1)
            if written != rows * file.row_bytes:
                raise ValueError(f"{key}: part {name} sent {written} of its {rows * file.row_bytes} bytes")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: whole variables, their slots, and the manifest."""

    path: Path
    values: dict[str, Array]
    slots: dict[str, dict[str, Array]]
    manifest: dict[str, Any]
    policy_state: dict[str, dict[str, Array]] = field(default_factory=dict)  # asyncps.ps.policy_state
    files: dict[str, TensorFile] = field(default_factory=dict)  # by tensor key (empty: a model.npz checkpoint)

    @property
    def number(self) -> int:
        """The checkpoint's sequence number."""
        return int(self.manifest["number"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def assemble(placement: Placement, snaps: list[Snapshot]) -> tuple[dict[str, Array], dict[str, dict[str, Array]]]:
    """Whole variables and slots from every shard's snapshot."""
    values: dict[str, Array] = {}
    slots: dict[str, dict[str, Array]] = {}
    for spec in placement.variables:
        values[spec.name] = np.empty(spec.shape, dtype=spec.dtype)
    for part in placement.parts:
        snap = snaps[part.shard]
        if part.name not in snap.values:
            raise ValueError(f"shard {part.shard} has no {part.name}")
        target = values[part.variable]
        (target[part.rows()] if part.sliced else target)[...] = snap.values[part.name]
        for slot, array in snap.slots.get(part.name, {}).items():
            full = slots.setdefault(part.variable, {}).setdefault(
                slot, np.empty(target.shape, dtype=array.dtype))
            (full[part.rows()] if part.sliced else full)[...] = array
    return values, slots


def assemble_policy_state(placement: Placement, snaps: list[Snapshot]) -> dict[str, dict[str, Array]]:
    """Whole-variable policy state from every shard's snapshot; rows of a part with no state for
    a key get zeros, which the row masks (KEY@rows) mark as "no state"."""
    state: dict[str, dict[str, Array]] = {}
    rows_of = {spec.name: spec.shape[0] if spec.shape else 1 for spec in placement.variables}
    for part in placement.parts:
        for key, array in snaps[part.shard].policy_state.get(part.name, {}).items():
            shape = (rows_of[part.variable], *array.shape[1:]) if part.sliced else array.shape
            full = state.setdefault(part.variable, {}).setdefault(key, np.zeros(shape, dtype=array.dtype))
            (full[part.rows()] if part.sliced else full)[...] = array
    return state


def _part_of(array: Array, part: Part) -> Array:
    """The part's rows (or the whole array), C-contiguous and in its own shape (numpy < 2 made 0-d 1-d)."""
    piece = array[part.rows()] if part.sliced else array
    return np.ascontiguousarray(piece).reshape(piece.shape)


def split(placement: Placement, ckpt: Checkpoint, rule: UpdateRuleConfig) -> list[Snapshot]:
    """One Snapshot per shard of `placement` from a checkpoint (possibly of another shard count)."""
    snaps = []
    for shard, header in enumerate(split_counters(placement, ckpt, rule)):
        values: dict[str, Array] = {}
        slots: dict[str, dict[str, Array]] = {}
        policy_state: dict[str, dict[str, Array]] = {}
        for part in placement.parts_on(shard):
            values[part.name] = _part_of(ckpt.values[part.variable], part)
            slots[part.name] = {k: _part_of(a, part) for k, a in ckpt.slots.get(part.variable, {}).items()}
            state = {k: _part_of(a, part) for k, a in ckpt.policy_state.get(part.variable, {}).items()}
            if state:
                policy_state[part.name] = state
        snaps.append(dataclasses.replace(header, values=values, slots=slots, policy_state=policy_state))
    return snaps


def split_counters(placement: Placement, ckpt: Checkpoint, rule: UpdateRuleConfig) -> list[Snapshot]:
    """Per shard of `placement`, its Snapshot's counters and update counts (no arrays) from a checkpoint."""
    old_versions: list[int] = ckpt.manifest["shard_versions"]
    same_shape = len(old_versions) == placement.num_shards
    updates: dict[str, int] = ckpt.manifest["updates"]
    var_updates: dict[str, int] = ckpt.manifest["variable_updates"]
    counters = ckpt.manifest["shard_counters"]
    snaps = []
    for shard in range(placement.num_shards):
        part_updates = {part.name: updates.get(part.name, var_updates.get(part.variable, 0))
                        for part in placement.parts_on(shard)}
        version = old_versions[shard] if same_shape else max(old_versions, default=0)
        accepted = counters[shard]["accepted"] if same_shape else max(c["accepted"] for c in counters)
        dropped = counters[shard]["dropped"] if same_shape else max(c["dropped"] for c in counters)
        # the answers the shard had given (older checkpoints: none counted; another shard count: a new count)
        answers = int(counters[shard].get("answers", 0)) if same_shape else 0
        by_worker = {int(w): int(n) for w, n in counters[shard].get("answers_by_worker", {}).items()} \
            if same_shape else {}
        snaps.append(Snapshot(rule=rule, version=version, accepted=accepted, dropped=dropped, values={}, slots={},
                              updates=part_updates, answers=answers, answers_by_worker=by_worker))
    return snaps


def part_slices(placement: Placement, ckpt: Checkpoint, shard: int, chunk_bytes: int) -> Iterator[Slice]:
    """A shard's parts of a checkpoint written as tensors/ (its values, slots and policy state), read from
    the files chunk by chunk: the restore's stream, never a whole tensor in memory."""
    for part in placement.parts_on(shard):
        for key, file in ckpt.files.items():
            kind, _, rest = key.partition("/")
            label, _, variable = rest.partition("/") if kind != "value" else ("", "", rest)
            if variable == part.variable:
                name = f"value/{part.name}" if kind == "value" else f"{kind}/{label}/{part.name}"
                yield from file.slices(name, part if part.sliced else None, chunk_bytes)


class CheckpointDir:
    """The checkpoints of a run, newest last; keeps the last `keep`."""

    def __init__(self, root: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = root
        self.keep = keep
        self.names = CheckpointNames(root)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (a `.tmp` one is an interrupted write)."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.iterdir()
                 if CheckpointNames.number_of(p) is not None and CheckpointNames.manifest(p).exists()]
        return sorted(found, key=lambda p: p.name)

    def last_number(self) -> int:
        """The number of the newest complete checkpoint (0: none): new ones continue after it."""
        paths = self.complete()
        number = CheckpointNames.number_of(paths[-1]) if paths else None
        return number or 0

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, loaded, or None."""
        paths = self.complete()
        return self.load(paths[-1]) if paths else None

    @staticmethod
    def load(path: Path) -> Checkpoint:
        """Load one checkpoint directory (a tensors/ one as memory maps of its files)."""
        manifest = json.loads(CheckpointNames.manifest(path).read_text())
        values: dict[str, Array] = {}
        slots: dict[str, dict[str, Array]] = {}
        policy_state: dict[str, dict[str, Array]] = {}
        files: dict[str, TensorFile] = {}
        folder = CheckpointNames.tensors(path)
        if folder.is_dir():
            files = {CheckpointNames.tensor_key(f): TensorFile.open(f) for f in sorted(folder.glob("*.npy"))}
            arrays: Any = {key: file.array() for key, file in files.items()}
        else:
            arrays = dict(np.load(CheckpointNames.arrays(path), allow_pickle=False))
        for key, array in arrays.items():
            kind, _, rest = key.partition("/")
            if kind == "value":
                values[rest] = array
            else:
                slot, _, name = rest.partition("/")
                (policy_state if kind == "policy" else slots).setdefault(name, {})[slot] = array
        return Checkpoint(path, values, slots, manifest, policy_state, files)

    def save(self, number: int, values: dict[str, Array], slots: dict[str, dict[str, Array]],
             manifest: dict[str, Any], policy_state: dict[str, dict[str, Array]] | None = None) -> Path:
        """Write checkpoint `number` from whole arrays, atomically, and prune old ones; return its path
        (failures: see save_with)."""
        arrays = {f"value/{n}": a for n, a in values.items()}
        arrays.update({f"slot/{s}/{n}": a for n, by_slot in slots.items() for s, a in by_slot.items()})
        arrays.update({f"policy/{k}/{n}": a for n, by_key in (policy_state or {}).items() for k, a in by_key.items()})

        def write(tmp: Path) -> None:
            CheckpointNames.tensors(tmp).mkdir()
            for key, array in arrays.items():
                with open(CheckpointNames.tensor_file(tmp, key), "wb") as f:
                    np.save(f, np.ascontiguousarray(array))
                    f.flush()
                    os.fsync(f.fileno())
            _fsync_dir(CheckpointNames.tensors(tmp))

        return self.save_with(number, write, manifest)

    def save_with(self, number: int, write: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
        """Write checkpoint `number` atomically, its tensors by `write(staging directory)` (which flushes
        them), and prune old ones; return its path. A failure (an OSError: the disk full, a read-only
        directory; or the shards' stream breaking) leaves no trace of it but what the storage refused to
        remove (a `.tmp` directory, never read as a checkpoint): the complete checkpoints before it stay
        the latest."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.names.staging(number)
        try:
            final = self._write(number, tmp, write, manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk frees what the torn write took
            raise
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for torn in self.root.glob("ckpt-*.tmp"):  # a chief killed mid-write (one chief writes: ChiefLock)
            shutil.rmtree(torn, ignore_errors=True)
        return final

    def _write(self, number: int, tmp: Path, write: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
        """Stage checkpoint `number` in `tmp`, fsynced, and rename it into place; return its path."""
        final = self.names.final(number)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        with open(CheckpointNames.manifest(tmp), "w") as f:
            json.dump({**manifest, "number": number}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final
