"""The docs stay true to the code: docs/architecture.md lists every RPC of both services, and the floors
docs/operations.md states are the floors tested."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

from asyncps.pb import coordinator_pb2, ps_pb2

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_rpc_table_lists_every_shard_rpc_and_no_other() -> None:
    text = ARCHITECTURE.read_text()
    section = text[text.index("## The shard service"):]
    section = section[:section.index("\n## ", 1)]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    methods = [m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods]
    assert sorted(listed) == sorted(methods)


def test_every_coordinator_rpc_is_named() -> None:
    text = ARCHITECTURE.read_text()
    for method in coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].methods:
        assert f"`{method.name}`" in text, method.name


def test_the_floors_tested_are_the_floors_declared(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("floors", ROOT / "scripts" / "floors.py")
    assert spec is not None and spec.loader is not None
    floors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floors)
    pins = floors.floors()
    assert [p.split("==")[0].lower() for p in pins] == ["numpy", "grpcio", "protobuf"]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {p.replace("==", ">=") for p in pins} <= set(declared)
    unpinned = tmp_path / "pyproject.toml"
    deps = '"numpy", "grpcio>=1.62", "protobuf>=4"'
    unpinned.write_text(f"[project]\ndependencies = [{deps}]\n")
    with pytest.raises(SystemExit, match="no '>=' floor for numpy"):
        floors.floors(unpinned)
