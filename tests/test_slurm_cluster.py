"""deploy/slurm/asyncps.sbatch on a real Slurm cluster of containers: trains across nodes, survives losing one.

Opt-in: marked `multinode` and skipped unless ASYNCPS_MULTINODE=1, so neither `make test` nor
`make test-e2e` runs it:

    ASYNCPS_MULTINODE=1 .venv/bin/pytest -m multinode tests/test_slurm_cluster.py

scripts/slurm-cluster.sh starts slurmctld and three slurmd nodes (containers of asyncps-slurm:test,
built from the asyncps image when missing) on one Docker network, with one munge key, a shared
volume at /shared and this checkout mounted as the code every task runs. The batch script is the
one the docs give users, submitted from /shared with `sbatch --wait`; its defaults (2 nodes x 3
tasks, 2 shards) put the chief and both shards on one node and the three workers on another, so
every tensor crosses nodes: the shards must count their bytes under tcp (the data port), none under
shm. The node-loss test kills the container of the node holding the chief and the shards once the
chief has written a checkpoint: Slurm marks the node down and requeues the job (--requeue) on the two
nodes left, and the chief resumes from the checkpoint; the job must complete by itself.
Measured on 2 cores shared with other tests (`ASYNCPS_MULTINODE=1 pytest -m multinode -s --durations=5
tests/test_slurm_cluster.py`, two runs): the cluster starts in 5 s, the training job takes 42 s, the
node-loss job 176-203 s, training again 129-146 s after the loss (most of it Slurm noticing the lost
node, SlurmdTimeout=10 with its pings, and the surviving node's step timing out on messages to the dead
batch host): 3 min 46 s to 4 min 12 s in all, the image built.
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

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(BUILD_TIMEOUT_S + 2 * JOB_TIMEOUT_S)]


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

    def submit(self, **settings: str) -> subprocess.Popen[str]:
        """`sbatch --wait` of the documented batch script with ASYNCPS_* settings; it prints the job id at once
        and exits with the job's exit code when the job has ended (requeued runs included)."""
        env = [f"ASYNCPS_{name.upper()}={value}" for name, value in settings.items()]
        return subprocess.Popen(["docker", "exec", "-w", "/shared", f"{self.prefix}-slurmctl", "env", *env,
                                 "sbatch", "--wait", "--parsable", "/src/deploy/slurm/asyncps.sbatch"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for_line(self, path: str, pattern: str, timeout: float) -> None:
        """Block until a line of `path` (on the shared volume) matches `pattern` (tail -F: no polling here)."""
        self.sh(f"timeout {int(timeout)} tail -n +1 -F {path} 2>/dev/null | grep -m1 -q -E '{pattern}'",
                timeout=timeout + 10)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.sh(f"scontrol show job {job_id}")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.environ.get("ASYNCPS_MULTINODE") != "1":
        pytest.skip("multi-node Slurm tests run only when asked: ASYNCPS_MULTINODE=1 pytest -m multinode")
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


def finish(job: subprocess.Popen[str], cluster: Cluster, job_id: str) -> str:
    """Wait for `sbatch --wait` to end; the job's output (the test fails unless the job succeeded)."""
    _, err = job.communicate(timeout=JOB_TIMEOUT_S)
    output = cluster.sh(f"cat asyncps-{job_id}.out")
    assert job.returncode == 0, f"sbatch --wait: {job.returncode} {err.strip()}\n{output[-6000:]}"
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
    job = cluster.submit(max_updates="600", eval_every_s="30")
    assert job.stdout is not None
    job_id = job.stdout.readline().strip()
    output = finish(job, cluster, job_id)
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
    job = cluster.submit(max_updates="4000", checkpoint_every_updates="300", eval_every_s="30")
    assert job.stdout is not None
    job_id = job.stdout.readline().strip()
    out = f"asyncps-{job_id}.out"
    cluster.wait_for_line(out, "checkpoint ckpt-", timeout=180)
    first = roles_by_node(cluster.sh(f"cat {out}"))
    lost = next(node for node, roles in first.items() if "chief" in roles)
    subprocess.run(["docker", "kill", f"{cluster.prefix}-{lost}"], check=True, capture_output=True, timeout=60)
    killed_at = time.time()
    output = finish(job, cluster, job_id)
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
    assert data["tasks_in_flight"] == data["tasks_pending"] == 0, data  # type: ignore[index]
    assert data["tasks_done"] == data["tasks_issued"], data  # type: ignore[index]
