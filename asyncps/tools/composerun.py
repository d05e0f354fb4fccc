"""`asyncps compose-run`: the compose cluster as one command that survives killed containers.

`docker compose up --exit-code-from chief` stops the whole stack when any container exits, so a
crashed shard can never be restarted and restored. This runs `up -d` instead, then supervises:
a container that exited with a non-zero status (a crash, an OOM kill, `docker kill -s KILL`, which
Docker's restart policies ignore as a manual stop) is started again, up to --max-restarts times
each, until the chief exits 0; the command's exit status is the chief's. The compose command is
`docker compose` (v2) where Docker has it, else the older `docker-compose` (v1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncps.chief.lifecycle import EXIT_DIVERGED, EXIT_NO_WORKERS

SERVICE_LABEL = "com.docker.compose.service"


@dataclass(frozen=True)
class ContainerState:
    """What `docker inspect` says about one container of the project."""

    id: str
    service: str
    status: str  # created, running, restarting, exited, dead, paused
    exit_code: int


@dataclass(frozen=True)
class Decision:
    """What to do after one look at the project: containers to start again, or the end."""

    restart: tuple[str, ...] = ()
    finished: bool = False
    exit_code: int = 0
    reason: str = ""


#: Chief exits that end a run with a verdict (and summary.json), never restarted.
VERDICTS = {EXIT_DIVERGED: "the run diverged", EXIT_NO_WORKERS: "no worker was alive"}


def decide(containers: Sequence[ContainerState], restarts: dict[str, int], max_restarts: int,
           chief_service: str = "chief") -> Decision:
    """Pure: restart every crashed container with restarts left; finish when the chief exited 0,
    or exited non-zero with no restart left (its status is then the result)."""
    chiefs = [c for c in containers if c.service == chief_service]
    if not chiefs:
        return Decision(finished=True, exit_code=1, reason=f"no {chief_service} container in the project")
    chief = chiefs[0]
    if chief.status in ("exited", "dead") and chief.exit_code == 0:
        return Decision(finished=True, exit_code=0, reason=f"{chief_service} exited 0")
    if chief.status in ("exited", "dead") and chief.exit_code in VERDICTS:
        # the run ended with a verdict and its summary: a restarted chief would only repeat it
        return Decision(finished=True, exit_code=chief.exit_code,
                        reason=f"{chief_service} exited {chief.exit_code}: {VERDICTS[chief.exit_code]}")
    crashed = [c for c in containers if c.status in ("exited", "dead") and c.exit_code != 0]
    if chief in crashed and restarts.get(chief.id, 0) >= max_restarts:
        return Decision(finished=True, exit_code=chief.exit_code,
                        reason=f"{chief_service} exited {chief.exit_code} after {max_restarts} restarts")
    return Decision(restart=tuple(c.id for c in crashed if restarts.get(c.id, 0) < max_restarts))


COMPOSE_V1 = ("docker-compose",)


def compose_command(path: str | None = None) -> tuple[str, ...]:
    """`docker compose` when `docker compose version` answers (v2), else `docker-compose` (v1), looked
    up on `path` (default: $PATH); v1's name when neither is there, for the error to name it."""
    docker = shutil.which("docker", path=path)
    if docker is not None:
        try:
            probe = subprocess.run([docker, "compose", "version"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            probe = None
        if probe is not None and probe.returncode == 0:
            return (docker, "compose")
    v1 = shutil.which("docker-compose", path=path)
    return (v1,) if v1 is not None else COMPOSE_V1


class ComposeProject:
    """The compose command (`docker compose` or `docker-compose`) of one project and file."""

    def __init__(self, compose: Sequence[str], files: Sequence[str], project: str) -> None:
        self._base = [*compose, *(a for f in files for a in ("-f", f)), *(["-p", project] if project else [])]

    def run(self, *args: str, check: bool = True) -> str:
        """Run a compose subcommand; its stdout."""
        result = subprocess.run([*self._base, *args], stdout=subprocess.PIPE, text=True, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"`{' '.join([*self._base, *args])}` failed with status {result.returncode}")
        return result.stdout

    def containers(self) -> list[ContainerState]:
        """Every container of the project, stopped ones included."""
        ids = self.run("ps", "-q").split()
        if not ids:
            return []
        out = subprocess.run(["docker", "inspect", *ids], stdout=subprocess.PIPE, text=True, check=True).stdout
        return [ContainerState(c["Id"], c["Config"]["Labels"].get(SERVICE_LABEL, ""), c["State"]["Status"],
                               int(c["State"]["ExitCode"])) for c in json.loads(out)]


def supervise(project: ComposeProject, max_restarts: int, poll_s: float = 2.0) -> int:
    """Restart crashed containers until the run ends; the chief's exit status."""
    restarts: dict[str, int] = {}
    while True:
        states = project.containers()
        decision = decide(states, restarts, max_restarts)
        if decision.finished:
            print(f"asyncps compose-run: {decision.reason}", flush=True)
            return decision.exit_code
        names = {c.id: c.service for c in states}
        for container in decision.restart:
            restarts[container] = restarts.get(container, 0) + 1
            code = next(c.exit_code for c in states if c.id == container)
            print(f"asyncps compose-run: {names[container]} ({container[:12]}) exited {code}; starting it again "
                  f"({restarts[container]}/{max_restarts})", flush=True)
            subprocess.run(["docker", "start", container], stdout=subprocess.DEVNULL, check=False)
        time.sleep(poll_s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The compose-run flags."""
    p.add_argument("-f", "--file", action="append", default=[], help="compose file (repeatable; default: compose's)")
    p.add_argument("-p", "--project-name", default="", help="compose project name (default: compose's)")
    p.add_argument("--compose", default="auto",
                   help="the compose command, e.g. 'docker compose' or docker-compose (default: auto: docker compose "
                        "where `docker compose version` works, else docker-compose)")
    p.add_argument("--build", action="store_true", help="build the image first (up --build)")
    p.add_argument("--max-restarts", type=int, default=5, help="restarts per container (default: %(default)s)")
    p.add_argument("--down", action="store_true", help="remove the containers and network afterwards (keeps volumes)")


def cmd_compose_run(args: argparse.Namespace) -> int:
    """asyncps compose-run."""
    compose = compose_command() if args.compose == "auto" else tuple(str(args.compose).split())
    project = ComposeProject(compose, args.file, args.project_name)
    try:
        project.run("up", "-d", *(["--build"] if args.build else []))
        code = supervise(project, int(args.max_restarts))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"asyncps compose-run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("asyncps compose-run: interrupted; stopping the project", file=sys.stderr)
        project.run("stop", check=False)
        return 130
    if args.down:
        project.run("down", "--remove-orphans", check=False)
    print(f"asyncps compose-run: exit status {code}", flush=True)
    return code
