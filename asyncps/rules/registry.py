"""One registry style for every kind of update rule: optimizers, staleness policies, modes.

An entry is a frozen dataclass whose fields are its typed parameters (int, float, or float | None
where None means "not set"), registered under a name. Every kind is chosen by one spec form:

    NAME                      every parameter at its default
    NAME:KEY=VALUE[,KEY=VALUE...]

e.g. `sync:backup=1`, `ssp:bound=2`, `dc-asgd:lambda=0.04`. Older positional spellings
(`drop:4`, `dc-asgd-a:2,0.9`) still parse: values without a key fill the parameters in order.
`canonical` writes the keyed form with the parameters at their defaults left out, so
`parse(canonical(x)) == x`. A malformed spec is a ValueError naming the kind, the spec and what is
allowed. The spec key of a field is its name unless the field says otherwise (`param(key=...)`).

Plugins: a name the registry does not know is looked up, in the process that parses the spec (the
shards included), first as an entry point of the kind's group (`asyncps.policies`,
`asyncps.optimizers`, `asyncps.modes`), then, when it has the form `package.module:Class`, by
importing the module. A plugin's spec is `package.module:Class[:KEY=VALUE,...]`; it travels on the
wire in that form, so every process needs the module on its Python path.

A process that parses specs it receives over the network (a shard: Initialize, Restore) parses
them within `plugin_modules_only(the modules its own command line names)` (`asyncps ps
--plugins`): there a `module:Class` name imports its module only when that module (or a package
holding it) is listed, else PluginNotAllowed says how to allow it. Installed entry points stay
allowed: installing a package is the machine owner's decision, not a caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import math
import re
import typing
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)

_NAME = re.compile(r"[a-z][a-z0-9_-]*")
# `package.module:Class`: a plugin named by where it lives (the module part has a dot or is one identifier).
_CLASS_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class PluginNotAllowed(ValueError):
    """A spec names a plugin module this shard was not started to load (see plugin_modules_only)."""


# None: any module a spec names is imported (a process parsing its own command line); else only these
# modules and their submodules (a shard parsing a request's spec: see plugin_modules_only).
_allowed_modules: ContextVar[frozenset[str] | None] = ContextVar("asyncps_plugin_modules", default=None)


def import_plugin_modules(modules: Iterable[str]) -> frozenset[str]:
    """Check and import the modules a shard's `--plugins` lists (a typo fails at start, not at the first
    Initialize); return them for plugin_modules_only."""
    names = frozenset(m.strip() for m in modules if m.strip())
    for name in sorted(names):
        if not _MODULE.fullmatch(name):
            raise ValueError(f"--plugins: {name!r} is not a module name (package.module)")
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ValueError(f"--plugins: cannot import {name}: {error} "
                             "(is its directory on PYTHONPATH / --user-path?)") from None
    return names


@contextlib.contextmanager
def plugin_modules_only(modules: frozenset[str]) -> Iterator[None]:
    """Within (this thread): a `module:Class` spec imports its module only when `modules` holds it or a
    package of it, else PluginNotAllowed. For specs that arrive over the network."""
    token = _allowed_modules.set(modules)
    try:
        yield
    finally:
        _allowed_modules.reset(token)


def plugin_module_allowed(module: str) -> bool:
    """Whether a `module:Class` spec may import module here and now."""
    allowed = _allowed_modules.get()
    return allowed is None or any(module == a or module.startswith(a + ".") for a in allowed)


def param(default: Any = dataclasses.MISSING, *, key: str = "", help: str = "") -> Any:
    """A dataclass field that is a spec parameter: its spec key (default: the field name) and help."""
    metadata = {"key": key, "help": help}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Param:
    """One parameter of a registered entry."""

    key: str  # as written in a spec
    field: str  # the dataclass field
    kind: type  # int or float
    optional: bool  # None is allowed (and then is the default: "not set")
    default: Any  # dataclasses.MISSING when the parameter is required
    help: str

    @property
    def required(self) -> bool:
        """True when a spec must give this parameter."""
        return self.default is dataclasses.MISSING

    def usage(self) -> str:
        """`key=INT` (required) or `key=FLOAT` with the default, for help texts."""
        return f"{self.key}={'INT' if self.kind is int else 'FLOAT'}"

    def default_text(self) -> str:
        """The default as written in a spec, 'required', or 'unset'."""
        if self.required:
            return "required"
        return "unset" if self.default is None else format_value(self.default)


@dataclass(frozen=True)
class Entry:
    """A registered class with its name, parameters and one-line summary (for help and docs/experiments.md)."""

    name: str
    cls: type
    params: tuple[Param, ...]
    plugin: bool = False  # loaded from outside asyncps (an entry point or `module:Class`)

    @property
    def summary(self) -> str:
        """The first line of the class docstring."""
        return (self.cls.__doc__ or "").strip().splitlines()[0] if self.cls.__doc__ else ""

    def usage(self) -> str:
        """`name` or `name[:key=INT,...]` (brackets when every parameter has a default)."""
        if not self.params:
            return self.name
        keys = ",".join(p.usage() for p in self.params)
        return f"{self.name}:{keys}" if any(p.required for p in self.params) else f"{self.name}[:{keys}]"


def format_value(value: int | float) -> str:
    """An int as is; a float as the shortest text float() reads back exactly, without '.0'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"spec values are numbers, got {value!r}")
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _parse_value(p: Param, text: str) -> int | float:
    """The typed value of one spec parameter; ValueError saying what was expected."""
    if not text or text != text.strip():
        raise ValueError(f"{p.key} needs a value, got {text!r}")
    if p.kind is int:
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise ValueError(f"{p.key} must be an integer, got {text!r}")
        return int(text)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{p.key} must be a number, got {text!r}") from None


def _cell(text: str) -> str:
    """Text for a markdown table cell: a '|' would end the cell."""
    return text.replace("|", "\\|")


def _params_of(cls: type) -> tuple[Param, ...]:
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: registered entries must be frozen dataclasses")
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        args = set(typing.get_args(hint))
        optional = type(None) in args
        kind = (args - {type(None)}).pop() if optional and len(args) == 2 else hint
        if kind not in (int, float):
            raise TypeError(f"{cls.__name__}.{f.name}: spec parameters are int, float or float | None")
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: spec parameters take plain defaults")
        key = str(f.metadata.get("key") or f.name)
        params.append(Param(key, f.name, kind, optional, default, str(f.metadata.get("help", ""))))
    return tuple(params)


class Registry(Generic[T]):
    """Named classes of one kind (e.g. "staleness policy"), built from spec strings."""

    def __init__(self, kind: str, base: type, group: str = "") -> None:
        # `base` is the kind's (usually abstract) base class; entries must subclass it. `group`: the
        # entry-point group where installed plugins of this kind are found ("" for none).
        self.kind = kind
        self.base = base
        self.group = group
        self._entries: dict[str, Entry] = {}
        self._names: dict[type, str] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: register a frozen dataclass (a subclass of the kind's base) as `name`."""

        def add(cls: C) -> C:
            if not _NAME.fullmatch(name):
                raise ValueError(f"{self.kind} name {name!r}: lowercase letters, digits, '-' and '_'")
            self._add(name, cls)
            return cls

        return add

    def _add(self, name: str, cls: type, plugin: bool = False) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        entry = Entry(name, cls, _params_of(cls), plugin)
        if not isinstance(cls, type) or not issubclass(entry.cls, self.base):
            raise TypeError(f"{getattr(cls, '__name__', cls)!r} is not a {self.base.__name__}")
        self._entries[name] = entry
        # A plugin is spelled by the name it was loaded under: that is what other processes can load.
        self._names[entry.cls] = name

    def _load(self, name: str) -> bool:
        """Register the plugin `name` names (an entry point, or `module:Class`); False if none does.

        A plugin that exists but cannot be loaded (import error, not a frozen dataclass of this
        kind) is a ValueError that says so, never a silent "unknown".
        """
        if name in self._entries:
            return True
        target = self._entry_point(name) if _NAME.fullmatch(name) else None
        if target is None and not _CLASS_PATH.fullmatch(name):
            return False
        where = target or name
        module_name, _, attr = where.partition(":")
        if target is None and not plugin_module_allowed(module_name):
            allowed = ",".join(sorted(_allowed_modules.get() or ())) or "none"
            raise PluginNotAllowed(
                f"{self.kind} plugin {name!r}: this process imports plugin modules only from its --plugins "
                f"(now: {allowed}), never because a request names one; to allow it, start the shard with "
                f"--plugins {module_name} (env ASYNCPS_PLUGINS)"
                + (f", or install the plugin as an entry point of {self.group}" if self.group else ""))
        try:
            module = importlib.import_module(module_name)
            cls = module
            for part in attr.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{self.kind} plugin {name!r} ({where}) cannot be loaded: {error} "
                             "(is its directory on PYTHONPATH / --user-path?)") from None
        try:
            self._add(name, cls, plugin=True)  # type: ignore[arg-type]  # checked by _add
        except TypeError as error:
            raise ValueError(f"{self.kind} plugin {name!r}: {error}") from None
        return True

    def _entry_point(self, name: str) -> str | None:
        """`module:attr` of the installed entry point `name` in this kind's group, if any."""
        if not self.group:
            return None
        for ep in importlib.metadata.entry_points(group=self.group):
            if ep.name == name:
                return str(ep.value)
        return None

    def _split_name(self, spec: str) -> tuple[str, str, str]:
        """(name, colon, parameters) of a spec, where a plugin's name `module:Class` has a colon too."""
        head, colon, rest = spec.partition(":")
        if colon and head not in self._entries and (not _NAME.fullmatch(head) or self._entry_point(head) is None):
            cls_name, colon2, rest2 = rest.partition(":")
            if cls_name.isidentifier():  # else `name:values` of an unknown name, reported as such
                return f"{head}:{cls_name}", colon2, rest2
        return head, colon, rest

    def module_of(self, spec: str) -> str | None:
        """The module a `package.module:Class[:...]` spec imports; None for a built-in or an entry point."""
        name = self._split_name(spec)[0]
        return name.partition(":")[0] if _CLASS_PATH.fullmatch(name) else None

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register one of their own)."""
        entry = self._entries.pop(name)
        del self._names[entry.cls]

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def entries(self) -> tuple[Entry, ...]:
        """Every registered entry, in registration order."""
        return tuple(self._entries.values())

    def entry(self, name: str) -> Entry:
        """The entry registered (or loadable as a plugin) as `name` (ValueError naming the valid ones)."""
        if not isinstance(name, str) or not self._load(name):
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {self.usage()}")
        return self._entries[name]

    def usage(self) -> str:
        """Every accepted form, e.g. `async | sync[:backup=INT] | ssp[:bound=INT]`."""
        return " | ".join(e.usage() for e in self._entries.values())

    def split(self, spec: str, extra: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
        """(name, {key: text}) of a spec, positional values given the keys in order.

        `extra`: keys accepted (keyed only) besides the entry's parameters, left to the caller.
        """
        if not isinstance(spec, str):
            raise ValueError(f"a {self.kind} spec is a string, got {spec!r}")
        name, colon, rest = self._split_name(spec)
        if not self._load(name):
            where = "" if name == spec else f" in {spec!r}"
            raise ValueError(f"unknown {self.kind} {name!r}{where}; valid: {self.usage()} or a plugin "
                             f"(an entry point of {self.group or 'no group'}, or package.module:Class)")
        entry = self._entries[name]
        if not colon:
            return name, {}
        try:
            return name, self._items(entry, rest, extra)
        except ValueError as error:
            raise ValueError(f"{self.kind} {spec!r}: {error}; valid: {entry.usage()}") from None

    @staticmethod
    def _items(entry: Entry, rest: str, extra: tuple[str, ...]) -> dict[str, str]:
        keys = [*extra, *(p.key for p in entry.params)]
        if not keys:
            raise ValueError(f"{entry.name} takes no parameters")
        values: dict[str, str] = {}
        keyed = False
        for position, item in enumerate(rest.split(",")):
            key, eq, text = item.partition("=")
            if not eq:  # positional (the older spellings): the next parameter in order
                if keyed:
                    raise ValueError("a value without a key after key=value items")
                if position >= len(entry.params):
                    raise ValueError(f"{entry.name} takes at most {len(entry.params)} positional value(s); keys: "
                                     f"{', '.join(keys)}")
                key, text = entry.params[position].key, item
            else:
                keyed = True
                if key not in keys:
                    raise ValueError(f"unknown key {key!r}; {entry.name} takes: {', '.join(keys)}")
            if key in values:
                raise ValueError(f"{key} given twice")
            values[key] = text
        return values

    def parse(self, spec: str) -> T:
        """Build the entry a spec names, with its parameters (ValueError when malformed)."""
        name, texts = self.split(spec)
        entry = self._entries[name]
        kwargs: dict[str, Any] = {}
        try:
            for p in entry.params:
                if p.key in texts:
                    kwargs[p.field] = _parse_value(p, texts[p.key])
                elif p.required:
                    raise ValueError(f"{name} needs {p.usage()}")
            item: T = entry.cls(**kwargs)
        except ValueError as error:
            raise ValueError(f"{self.kind} {spec!r}: {error}; valid: {entry.usage()}") from None
        return item

    def name_of(self, item: T) -> str:
        """The name `item`'s class is registered under."""
        try:
            return self._names[type(item)]
        except KeyError:
            raise ValueError(f"{type(item).__name__} is not a registered {self.kind}") from None

    def canonical(self, item: T) -> str:
        """The canonical spec: keyed, parameters at their defaults left out; parse() rebuilds `item`."""
        name = self.name_of(item)
        shown = []
        for p in self._entries[name].params:
            value = getattr(item, p.field)
            if p.required or value != p.default:
                if value is None:
                    continue
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{self.kind} {name}: {p.key} is not finite")
                shown.append(f"{p.key}={format_value(value)}")
        return f"{name}:{','.join(shown)}" if shown else name

    def normalize(self, spec: str) -> str:
        """The canonical form of a spec (ValueError when malformed)."""
        return self.canonical(self.parse(spec))

    def markdown(self) -> str:
        """A markdown table of every built-in entry (plugins loaded so far are left out): spec,
        parameters with defaults, summary."""
        lines = [f"| {self.kind} | parameters (default) | what it does |", "|---|---|---|"]
        for e in self._entries.values():
            if e.plugin:
                continue
            params = "<br>".join(
                f"`{p.key}` ({p.default_text()}): {p.help}".rstrip(": ") for p in e.params
            ) or "—"
            lines.append("| " + " | ".join(_cell(c) for c in (f"`{e.name}`", params, e.summary)) + " |")
        return "\n".join(lines)
