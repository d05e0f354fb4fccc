"""`asyncps compose-run`'s supervision rule (the Docker side is tests/test_docker_compose.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from asyncps.tools.cli import build_parser
from asyncps.tools.composerun import COMPOSE_V1, ContainerState, compose_command, decide


def state(cid: str, service: str, status: str = "running", code: int = 0) -> ContainerState:
    return ContainerState(cid, service, status, code)


def test_a_killed_shard_or_worker_is_started_again_and_the_run_goes_on() -> None:
    project = [state("c", "chief"), state("p0", "ps-0"), state("p1", "ps-1", "exited", 137),
               state("w1", "worker", "exited", 1), state("w0", "worker", "exited", 0)]
    decision = decide(project, {}, max_restarts=2)
    assert not decision.finished
    assert set(decision.restart) == {"p1", "w1"}  # a worker that finished (0) stays finished


def test_a_killed_chief_is_started_again_until_its_restarts_run_out() -> None:
    project = [state("c", "chief", "exited", 137), state("p0", "ps-0")]
    assert decide(project, {"c": 1}, max_restarts=2).restart == ("c",)
    ended = decide(project, {"c": 2}, max_restarts=2)
    assert (ended.finished, ended.exit_code) == (True, 137)
    assert "after 2 restarts" in ended.reason


@pytest.mark.parametrize("verdict", [5, 6])  # diverged, no worker alive: the run ended with its summary
def test_a_chief_that_ended_the_run_with_a_verdict_is_not_restarted(verdict: int) -> None:
    project = [state("c", "chief", "exited", verdict), state("p0", "ps-0")]
    decision = decide(project, {}, max_restarts=5)
    assert (decision.finished, decision.exit_code, decision.restart) == (True, verdict, ())


def test_the_run_ends_with_the_chiefs_clean_exit() -> None:
    project = [state("c", "chief", "exited", 0), state("p0", "ps-0", "exited", 0), state("w", "worker", "exited", 3)]
    decision = decide(project, {}, max_restarts=5)
    assert (decision.finished, decision.exit_code, decision.restart) == (True, 0, ())


def test_no_restart_beyond_the_limit_and_no_chief_is_an_error() -> None:
    project = [state("c", "chief"), state("p1", "ps-1", "exited", 137)]
    assert decide(project, {"p1": 5}, max_restarts=5).restart == ()
    missing = decide([state("p1", "ps-1")], {}, max_restarts=5)
    assert (missing.finished, missing.exit_code) == (True, 1)


def test_the_command_line() -> None:
    args = build_parser().parse_args(["compose-run", "-p", "demo", "-f", "docker-compose.yml", "--max-restarts", "3"])
    assert (args.project_name, args.file, args.max_restarts, args.compose) == ("demo", ["docker-compose.yml"], 3,
                                                                               "auto")


def fake_tools(where: Path, docker_compose_works: bool, v1: bool) -> str:
    """A PATH of one directory with a fake `docker` (whose `compose version` answers or fails) and,
    with `v1`, a fake `docker-compose`."""
    where.mkdir()
    answer = 0 if docker_compose_works else 1
    (where / "docker").write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'compose version' ] && exit {answer}\nexit 0\n")
    if v1:
        (where / "docker-compose").write_text("#!/bin/sh\nexit 0\n")
    for tool in where.iterdir():
        tool.chmod(0o755)
    return str(where)


@pytest.mark.parametrize(("v2", "v1", "chosen"), [(True, True, "docker compose"), (False, True, "docker-compose"),
                                                 (False, False, "docker-compose")])
def test_compose_run_prefers_docker_compose_v2_and_falls_back_to_v1(tmp_path: Path, v2: bool, v1: bool,
                                                                     chosen: str) -> None:
    path = fake_tools(tmp_path / "bin", v2, v1)
    command = compose_command(path)
    assert " ".join([Path(command[0]).name, *command[1:]]) == chosen


def test_compose_run_on_this_machine_uses_the_compose_that_answers() -> None:
    """The real probe: v2 where `docker compose version` works, else v1 (the CI machine has only v1)."""
    docker = shutil.which("docker")
    v2 = docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True,
                                               check=False).returncode == 0
    command = compose_command()
    if v2:
        assert command[1:] == ("compose",)
    else:
        assert Path(command[0]).name == COMPOSE_V1[0]


def compose_services() -> dict[str, dict[str, object]]:
    import yaml

    from tests.conftest import REPO_ROOT

    services: dict[str, dict[str, object]] = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    return services


def test_every_role_in_the_compose_file_has_a_restart_policy() -> None:
    services = compose_services()
    assert {name: services[name].get("restart") for name in ("ps-0", "ps-1", "chief", "worker")} == dict.fromkeys(
        ("ps-0", "ps-1", "chief", "worker"), "on-failure")


def test_every_run_setting_reaches_the_chief_in_compose() -> None:
    from asyncps.config import env_name, run_options

    environment = compose_services()["chief"]["environment"]
    assert isinstance(environment, dict)
    # how `asyncps local` packs workers into processes; in compose every worker container is one process
    launcher_only = {"worker_processes"}
    # the chief counts its shards from ASYNCPS_PS, the address list (num_ps is for `asyncps local`)
    assert "ASYNCPS_PS" in environment
    launcher_only.add("num_ps")
    missing = [name for name in run_options() if name not in launcher_only and env_name(name) not in environment]
    assert missing == [], f"run settings docker-compose.yml does not forward to the chief: {missing}"
    assert {"ASYNCPS_RESUME", "ASYNCPS_TOKEN_FILE", "ASYNCPS_CHIEF_TOKEN_FILE", "ASYNCPS_TLS_CERT"} <= set(environment)
    worker = compose_services()["worker"]["environment"]
    assert isinstance(worker, dict)
    assert "ASYNCPS_CHIEF_TOKEN_FILE" not in worker  # a worker never holds the chief's token


def test_every_shard_declares_a_fixed_data_port_in_compose_and_the_stack() -> None:
    """Workers on other hosts reach a shard's TCP data port: fixed (not 0: any free port), apart
    from the gRPC port, and declared beside it (the shard announces the port over gRPC)."""
    import yaml

    from tests.conftest import REPO_ROOT

    stack = yaml.safe_load((REPO_ROOT / "deploy" / "stack.yml").read_text())["services"]
    for where, services in (("docker-compose.yml", compose_services()), ("deploy/stack.yml", stack)):
        shards = sorted(name for name in services if name.startswith("ps-"))
        assert shards == ["ps-0", "ps-1"], where
        for name in shards:
            service = services[name]
            environment = service["environment"]
            assert isinstance(environment, dict)
            grpc_port, data_port = int(environment["ASYNCPS_PORT"]), int(environment["ASYNCPS_DATA_PORT"])
            assert data_port > 0 and data_port != grpc_port, (where, name)
            exposed = service.get("expose")
            assert isinstance(exposed, list), (where, name)
            assert {str(grpc_port), str(data_port)} <= {str(port) for port in exposed}, (where, name)
