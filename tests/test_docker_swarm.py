"""deploy/stack.yml on a real Docker Swarm: train, lose a shard, add a worker, remove the stack.

Needs a Docker engine (skipped without one unless ASYNCPS_REQUIRE_DOCKER=1). The engine becomes a
single-node swarm for the test (`docker swarm init --advertise-addr 127.0.0.1`) and leaves it
afterwards (`docker swarm leave --force`, and the docker_gwbridge network that swarm made is
removed); an engine that is already a swarm manager is used as it is and left so.

One deployment, so the whole scenario costs one start-up (~1 min on 2 cores): with token and mTLS
from Docker secrets, checkpoints every 400 updates and 75 s of training. Once both workers train,
the worker service is scaled from 2 to 3; once the chief has written a checkpoint, ps-1's
container is killed with `docker kill` (a failure to swarm: the restart policy starts a new task).
The chief must restore shard 1, and only it, at the checkpoint's version. Then `docker service
update --force` replaces the chief's task (SIGTERM, as for an unhealthy one): the chief hands over
(exit 143) and the new task resumes on the live shards, and ps-0 is never replaced; the third worker's
pushes reach pushes.csv; the chief's task ends "complete" with exit code 0 (read as the stack
file documents); accuracy >= 0.90 (the demo's); `docker stack rm` then removes services, network
and secrets, and the test the volumes.
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
from pathlib import Path

import pytest

from asyncps.rundir import PUSHES_CSV, SUMMARY_JSON
from asyncps.tools.devcerts import generate_dev_certs
from tests.dockerutil import BUILD_TIMEOUT_S, ROOT, require_engine, unavailable

STACK_FILE = ROOT / "deploy" / "stack.yml"
SCENARIO_TIMEOUT_S = 600

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + SCENARIO_TIMEOUT_S)]


def docker(*args: str, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None) -> str:
    """Run `docker ARGS...`; its stdout (fail the test with stderr when check and it fails)."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}", pytrace=False)
    return result.stdout


# -- a single-node swarm, made for the test and left afterwards ----------------------------------
@pytest.fixture(scope="module")
def swarm() -> Iterator[None]:
    require_engine()
    state = docker("info", "--format", "{{.Swarm.LocalNodeState}} {{.Swarm.ControlAvailable}}").split()
    if state[0] == "active":
        if state[1] != "true":
            unavailable("the engine is a swarm worker, not a manager: it cannot deploy a stack")
        yield  # someone else's swarm: use it, leave it as it is
        return
    if state[0] != "inactive":
        unavailable(f"the engine's swarm state is {state[0]!r}")
    had_gwbridge = bool(docker("network", "ls", "-q", "--filter", "name=^docker_gwbridge$").split())
    start = time.monotonic()
    docker("swarm", "init", "--advertise-addr", "127.0.0.1", timeout=120)
    print(f"docker swarm init: {time.monotonic() - start:.1f}s")
    try:
        yield
    finally:
        docker("swarm", "leave", "--force", timeout=120, check=False)
        if not had_gwbridge:  # made by `swarm init`; `swarm leave` keeps it
            docker("network", "rm", "docker_gwbridge", check=False)


# -- one stack ----------------------------------------------------------------------------------
class Stack:
    """One deployment of deploy/stack.yml under its own name, with its own settings and secrets."""

    def __init__(self, image: str, secrets_dir: Path) -> None:
        self.image = image
        self.name = f"asyncpst{secrets.token_hex(3)}"
        self.run_name = "test"
        self.label = f"label=com.docker.stack.namespace={self.name}"
        # Only what the test sets reaches the file's ${...}: no ASYNCPS_* from outside.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCPS_") and k != "TF_CONFIG"}
        self.env.update(ASYNCPS_IMAGE=image, ASYNCPS_RUN_NAME=self.run_name, ASYNCPS_SECRETS=str(secrets_dir))
        self.deployed = False

    def deploy(self, **settings: object) -> None:
        self.env.update({k: str(v) for k, v in settings.items()})
        self.deployed = True
        docker("stack", "deploy", "--resolve-image", "never", "-c", str(STACK_FILE), self.name,
               timeout=120, env=self.env)

    def containers(self, service: str) -> list[str]:
        """Ids of a service's containers, newest first, running or not."""
        return docker("ps", "-aq", "--no-trunc", "--filter", self.label,
                      "--filter", f"label=com.docker.swarm.service.name={self.name}_{service}").split()

    def log(self, service: str) -> str:
        """The logs of every container of a service (its replaced tasks' too)."""
        out = []
        for c in self.containers(service):
            result = subprocess.run(["docker", "logs", c], capture_output=True, text=True, timeout=60)
            out.append(result.stdout + result.stderr)
        return "\n".join(out)

    def all_logs(self, chars: int = 3000) -> str:
        """Every service's log and the stack's tasks with their errors (for failure messages)."""
        tasks = docker("stack", "ps", "--no-trunc", "--format",
                       "{{.Name}} {{.DesiredState}} {{.CurrentState}} {{.Error}}", self.name, check=False)
        return "\n".join([f"--- tasks\n{tasks}",
                          *(f"--- {s}\n{self.log(s)[-chars:]}" for s in ("chief", "ps-0", "ps-1", "worker"))])

    def wait_for_log(self, service: str, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log(service))
            if found:
                return found
            time.sleep(2)
        pytest.fail(f"no {pattern!r} in the {service} log within {timeout:.0f}s\n{self.all_logs()}", pytrace=False)
        raise AssertionError("unreachable")

    def tasks(self, service: str) -> list[tuple[str, str]]:
        """(state, container exit code) of every task of a service, as `docker service ps` lists them."""
        ids = docker("service", "ps", "-q", "--no-trunc", f"{self.name}_{service}").split()
        if not ids:
            return []
        out = docker("inspect", "-f", "{{.Status.State}} {{.Status.ContainerStatus.ExitCode}}", *ids)
        return [(line.split()[0], line.split()[1]) for line in out.splitlines() if line.strip()]

    def wait_for_chief(self, timeout: float) -> tuple[str, int]:
        """The chief task's final state and exit code (the way deploy/stack.yml documents)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # not "shutdown": a task swarm replaced (the new one finishes the run)
            ended = [(s, int(c)) for s, c in self.tasks("chief") if s in ("complete", "failed", "rejected")]
            if ended:
                return ended[0]
            time.sleep(3)
        pytest.fail(f"the chief did not finish within {timeout:.0f}s\n{self.all_logs()}", pytrace=False)
        raise AssertionError("unreachable")

    def run_file(self, name: str) -> str:
        """A file of the run directory, read from the runs volume by a throwaway container."""
        result = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v", f"{self.name}_runs:/runs:ro",
             "--entrypoint", "cat", self.image, f"/runs/{self.run_name}/{name}"],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"cannot read {name} from the runs volume: {result.stderr}"
        return result.stdout

    def leftovers(self) -> dict[str, list[str]]:
        found = {
            "services": docker("service", "ls", "-q", "--filter", self.label, check=False).split(),
            "containers": docker("ps", "-aq", "--filter", self.label, check=False).split(),
            "networks": docker("network", "ls", "-q", "--filter", self.label, check=False).split(),
            "secrets": docker("secret", "ls", "-q", "--filter", self.label, check=False).split(),
            "volumes": docker("volume", "ls", "-q", "--filter", self.label, check=False).split(),
        }
        return {kind: ids for kind, ids in found.items() if ids}

    def remove(self, timeout: float = 120) -> float:
        """`docker stack rm`, wait until its containers and network are gone, then remove the volumes."""
        start = time.monotonic()
        docker("stack", "rm", self.name, timeout=120, check=False)
        deadline = start + timeout
        while time.monotonic() < deadline:
            left = self.leftovers()
            left.pop("volumes", None)  # `stack rm` keeps volumes by design
            if not left:
                break
            time.sleep(1)
        for volume in docker("volume", "ls", "-q", "--filter", self.label, check=False).split():
            docker("volume", "rm", volume, check=False)
        return time.monotonic() - start


@pytest.fixture
def stack(docker_image: str, swarm: None, tmp_path: Path) -> Iterator[Stack]:
    secrets_dir = tmp_path / "secrets"
    generate_dev_certs(secrets_dir, ["ps-0", "ps-1", "chief"])
    (secrets_dir / "token").write_text(secrets.token_urlsafe(32) + "\n")
    (secrets_dir / "chief-token").write_text(secrets.token_urlsafe(32) + "\n")
    deployed = Stack(docker_image, secrets_dir)
    try:
        yield deployed
    finally:
        if deployed.deployed:
            (tmp_path / "stack.log").write_text(deployed.all_logs(chars=200_000))  # kept by pytest
            deployed.remove()
            left = deployed.leftovers()
            assert not left, f"left after `docker stack rm` and removing the volumes: {left}"


def test_stack_trains_survives_a_killed_shard_and_scales_workers(stack: Stack) -> None:
    start = time.monotonic()
    # Stop on training time: the outage must not shorten the run, and the third worker (TensorFlow
    # and the dataset load for ~30 s on a busy 2-core machine) must get its turn.
    stack.deploy(ASYNCPS_EPOCHS=0, ASYNCPS_MAX_TRAINING_S=75, ASYNCPS_CHECKPOINT_EVERY_UPDATES=400,
                 ASYNCPS_CHECKPOINT_EVERY_S="off", ASYNCPS_NUM_WORKERS=2)
    stack.wait_for_log("chief", r"live workers: 2", timeout=360)  # the two planned workers train
    docker("service", "scale", "--detach", f"{stack.name}_worker=3")
    print(f"swarm: training with 2 workers, scaled to 3 at {time.monotonic() - start:.1f}s")
    # Once a checkpoint is written, the outage hits a training cluster with something to restore.
    written = stack.wait_for_log("chief", r"checkpoint (ckpt-\d{8}) at versions \[(\d+), (\d+)\]", timeout=180)
    (ps1,) = stack.containers("ps-1")
    docker("kill", ps1)
    print(f"swarm: {written.group(0)}; killed ps-1 ({ps1[:12]}) at {time.monotonic() - start:.1f}s")

    # The restart policy starts a new ps-1 task; the chief restores shard 1 from a checkpoint.
    restored = stack.wait_for_log("chief", r"shard 1 at ps-1:8470: restored from (ckpt-\d{8}) at version (\d+)",
                                  timeout=180)
    print(f"swarm: {restored.group(0)} at {time.monotonic() - start:.1f}s")

    # Swarm replaces the chief's task (as it does an unhealthy one): SIGTERM, on which the chief hands
    # over (ASYNCPS_ON_SIGTERM) and the new task resumes on the live shards. Right after the restore:
    # well before the 75 s of training are up (a task replaced after the end would start a new chief).
    docker("service", "update", "--detach", "--force", "--no-resolve-image", f"{stack.name}_chief", timeout=120)
    stack.wait_for_log("chief", r"SIGTERM \(--on-sigterm handover\)", timeout=120)
    resumed = stack.wait_for_log("chief", r"resuming on the live shards at versions \[\d+, \d+\]", timeout=240)
    print(f"swarm: chief replaced: {resumed.group(0)} at {time.monotonic() - start:.1f}s")
    joined = stack.wait_for_log("worker", r"registered as worker 2 of \d+", timeout=180)
    print(f"swarm: scale-up: {joined.group(0)} at {time.monotonic() - start:.1f}s")

    state, code = stack.wait_for_chief(timeout=SCENARIO_TIMEOUT_S - (time.monotonic() - start) - 60)
    took = time.monotonic() - start
    chief_log = stack.log("chief")
    assert (state, code) == ("complete", 0), f"chief task {state}, exit code {code}\n{stack.all_logs()}"

    ps1_tasks = stack.tasks("ps-1")
    assert len(ps1_tasks) == 2 and ("failed", "137") in ps1_tasks, ps1_tasks  # killed, then replaced
    assert len(stack.tasks("ps-0")) == 1, "ps-0 was replaced too"
    assert sorted(stack.tasks("chief")) == [("complete", "0"), ("shutdown", "143")], stack.tasks("chief")
    assert chief_log.count("resuming on the live shards") == 1, "the replaced chief's shards were not live"
    assert "shard 0 at ps-0:8470: restored" not in chief_log, "ps-0 was restored too"
    matches = re.findall(r"shard 1 at ps-1:8470: restored from (ckpt-\d{8}) at version (\d+)", chief_log)
    assert len(matches) == 1, f"shard 1 restored {len(matches)} times: {matches}"
    ckpt, version = matches[0][0], int(matches[0][1])
    line = re.search(rf"checkpoint {ckpt} at versions \[(\d+), (\d+)\]", chief_log)
    assert line is not None and version == int(line.group(2)) > 0, (version, line)

    summary = json.loads(stack.run_file(SUMMARY_JSON))
    pushes: dict[int, int] = {}
    for row in csv.DictReader(io.StringIO(stack.run_file(PUSHES_CSV))):
        pushes[int(row["worker"])] = pushes.get(int(row["worker"]), 0) + 1
    accuracy = summary["final_eval"]["accuracy"]
    print(f"swarm: chief task {state}, exit code {code} after {took:.1f}s; accuracy {accuracy:.4f}, "
          f"updates {summary['updates_applied']}, pushes by worker {dict(sorted(pushes.items()))}, "
          f"shard 1 version {summary['shards'][1]['version']} (restored at {version})")
    assert accuracy >= 0.90, summary
    assert set(pushes) == {0, 1, 2} and pushes[2] > 0, pushes
    assert summary["shards"][1]["version"] > version, summary  # shard 1 trained on after the restore

    removed_in = stack.remove()
    print(f"swarm: docker stack rm and volumes: {removed_in:.1f}s")
    assert stack.leftovers() == {}, stack.leftovers()
