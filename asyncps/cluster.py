"""Cluster specification: from TensorFlow's TF_CONFIG (the JSON a Kubeflow TFJob injects) or from a Slurm
step's environment (the same decisions as TF's SlurmClusterResolver)."""

from __future__ import annotations

import json
from collections.abc import Mapping
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


# -- Slurm: the same cluster spec from an allocation's environment -------------------------------------------------
SLURM_PORT_BASE = 8470


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Expand a Slurm host list (`node[1-3,7]`, `a[01-03]`, `n1,n[4-5]`, `r[1-2]-n[1-2]`) in Slurm's order."""
    hosts: list[str] = []
    for item in _split_outside_brackets(text.strip()):
        hosts.extend(_expand_host(item, text))
    if not hosts:
        raise ClusterConfigError(f"bad Slurm node list {text!r}: no hosts")
    return tuple(hosts)


def _split_outside_brackets(text: str) -> list[str]:
    """`a[1,2],b` -> [`a[1,2]`, `b`]: commas inside brackets belong to a range."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_host(item: str, whole: str) -> list[str]:
    """One host expression: a prefix, then (recursively) its first bracket's numbers before the rest."""
    head, bracket, rest = item.partition("[")
    if not bracket:
        if "]" in item or not item:
            raise ClusterConfigError(f"bad Slurm node list {whole!r}: unbalanced brackets")
        return [item]
    ranges, close, tail = rest.partition("]")
    if not close or "[" in ranges:
        raise ClusterConfigError(f"bad Slurm node list {whole!r}: unbalanced brackets")
    return [head + number + suffix for number in _expand_ranges(ranges, whole)
            for suffix in (_expand_host(tail, whole) if tail else [""])]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    """`1-3,7` -> 1 2 3 7; `01-03` keeps the zero padding of the range's first number."""
    numbers: list[str] = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ClusterConfigError(f"bad Slurm node list {whole!r}: bad range {part!r}")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1))
    return numbers


def expand_tasks_per_node(text: str) -> tuple[int, ...]:
    """Expand Slurm's tasks per node (`2(x3),1` -> 2, 2, 2, 1)."""
    counts: list[int] = []
    for part in text.strip().split(","):
        count, times = part, "1"
        if part.endswith(")") and "(x" in part:
            count, _, times = part[:-1].partition("(x")
        if not count.isdigit() or not times.isdigit() or int(count) < 1 or int(times) < 1:
            raise ClusterConfigError(f"bad Slurm tasks per node {text!r}: expected forms like 2(x3),1")
        counts.extend([int(count)] * int(times))
    return tuple(counts)


def _slurm_var(environ: Mapping[str, str], *names: str) -> str:
    """The first of `names` set in the environment (a step's variable before the job's)."""
    for name in names:
        if environ.get(name, "").strip():
            return environ[name].strip()
    raise ClusterConfigError(f"not in a Slurm step: {' or '.join(names)} is not set (run under srun)")


def _slurm_int(environ: Mapping[str, str], *names: str) -> int:
    text = _slurm_var(environ, *names)
    if not text.isdigit():
        raise ClusterConfigError(f"{names[0]}={text!r} is not a number")
    return int(text)


def slurm_addresses(environ: Mapping[str, str], port_base: int = SLURM_PORT_BASE) -> tuple[str, ...]:
    """Every task's host:port by rank, as Slurm's block distribution places them (and TF's
    SlurmClusterResolver assumes): ranks fill the nodes in node-list order, a node's tasks taking the
    ports port_base, port_base+1, ... in rank order."""
    hosts = expand_hostlist(_slurm_var(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    counts = expand_tasks_per_node(_slurm_var(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if len(hosts) != len(counts):
        raise ClusterConfigError(f"Slurm lists {len(hosts)} node(s) but tasks per node for {len(counts)}")
    if not (port_base > 0 and port_base + max(counts) - 1 < 65536):
        raise ClusterConfigError(f"port base {port_base} leaves no room for {max(counts)} task(s) per node")
    return tuple(f"{host}:{port_base + local}" for host, count in zip(hosts, counts, strict=True)
                 for local in range(count))


def parse_slurm(environ: Mapping[str, str], num_ps: int, port_base: int = SLURM_PORT_BASE) -> TFConfig:
    """This task's cluster spec from a Slurm step: rank 0 the chief, ranks 1..num_ps the shards, the rest
    the workers (TF's SlurmClusterResolver's order: its roles sorted by name, chief < ps < worker)."""
    addresses = slurm_addresses(environ, port_base)
    ntasks, rank = _slurm_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), _slurm_int(environ, "SLURM_PROCID")
    if ntasks != len(addresses):
        raise ClusterConfigError(f"SLURM_NTASKS={ntasks} but the tasks per node add up to {len(addresses)}")
    if num_ps < 1 or ntasks < num_ps + 2:
        raise ClusterConfigError(f"{ntasks} Slurm task(s) cannot hold a chief, {num_ps} shard(s) and a worker: "
                                 f"ask for at least {max(num_ps, 1) + 2} (srun -n)")
    if rank >= ntasks:
        raise ClusterConfigError(f"SLURM_PROCID={rank} is out of range for {ntasks} task(s)")
    _check_block_layout(environ, addresses[rank], port_base)
    roles = {"chief": addresses[:1], "ps": addresses[1:num_ps + 1], "worker": addresses[num_ps + 1:]}
    task_type = "chief" if rank == 0 else "ps" if rank <= num_ps else "worker"
    index = {"chief": 0, "ps": rank - 1, "worker": rank - num_ps - 1}[task_type]
    return TFConfig(roles["chief"], roles["worker"], roles["ps"], task_type, index)


def _check_block_layout(environ: Mapping[str, str], own: str, port_base: int) -> None:
    """This task runs where the block layout puts it (else every address would be wrong)."""
    node, local = environ.get("SLURMD_NODENAME", ""), environ.get("SLURM_LOCALID", "")
    host, port = split_address(own)
    if (node and node != host) or (local.isdigit() and port_base + int(local) != port):
        raise ClusterConfigError(f"task {environ.get('SLURM_PROCID')} runs on {node or '?'} as local task "
                                 f"{local or '?'}, but block distribution puts it at {own}: run srun with its "
                                 "default --distribution=block")


def tf_config_json(config: TFConfig) -> str:
    """`config` as TF_CONFIG's JSON (what an srun-started role hands to its role's code)."""
    cluster = {"chief": list(config.chief), "ps": list(config.ps), "worker": list(config.worker)}
    return json.dumps({"cluster": cluster, "task": {"type": config.task_type, "index": config.task_index}})
