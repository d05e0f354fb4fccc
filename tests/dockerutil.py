"""What the Docker tests share: is there an engine, and the asyncps image they run.

The image is built once per session from the repository (scripts/docker-base.sh and
scripts/wheelhouse.sh first: there is no registry on the project's machines, and containers
install wheels from .wheelhouse/). ASYNCPS_TEST_IMAGE=TAG uses an image built elsewhere instead;
ASYNCPS_BASE_IMAGE=IMAGE builds on that base instead of the local asyncps-base:bookworm.
Without a reachable engine the tests skip, unless ASYNCPS_REQUIRE_DOCKER=1 (CI) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL_BASE = "asyncps-base:bookworm"
TEST_IMAGE = "asyncps:test"
TEST_SHARD_IMAGE = "asyncps-shard:test"  # the slim shard image (the Dockerfile's `shard` target)
BUILD_TIMEOUT_S = 1200  # a cold build (base image, deps layer) takes ~5 min on 2 cores


def unavailable(reason: str) -> None:
    """Skip the test, or fail it when ASYNCPS_REQUIRE_DOCKER=1."""
    if os.environ.get("ASYNCPS_REQUIRE_DOCKER") == "1":
        pytest.fail(f"ASYNCPS_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(f"docker tests skipped: {reason} (set ASYNCPS_REQUIRE_DOCKER=1 to fail instead)")


def probe(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a short command; None when it cannot start or hangs."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def require_engine() -> None:
    """Skip (or fail) unless a `docker` command reaches an engine."""
    if shutil.which("docker") is None:
        unavailable("no `docker` command on PATH")
    info = probe(["docker", "info", "--format", "{{.ServerVersion}}"])
    if info is None or info.returncode != 0:
        detail = "timed out" if info is None else (info.stderr.strip() or info.stdout.strip())
        unavailable(f"no Docker engine is reachable (`docker info`: {detail})")


def tail(path: Path, chars: int = 6000) -> str:
    """The end of a log file, for failure messages."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """Run a build step with its output in `log`; fail the test with the log's end if it fails."""
    start = time.monotonic()
    with log.open("w") as out:
        try:
            result = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                    env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(cmd)} took over {timeout:.0f}s; log: {log}\n{tail(log)}", pytrace=False)
    print(f"{' '.join(cmd)}: {time.monotonic() - start:.1f}s")
    if result.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({result.returncode}); log: {log}\n{tail(log)}", pytrace=False)


def image_id(tag: str) -> str:
    """The id of a local image, "" when there is none."""
    found = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else ""


def build_image(logs: Path) -> str:
    """The asyncps image of this checkout (or ASYNCPS_TEST_IMAGE), built with its logs in `logs`; the slim
    shard image (TEST_SHARD_IMAGE) is built beside it."""
    given = os.environ.get("ASYNCPS_TEST_IMAGE")
    if given:
        if not image_id(given):
            pytest.fail(f"ASYNCPS_TEST_IMAGE={given} does not exist", pytrace=False)
        return given
    base = os.environ.get("ASYNCPS_BASE_IMAGE", LOCAL_BASE)
    if base == LOCAL_BASE:  # idempotent: seconds when the image exists
        run_logged([str(ROOT / "scripts" / "docker-base.sh"), "--tag", LOCAL_BASE], logs / "base.log", 900)
    run_logged([str(ROOT / "scripts" / "wheelhouse.sh")], logs / "wheelhouse.log", 900)  # idempotent
    before = image_id(TEST_IMAGE)
    run_logged(["docker", "build", "--build-arg", f"BASE_IMAGE={base}", "-t", TEST_IMAGE, str(ROOT)],
               logs / "build.log", BUILD_TIMEOUT_S)
    run_logged(["docker", "build", "--build-arg", f"BASE_IMAGE={base}", "--target", "shard",
                "-t", TEST_SHARD_IMAGE, str(ROOT)], logs / "build-shard.log", BUILD_TIMEOUT_S)
    if before and before != image_id(TEST_IMAGE):  # the previous session's image, now untagged
        subprocess.run(["docker", "image", "rm", before], capture_output=True)  # fails harmlessly if in use
    return TEST_IMAGE
