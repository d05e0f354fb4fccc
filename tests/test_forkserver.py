"""The fork server (asyncps.tools.forkserver): children forked from one process that loaded TensorFlow, seen by the
launcher as Popen-like handles: exit codes, signals, timeouts, their own logs, and the server's death."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncps.procenv import process_env
from asyncps.tools.forkserver import LOST_STATUS, ForkServer
from tests.conftest import asyncps_processes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    logs = tmp_path_factory.mktemp("forkserver")
    fork_server = ForkServer(process_env(intra_op=1), logs / "server.log", str(logs))
    yield fork_server
    fork_server.close()


def waiting_worker(tmp_path: Path) -> list[str]:
    """A worker that waits for a chief port file that never appears (it runs until killed)."""
    return ["worker", "--chief-port-file", str(tmp_path / "never.port"), "--chief-timeout-s", "600"]


def test_child_runs_the_cli_with_its_own_log_and_exit_code(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = server.spawn(["worker", "--no-such-flag"], process_env(intra_op=1), log)
    assert child is not None
    assert child.wait(timeout=60) == 2  # argparse's usage error, as an exec'd `asyncps worker --no-such-flag`
    assert child.poll() == 2 and child.returncode == 2
    assert "--no-such-flag" in log.read_text()


def test_signals_timeouts_and_environment(server: ForkServer, tmp_path: Path) -> None:
    env = {**process_env(intra_op=1), "ASYNCPS_TEST_MARK": "forked"}
    child = server.spawn(waiting_worker(tmp_path), env, tmp_path / "child.log")
    assert child is not None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)
    assert child.poll() is None
    assert os.getsid(child.pid) == child.pid  # a session of its own
    titles = {pid: args for pid, args in asyncps_processes()}  # `ps` names its role and arguments
    assert titles[child.pid] == waiting_worker(tmp_path)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # an ended child: nothing to signal, as Popen


def test_children_outlive_a_dead_server_and_are_seen_to_end(tmp_path: Path) -> None:
    fork_server = ForkServer(process_env(intra_op=1), tmp_path / "server.log", str(tmp_path))
    try:
        child = fork_server.spawn(waiting_worker(tmp_path), process_env(intra_op=1), tmp_path / "child.log")
        assert child is not None
        fork_server._proc.kill()  # the server dies; its child runs on (adopted by init)
        fork_server._reader.join(timeout=30)
        assert not fork_server.reporting
        assert fork_server.spawn(["worker", "--help"], process_env(intra_op=1), tmp_path / "x.log") is None
        assert child.poll() is None
        child.kill()
        assert child.wait(timeout=30) == LOST_STATUS  # its status went to init: reported as a kill
    finally:
        fork_server.close()
