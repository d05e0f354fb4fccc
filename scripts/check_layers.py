"""Check the three floors of the code: core <- roles <- tools.

- core: every module of `asyncps` outside the roles and the tools (wire contract, codec, rule
  types, placement, transport, rpc plumbing, cluster spec, configuration, security). It imports
  no role and no tool.
- roles: `asyncps.ps`, `asyncps.worker`, `asyncps.chief` (the folders ps/, worker/, chief/, mapped by
  pyproject's package-dir: scripts/pkglayout.py names every module as it is imported). A
  role imports the core and itself, never another role, never a tool.
- tools: `asyncps.tools`, benchmarks/, scripts/ may import anything.

Every import counts, including imports inside functions and under TYPE_CHECKING. The bare names
`ps`, `worker` and `chief` are never imported (the distribution claims only `asyncps`).

Usage: python scripts/check_layers.py [ROOT]   (exit 1 and one line per violation)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pkglayout import modules

ROLES = ("asyncps.ps", "asyncps.worker", "asyncps.chief")
TOOLS = ("asyncps.tools", "benchmarks", "scripts")
BARE_ROLE_NAMES = ("ps", "worker", "chief")


@dataclass(frozen=True)
class Violation:
    """One import that crosses the floors the wrong way."""

    path: str
    line: int
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}: {self.why}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_of(module: str) -> str:
    """'core', 'role:<name>', 'tool', 'test' or 'outside' (third-party and stdlib)."""
    for role in ROLES:
        if _within(module, role):
            return "role:" + role
    if any(_within(module, tool) for tool in TOOLS):
        return "tool"
    if _within(module, "tests"):
        return "test"
    if _within(module, "asyncps"):
        return "core"
    return "outside"


def imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # `from asyncps import ps` imports the module asyncps.ps
                if floor_of(f"{target}.{alias.name}") != floor_of(target):
                    yield node.lineno, f"{target}.{alias.name}"


# Imports allowed to break the floors while a move is under way (none now); the tests keep it honest.
KNOWN: frozenset[tuple[str, str]] = frozenset()


def check(root: Path, known: frozenset[tuple[str, str]] = frozenset()) -> list[Violation]:
    """Every import in the tree that breaks the floors (but those in `known`)."""
    found: list[Violation] = []
    for module, path in modules(root, skip=frozenset({"asyncps.pb"})):
        importer = floor_of(module)
        rel = str(path.relative_to(root))
        for line, imported in imports(path, module):
            top = imported.split(".")[0]
            if top in BARE_ROLE_NAMES:
                found.append(Violation(rel, line, module, imported, "import the role as asyncps." + top))
                continue
            target = floor_of(imported)
            if (module, imported) in known or target == "outside" or importer in ("tool", "test"):
                continue
            if importer == "core" and target != "core":
                found.append(Violation(rel, line, module, imported, "the core imports no role and no tool"))
            elif importer.startswith("role:") and target == "tool":
                found.append(Violation(rel, line, module, imported, "a role imports no tool"))
            elif importer.startswith("role:") and target.startswith("role:") and target != importer:
                found.append(Violation(rel, line, module, imported, "a role never imports another role"))
    return found


def main(argv: list[str]) -> int:
    """Print the violations; exit 1 if there are any."""
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    violations = check(root, KNOWN)
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} import(s) break the layers (core <- roles <- tools)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
