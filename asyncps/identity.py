"""Worker ids: how a process incarnation is named to the chief and to the shards.

A worker started with a fixed index (the local launcher, TF_CONFIG, `--index`) carries it in its
id, `worker#3-host-pid-abc123`, so that a shard, which knows workers only by id, can tell a
staleness policy which worker pushed (asyncps.rules.policies.PushContext.worker_index).
"""

from __future__ import annotations

import os
import re
import socket
import uuid

_INDEXED = re.compile(r"[a-z]+#(\d+)-")


def new_worker_id(role: str, index: int = -1) -> str:
    """A unique id for this process incarnation, with its index when it asked for one (>= 0)."""
    tag = f"{role}#{index}" if index >= 0 else role
    return f"{tag}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def index_of(worker_id: str) -> int | None:
    """The index a worker id carries, or None (a worker whose index the chief chose)."""
    match = _INDEXED.match(worker_id)
    return int(match.group(1)) if match else None


__all__ = ["index_of", "new_worker_id"]
