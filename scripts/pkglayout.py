"""Where each Python module of the project lives on disk, read from pyproject.toml.

The distribution is one import name, `asyncps`; its role subpackages sit at the top of the
repository (`ps/`, `worker/`, `chief/`) and pyproject's `[tool.setuptools.package-dir]` maps them to
`asyncps.ps`, `asyncps.worker` and `asyncps.chief`. That table is the one place the mapping is
written: setuptools builds the wheel and the editable install from it, and the layering check
(check_layers.py) and the type check (typecheck.py) read it here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Top-level folders that are not installed but are checked like the package.
EXTRA_SOURCES = ("benchmarks", "scripts", "tests")
SKIP_DIRS = {"__pycache__"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each installed package's folder: the mapped ones from package-dir, the rest under asyncps/."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setuptools.get("package-dir", {})
    found: dict[str, Path] = {}
    for package in setuptools["packages"]:
        owner = max((m for m in mapped if package == m or package.startswith(m + ".")), key=len, default="")
        if owner:
            rest = package[len(owner):].lstrip(".").split(".") if package != owner else []
            found[package] = root.joinpath(mapped[owner], *[p for p in rest if p])
        else:
            found[package] = root.joinpath(*package.split("."))
    return found


def source_roots(root: Path = ROOT) -> dict[str, Path]:
    """The folder of every top-level module name the checks cover: packages as installed, and the extras."""
    roots = {name: path for name, path in package_dirs(root).items()}
    roots.update({name: root / name for name in EXTRA_SOURCES if (root / name).is_dir()})
    return roots


def modules(root: Path = ROOT, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, Path]]:
    """(module name, path) of each Python file, each exactly once, under the name it is imported by.

    A package's own files are named under it; a sub-folder that is a package of its own is named
    where that package is (so a mapped role folder is never reached twice). `skip`: package names
    left out with everything under them.
    """
    roots = source_roots(root)
    claimed = {path.resolve() for path in roots.values()}
    for package, folder in sorted(roots.items()):
        if not folder.is_dir() or any(package == s or package.startswith(s + ".") for s in skip):
            continue
        for path in sorted(folder.glob("*.py")):
            stem = path.stem
            yield (package if stem == "__init__" else f"{package}.{stem}"), path
        if package in EXTRA_SOURCES:  # not installed: every sub-folder belongs to it
            for path in sorted(folder.rglob("*/*.py")):
                rel = path.relative_to(folder)
                if SKIP_DIRS & set(rel.parts) or any(p.resolve() in claimed for p in path.parents if p != folder):
                    continue
                parts = [package, *rel.with_suffix("").parts]
                if parts[-1] == "__init__":
                    parts.pop()
                yield ".".join(parts), path


def unlisted_packages(root: Path = ROOT) -> list[str]:
    """Folders with an __init__.py inside an installed package that pyproject does not list."""
    dirs = package_dirs(root)
    listed = {path.resolve() for path in dirs.values()}
    missing = []
    for package, folder in dirs.items():
        for init in folder.glob("*/__init__.py"):
            if init.parent.resolve() not in listed and init.parent.name not in SKIP_DIRS:
                missing.append(f"{package}.{init.parent.name}")
    return sorted(missing)
