"""TF_CONFIG: parsing, clear errors, and a cluster configured by TF_CONFIG alone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from asyncps.cluster import ClusterConfigError, parse_tf_config
from asyncps.rundir import RunDir
from tests.conftest import REPO_ROOT, child_env

CLUSTER = {"chief": ["c:1"], "worker": ["w0:2", "w1:3"], "ps": ["p0:4", "p1:5"]}


def test_parse_gives_roles_and_own_address() -> None:
    cfg = parse_tf_config(json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 1}}))
    assert cfg.ps == ("p0:4", "p1:5") and cfg.worker == ("w0:2", "w1:3") and cfg.chief == ("c:1",)
    assert cfg.own_address == "p1:5" and cfg.own_port == 5


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    (json.dumps({"task": {"type": "ps"}}), '"cluster"'),
    (json.dumps({"cluster": CLUSTER}), '"task"'),
    (json.dumps({"cluster": CLUSTER, "task": {"type": "boss", "index": 0}}), "task.type"),
    (json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 5}}), "out of range"),
    (json.dumps({"cluster": {**CLUSTER, "ps": ["nohost"]}, "task": {"type": "ps", "index": 0}}), "host:port"),
    (json.dumps({"cluster": {**CLUSTER, "chief": []}, "task": {"type": "ps", "index": 0}}), "exactly one"),
])
def test_bad_tf_config_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        parse_tf_config(text)


def test_bad_tf_config_on_the_command_line_is_one_line() -> None:
    env = {**child_env(), "TF_CONFIG": '{"cluster": {}}'}
    out = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "worker"], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "TF_CONFIG" in out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_cluster_configured_only_by_tf_config_trains(tmp_path: Path) -> None:
    # TF_CONFIG names every address up front, so ports are picked free (ephemeral) just before.
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}"],
               "worker": [f"127.0.0.1:{free_port()}"]}
    procs = []
    try:
        for role, args in (("ps", ["--host", "127.0.0.1"]),
                           ("chief", ["--host", "127.0.0.1", "--run-dir", str(tmp_path / "run"),
                                      "--max-updates", "50", "--eval-every-s", "30"]),
                           ("worker", [])):
            env = {**child_env(), "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": 0}})}
            log = open(tmp_path / f"{role}.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", role, *args], env=env,
                                          cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        assert procs[1].wait(timeout=180) == 0, (tmp_path / "chief.log").read_text()[-3000:]
        assert procs[2].wait(timeout=30) == 0 and procs[0].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    summary = json.loads(RunDir(tmp_path / "run").summary.read_text())
    assert summary["updates_applied"] >= 50 and summary["workers"] == 1 and summary["ps_shards"] == 1
    assert os.path.exists(RunDir(tmp_path / "run").pushes)
