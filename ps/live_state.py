"""The live part of a shard's state, which a snapshot leaves out, encoded for a backup seeded from a live
primary (asyncps.ps.replica): the consistency mode's state (a sync follower's staged gradients, a
coordinator's pending step and decisions, SSP's clocks, the K-variants' accumulations), the values each
worker read (staleness policies that correct with them), the retry memo of each worker's last push, the
drops by reason and the row clocks of tables read by rows. A checkpoint starts all of them over; a backup
must hold them to give the primary's next answers.

The encoding is a JSON tree, not a pickle: plain values (None, bools, ints, floats, strings), containers
tagged with their type (list, tuple, set, frozenset, dict, OrderedDict), numpy scalars, arrays by index
into the tensors that ride beside the tree (the wire's dtypes only), enum members and instances of the
classes `live_classes` names (the store's, the mode's own and those it names: Consistency.state_types),
rebuilt field by field without calling any code the sender names. A tree
that names anything else is refused (InvalidArgumentError); the store then checks the decoded mode against
the one its rule starts (`check_mode`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from asyncps.ps.policy_state import ReadValues

from asyncps.errors import InvalidArgumentError
from asyncps.rules.consistency import Consistency, RetryMemo
from asyncps.rules.drops import DropReason
from asyncps.wire.codec import Array, IndexArray, SparseRows
from asyncps.wire.shard import LiveBlob, PushOutcome, RowStaleness


@dataclasses.dataclass
class LiveState:
    """What a live shard state holds beyond its snapshot (ShardStore.attach_journal)."""

    mode: Consistency
    reads: ReadValues
    last_pushes: RetryMemo[PushOutcome]
    last_commits: RetryMemo[PushOutcome]
    dropped_by_reason: dict[str, int]
    clocks: dict[str, tuple[IndexArray, int]]  # tables read by rows: name -> (row clocks, updates when made)


# the classes every live state may hold: its own parts and the store's (the mode's class and the classes it
# names, Consistency.state_types, come beside them: the store never names a mode)
STORE_CLASSES: tuple[type, ...] = (LiveState, ReadValues, RetryMemo, PushOutcome, RowStaleness, SparseRows, DropReason)
_DTYPES = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", "int32", "int64"))
_SCALAR_KINDS = frozenset("fiub")
_CONTAINERS: dict[str, Callable[[list[Any]], Any]] = {"l": list, "t": tuple, "s": set, "f": frozenset}


def live_classes(mode: type[Consistency]) -> dict[str, type]:
    """The classes a live state of `mode` may hold, by name."""
    return {_name(c): c for c in (*STORE_CLASSES, mode, *mode.state_types)}


def encode_live(state: LiveState) -> LiveBlob:
    """The state as a tree and its arrays (copies: the state goes on changing). TypeError naming what
    cannot be sent (a class neither the store's nor named by the mode: live_classes)."""
    arrays: list[Array] = []
    allowed = frozenset(live_classes(type(state.mode)).values())

    def enc(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)) or type(x) in (int, float):
            return x
        if isinstance(x, np.ndarray):
            if x.dtype not in _DTYPES:
                raise TypeError(f"an array of {x.dtype} cannot be sent")
            arrays.append(np.array(x, copy=True, order="C"))
            return {"a": len(arrays) - 1}
        if isinstance(x, np.generic):
            return {"n": [x.dtype.str, x.item()]}
        if isinstance(x, enum.Enum) and type(x) in allowed:
            return {"e": _name(type(x)), "m": x.name}
        if isinstance(x, collections.OrderedDict):
            return {"o": [[enc(k), enc(v)] for k, v in x.items()]}
        if type(x) is dict:
            return {"d": [[enc(k), enc(v)] for k, v in x.items()]}
        for tag, kind in _CONTAINERS.items():
            if type(x) is kind:  # a set's members in one order whatever its history (one state, one tree)
                items = [enc(v) for v in x]
                return {tag: sorted(items, key=json.dumps) if tag in ("s", "f") else items}
        if type(x) in allowed:
            return {"c": _name(type(x)), "v": {k: enc(v) for k, v in _fields(x).items()}}
        raise TypeError(f"a {type(x).__module__}.{type(x).__qualname__} cannot be sent in a live state")

    tree = json.dumps(enc(state), separators=(",", ":")).encode()
    return LiveBlob(tree, tuple(arrays))


def decode_live(blob: LiveBlob, mode: type[Consistency]) -> LiveState:
    """The state a tree and its arrays encode, of a shard whose rule runs `mode`; InvalidArgumentError on
    anything else (a class live_classes(mode) does not name included)."""
    used: set[int] = set()
    by_name = live_classes(mode)

    def _class(name: Any) -> type:
        cls = by_name.get(name) if isinstance(name, str) else None
        if cls is None:
            raise InvalidArgumentError(f"a live state names the class {str(name)[:80]!r}, which is not one a "
                                       f"{mode.__qualname__} shard's state may hold")
        return cls

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str, int, float)):
            return x
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise InvalidArgumentError(f"a live state's node must be a plain value or a tagged one, got "
                                       f"{str(x)[:80]}")
        if "a" in x:
            index = x["a"]
            if type(index) is not int or not 0 <= index < len(blob.arrays) or index in used:
                raise InvalidArgumentError(f"a live state names array {index!r} of {len(blob.arrays)}")
            used.add(index)
            return np.array(blob.arrays[index], copy=True)
        if "n" in x:
            dtype, value = _pair(x["n"], "n")
            kind = np.dtype(dtype) if isinstance(dtype, str) and len(dtype) < 8 else None
            if kind is None or kind.kind not in _SCALAR_KINDS or isinstance(value, (str, list, dict)):
                raise InvalidArgumentError(f"a live state's scalar {str(x)[:80]} is not a number of a known type")
            return kind.type(value)
        if "e" in x:
            cls = _class(x["e"])
            if not issubclass(cls, enum.Enum) or not isinstance(x.get("m"), str) or x["m"] not in cls.__members__:
                raise InvalidArgumentError(f"a live state names no member {str(x)[:80]}")
            return cls[x["m"]]
        if "c" in x:
            cls = _class(x["c"])
            fields = x.get("v")
            if issubclass(cls, enum.Enum) or not isinstance(fields, dict) or not all(
                    isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in fields):
                raise InvalidArgumentError(f"a live state's {cls.__qualname__} needs its fields by name")
            if dataclasses.is_dataclass(cls):
                names = {f.name for f in dataclasses.fields(cls)}
                if set(fields) != names:
                    raise InvalidArgumentError(f"a live state's {cls.__qualname__} has the fields {sorted(names)}, "
                                               f"not {sorted(fields)[:20]}")
            obj = object.__new__(cls)
            for key, value in fields.items():
                object.__setattr__(obj, key, dec(value))
            try:
                getattr(obj, "__post_init__", lambda: None)()  # a dataclass's own checks
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(f"a live state's {cls.__qualname__}: {exc}") from None
            return obj
        (tag, items), = x.items()
        if not isinstance(items, list):
            raise InvalidArgumentError(f"a live state's {tag!r} node holds no list")
        if tag in ("d", "o"):
            pairs = [_pair(item, tag) for item in items]
            made = collections.OrderedDict() if tag == "o" else {}
            for k, v in pairs:
                made[_hashable(dec(k))] = dec(v)
            return made
        if tag in _CONTAINERS:
            values = [dec(v) for v in items]
            return _CONTAINERS[tag]([_hashable(v) for v in values] if tag in ("s", "f") else values)
        raise InvalidArgumentError(f"a live state's node tagged {tag!r}: not one of a, n, e, c, d, o, l, t, s, f")

    try:
        state = dec(json.loads(blob.tree))
    except (ValueError, RecursionError) as exc:  # not JSON, or nested beyond reason
        raise InvalidArgumentError(f"a live state that is not one: {type(exc).__name__}: {str(exc)[:120]}") from None
    if not isinstance(state, LiveState) or len(used) != len(blob.arrays):
        raise InvalidArgumentError(f"a live state must be one LiveState using each of its {len(blob.arrays)} "
                                   f"arrays once, got a {type(state).__qualname__} using {len(used)}")
    return state


def check_mode(got: Consistency, fresh: Consistency) -> None:
    """InvalidArgumentError unless `got` is a state of the mode `fresh` is (started by the store's rule):
    the same class and worker count, the same fields, each of the same type as the fresh one's or None."""
    if type(got) is not type(fresh) or got.num_workers != fresh.num_workers:
        raise InvalidArgumentError(f"a live mode state {type(got).__qualname__} of {got.num_workers} workers "
                                   f"for a shard whose rule runs {type(fresh).__qualname__} of {fresh.num_workers}")
    mine, theirs = vars(fresh), vars(got)
    if set(mine) != set(theirs):
        raise InvalidArgumentError(f"a live mode state with the fields {sorted(theirs)[:20]}, not {sorted(mine)}")
    for key, value in mine.items():
        if value is not None and theirs[key] is not None and type(theirs[key]) is not type(value):
            raise InvalidArgumentError(f"a live mode state's {key} is a {type(theirs[key]).__qualname__}, not a "
                                       f"{type(value).__qualname__}")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fields(x: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(x):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return dict(vars(x))


def _pair(item: Any, tag: str) -> tuple[Any, Any]:
    if not isinstance(item, list) or len(item) != 2:
        raise InvalidArgumentError(f"a live state's {tag!r} node holds {str(item)[:80]}, not a pair")
    return item[0], item[1]


def _hashable(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        raise InvalidArgumentError(f"a live state's key or set member {str(x)[:80]} is not hashable") from None
    return x


__all__ = ["STORE_CLASSES", "LiveState", "check_mode", "decode_live", "encode_live", "live_classes"]
