"""Roles from a Slurm step's environment: node-list and tasks-per-node forms, role assignment, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncps.cluster import (
    ClusterConfigError,
    expand_hostlist,
    expand_tasks_per_node,
    parse_slurm,
    parse_tf_config,
    tf_config_json,
)
from tests.conftest import REPO_ROOT, child_env


@pytest.mark.parametrize("text, hosts", [
    ("node7", ("node7",)),
    ("node[1-3,7]", ("node1", "node2", "node3", "node7")),
    ("a[01-03]", ("a01", "a02", "a03")),
    ("n1,n[4-5]", ("n1", "n4", "n5")),
    ("gpu[9-11]", ("gpu9", "gpu10", "gpu11")),
    ("c[098-101],d", ("c098", "c099", "c100", "c101", "d")),
    ("r[1-2]-n[1-2]", ("r1-n1", "r1-n2", "r2-n1", "r2-n2")),
    ("x-[3]-y", ("x-3-y",)),
])
def test_node_lists_expand_as_slurm_writes_them(text: str, hosts: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[1-3", "node1-3]", "n[3-1]", "n[a-b]", "n[1,,2]", "n[[1]]"])
def test_bad_node_lists_are_refused(text: str) -> None:
    with pytest.raises(ClusterConfigError, match="Slurm node list"):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [
    ("4", (4,)), ("2(x3),1", (2, 2, 2, 1)), ("1,3(x2)", (1, 3, 3)), ("16(x1)", (16,)),
])
def test_tasks_per_node_expand(text: str, counts: tuple[int, ...]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x", "0", "2(x0)", "2(3)"])
def test_bad_tasks_per_node_are_refused(text: str) -> None:
    with pytest.raises(ClusterConfigError, match="tasks per node"):
        expand_tasks_per_node(text)


def step(rank: int, nodes: str = "node[1-2]", per_node: str = "3(x2)", ntasks: int = 6, **more: str) -> dict[str, str]:
    """A step's environment as srun sets it for task `rank` (SLURMD_NODENAME and SLURM_LOCALID left out)."""
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NODELIST": nodes,
            "SLURM_STEP_TASKS_PER_NODE": per_node, **more}


def test_roles_follow_rank_chief_then_shards_then_workers() -> None:
    roles = [parse_slurm(step(rank), num_ps=2) for rank in range(6)]
    assert [(r.task_type, r.task_index) for r in roles] == [
        ("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    first = roles[0]
    assert first.chief == ("node1:8470",) and first.ps == ("node1:8471", "node1:8472")
    assert first.worker == ("node2:8470", "node2:8471", "node2:8472")
    assert all((r.chief, r.ps, r.worker) == (first.chief, first.ps, first.worker) for r in roles)
    assert roles[2].own_address == "node1:8472" and roles[4].own_port == 8471


def test_several_tasks_per_node_uneven_and_a_port_base() -> None:
    env = step(4, nodes="c[01-03],gpu7", per_node="2(x3),1", ntasks=7)
    config = parse_slurm(env, num_ps=1, port_base=9000)
    assert config.chief == ("c01:9000",) and config.ps == ("c01:9001",)
    assert config.worker == ("c02:9000", "c02:9001", "c03:9000", "c03:9001", "gpu7:9000")
    assert (config.task_type, config.task_index, config.own_address) == ("worker", 2, "c03:9000")


def test_job_variables_stand_in_for_a_steps() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1,n[4-5]", "SLURM_TASKS_PER_NODE": "1(x3)"}
    config = parse_slurm(env, num_ps=1)
    assert config.own_address == "n4:8470" and config.task_type == "ps"


def test_the_tf_config_made_from_slurm_reads_back_the_same() -> None:
    config = parse_slurm(step(3), num_ps=2)
    assert parse_tf_config(tf_config_json(config)) == config


def test_the_task_is_where_block_distribution_puts_it() -> None:
    parse_slurm(step(3, SLURMD_NODENAME="node2", SLURM_LOCALID="0"), num_ps=2)
    with pytest.raises(ClusterConfigError, match="distribution=block"):  # cyclic: rank 1 on node2
        parse_slurm(step(1, SLURMD_NODENAME="node2", SLURM_LOCALID="0"), num_ps=2)


@pytest.mark.parametrize("env, num_ps, message", [
    ({}, 1, "SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is not set"),
    (step(0, ntasks=5), 1, "add up to 6"),
    (step(0, per_node="3"), 1, "2 node"),
    (step(0, ntasks=3, per_node="3", nodes="n1"), 2, "at least 4"),
    (step(7), 1, "out of range"),
    (step(0, SLURM_PROCID="x"), 1, "not a number"),
])
def test_bad_environments_are_one_clear_error(env: dict[str, str], num_ps: int, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        parse_slurm(env, num_ps=num_ps)


def test_asyncps_slurm_outside_slurm_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "slurm", "--num-ps", "2"], env=child_env(),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "not in a Slurm step" in out.stderr


def test_a_port_base_without_room_is_one_line() -> None:
    env = {**child_env(), **step(2)}
    out = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "slurm", "--num-ps", "2", "--port-base", "65534"],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "port base 65534 leaves no room for 3" in out.stderr
