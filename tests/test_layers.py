"""The floors of the code (core <- roles <- tools, the core's own floors, no circles), the import names, and
what a shard loads."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, ShardLauncher


def _module(name: str) -> ModuleType:
    """A script of scripts/ (they import their neighbours by bare name)."""
    if str(REPO_ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
    return importlib.import_module(name)


def _checker() -> ModuleType:
    return _module("check_layers")


def test_the_tree_keeps_its_floors() -> None:
    checker = _checker()
    assert [str(v) for v in checker.check(REPO_ROOT, checker.KNOWN)] == []


def test_every_known_exception_still_exists_so_the_list_only_shrinks() -> None:
    checker = _checker()
    found = {(v.importer, v.imported) for v in checker.check(REPO_ROOT)}
    assert set(checker.KNOWN) <= found, f"fixed, remove from KNOWN: {sorted(set(checker.KNOWN) - found)}"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _skeleton(root: Path) -> None:
    """A fake tree's pyproject and empty package files: the core, the tools and the three roles."""
    _write(root, "pyproject.toml", _PYPROJECT)
    for rel in ("asyncps/__init__.py", "asyncps/tools/__init__.py", "ps/__init__.py", "worker/__init__.py",
                "chief/__init__.py"):
        _write(root, rel, "")


_PYPROJECT = """\
[tool.setuptools]
packages = ["asyncps", "asyncps.tools", "asyncps.wire", "asyncps.ps", "asyncps.worker", "asyncps.chief"]
[tool.setuptools.package-dir]
"asyncps.ps" = "ps"
"asyncps.worker" = "worker"
"asyncps.chief" = "chief"
"""


def test_the_check_fails_on_wrong_imports_wherever_they_stand(tmp_path: Path) -> None:
    _skeleton(tmp_path)
    _write(tmp_path, "asyncps/wire/codec.py", "import numpy\n")
    _write(tmp_path, "asyncps/tools/cli.py", "from asyncps.ps import store\nimport asyncps.chief.main\n")
    _write(tmp_path, "ps/store.py", "from asyncps.wire.codec import x\nfrom . import servicer\n")
    _write(tmp_path, "ps/servicer.py", """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from asyncps.worker.trainer import Trainer
        def f():
            from ..chief import main
            import asyncps.tools.cli
        """)
    _write(tmp_path, "asyncps/config.py", "def f():\n    from asyncps.worker import trainer\n")
    _write(tmp_path, "asyncps/rules.py", "from asyncps import ps\n")
    _write(tmp_path, "chief/main.py", "import ps.store\nfrom worker import trainer\n")
    found = {(v.importer, v.imported) for v in _checker().check(tmp_path)}
    assert found == {
        ("asyncps.ps.servicer", "asyncps.worker.trainer"),
        ("asyncps.ps.servicer", "asyncps.chief"),
        ("asyncps.ps.servicer", "asyncps.tools.cli"),
        ("asyncps.config", "asyncps.worker"),
        ("asyncps.rules", "asyncps.ps"),
        ("asyncps.chief.main", "ps.store"),
        ("asyncps.chief.main", "worker"),
    }


def _core_tree(root: Path, files: dict[str, str]) -> set[tuple[str, str, str]]:
    """(importer, imported, why) of every violation in a small tree of the core with `files` in it."""
    _write(root, "pyproject.toml", """\
        [tool.setuptools]
        packages = ["asyncps", "asyncps.wire", "asyncps.rules", "asyncps.ml", "asyncps.transport"]
        """)
    for rel in ("asyncps/__init__.py", "asyncps/wire/__init__.py", "asyncps/rules/__init__.py",
                "asyncps/ml/__init__.py", "asyncps/transport/__init__.py"):
        _write(root, rel, "")
    for rel, text in files.items():
        _write(root, rel, text)
    return {(v.importer, v.imported, v.why) for v in _checker().check(root)}


def test_the_check_fails_on_an_import_up_a_floor_of_the_core(tmp_path: Path) -> None:
    found = _core_tree(tmp_path, {
        "asyncps/wire/codec.py": "def f():\n    from asyncps.rules import registry\n",  # codec below rules
        "asyncps/rules/registry.py": "",
        "asyncps/rules/policies.py": "from asyncps.wire.codec import Array\nfrom asyncps.wire import shard\n",
        "asyncps/wire/shard.py": "from asyncps.rules.policies import DropReason\n",  # down: fine
        "asyncps/newfloor.py": "",
    })
    assert {(importer, imported) for importer, imported, _ in found} == {
        ("asyncps.wire.codec", "asyncps.rules.registry"),
        ("asyncps.rules.policies", "asyncps.wire.shard"),
        ("asyncps.newfloor", "asyncps.newfloor"),  # a new module of the core must be placed on a floor
    }
    assert ("asyncps.rules.policies", "asyncps.wire.shard",
            "the rules floor of the core imports none above it (wire)") in found


def test_the_check_fails_on_a_circle_even_inside_functions_but_not_under_type_checking(tmp_path: Path) -> None:
    found = _core_tree(tmp_path, {
        "asyncps/ml/models.py": "def make_loss():\n    from asyncps.ml.task import resolve_loss\n",
        "asyncps/ml/task.py": "def resolve_loss():\n    from asyncps.ml import models\n",
        "asyncps/ml/specs.py": "import typing\nif typing.TYPE_CHECKING:\n    from asyncps.ml import datasets\n",
        "asyncps/ml/datasets.py": "from asyncps.ml.specs import x\n",
    })
    assert found == {("asyncps.ml.models", "asyncps.ml.task",
                      "an import circle: asyncps.ml.models -> asyncps.ml.task -> asyncps.ml.models")}


def test_the_check_names_the_shortest_circle_through_a_role_and_a_tool(tmp_path: Path) -> None:
    _skeleton(tmp_path)
    _write(tmp_path, "worker/main.py", "from asyncps.worker import logical\n")
    _write(tmp_path, "worker/logical.py", "def run():\n    from .build import Trainer\n")
    _write(tmp_path, "worker/build.py", "import asyncps.worker.main\n")
    _write(tmp_path, "asyncps/tools/a.py", "from asyncps.tools.b import x\n")
    _write(tmp_path, "asyncps/tools/b.py", "from . import a\n")
    found = {(v.importer, v.why) for v in _checker().check(tmp_path)}
    assert found == {
        ("asyncps.tools.a", "an import circle: asyncps.tools.a -> asyncps.tools.b -> asyncps.tools.a"),
        ("asyncps.worker.build", "an import circle: asyncps.worker.build -> asyncps.worker.main -> "
                                 "asyncps.worker.logical -> asyncps.worker.build"),
    }


def test_the_check_fails_on_an_import_across_transports(tmp_path: Path) -> None:
    files = {
        "asyncps/transport/base.py": "",
        "asyncps/transport/tcp.py": "from asyncps.transport.base import DataPath\n",
        "asyncps/transport/shm.py": "from asyncps.transport.tcp import data_connection\n",
        "asyncps/transport/model.py": "def f():\n    from asyncps.transport import shm\n",
        "asyncps/transport/registry.py": "from asyncps.transport import shm, tcp\n",  # the registry names them all
    }
    found = {(importer, imported) for importer, imported, _ in _core_tree(tmp_path, files)}
    assert found == {("asyncps.transport.shm", "asyncps.transport.tcp"),
                     ("asyncps.transport.model", "asyncps.transport.shm")}
    assert sorted(str(v) for v in _checker().check(tmp_path, _checker().KNOWN)) == [
        "asyncps/transport/model.py:2: asyncps.transport.model imports asyncps.transport.shm: a transport never "
        "imports another transport's channel (only the registry names them all)",
        "asyncps/transport/shm.py:1: asyncps.transport.shm imports asyncps.transport.tcp: a transport never "
        "imports another transport's channel (only the registry names them all)"]


def test_every_floor_of_the_core_names_modules_that_exist() -> None:
    checker = _checker()
    names = {name for name, _ in _module("pkglayout").modules(REPO_ROOT)}
    entries = [entry for _, floor in checker.CORE_FLOORS for entry in floor]
    stale = [e for e in entries if not any(n == e or n.startswith(e + ".") for n in names)]
    assert stale == [], "remove them from CORE_FLOORS"
    assert len(entries) == len(set(entries))
    assert checker.core_floor("asyncps.wire.codec") < checker.core_floor("asyncps.rules.modes") \
        < checker.core_floor("asyncps.wire.shard") < checker.core_floor("asyncps.transport.tcp")


def test_only_the_asyncps_import_name_is_installed(tmp_path: Path) -> None:
    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    for bare in ("ps", "worker", "chief"):
        result = run(f"import {bare}")
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, (bare, result.stderr)
    result = run("import asyncps.ps.store, asyncps.worker.trainer, asyncps.chief.main, asyncps.tools.cli")
    assert result.returncode == 0, result.stderr


def test_a_running_shard_loads_neither_tensorflow_nor_matplotlib(shard_factory: ShardLauncher) -> None:
    from asyncps.rules import OptimizerConfig, UpdateRuleConfig
    from asyncps.transport import GrpcShardTransport
    from asyncps.wire.shard import PushRequest

    shard = shard_factory(1, python_flags=("-X", "importtime"))[0]
    client = GrpcShardTransport(shard.address, deadline_s=30)
    values = {"w": np.ones((4, 3), np.float32)}
    client.initialize("test", 0, 1, UpdateRuleConfig(OptimizerConfig("adam", 0.1)), values)
    result, reply = client.push_pull(PushRequest("test", 0, {"w": np.ones((4, 3), np.float32)}))
    assert result.accepted and reply.values is not None
    client.snapshot()
    client.stats()
    client.close()
    shard.process.terminate()
    shard.process.wait(timeout=30)
    loaded = set(re.findall(r"import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)", shard.log_path.read_text()))
    assert "asyncps.ps.store" in loaded  # the log really lists the shard's imports
    # nor anything else the slim shard image (Dockerfile target `shard`: numpy, grpcio, protobuf) lacks
    heavy = {m for m in loaded if m.split(".")[0] in ("tensorflow", "keras", "matplotlib", "sklearn", "pandas",
                                                      "scipy", "yaml", "rich", "prometheus_client", "tensorboard",
                                                      "PIL", "cryptography")}
    assert not heavy, f"a shard imported {sorted(heavy)[:10]}"


@pytest.mark.parametrize("role", ["ps", "worker", "chief"])
def test_the_role_folders_are_the_asyncps_subpackages(role: str) -> None:
    module = importlib.import_module(f"asyncps.{role}")
    assert Path(module.__file__ or "").resolve().parent == (REPO_ROOT / role).resolve()


def test_each_file_has_one_path_no_symlink_and_every_package_is_listed() -> None:
    links = [str(p.relative_to(REPO_ROOT)) for top in ("asyncps", "ps", "worker", "chief")
             for p in (REPO_ROOT / top).rglob("*") if p.is_symlink()]
    assert links == []
    layout = _module("pkglayout")
    assert layout.unlisted_packages(REPO_ROOT) == [], "add them to [tool.setuptools] packages in pyproject.toml"
    names = [name for name, _ in layout.modules(REPO_ROOT)]
    assert len(names) == len(set(names))
    paths = [path.resolve() for _, path in layout.modules(REPO_ROOT)]
    assert len(paths) == len(set(paths)), "a file is reached under two names"
    assert "asyncps.ps.store" in names and "asyncps.wire.frames" in names and "tests.test_layers" in names


def test_the_type_check_names_each_role_file_as_it_is_imported() -> None:
    sources = {s.module: s.path for s in _module("typecheck").sources(REPO_ROOT)}
    assert sources["asyncps.ps.store"] == "ps/store.py"
    assert sources["asyncps.chief.main"] == "chief/main.py"
    assert sources["asyncps.tools.cli"] == "asyncps/tools/cli.py"
    assert not any(name.startswith(("tests", "asyncps.pb")) for name in sources)
