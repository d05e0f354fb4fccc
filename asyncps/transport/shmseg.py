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
from dataclasses import dataclass
from pathlib import Path

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
    tag = os.environ.get(TAG_ENV, "")
    name = f"{PREFIX}{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(6)}"
    if not valid_name(name):
        raise ValueError(f"bad segment name {name!r} (check {TAG_ENV})")
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


__all__ = ["ALIGN", "MAX_SEGMENT_BYTES", "PREFIX", "SHM_DIR", "TAG_ENV", "TOKEN_BYTES", "Segment", "align", "attach",
           "available", "create", "sweep", "valid_name"]
