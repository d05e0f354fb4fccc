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
from asyncps.tools.forkserver import LOST_STATUS, ForkServer, shared_server
from tests.conftest import asyncps_processes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    logs = tmp_path_factory.mktemp("forkserver")
    fork_server = ForkServer(process_env(intra_op=1), logs / "server.log")
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


def test_signals_timeouts_and_working_directory(server: ForkServer, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the launcher's, when it asks: not the server's
    child = server.spawn(waiting_worker(tmp_path), process_env(intra_op=1), tmp_path / "child.log")
    assert child is not None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)
    assert child.poll() is None
    assert os.getsid(child.pid) == child.pid  # a session of its own
    titles = {pid: args for pid, args in asyncps_processes()}  # `ps` names its role and arguments
    assert titles[child.pid] == waiting_worker(tmp_path)
    assert Path(f"/proc/{child.pid}/cwd").resolve() == tmp_path.resolve()
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # an ended child: nothing to signal, as Popen


def test_children_outlive_a_dead_server_and_are_seen_to_end(tmp_path: Path) -> None:
    fork_server = ForkServer(process_env(intra_op=1), tmp_path / "server.log")
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


def test_a_launcher_shares_one_server_per_environment(tmp_path: Path) -> None:
    env = process_env(intra_op=1)
    first = shared_server({**env, "ASYNCPS_SHM_TAG": "a"}, per_request=("ASYNCPS_SHM_TAG",))
    assert shared_server({**env, "ASYNCPS_SHM_TAG": "b"}, per_request=("ASYNCPS_SHM_TAG",)) is first
    other = shared_server({**env, "MALLOC_TOP_PAD_": "0"}, per_request=("ASYNCPS_SHM_TAG",))
    assert other is not first  # read as a process starts: another server
    child = first.spawn(["worker", "--no-such-flag"], env, tmp_path / "child.log")
    assert child is not None and child.wait(timeout=60) == 2
    first._proc.kill()  # a dead one is replaced on the next ask
    first._reader.join(timeout=30)
    assert shared_server(env, per_request=("ASYNCPS_SHM_TAG",)) is not first
