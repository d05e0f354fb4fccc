"""The README's tables stay true to the code: every RPC of both services is listed."""

from __future__ import annotations

import re
from pathlib import Path

from asyncps.pb import coordinator_pb2, ps_pb2

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_rpc_table_lists_every_shard_rpc_and_no_other() -> None:
    text = README.read_text()
    section = text[text.index("### The shard service"):]
    section = section[:section.index("\n\n**")]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    methods = [m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods]
    assert sorted(listed) == sorted(methods)


def test_every_coordinator_rpc_is_named() -> None:
    text = README.read_text()
    for method in coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].methods:
        assert f"`{method.name}`" in text, method.name
