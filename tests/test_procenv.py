"""One allocator setting and one thread rule for every process: asyncps.procenv, and every place
that sets the same variables outside Python (Dockerfile, docker-compose.yml, deploy/) agrees."""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncps.config import RunConfig
from asyncps.procenv import MALLOC_ENV, THREAD_VARS, has_malloc_env, process_env, thread_env
from asyncps.tools.local import LocalCluster
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parent.parent
_DEFAULT = re.compile(r"^\$\{[A-Z0-9_]+:-(?P<default>[^}]*)\}$")


def dockerfile_env(text: str) -> dict[str, str]:
    """KEY=VALUE pairs of every ENV instruction of a Dockerfile (line continuations joined)."""
    joined = re.sub(r"\\\n", " ", text)
    env: dict[str, str] = {}
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["ENV"]:
            for word in words[1:]:
                key, sep, value = word.partition("=")
                assert sep, f"ENV {word!r}: only the KEY=VALUE form is used here"
                env[key] = value
    return env


def _resolved(value: Any) -> str:
    """A compose value with `${VAR:-default}` replaced by its default (what runs without .env)."""
    text = str(value)
    match = _DEFAULT.match(text)
    return match["default"] if match else text


def check_env(where: str, env: dict[str, str]) -> list[str]:
    """Problems of one process environment: MALLOC_* other than MALLOC_ENV, a partial or
    inconsistent thread set."""
    problems = []
    malloc = {k: v for k, v in env.items() if k.startswith("MALLOC_")}
    if malloc and malloc != MALLOC_ENV:
        problems.append(f"{where}: MALLOC_* {malloc} != asyncps.procenv.MALLOC_ENV {MALLOC_ENV}")
    threads = {k: v for k, v in env.items() if k in THREAD_VARS}
    if threads:
        intra = threads.get("TF_NUM_INTRAOP_THREADS", "")
        inter = threads.get("TF_NUM_INTEROP_THREADS", "")
        if not (intra.isdigit() and inter.isdigit()) or threads != thread_env(int(intra), int(inter)):
            problems.append(f"{where}: thread variables {threads} are not asyncps.procenv.thread_env's "
                            f"set {list(THREAD_VARS)}")
    return problems


def _container_envs(node: Any, path: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Every Kubernetes container `env:` list under `node`, as a dict."""
    if isinstance(node, dict):
        if isinstance(node.get("env"), list) and "image" in node:
            yield path, {str(e["name"]): str(e.get("value", "")) for e in node["env"]}
        for key, value in node.items():
            yield from _container_envs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _container_envs(value, f"{path}[{i}]")


def test_dockerfile_env_is_procenv() -> None:
    env = dockerfile_env((ROOT / "Dockerfile").read_text())
    assert {k: v for k, v in env.items() if k.startswith("MALLOC_")} == MALLOC_ENV
    assert {k: v for k, v in env.items() if k in THREAD_VARS} == thread_env(1)
    assert check_env("Dockerfile", env) == []


def test_compose_services_follow_procenv() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    problems = []
    for name, service in compose["services"].items():
        env = {k: _resolved(v) for k, v in (service.get("environment") or {}).items()}
        problems += check_env(f"docker-compose.yml service {name}", env)
        # a service that sets threads sets them from the one knob, ASYNCPS_TF_THREADS
        for key in THREAD_VARS:
            if key in (service.get("environment") or {}):
                assert str(service["environment"][key]) == "${ASYNCPS_TF_THREADS:-1}", (name, key)
    assert problems == []


def test_deploy_manifests_follow_procenv() -> None:
    manifests = sorted((ROOT / "deploy").rglob("*.y*ml"))
    assert manifests, "no manifests under deploy/"
    problems = []
    for manifest in manifests:
        for doc in yaml.safe_load_all(manifest.read_text()):
            for where, env in _container_envs(doc, manifest.name):
                problems += check_env(where, env)
            for name, service in ((doc or {}).get("services") or {}).items():  # a swarm stack file
                env = {k: _resolved(v) for k, v in (service.get("environment") or {}).items()}
                problems += check_env(f"{manifest.name} service {name}", env)
    assert problems == []


def test_checks_catch_a_drift() -> None:
    """The checks above can fail: a changed tunable, a partial thread set, a stray Dockerfile value."""
    assert check_env("x", {**MALLOC_ENV, "MALLOC_TOP_PAD_": "1"})
    assert check_env("x", {"TF_NUM_INTRAOP_THREADS": "1"})
    assert check_env("x", {**thread_env(1), "OMP_NUM_THREADS": "2"})
    assert check_env("x", {**MALLOC_ENV, **thread_env(2, 3)}) == []
    text = "FROM x\nENV A=1 \\\n    MALLOC_TRIM_THRESHOLD_=1 \\\n    B=\"two words\"\nRUN true\n"
    assert dockerfile_env(text) == {"A": "1", "MALLOC_TRIM_THRESHOLD_": "1", "B": "two words"}


def test_process_env_sets_exactly_the_asked_threads() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "16", "TF_NUM_INTEROP_THREADS": "8", "MALLOC_TOP_PAD_": "0"}
    env = process_env(base, intra_op=2, inter_op=0)
    assert env["PATH"] == "/bin"
    assert has_malloc_env(env)
    assert {k: env[k] for k in THREAD_VARS if k in env} == {
        "TF_NUM_INTRAOP_THREADS": "2", "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    assert not any(k in process_env(base) for k in THREAD_VARS)  # 0: the libraries' defaults
    assert thread_env(3) == {"TF_NUM_INTRAOP_THREADS": "3", "TF_NUM_INTEROP_THREADS": "3",
                             "OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    with pytest.raises(ValueError, match="thread counts"):
        thread_env(-1)


def test_launchers_use_procenv(tmp_path: Path) -> None:
    """`asyncps local`, the test fixtures and the benchmarks' children all get MALLOC_ENV."""
    run = RunConfig(num_workers=1, num_ps=1, max_updates=1, tf_threads=3)
    cluster_env = LocalCluster(run, tmp_path).env
    assert has_malloc_env(cluster_env)
    assert {k: v for k, v in cluster_env.items() if k in THREAD_VARS} == thread_env(3)
    assert has_malloc_env(child_env())

    from benchmarks.baselines import _Children

    probe = "import json, os; print('RESULT ' + json.dumps(dict(os.environ)), flush=True)"
    with _Children() as children:
        child = children.start("probe", [sys.executable, "-c", probe], 2, 1)
        env = json.loads(child.read_tagged_line("RESULT", 60))
    assert has_malloc_env(env)
    assert {k: v for k, v in env.items() if k in THREAD_VARS} == thread_env(2, 1)
