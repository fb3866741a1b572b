"""JSON for numbers that may not be finite: NaN and ±Infinity are the strings 'nan', 'inf',
'-inf' (JSON has neither, and a NaN loss is exactly what the store and the logs must keep).

`to_json` makes a JSON-ready copy, `from_json` turns those strings back into floats, `dumps`
serialises with a fast path for the usual all-finite value.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

NON_FINITE = ("nan", "inf", "-inf")  # repr() of the non-finite floats


def to_json(value: Any) -> Any:
    """A JSON-ready copy of `value`: non-finite floats as 'nan'/'inf'/'-inf', dataclass
    instances as dicts of their fields, tuples as lists; containers are copied (a snapshot a
    writer thread may serialise while its owner moves on), other values returned as they are.

    The exact built-in types are told apart by `type()` first, and a dataclass's field names
    are looked up once per class: the recorder's writer turns every step's report into JSON
    this way (~70 values a W1 step; `dataclasses.fields` alone was ~40 us of it a step)."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else repr(value)
    if kind in _AS_IS:
        return value
    if kind is list or kind is tuple:
        return [to_json(v) for v in value]
    if kind is dict:
        return {k: to_json(v) for k, v in value.items()}
    names = _field_names(kind)
    if names is not None:
        return {name: to_json(getattr(value, name)) for name in names}
    return _subclass_to_json(value)


_AS_IS = frozenset({int, str, bool, type(None)})


@functools.lru_cache(maxsize=256)
def _field_names(kind: type) -> tuple[str, ...] | None:
    """A dataclass's field names, in order (None: `kind` is not a dataclass)."""
    if not dataclasses.is_dataclass(kind):
        return None
    return tuple(f.name for f in dataclasses.fields(kind))


def _subclass_to_json(value: Any) -> Any:
    """`to_json` of a value whose type is none of the above: a subclass of float, int, str,
    list, tuple or dict (an IntEnum, numpy's float64), or anything else, returned as is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def from_json(value: Any) -> Any:
    """The inverse of `to_json` for numbers: 'nan'/'inf'/'-inf' strings become floats."""
    if isinstance(value, str):
        return float(value) if value in NON_FINITE else value
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    return value


def dumps(value: Any, **kw: Any) -> str:
    """`json.dumps` that writes non-finite floats as strings. One C pass when every float is
    finite (the usual case); the `to_json` rewrite only when one is not."""
    try:
        return json.dumps(value, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(to_json(value), **kw)
