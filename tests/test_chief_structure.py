"""The chief's classes declare their state in one place: every attribute is assigned in
`__init__` (a placeholder where the value arrives later), and nothing reads or writes `self`
through getattr/setattr/hasattr with a name and a default."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tests.conftest import REPO_ROOT

DYNAMIC = ("getattr", "setattr", "hasattr")


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _self_name(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    decorators = {d.id for d in method.decorator_list if isinstance(d, ast.Name)}
    if decorators & {"staticmethod", "classmethod"} or not method.args.args:
        return None
    return method.args.args[0].arg


def _assigned(method: ast.FunctionDef | ast.AsyncFunctionDef, self_name: str) -> list[tuple[str, int]]:
    """Attributes of `self_name` the method stores to (plain, annotated, augmented, unpacking, for, with)."""
    return [(node.attr, node.lineno) for node in ast.walk(method)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == self_name]


def check_module(path: Path) -> list[str]:
    """One line per violation in a module: an attribute first assigned outside `__init__`, or a
    getattr/setattr/hasattr on `self`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    violations: list[str] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        declared: set[str] = set()
        if _is_dataclass(cls):  # the generated __init__ assigns the fields
            declared |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
                         and isinstance(n.target, ast.Name)}
        for method in methods:
            self_name = _self_name(method)
            if method.name == "__init__" and self_name is not None:
                declared |= {name for name, _ in _assigned(method, self_name)}
        for method in methods:
            self_name = _self_name(method)
            if self_name is None:
                continue
            if method.name != "__init__":
                for name, line in _assigned(method, self_name):
                    if name not in declared:
                        violations.append(f"{path.name}:{line}: {cls.name}.{method.name} assigns "
                                          f"{self_name}.{name}, which __init__ does not")
            for node in ast.walk(method):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DYNAMIC
                        and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == self_name):
                    violations.append(f"{path.name}:{node.lineno}: {cls.name}.{method.name} calls "
                                      f"{node.func.id}({self_name}, ...)")
    return violations


def check_tree(folder: Path) -> tuple[int, list[str]]:
    """(classes checked, violations) over every module of a folder."""
    classes, violations = 0, []
    for path in sorted(folder.glob("*.py")):
        classes += sum(isinstance(n, ast.ClassDef) for n in ast.walk(ast.parse(path.read_text())))
        violations += check_module(path)
    return classes, violations


def test_every_chief_attribute_is_assigned_in_init() -> None:
    classes, violations = check_tree(REPO_ROOT / "chief")
    assert violations == []
    assert classes >= 10  # the walk saw the chief's classes (not an empty or moved folder)


def test_the_check_catches_late_attributes_and_getattr_defaults(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        class Late:
            def __init__(self) -> None:
                self.ready = False

            def start(self) -> None:
                self.ready = True            # declared: fine
                self.server = object()       # first assigned here
                self.a, (self.b, self.ready) = 1, (2, True)

            def poll(self) -> float:
                self.count += 1              # augmented, never declared
                return getattr(self, "last", 0.0)
    """))
    assert check_module(bad) == [
        "bad.py:8: Late.start assigns self.server, which __init__ does not",
        "bad.py:9: Late.start assigns self.a, which __init__ does not",
        "bad.py:9: Late.start assigns self.b, which __init__ does not",
        "bad.py:12: Late.poll assigns self.count, which __init__ does not",
        "bad.py:13: Late.poll calls getattr(self, ...)",
    ]
    assert check_tree(tmp_path)[1] == check_module(bad)


def test_the_check_accepts_declared_state(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("""
        from dataclasses import dataclass, field

        @dataclass
        class Counters:
            done: bool = False
            seen: list[int] = field(default_factory=list)

            def finish(self) -> None:
                self.done = True

        class Server:
            def __init__(self) -> None:
                self._server: object | None = None
                self.port, self.host = 0, ""

            def start(self) -> None:
                self._server = object()
                self.port += 1

            @staticmethod
            def make(self_like: object) -> object:
                return getattr(self_like, "x", None)
    """))
    assert check_module(good) == []
