"""Code the user brings: `package.module:function` specs for models, datasets, losses and metrics.

The chief and every worker load the same spec the same way (import the module, take the
attribute, call it with the keyword arguments it accepts), so they build the same model from the
same data. The module must be importable in every process: on the Python path, e.g. through
PYTHONPATH or `asyncps ... --user-path DIR` (asyncps.ml.userfns.add_user_path).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

#: Environment variable with directories (os.pathsep-separated) put on sys.path by every process.
USER_PATH_ENV = "ASYNCPS_USER_PATH"

_FUNCTION_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*")


def is_function_spec(spec: str, builtin_prefixes: Iterable[str] = ()) -> bool:
    """True for `package.module:function` (and not a built-in `name:args` spec such as `mlp:64`)."""
    head = spec.partition(":")[0]
    return bool(_FUNCTION_SPEC.fullmatch(spec)) and head not in set(builtin_prefixes)


def load_function(spec: str, what: str) -> Callable[..., Any]:
    """The callable a `package.module:function` spec names; ValueError saying what went wrong."""
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({error}); put its directory on "
                         f"PYTHONPATH or pass --user-path DIR") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what} {spec!r}: {attr!r} is not callable")
    return target  # type: ignore[no-any-return]


def call_with_accepted(fn: Callable[..., Any], **offered: Any) -> Any:
    """Call `fn` with those of the offered keyword arguments it accepts (all of them with **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(**offered)
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)}
    return fn(**{k: v for k, v in offered.items() if k in names})


def add_user_path(dirs: Iterable[str]) -> list[str]:
    """Put each directory (absolute) at the front of sys.path once; return the absolute paths."""
    added = []
    for d in dirs:
        if not d:
            continue
        path = os.path.abspath(d)
        if not os.path.isdir(path):
            raise ValueError(f"user path {d!r} is not a directory")
        if path not in sys.path:
            sys.path.insert(0, path)
        added.append(path)
    return added


def user_path_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """The directories of ASYNCPS_USER_PATH."""
    return [d for d in environ.get(USER_PATH_ENV, "").split(os.pathsep) if d]


__all__ = ["USER_PATH_ENV", "add_user_path", "call_with_accepted", "is_function_spec", "load_function",
           "user_path_from_env"]
