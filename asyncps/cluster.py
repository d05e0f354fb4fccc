"""Cluster specification from TensorFlow's TF_CONFIG (the JSON a Kubeflow TFJob injects)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("chief", "worker", "ps")


class ClusterConfigError(ValueError):
    """TF_CONFIG (or an address) is malformed; the message says what is wrong in one line."""


@dataclass(frozen=True)
class TFConfig:
    """The parts of TF_CONFIG asyncps uses: addresses per role and this task's role and index."""

    chief: tuple[str, ...]
    worker: tuple[str, ...]
    ps: tuple[str, ...]
    task_type: str
    task_index: int

    @property
    def own_address(self) -> str:
        """This task's address in the cluster."""
        return getattr(self, self.task_type)[self.task_index]  # type: ignore[no-any-return]

    @property
    def own_port(self) -> int:
        """The port of this task's address (what it binds)."""
        return split_address(self.own_address)[1]


def split_address(address: str) -> tuple[str, int]:
    """Split host:port; raise ClusterConfigError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f"bad address {address!r}: expected host:port")
    return host, int(port)


def parse_tf_config(text: str) -> TFConfig:
    """Parse TF_CONFIG JSON; roles are chief, worker, ps (evaluator entries are ignored)."""
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cluster"), dict):
        raise ClusterConfigError('TF_CONFIG needs a "cluster" object')
    cluster = doc["cluster"]
    task = doc.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ClusterConfigError('TF_CONFIG needs a "task" object with "type" and "index"')
    unknown = set(cluster) - {*ROLES, "evaluator"}
    if unknown:
        raise ClusterConfigError(f"TF_CONFIG cluster has unknown roles {sorted(unknown)}; valid: {ROLES}")
    roles: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        entries = cluster.get(role, [])
        if not isinstance(entries, list) or not all(isinstance(a, str) for a in entries):
            raise ClusterConfigError(f"TF_CONFIG cluster.{role} must be a list of host:port strings")
        for address in entries:
            split_address(address)
        roles[role] = tuple(entries)
    if len(roles["chief"]) != 1:
        raise ClusterConfigError("TF_CONFIG cluster.chief must have exactly one address")
    if not roles["ps"]:
        raise ClusterConfigError("TF_CONFIG cluster.ps must have at least one address")
    task_type = task["type"]
    if task_type not in ROLES:
        raise ClusterConfigError(f"TF_CONFIG task.type {task_type!r} is not one of {ROLES}")
    index = task.get("index", 0)
    if not isinstance(index, int) or not 0 <= index < len(roles[task_type]):
        raise ClusterConfigError(
            f"TF_CONFIG task.index {index!r} is out of range for {len(roles[task_type])} {task_type} task(s)"
        )
    return TFConfig(roles["chief"], roles["worker"], roles["ps"], task_type, index)
