"""Shared fixtures: real parameter-server shard processes, each bound to port 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from asyncps.ps.main import EXIT_TERMINATED

from asyncps.procenv import process_env
from asyncps.rundir import wait_port_file

if TYPE_CHECKING:
    from asyncps.pb.coordinator_pb2 import ClusterStatus
    from asyncps.tools.local import LocalCluster

REPO_ROOT = Path(__file__).resolve().parent.parent
# Generous: the test machine is shared and a cold interpreter imports grpc and numpy.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


@dataclass
class ShardProcess:
    """One running `asyncps ps` process and where it serves."""

    index: int
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    killed: bool = False  # killed on purpose: teardown expects no clean exit

    def kill(self) -> None:
        """SIGKILL the shard (a crash); teardown will not count it as a problem."""
        self.killed = True
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the shard's combined stdout/stderr, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def asyncps_processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, CLI arguments) of every live asyncps process of this machine: an exec'd one runs
    `python -c BOOTSTRAP ARGS` (asyncps.procenv.cli_command, the fork server's own start), one the fork server
    forked is titled `asyncps ARGS` (asyncps.tools.forkserver.set_title)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().rstrip(b"\0").decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) >= 3 and argv[1] == "-c" and "from asyncps.tools." in argv[2]:
            yield int(proc.name), argv[3:]
        elif argv[0].startswith("asyncps "):
            yield int(proc.name), argv[0].split()[1:]


def child_env() -> dict[str, str]:
    """Environment of every process a test starts: the allocator and thread settings of
    asyncps.procenv (as in production), and no ASYNCPS_* or TF_CONFIG: flags must come from the
    command line only, those would override them."""
    env = process_env({k: v for k, v in os.environ.items() if not k.startswith("ASYNCPS_") and k != "TF_CONFIG"},
                      intra_op=1)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


class ShardLauncher:
    """Starts shard processes on port 0 and stops them all in teardown.

    Call it with a count to start that many shards at once (they boot in parallel); it returns
    them in index order once every one has published its port.
    """

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._started: list[ShardProcess] = []

    def __call__(self, count: int = 1, first_index: int = 0, python_flags: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> list[ShardProcess]:
        """Start `count` shards with indices first_index.. (and extra `asyncps ps` args) and wait until all serve."""
        pending = []
        for index in range(first_index, first_index + count):
            serial = len(self._started) + len(pending)
            port_file = self._workdir / f"shard{serial}.port"
            log_path = self._workdir / f"shard{serial}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, *python_flags, "-m", "asyncps.tools.cli", "ps", "--host", "127.0.0.1",
                     "--port", "0", "--port-file", str(port_file), "--index", str(index),
                     "--chief-timeout-s", "0", *args],  # the test is the chief: no watchdog
                    stdout=log, stderr=subprocess.STDOUT, env={**child_env(), **(extra_env or {})}, cwd=REPO_ROOT,
                )
            pending.append((index, process, port_file, log_path))
        shards = []
        for index, process, port_file, log_path in pending:
            shard = ShardProcess(index, "", process, log_path)
            self._started.append(shard)
            try:
                port = wait_port_file(port_file, START_TIMEOUT_S,
                                      alive=lambda p=process: p.poll() is None)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(
                    f"shard {index} did not start: {exc}\n{shard.log_tail()}") from exc
            shard.address = f"127.0.0.1:{port}"
            shards.append(shard)
        return shards

    def stop_all(self) -> list[str]:
        """Terminate every shard still running; return a problem line per unclean exit."""
        for shard in self._started:
            if shard.process.poll() is None:
                shard.process.terminate()  # SIGTERM: the shard stops gracefully and returns EXIT_TERMINATED
        problems = []
        for shard in self._started:
            try:
                code = shard.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                shard.process.kill()
                shard.process.wait()
                problems.append(f"shard {shard.index} ignored SIGTERM for {STOP_TIMEOUT_S:.0f}s")
                continue
            if code not in (0, EXIT_TERMINATED) and not shard.killed:  # the chief's Shutdown, or SIGTERM
                problems.append(f"shard {shard.index} exited with {code}:\n{shard.log_tail()}")
        return problems


@pytest.fixture
def shard_factory(tmp_path: Path) -> Iterator[ShardLauncher]:
    """Start N real shard processes with `shard_factory(n)`; all are stopped in teardown."""
    launcher = ShardLauncher(tmp_path)
    yield launcher
    problems = launcher.stop_all()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def module_shard_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardLauncher]:
    """Like shard_factory, but the shards live for the whole test module."""
    launcher = ShardLauncher(tmp_path_factory.mktemp("shards"))
    yield launcher
    problems = launcher.stop_all()
    assert not problems, "\n".join(problems)


@pytest.fixture
def shard_server(shard_factory: ShardLauncher) -> str:
    """The address (host:port) of one fresh, uninitialized shard process."""
    return shard_factory(1)[0].address


@pytest.fixture
def start_shards(shard_factory: ShardLauncher) -> Callable[[int], list[str]]:
    """`start_shards(n)` starts n fresh shard processes and returns their addresses."""

    def start(count: int) -> list[str]:
        return [shard.address for shard in shard_factory(count)]

    return start


def start_until(cluster: LocalCluster, ready: Callable[[ClusterStatus], bool], timeout_s: float = 120.0
                ) -> ClusterStatus:
    """Start `cluster` and wait until `ready(status)` (the chief alive throughout); the status then."""
    import time

    from asyncps.transport.coordinator import CoordinatorClient

    cluster.start()
    coord = CoordinatorClient(cluster.chief_address, deadline_s=30)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(status := coord.status()):
            assert time.monotonic() < deadline and cluster.chief.alive(), f"training did not start: {status}"
            time.sleep(0.1)
        return status
    finally:
        coord.close()


def kill_worker_mid_run(cluster: LocalCluster, ready: Callable[[ClusterStatus], bool],
                        worker: str = "worker-2", timeout_s: float = 120.0) -> ClusterStatus:
    """Start `cluster`, wait until `ready(status)`, SIGKILL one worker; return the status at the kill."""
    import signal

    status = start_until(cluster, ready, timeout_s)
    next(c for c in cluster.children if c.name == worker).proc.send_signal(signal.SIGKILL)
    return status


@pytest.fixture(scope="session")
def docker_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The asyncps image of this checkout, built once per session (skips without a Docker engine)."""
    from tests.dockerutil import build_image, require_engine

    require_engine()
    return build_image(tmp_path_factory.mktemp("docker-build"))



# What runs together under pytest-xdist: `make test-e2e` runs the long suites on 2 workers, which the
# scheduler below (xdist's hook) feeds one unit at a time, in the order of the collection
# (--no-loadscope-reorder; _order below); one at a time kept only ~58% of the 2 cores busy,
# the suites mostly wait on the wall clock. The docker modules share one Docker engine, the session's
# image build and the swarm: one unit (the Slurm cluster's image is built from the session's). Each reduced
# experiment is a unit of its own (the largest, 25-175 s).
# Every other module is one unit: its tests share its module-scoped clusters, started once.
DOCKER_MODULES = frozenset({"test_docker_compose.py", "test_docker_swarm.py", "test_slurm_cluster.py",
                            "test_swarm_multinode.py"})
SPLIT_MODULES = frozenset({"test_experiments_ci.py"})
# `make test` runs the default suite the same way (TEST_WORKERS): its longest module goes out first, so it
# does not start last and hold the run's end (tests/test_hostile_input.py: ~60-90 s against seconds for most)
LONG_DEFAULT_MODULES = frozenset({"test_hostile_input.py"})
# pytest-timeout's limit for a test marked slow that sets none of its own (pyproject.toml's 300 s for the rest)
SLOW_TIMEOUT_S = 900


def e2e_unit(nodeid: str) -> str:
    """The unit a test runs in under `make test-e2e`: a module, or the test itself in SPLIT_MODULES."""
    module = nodeid.split("::", 1)[0]
    name = module.rsplit("/", 1)[-1]
    if name in DOCKER_MODULES:
        return "docker"
    return nodeid if name in SPLIT_MODULES else module


def _order(item: pytest.Item) -> int:
    """Longest first: the docker unit (the image build is most of its first test), then the experiments."""
    if item.path.name in DOCKER_MODULES:
        return 0
    if item.path.name in LONG_DEFAULT_MODULES:
        return 1
    return 1 if item.path.name in SPLIT_MODULES and item.get_closest_marker("slow") else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses_docker = item.get_closest_marker("docker") or "docker_image" in getattr(item, "fixturenames", ())
        if uses_docker and item.path.name not in DOCKER_MODULES:
            raise pytest.UsageError(f"{item.nodeid} uses Docker: list its module in DOCKER_MODULES "
                                    "(tests/conftest.py), so that make test-e2e runs it with the other docker tests")
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            # a hang guard, not a speed check: a long suite's test may take 2-3x its time here on a slower or
            # loaded machine (CI's took 300+ s for a chaos run of ~110 s here), past the suite's 300 s default
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    items.sort(key=_order)  # stable: each file's own order is kept


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the floors' venv does not install
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return e2e_unit(nodeid)

    return UnitScheduling(config, log)
