"""asyncps installs beside the user's TensorFlow without changing it.

Fast: the `cpu` extra's markers pick a TensorFlow that has wheels on each platform. Slow (needs PyPI, or
pip's cache): the built wheel goes into a fresh venv that already holds a TensorFlow — by default
tensorflow-cpu 2.16 (the oldest supported, which keeps protobuf 4.x) and the newest the index has — then
`pip check`, TensorFlow and protobuf unchanged, and a tiny run trained through the installed `asyncps`
command, started from the checkout's root, whose own asyncps/ folder must not shadow the installed package
(skipped when no index is reachable, unless ASYNCPS_REQUIRE_PYPI=1). ASYNCPS_INSTALL_TF="2.16.* 2.21.*"
(any specs, space separated; `newest` for the index's newest) replaces that list; each TensorFlow is a
~500 MB download the first time, then pip's cache serves it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement

from asyncps.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
# the oldest TensorFlow asyncps supports and the newest the index has ("newest": no version given)
TF_SPECS = os.environ.get("ASYNCPS_INSTALL_TF", "2.16.* newest").split()


def extra(name: str) -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]
    return [Requirement(d) for d in deps]


def chosen(requirements: list[Requirement], machine: str, system: str) -> list[str]:
    env = {"platform_machine": machine, "platform_system": system, "sys_platform": system.lower()}
    return [r.name for r in requirements if r.marker is None or Marker(str(r.marker)).evaluate(env)]


@pytest.mark.parametrize(("machine", "system", "expected"), [
    ("x86_64", "Linux", ["tensorflow-cpu"]),
    ("AMD64", "Windows", ["tensorflow-cpu"]),
    ("aarch64", "Linux", ["tensorflow"]),   # tensorflow-cpu has no aarch64 wheels
    ("arm64", "Darwin", ["tensorflow"]),    # nor Apple silicon ones
])
def test_the_cpu_extra_picks_a_tensorflow_with_wheels(machine: str, system: str, expected: list[str]) -> None:
    assert [n for n in chosen(extra("cpu"), machine, system) if n not in ("tensorboard", "setproctitle")] == expected


def test_dependencies_are_sized_to_the_job() -> None:
    """The core set is what every process needs (a shard, a worker, the tools): no scikit-learn (the digits
    ship inside the package), tensorboard only with a TensorFlow extra (the chief's tf.summary), cryptography
    only in `certs` (asyncps devcerts, --secure); Python 3.10 gets tomli for the TOML specs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {Requirement(d).name for d in project["dependencies"]}
    assert not core & {"scikit-learn", "scipy", "tensorboard", "cryptography"}, core
    for name in ("tf", "cpu"):  # the fork server's children name their roles in `ps` (asyncps.tools.forkserver)
        assert {"tensorboard", "setproctitle"} <= {r.name for r in extra(name)}, name
    assert {r.name for r in extra("certs")} == {"cryptography"}
    tomli = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "tomli")
    assert tomli.marker is not None and tomli.marker.evaluate({"python_version": "3.10"})
    assert not tomli.marker.evaluate({"python_version": "3.11"})


def test_no_dependency_pins_protobuf_past_what_tensorflow_2_16_allows() -> None:
    """TF 2.16 needs protobuf < 5: the floors must leave 4.x possible, and grpcio-health-checking (whose
    newest releases require a newer protobuf, so pip upgrades it beside an installed TF) stays out."""
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    assert "grpcio-health-checking" not in {d.name for d in deps}
    protobuf = next(d for d in deps if d.name == "protobuf")
    assert protobuf.specifier.contains("4.25.3")


def run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def index_reachable() -> bool:
    """pip can reach a package index (a configured one is taken on trust; else pypi.org:443)."""
    if os.environ.get("PIP_INDEX_URL") or os.environ.get("PIP_FIND_LINKS"):
        return True
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not index_reachable() and os.environ.get("ASYNCPS_REQUIRE_PYPI") != "1":
        pytest.skip("no package index reachable (ASYNCPS_REQUIRE_PYPI=1 makes this a failure)")
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "runs", "build", "*.egg-info", "__pycache__", ".*_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)], cwd=out)
    return next(out.glob("asyncps-*.whl"))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a fresh TensorFlow install: 85 s with pip's cache on an idle machine, minutes when loaded
@pytest.mark.parametrize("tf_spec", TF_SPECS)
def test_the_wheel_installs_beside_tensorflow_and_trains(tf_spec: str, wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    requirement = "tensorflow-cpu" if tf_spec == "newest" else f"tensorflow-cpu=={tf_spec}"
    run([str(python), "-m", "pip", "install", "--quiet", requirement], cwd=tmp_path)
    versions = "import google.protobuf, tensorflow as tf; print(tf.__version__, google.protobuf.__version__)"
    before = run([str(python), "-c", versions], cwd=tmp_path).stdout.split()
    run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], cwd=tmp_path)  # as a user would, afterwards
    run([str(python), "-m", "pip", "check"], cwd=tmp_path)
    after = run([str(python), "-c", versions], cwd=tmp_path).stdout.split()
    assert after == before, f"installing asyncps changed TensorFlow/protobuf from {before} to {after}"
    run_dir = tmp_path / "run"
    # from the checkout's root, whose asyncps/ folder (the core without the roles) must not shadow the installed
    # package in any child process (asyncps.procenv.CLI_BOOTSTRAP)
    run([str(venv / "bin" / "asyncps"), "local", "--run-dir", str(run_dir), "--quiet", "--model", "logreg",
         "--num-workers", "2", "--num-ps", "1", "--max-updates", "40", "--tf-threads", "1"], cwd=ROOT, timeout=300)
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["final_eval"]["accuracy"] > 0.5, summary["final_eval"]
    # TensorFlow 2.20+ comes without tensorboard, which only asyncps' tf/cpu extras add: the chief then
    # trains without TensorBoard event files and says so (a crash here before it did)
    has_tensorboard = subprocess.run([str(python), "-c", "import tensorboard"], capture_output=True).returncode == 0
    chief_log = RunDir(run_dir).log("chief").read_text()
    assert ("no TensorBoard event files" in chief_log) == (not has_tensorboard), chief_log[-2000:]
