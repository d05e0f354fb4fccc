"""Security end to end: a whole cluster over mutual TLS with a token; clean failures."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncps.rundir import RunDir
from tests.conftest import REPO_ROOT, child_env
from tests.test_local_cluster import run_cli


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["mTLS", "TLS"])
def test_secure_local_cluster_trains_over_tls_with_a_token(tmp_path: Path, transport: str) -> None:
    run_dir = tmp_path / "run"
    tls_only = ["--tls-no-client-auth"] if transport == "TLS" else []
    result = run_cli(["local", "--secure", *tls_only, "--run-dir", str(run_dir), "--epochs", "15", "--quiet"])
    assert result.returncode == 0, result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["final_eval"]["accuracy"] >= 0.90
    for log in ("ps-0.log", "ps-1.log", "chief.log"):
        assert f"({transport}, per-role tokens auth)" in (RunDir(run_dir).logs / log).read_text()
    token = (run_dir / "secrets" / "token").read_text().strip()
    for log in RunDir(run_dir).logs.glob("*.log"):
        assert token not in log.read_text()


def test_worker_pointed_at_a_dead_address_exits_with_a_clear_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed again below: nothing listens there
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "worker", "--chief", dead, "--chief-timeout-s",
                          "3"],
                         cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert elapsed < 30
    assert f"could not reach the chief at {dead} within 3s" in out.stderr
    assert "Traceback" not in out.stderr
