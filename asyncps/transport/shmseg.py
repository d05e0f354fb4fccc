"""Shared-memory segments for the same-host data path: files under /dev/shm, mapped by a worker
and by the shards it talks to.

Lifetime: the worker creates a segment, the shards map it, and the name is unlinked as soon as
every shard has answered (either side unlinks; the second finds nothing). The memory lives on
in the mappings and is freed by the kernel when the last process holding one exits, so no
segment outlives a run, `kill -9` included. A launcher that starts workers also removes any
segment of its run tag left by a worker killed between creating and unlinking (microseconds).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path(os.environ.get("ASYNCPS_SHM_DIR", "/dev/shm"))
PREFIX = "asyncps-"
TAG_ENV = "ASYNCPS_SHM_TAG"  # a launcher's run tag: segments of its run are named asyncps-TAG-...
TOKEN_BYTES = 16
ALIGN = 64  # every region starts on a cache line
MAX_SEGMENT_BYTES = 64 << 30
_NAME = re.compile(r"asyncps-[A-Za-z0-9_-]{1,100}")


def valid_name(name: str) -> bool:
    """A segment name a shard may open: asyncps-..., no path separators."""
    return bool(_NAME.fullmatch(name))


def align(position: int) -> int:
    """The next multiple of ALIGN."""
    return -(-position // ALIGN) * ALIGN


@dataclass
class Segment:
    """A mapped segment this process created (and unlinks)."""

    name: str
    size: int
    buffer: mmap.mmap
    token: bytes

    @property
    def path(self) -> Path:
        """Where the name lives while it exists."""
        return SHM_DIR / self.name

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid); idempotent."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def available() -> bool:
    """Whether this host has a writable shared-memory directory."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def create(size: int) -> Segment:
    """A new zeroed segment of `size` bytes whose first TOKEN_BYTES are a random token."""
    if not 0 < size <= MAX_SEGMENT_BYTES:
        raise ValueError(f"segment size {size} outside (0, {MAX_SEGMENT_BYTES}]")
    name = _new_name()
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        buffer = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(SHM_DIR / name)
        raise
    os.close(fd)
    token = secrets.token_bytes(TOKEN_BYTES)
    buffer[:TOKEN_BYTES] = token
    return Segment(name, size, buffer, token)


def attach(name: str, size: int, token: bytes) -> mmap.mmap:
    """Map another process's segment, check its size and token, and unlink its name.

    ValueError for a name or size that is not acceptable; FileNotFoundError when the segment is
    not visible here (another host or IPC namespace); PermissionError when the token differs.
    """
    if not valid_name(name):
        raise ValueError(f"segment name {name!r} is not asyncps-[A-Za-z0-9_-]+")
    if not TOKEN_BYTES <= size <= MAX_SEGMENT_BYTES:
        raise ValueError(f"segment size {size} outside [{TOKEN_BYTES}, {MAX_SEGMENT_BYTES}]")
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"segment {name} holds {actual} bytes, not {size}")
        buffer = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if buffer[:TOKEN_BYTES] != token:
        buffer.close()
        raise PermissionError(f"segment {name}: token mismatch (not the segment the caller created)")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return buffer


def _new_name() -> str:
    tag = os.environ.get(TAG_ENV, "")
    name = f"{PREFIX}{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(6)}"
    if not valid_name(name):
        raise ValueError(f"bad segment name {name!r} (check {TAG_ENV})")
    return name


class Arena:
    """One worker's shared memory for all its shards: the full variables it computes from and a
    gradient region per shard part, in one segment, so each shard writes its rows of a sliced
    variable straight into the array the worker computes from: values are written once, by the
    shards. Regions are handed out by `take` (64-byte aligned: TensorFlow reads a buffer in place
    only when aligned).

    A shard maps a segment by name and unlinks the name; an unlinked tmpfs file cannot be named
    again, so the arena keeps a base name while its shards attach for the first time (`settled`
    counts them) and each attach gets a fresh hard link of it (`named`); once every path has settled,
    or at `close`, the base name goes. A path that must attach again later (a restarted shard) finds
    no name (None from `named`) and uses a segment of its own. A worker killed before its paths
    settled leaves the base name behind until its launcher sweeps its run tag (`sweep`).

    Every shard that maps the arena sees the whole model's values and gradients: the shards are
    the worker's own peers, holding the model already."""

    def __init__(self, size: int, users: int) -> None:
        """A zeroed arena of `size` bytes (after the token) for `users` paths; OSError where the
        segment cannot be made."""
        size = align(TOKEN_BYTES) + align(size)
        segment = create(size)
        self.buffer = segment.buffer
        self.size = size
        self.token = segment.token
        self._name: str | None = segment.name
        self._users = users
        self._settled = 0
        self._base = np.frombuffer(self.buffer, np.uint8)
        self._address = int(self._base.ctypes.data)
        self._next = align(TOKEN_BYTES)
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int, users: int) -> Arena | None:
        """An arena, or None where this host cannot make one (the callers' buffers are then their own)."""
        if not available() or users < 1:
            return None
        try:
            return cls(size, users)
        except (OSError, ValueError):
            return None

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A fresh zeroed array in the arena (ModelBuffers: a worker's variable; MemoryError when full)."""
        return self.take(shape, dtype)[1]

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[int, np.ndarray[Any, Any]]:
        """A fresh zeroed region for a C-contiguous array: its offset and the array over it
        (MemoryError when the arena is full)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            offset = self._next
            if offset + nbytes > self.size:
                raise MemoryError(f"arena of {self.size} bytes is full ({offset} used, {nbytes} asked)")
            self._next = align(offset + nbytes)
        count = nbytes // dtype.itemsize
        return offset, self._base[offset:offset + nbytes].view(dtype)[:count].reshape(shape)

    def offset_of(self, array: np.ndarray[Any, Any]) -> int | None:
        """Where a C-contiguous array lies in the arena, or None when it is not wholly inside."""
        if not array.flags.c_contiguous:
            return None
        offset = int(array.ctypes.data) - self._address
        if offset < TOKEN_BYTES or offset + array.nbytes > self.size or offset % 8:
            return None
        return offset

    @contextlib.contextmanager
    def named(self) -> Iterator[str | None]:
        """A fresh name under SHM_DIR for the arena while the block runs (the shard maps it by name and
        unlinks it; it is removed on the way out in any case); None once the base name is gone."""
        with self._lock:
            base = self._name
            name = _new_name() if base is not None else None
            if base is not None and name is not None:
                os.link(SHM_DIR / base, SHM_DIR / name)
        try:
            yield name
        finally:
            if name is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SHM_DIR / name)

    def settled(self) -> None:
        """One path has attached (or given up on shared memory): the last one removes the base name."""
        with self._lock:
            self._settled += 1
            if self._settled >= self._users:
                self._unlink()

    def _unlink(self) -> None:
        if self._name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / self._name)
            self._name = None

    def close(self) -> None:
        """Remove the base name if it is still there; the mapping goes with the last array over it."""
        with self._lock:
            self._unlink()


def sweep(tag: str) -> list[str]:
    """Remove the segments of a run tag that are still named (a worker killed mid-attach)."""
    removed: list[str] = []
    if not tag or not available():
        return removed
    for path in SHM_DIR.glob(f"{PREFIX}{tag}-*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


__all__ = ["ALIGN", "MAX_SEGMENT_BYTES", "PREFIX", "SHM_DIR", "TAG_ENV", "TOKEN_BYTES", "Arena", "Segment",
           "align", "attach", "available", "create", "sweep", "valid_name"]
