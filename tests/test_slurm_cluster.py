"""deploy/slurm/asyncps.sbatch on a real Slurm cluster of containers: trains across nodes, survives losing one.

Marked `multinode` and `docker`: `make test-e2e` runs it with the docker tests (one unit, after them: it
builds its image from theirs), skipped without a Docker engine unless ASYNCPS_REQUIRE_DOCKER=1; alone:

    .venv/bin/pytest -m multinode -s --durations=5 tests/test_slurm_cluster.py

scripts/slurm-cluster.sh starts slurmctld and three slurmd nodes (containers of asyncps-slurm:test,
built from the asyncps image when missing) on one Docker network, with one munge key, a shared
volume at /shared and this checkout mounted as the code every task runs. The batch script is the
one the docs give users, submitted from /shared with `sbatch`; its defaults (2 nodes x 3
tasks, 2 shards) put the chief and both shards on one node and the three workers on another, so
every tensor crosses nodes: the shards must count their bytes under tcp (the data port), none under
shm. The node-loss test kills the container of the node holding the chief and the shards once the
chief has written a checkpoint: Slurm marks the node down and requeues the job (--requeue) on the two
nodes left, and the chief resumes from the checkpoint; the job must complete by itself.
Measured here (`pytest -m multinode -s --durations=5 tests/test_slurm_cluster.py`, 2 cores, the images
built): the cluster starts in 4 s, the training job takes 20 s, the node-loss job 117 s, training again
88-90 s after the loss (Slurm noticing the lost node, ~29 s with SlurmdTimeout=10; the surviving node's
step ending, ~26 s; the requeued job's start, ~24 s; the chief's resume and the workers' start, ~13 s):
2 min 22 s in all.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from asyncps.rundir import PUSHES_CSV, SUMMARY_JSON
from tests.dockerutil import BUILD_TIMEOUT_S, ROOT, build_image, image_id, require_engine, run_logged

SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
SLURM_IMAGE = "asyncps-slurm:test"
JOB_TIMEOUT_S = 480
ROLE_LINE = re.compile(r"^asyncps slurm: rank (\d+) on (\S+) is (\S+) \(", re.M)

pytestmark = [pytest.mark.multinode, pytest.mark.docker, pytest.mark.timeout(BUILD_TIMEOUT_S + 2 * JOB_TIMEOUT_S)]


@dataclass(frozen=True)
class Cluster:
    """A running container cluster: its controller and nodes by name (PREFIX-slurmctl, PREFIX-node1...)."""

    prefix: str

    def sh(self, command: str, timeout: float = 60) -> str:
        """Run `command` with bash on the controller, in /shared; its stdout (the test fails on an error)."""
        out = subprocess.run(["docker", "exec", "-w", "/shared", f"{self.prefix}-slurmctl", "bash", "-c", command],
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{command}: {out.stderr.strip()}"
        return out.stdout

    def submit(self, **settings: str) -> str:
        """`sbatch` of the documented batch script with ASYNCPS_* settings; the job's id."""
        env = [f"ASYNCPS_{name.upper()}={value}" for name, value in settings.items()]
        return self.sh(f"env {' '.join(env)} sbatch --parsable /src/deploy/slurm/asyncps.sbatch").strip()

    def wait_for_line(self, path: str, pattern: str, timeout: float) -> None:
        """Block until a line of `path` (on the shared volume) matches `pattern` (tail -F: no polling here)."""
        self.sh(f"timeout {int(timeout)} tail -n +1 -F {path} 2>/dev/null | grep -m1 -q -E '{pattern}'",
                timeout=timeout + 10)

    def poll_job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`, or {} while the controller does not answer (busy with a lost node: its calls to
        the node time out, MessageTimeout, and hold the caller's)."""
        out = subprocess.run(["docker", "exec", f"{self.prefix}-slurmctl", "scontrol", "show", "job", job_id],
                             capture_output=True, text=True, timeout=60)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.sh(f"scontrol show job {job_id}")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_engine()
    logs = tmp_path_factory.mktemp("slurm-cluster")
    if not image_id(SLURM_IMAGE):
        base = build_image(logs)
        run_logged([str(SCRIPT), "--base", base, "--image", SLURM_IMAGE, "build"], logs / "slurm-image.log",
                   BUILD_TIMEOUT_S)
    prefix = f"asyncps-slurm-t{os.getpid()}"
    options = ["--image", SLURM_IMAGE, "--prefix", prefix, "--nodes", "3", "--src", str(ROOT)]
    try:
        run_logged([str(SCRIPT), *options, "up"], logs / "up.log", 300)
        yield Cluster(prefix)
    finally:
        subprocess.run([str(SCRIPT), *options, "down"], capture_output=True, timeout=120)


# a job's states that end it (a requeued job passes through others: REQUEUED, PENDING, NODE_FAIL...)
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


def finish(cluster: Cluster, job_id: str) -> str:
    """Wait for the job to end (its state asked every second: `sbatch --wait` asks at growing intervals, up to
    half a minute late); its output (the test fails unless the job completed with exit 0)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    state = cluster.poll_job(job_id)
    while state.get("JobState") not in FINAL_STATES and time.monotonic() < deadline:
        time.sleep(1.0)
        state = cluster.poll_job(job_id)
    output = cluster.sh(f"cat asyncps-{job_id}.out")
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", (
        f"job {job_id}: {state.get('JobState')} exit {state.get('ExitCode')}\n{output[-6000:]}")
    return output


def roles_by_node(output: str) -> dict[str, list[str]]:
    """Which roles each node ran, from `asyncps slurm`'s line per task (every start of a requeued job)."""
    nodes: dict[str, list[str]] = {}
    for _, node, role in ROLE_LINE.findall(output):
        nodes.setdefault(node, []).append(role)
    return {node: sorted(roles) for node, roles in nodes.items()}


def summary(cluster: Cluster, job_id: str) -> dict[str, object]:
    return json.loads(cluster.sh(f"cat runs/asyncps-{job_id}/{SUMMARY_JSON}"))  # type: ignore[no-any-return]


def test_the_batch_script_trains_across_two_nodes(cluster: Cluster) -> None:
    started = time.monotonic()
    job_id = cluster.submit(max_updates="600", eval_every_s="30")
    output = finish(cluster, job_id)
    roles = roles_by_node(output)
    print(f"job {job_id}: {time.monotonic() - started:.0f} s; roles by node: {roles}")
    assert sorted(roles.values()) == [["chief", "ps-0", "ps-1"], ["worker-0", "worker-1", "worker-2"]], roles
    result = summary(cluster, job_id)
    assert result["updates_applied"] >= 600 and result["workers"] == 3 and result["ps_shards"] == 2  # type: ignore[operator]
    for shard in result["shards"]:  # type: ignore[attr-defined]
        crossed = shard["bytes_by_transport"]
        print(f"shard bytes by transport: {crossed}")
        assert crossed["tcp"]["pushed"] > 0 and crossed["tcp"]["pulled"] > 0, crossed
        assert crossed.get("shm", {}).get("pushed", 0) == 0, crossed  # no worker shares a node with a shard
        assert sorted(shard["answers_by_worker"]) == ["0", "1", "2"]


def test_losing_the_chiefs_node_requeues_and_the_run_finishes(cluster: Cluster) -> None:
    job_id = cluster.submit(max_updates="4000", checkpoint_every_updates="300", eval_every_s="30")
    out = f"asyncps-{job_id}.out"
    cluster.wait_for_line(out, "checkpoint ckpt-", timeout=180)
    first = roles_by_node(cluster.sh(f"cat {out}"))
    lost = next(node for node, roles in first.items() if "chief" in roles)
    subprocess.run(["docker", "kill", f"{cluster.prefix}-{lost}"], check=True, capture_output=True, timeout=60)
    killed_at = time.time()
    output = finish(cluster, job_id)
    state = cluster.job(job_id)
    assert state["JobState"] == "COMPLETED" and int(state["Restarts"]) >= 1, state
    assert "start 2" in output and lost not in state["NodeList"], state
    after = roles_by_node(output.split("start 2", 1)[1])
    result = summary(cluster, job_id)
    pushes = csv.DictReader(cluster.sh(f"cat runs/asyncps-{job_id}/{PUSHES_CSV}").splitlines())
    resumed_s = min(float(row["wall_time"]) for row in pushes if float(row["wall_time"]) > killed_at) - killed_at
    print(f"lost {lost} (first start {first}); second start {after}; training again {resumed_s:.0f} s after "
          f"the loss; {result['updates_applied']} updates")
    assert lost not in after and result["updates_applied"] >= 4000  # type: ignore[operator]
    data = result["data"]
    # every task issued is done, or back in the queue (handed out as the stop came, or re-queued and not handed
    # out again before it: an updates-limited run ends with data left), none in flight with a worker that is gone
    assert data["tasks_in_flight"] == 0, data  # type: ignore[index]
    assert data["tasks_done"] + data["tasks_pending"] == data["tasks_issued"], data  # type: ignore[index,operator]
