"""Check the floors of the code: core <- roles <- tools, the floors inside the core, and no circles.

- core: every module of `asyncps` outside the roles and the tools (wire contract, codec, rule
  types, placement, transport, rpc plumbing, cluster spec, configuration, security). It imports
  no role and no tool.
- roles: `asyncps.ps`, `asyncps.worker`, `asyncps.chief` (the folders ps/, worker/, chief/, mapped by
  pyproject's package-dir: scripts/pkglayout.py names every module as it is imported). A
  role imports the core and itself, never another role, never a tool.
- tools: `asyncps.tools`, benchmarks/, scripts/ may import anything.

Inside the core, every module stands on one of CORE_FLOORS and imports only its own floor and those
below. In asyncps/transport/ no module imports a transport's channel (TRANSPORT_CHANNELS) but the
registry and the package, which name them all. No module of the core, the roles or the tools
imports itself back through others (a circle), whatever floor each stands on.

Every import counts, including imports inside functions and under TYPE_CHECKING; only the circle
check leaves out imports under `if TYPE_CHECKING:` (they never run, and annotations naming each
other are how two types refer to each other). An import is an arrow to the module it names: `from
a.b import c` to the module a.b.c if there is one, else to a.b (a package's __init__, which Python
also runs for `import a.b.c`, is not counted: a package re-exporting its modules is no circle). The
bare names `ps`, `worker` and `chief` are never imported (the distribution claims only `asyncps`).

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
TOOLS = ("asyncps.tools", "asyncps.__main__", "benchmarks", "scripts")
BARE_ROLE_NAMES = ("ps", "worker", "chief")

# The floors inside the core, bottom up: a module imports its own floor and those below, never one
# above. An entry names a module or a package with everything under it; the longest entry naming a
# module places it (so wire's codec sits below the rules, and wire's shard types above them). The
# root package `asyncps` names only its own __init__: a new core module must be placed here.
CORE_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # errors, the generated protobuf, identities, deterministic placement, injected delays, TF_CONFIG,
    # process settings: they import nothing of the project
    ("ground", ("asyncps", "asyncps.errors", "asyncps.pb", "asyncps.identity", "asyncps.placement",
                "asyncps.delays", "asyncps.cluster", "asyncps.procenv", "asyncps.signals")),
    # tensors as arrays and as raw frames: what the rules compute on
    ("codec", ("asyncps.wire.codec", "asyncps.wire.frames", "asyncps.wire.stream")),
    # optimizers, staleness policies, consistency modes, the sync protocol's types
    ("rules", ("asyncps.rules",)),
    # the shard's answers as domain types (they carry the rules' DropReason, sync decisions) and the
    # one protobuf converter; the worker's side of the sync protocol speaks in those answers
    ("wire", ("asyncps.wire", "asyncps.rules.sync.client")),
    ("net", ("asyncps.net",)),  # gRPC plumbing, security, authz (names requests by wire.proto)
    ("transport", ("asyncps.transport",)),
    # TensorFlow's side (models, datasets, the user's code): nothing of the shard's floors reaches it
    ("ml", ("asyncps.ml",)),
    ("config", ("asyncps.config",)),  # RunConfig: names transports, rules, datasets and models
    ("rundir", ("asyncps.rundir",)),  # the run directory's files (the summary holds a RunConfig)
    ("runmodel", ("asyncps.runmodel",)),  # a run's data and model, from its RunConfig
)
ROOT_PACKAGE = "asyncps"

# A transport's channel: only the registry and the package (which name every transport) import it.
TRANSPORT_CHANNELS = ("asyncps.transport.tcp", "asyncps.transport.shm")
TRANSPORT_HUBS = ("asyncps.transport", "asyncps.transport.registry")

# Imports allowed to break the rules while a move is under way; the tests keep the list shrinking.
# (Empty: shared memory rings its doorbell over the framed connection, asyncps.net.framed, beside the
# tcp channel, no longer through it.)
KNOWN: frozenset[tuple[str, str]] = frozenset()


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


@dataclass(frozen=True)
class Statement:
    """One import statement: the module it names (relative imports resolved), the names a `from`
    import takes from it, and whether it stands under `if TYPE_CHECKING:`."""

    line: int
    target: str
    names: tuple[str, ...]
    type_checking: bool


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


def core_floor(module: str) -> int | None:
    """The index in CORE_FLOORS of a core module's floor (None: on no floor)."""
    best: tuple[int, int] | None = None  # (length of the entry, floor)
    for index, (_, entries) in enumerate(CORE_FLOORS):
        for entry in entries:
            names = module == entry if entry == ROOT_PACKAGE else _within(module, entry)
            if names and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes under an `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) body."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            found.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return found


def statements(path: Path, module: str) -> Iterator[Statement]:
    """Every import statement of the file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    guarded = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Statement(node.lineno, alias.name, (), id(node) in guarded)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield Statement(node.lineno, target, tuple(a.name for a in node.names), id(node) in guarded)


def imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in the file, wherever it stands, as the three floors see it."""
    for statement in statements(path, module):
        yield statement.line, statement.target
        for name in statement.names:  # `from asyncps import ps` imports the module asyncps.ps
            if floor_of(f"{statement.target}.{name}") != floor_of(statement.target):
                yield statement.line, f"{statement.target}.{name}"


def arrows(statement: Statement, known_modules: set[str]) -> Iterator[str]:
    """The project's modules a statement imports: `from a.b import c` the module a.b.c if there is
    one, else a.b; `import a.b.c` the longest of a.b.c, a.b, a that is a module."""
    for name in statement.names:
        if f"{statement.target}.{name}" in known_modules:
            yield f"{statement.target}.{name}"
        else:
            yield from _longest_module(statement.target, known_modules)
    if not statement.names:
        yield from _longest_module(statement.target, known_modules)


def _longest_module(name: str, known_modules: set[str]) -> Iterator[str]:
    """The longest of name, its parents that is a module of the project (none: third-party or stdlib)."""
    while name and name not in known_modules:
        name = name.rpartition(".")[0]
    if name:
        yield name


@dataclass(frozen=True)
class Arrow:
    """An import between two modules of the project, where it stands."""

    importer: str
    imported: str
    path: str
    line: int
    type_checking: bool


def project_arrows(root: Path) -> list[Arrow]:
    """Every import between two (different) modules of the project, the generated protobuf's own left out."""
    known_modules = {name for name, _ in modules(root)}
    found: list[Arrow] = []
    for module, path in modules(root, skip=frozenset({"asyncps.pb"})):
        rel = str(path.relative_to(root))
        for statement in statements(path, module):
            for imported in set(arrows(statement, known_modules)) - {module}:
                found.append(Arrow(module, imported, rel, statement.line, statement.type_checking))
    return found


def _floors_violation(module: str, imported: str) -> str | None:
    """Why an import breaks the three floors (None: it does not)."""
    importer, target = floor_of(module), floor_of(imported)
    if target == "outside" or importer in ("tool", "test"):
        return None
    if importer == "core" and target != "core":
        return "the core imports no role and no tool"
    if importer.startswith("role:") and target == "tool":
        return "a role imports no tool"
    if importer.startswith("role:") and target.startswith("role:") and target != importer:
        return "a role never imports another role"
    return None


def check_floors(root: Path) -> list[Violation]:
    """Every import that breaks core <- roles <- tools, or imports a role by its bare name."""
    found: list[Violation] = []
    for module, path in modules(root, skip=frozenset({"asyncps.pb"})):
        rel = str(path.relative_to(root))
        for line, imported in imports(path, module):
            top = imported.split(".")[0]
            if top in BARE_ROLE_NAMES:
                found.append(Violation(rel, line, module, imported, "import the role as asyncps." + top))
                continue
            why = _floors_violation(module, imported)
            if why:
                found.append(Violation(rel, line, module, imported, why))
    return found


def check_placed(root: Path) -> list[Violation]:
    """Every core module that stands on no floor of CORE_FLOORS."""
    return [Violation(str(path.relative_to(root)), 1, module, module,
                      "stands on no floor of the core: place it in CORE_FLOORS (scripts/check_layers.py)")
            for module, path in modules(root, skip=frozenset({"asyncps.pb"}))
            if floor_of(module) == "core" and core_floor(module) is None]


def check_core_floors(arrows_: list[Arrow]) -> list[Violation]:
    """Every import inside the core that runs up a floor."""
    found: list[Violation] = []
    for arrow in arrows_:
        if floor_of(arrow.importer) != "core" or floor_of(arrow.imported) != "core":
            continue
        low, high = core_floor(arrow.importer), core_floor(arrow.imported)
        if low is not None and high is not None and high > low:
            found.append(Violation(arrow.path, arrow.line, arrow.importer, arrow.imported,
                                   f"the {CORE_FLOORS[low][0]} floor of the core imports none above it "
                                   f"({CORE_FLOORS[high][0]})"))
    return found


def check_transports(arrows_: list[Arrow]) -> list[Violation]:
    """Every import of a transport's channel by another module of asyncps/transport/ but the hubs."""
    return [Violation(a.path, a.line, a.importer, a.imported,
                      "a transport never imports another transport's channel (only the registry names them all)")
            for a in arrows_
            if _within(a.importer, "asyncps.transport") and a.imported in TRANSPORT_CHANNELS
            and a.importer != a.imported and a.importer not in TRANSPORT_HUBS]


def check_circles(arrows_: list[Arrow]) -> list[Violation]:
    """One violation per import circle among the core, the roles and the tools (TYPE_CHECKING left out)."""
    graph: dict[str, dict[str, Arrow]] = {}
    for arrow in arrows_:
        if not arrow.type_checking and "test" not in (floor_of(arrow.importer), floor_of(arrow.imported)):
            graph.setdefault(arrow.importer, {}).setdefault(arrow.imported, arrow)
    found: list[Violation] = []
    for component in _strongly_connected(graph):
        circle = _shortest_circle(min(component), graph, component)
        first = graph[circle[0]][circle[1]]
        found.append(Violation(first.path, first.line, first.importer, first.imported,
                               "an import circle: " + " -> ".join(circle)))
    return found


def _strongly_connected(graph: dict[str, dict[str, Arrow]]) -> list[set[str]]:
    """The sets of modules on a circle, each the modules that reach each other."""
    reach = {module: _reachable(graph, module) for module in graph}
    found: list[set[str]] = []
    for module in sorted(graph):
        if module in reach[module] and not any(module in component for component in found):
            found.append({other for other in reach[module] if module in reach.get(other, set())})
    return found


def _reachable(graph: dict[str, dict[str, Arrow]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for successor in graph.get(todo.pop(), {}):
            if successor not in seen:
                seen.add(successor)
                todo.append(successor)
    return seen


def _shortest_circle(start: str, graph: dict[str, dict[str, Arrow]], component: set[str]) -> list[str]:
    """The shortest path of imports from `start` back to it, within its component: [start, ..., start]."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for successor in sorted(graph.get(node, {})):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor in component and successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise ValueError(f"{start} is in no circle")  # unreachable: a component's members reach each other


def check(root: Path, known: frozenset[tuple[str, str]] = frozenset()) -> list[Violation]:
    """Every import that breaks the floors or the transports' rule or closes a circle (but those in `known`)."""
    arrows_ = project_arrows(root)
    found = (check_floors(root) + check_placed(root) + check_core_floors(arrows_) + check_transports(arrows_)
             + check_circles(arrows_))
    return [v for v in found if (v.importer, v.imported) not in known]


def main(argv: list[str]) -> int:
    """Print the violations; exit 1 if there are any."""
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    violations = check(root, KNOWN)
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} import(s) break the layers (core <- roles <- tools, the core's floors, "
              "no circles)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
