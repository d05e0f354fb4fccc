"""deploy/stack.yml on a Docker Swarm of three nodes: shards and workers apart, losing a worker's node.

Marked `multinode` and `docker`: `make test-e2e` runs it with the docker tests (one unit, after them: it
loads their image into its nodes), skipped without a Docker engine unless ASYNCPS_REQUIRE_DOCKER=1; alone:

    .venv/bin/pytest -m multinode -s --durations=5 tests/test_swarm_multinode.py

scripts/swarm-nodes.sh starts three containers on one Docker network, each with its own dockerd: `mgr`
inits the swarm and is labelled asyncps.role=ps, `w1` and `w2` join it and are labelled asyncps.role=worker;
the asyncps image is loaded into each (there is no registry). The stack is deployed from the manager with
the file's own placement constraints: the chief and both shards on mgr, the two workers spread over w1 and
w2, so every tensor crosses nodes on the stack's overlay network (VXLAN between the node containers): the
shards must count their bytes under tcp (the data port). Once both workers train, the container of a node
running a worker is killed (`docker kill`, as a host that dies): swarm marks the node Down and starts its
worker task again on the node left, the chief declares the lost worker dead and re-queues its data tasks,
and the run must end by itself: the chief's task complete with exit 0, the accounting closed (every data
task issued done, none in flight or pending). The nodes are always removed, with their volumes.
Measured here (`pytest -m multinode -s --durations=5 tests/test_swarm_multinode.py`, 2 cores, the images
built; the node image, when missing, 23-50 s more): nodes and swarm 4-7 s, the image loaded into the three
nodes 71-98 s, the run 126-146 s (both workers training ~50 s after the deploy; the lost node Down ~6 s after
the kill, its worker running on the other node ~12 s after), teardown 8-18 s: 3 min 51 s to 4 min 13 s.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncps.rundir import PUSHES_CSV, SUMMARY_JSON
from asyncps.tools.devcerts import generate_dev_certs
from tests.dockerutil import BUILD_TIMEOUT_S, ROOT, image_id, require_engine, run_logged

SCRIPT = ROOT / "scripts" / "swarm-nodes.sh"
NODE_IMAGE = "asyncps-mn-node:test"
STACK = "asyncps"
RUN_TIMEOUT_S = 600

pytestmark = [pytest.mark.multinode, pytest.mark.docker, pytest.mark.timeout(2 * BUILD_TIMEOUT_S + RUN_TIMEOUT_S)]


@dataclass(frozen=True)
class Nodes:
    """The running node containers (PREFIX-mgr, PREFIX-w1, PREFIX-w2) and the image the stack runs."""

    prefix: str
    image: str

    def docker(self, node: str, *args: str, timeout: float = 60, check: bool = True,
               env: dict[str, str] | None = None) -> str:
        """`docker ARGS` against a node's engine; its stdout (the test fails on an error when check)."""
        setenv = [f"--env={k}={v}" for k, v in (env or {}).items()]
        out = subprocess.run(["docker", "exec", "-w", "/stack", *setenv, f"{self.prefix}-{node}", "docker", *args],
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            pytest.fail(f"{node}: docker {' '.join(args)} ({out.returncode}): {out.stderr.strip()}", pytrace=False)
        return out.stdout

    def mgr(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        return self.docker("mgr", *args, timeout=timeout, check=check)

    def tasks(self, service: str) -> list[dict[str, str]]:
        """A service's tasks as `docker service ps` lists them: node, desired and current state, error."""
        rows = self.mgr("service", "ps", "--no-trunc", "--format",
                        "{{.Node}}\t{{.DesiredState}}\t{{.CurrentState}}\t{{.Error}}", f"{STACK}_{service}",
                        check=False)
        keys = ("node", "desired", "state", "error")
        return [dict(zip(keys, line.split("\t"), strict=False)) for line in rows.splitlines() if line.strip()]

    def log(self, service: str) -> str:
        """A service's log, every task's (`docker service logs`: gathered by the manager from every node)."""
        out = subprocess.run(["docker", "exec", f"{self.prefix}-mgr", "docker", "service", "logs", "--raw",
                              f"{STACK}_{service}"], capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def all_logs(self, chars: int = 3000) -> str:
        tasks = self.mgr("stack", "ps", "--no-trunc", "--format",
                         "{{.Name}} {{.Node}} {{.DesiredState}} {{.CurrentState}} {{.Error}}", STACK, check=False)
        nodes = self.mgr("node", "ls", check=False)
        return "\n".join([f"--- nodes\n{nodes}", f"--- tasks\n{tasks}",
                          *(f"--- {s}\n{self.log(s)[-chars:]}" for s in ("chief", "ps-0", "ps-1", "worker"))])

    def wait(self, what: str, until: object, timeout: float) -> None:
        """Poll `until()` each second until it is true; fail with every log after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until():  # type: ignore[operator]
                return
            time.sleep(1.0)
        pytest.fail(f"{what}: not within {timeout:.0f}s\n{self.all_logs()}", pytrace=False)

    def run_file(self, name: str) -> str:
        """A file of the run directory, from the runs volume on the manager (where the chief runs)."""
        return self.mgr("run", "--rm", "--network", "none", "-v", f"{STACK}_runs:/runs:ro", "--entrypoint", "cat",
                        self.image, f"/runs/test/{name}", timeout=120)


@pytest.fixture(scope="module")
def nodes(docker_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    require_engine()
    logs = tmp_path_factory.mktemp("swarm-nodes")
    prefix = f"asyncps-mn-t{os.getpid()}"
    options = ["--image", NODE_IMAGE, "--prefix", prefix, "--workers", "2"]
    timings: dict[str, float] = {}
    start = time.monotonic()
    if not image_id(NODE_IMAGE):
        run_logged([str(SCRIPT), *options, "build"], logs / "node-image.log", BUILD_TIMEOUT_S)
    timings["node image"] = time.monotonic() - start
    try:
        start = time.monotonic()
        run_logged([str(SCRIPT), *options, "start"], logs / "start.log", 300)
        timings["nodes and swarm"] = time.monotonic() - start
        start = time.monotonic()
        # every node runs the asyncps image: the chief and the shards on mgr, workers on w1 and w2
        run_logged([str(SCRIPT), *options, "load", docker_image, "mgr", "w1", "w2"], logs / "load.log",
                   BUILD_TIMEOUT_S)
        timings["image loads"] = time.monotonic() - start
        print("swarm nodes: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
        yield Nodes(prefix, docker_image)
    finally:
        subprocess.run([str(SCRIPT), *options, "stop"], capture_output=True, timeout=300)


def node_of(tasks: list[dict[str, str]]) -> set[str]:
    """The nodes of a service's running tasks."""
    return {t["node"] for t in tasks if t["desired"] == "Running" and t["state"].startswith("Running")}


def test_stack_across_nodes_trains_and_survives_a_lost_worker_node(nodes: Nodes, tmp_path: Path) -> None:
    started = time.monotonic()
    stack_dir = tmp_path / "stack"
    generate_dev_certs(stack_dir / "secrets", ["ps-0", "ps-1", "chief"])
    (stack_dir / "secrets" / "token").write_text(secrets.token_urlsafe(32) + "\n")
    (stack_dir / "secrets" / "chief-token").write_text(secrets.token_urlsafe(32) + "\n")
    (stack_dir / "stack.yml").write_bytes((ROOT / "deploy" / "stack.yml").read_bytes())
    subprocess.run(["docker", "cp", str(stack_dir), f"{nodes.prefix}-mgr:/stack"], check=True, timeout=60)
    # Stop on updates: the lost worker's data tasks are re-queued and done by the others before the end.
    settings = dict(ASYNCPS_IMAGE=nodes.image, ASYNCPS_SECRETS="/stack/secrets", ASYNCPS_RUN_NAME="test",
                    ASYNCPS_EPOCHS="0", ASYNCPS_MAX_UPDATES="20000", ASYNCPS_CHECKPOINT_EVERY_UPDATES="2000",
                    ASYNCPS_EVAL_EVERY_S="10", ASYNCPS_HEARTBEAT_TIMEOUT_S="15", ASYNCPS_NUM_WORKERS="2")
    nodes.docker("mgr", "stack", "deploy", "--resolve-image", "never", "-c", "stack.yml", STACK, env=settings,
                 timeout=120)
    try:
        nodes.wait("both workers training",
                   lambda: "live workers: 2" in nodes.log("chief"), timeout=360)
        deployed_s = time.monotonic() - started
        placement = {s: node_of(nodes.tasks(s)) for s in ("chief", "ps-0", "ps-1", "worker")}
        print(f"swarm multinode: both workers train {deployed_s:.1f}s after the deploy; placement {placement}")
        assert placement["chief"] == placement["ps-0"] == placement["ps-1"] == {"mgr"}, placement
        assert placement["worker"] == {"w1", "w2"}, placement  # spread: one worker per worker node

        # Lose the node mid-run: once training is under way (the first checkpoint), past the start barrier,
        # which waits for every planned worker's first gradient (a worker lost before it holds the run up to
        # the barrier's 300 s, its replacement registering under a new index).
        nodes.wait("a checkpoint", lambda: "checkpoint ckpt-" in nodes.log("chief"), timeout=120)
        lost = "w2"
        subprocess.run(["docker", "kill", f"{nodes.prefix}-{lost}"], check=True, capture_output=True, timeout=60)
        killed = time.monotonic()
        print(f"swarm multinode: killed node {lost} at {killed - started:.1f}s")
        nodes.wait(f"{lost} Down", lambda: re.search(rf"^{lost} Down$", nodes.mgr(
            "node", "ls", "--format", "{{.Hostname}} {{.Status}}"), re.M) is not None, timeout=60)
        down_s = time.monotonic() - killed
        nodes.wait("the lost worker's task running again on w1",
                   lambda: [t["node"] for t in nodes.tasks("worker")
                            if t["desired"] == "Running" and t["state"].startswith("Running")] == ["w1", "w1"],
                   timeout=120)
        moved_s = time.monotonic() - killed
        print(f"swarm multinode: {lost} Down after {down_s:.1f}s; its worker running on w1 after {moved_s:.1f}s")

        def chief_ended() -> bool:
            return any(t["state"].startswith(("Complete", "Failed", "Rejected")) for t in nodes.tasks("chief"))

        nodes.wait("the chief's end", chief_ended, timeout=RUN_TIMEOUT_S - (time.monotonic() - started))
        ended_s = time.monotonic() - started
        chief_tasks = nodes.tasks("chief")
        assert len(chief_tasks) == 1 and chief_tasks[0]["state"].startswith("Complete"), (
            f"{chief_tasks}\n{nodes.all_logs()}")
        (task_id,) = nodes.mgr("service", "ps", "-q", "--no-trunc", f"{STACK}_chief").split()
        code = nodes.mgr("inspect", "-f", "{{.Status.ContainerStatus.ExitCode}}", task_id).strip()
        assert code == "0", code

        chief_log = nodes.log("chief")
        # the lost incarnation: declared dead on its missed heartbeats, or replaced by the new task's registration
        dead = re.findall(r"worker (\d+) (?:\(\S+\) missed heartbeats for \d+s: declared dead|registered again "
                          r"\([^)]*\)); (\d+) data task", chief_log)
        summary = json.loads(nodes.run_file(SUMMARY_JSON))
        pushes: dict[int, int] = {}
        for row in csv.DictReader(io.StringIO(nodes.run_file(PUSHES_CSV))):
            pushes[int(row["worker"])] = pushes.get(int(row["worker"]), 0) + 1
        data = summary["data"]
        print(f"swarm multinode: chief complete, exit 0, {ended_s:.1f}s after the deploy; declared dead {dead}; "
              f"updates {summary['updates_applied']}, accuracy {summary['final_eval']['accuracy']:.4f}, "
              f"pushes by worker {dict(sorted(pushes.items()))}, data {data}")
        assert len(dead) == 1, chief_log[-4000:]
        assert summary["updates_applied"] >= 20000, summary
        # every task issued is done or back in the queue (handed out as the stop came: an updates-limited run)
        assert data["tasks_in_flight"] == 0 and data["tasks_requeued"] >= 1, data
        assert data["tasks_done"] + data["tasks_pending"] == data["tasks_issued"], data
        for shard in summary["shards"]:
            crossed = shard["bytes_by_transport"]
            print(f"swarm multinode: shard bytes by transport: {crossed}")
            assert crossed["tcp"]["pushed"] > 0 and crossed["tcp"]["pulled"] > 0, crossed  # the data port, across nodes
            assert crossed.get("shm", {}).get("pushed", 0) == 0, crossed
    finally:
        (tmp_path / "stack.log").write_text(nodes.all_logs(chars=200_000))  # kept by pytest
