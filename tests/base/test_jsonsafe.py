"""`grpod.base.jsonsafe`: non-finite numbers survive JSON as strings, and come back as floats."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from grpod.base.jsonsafe import dumps, from_json, to_json


@dataclass
class Point:
    x: float
    ys: tuple[float, ...]


def test_non_finite_numbers_round_trip() -> None:
    value = {"loss": math.nan, "p": [Point(math.inf, (1.0, -math.inf))], "n": 3, "ok": True}
    text = dumps(value, sort_keys=True)
    assert json.loads(text) == {
        "loss": "nan",
        "n": 3,
        "ok": True,
        "p": [{"x": "inf", "ys": [1.0, "-inf"]}],
    }
    back = from_json(json.loads(text))
    assert math.isnan(back["loss"]) and back["p"][0] == {"x": math.inf, "ys": [1.0, -math.inf]}
    assert dumps({"a": 1.5}) == '{"a": 1.5}'
    assert to_json(-0.0) == 0.0 and from_json("infinity") == "infinity"  # only repr() spellings


class Level(enum.IntEnum):
    LOW = 1


class Ratio(float):
    pass


def test_subclasses_and_dataclass_classes_convert_as_their_base() -> None:
    """Exact built-in types take a fast path; their subclasses convert as the base does, a
    dataclass class (not an instance) is returned as it is, so is anything unknown."""
    marker = object()
    value = {"level": Level.LOW, "r": Ratio("nan"), "t": (Ratio(2.0),), "cls": Point, "o": marker}
    out = to_json(value)
    assert out["level"] is Level.LOW and out["r"] == "nan" and out["t"] == [2.0]
    assert out["cls"] is Point and out["o"] is marker
    assert to_json([Point(1.0, (math.nan,))]) == [{"x": 1.0, "ys": ["nan"]}]
    nested = {"a": [1.0]}
    copied = to_json(nested)
    assert copied == nested and copied["a"] is not nested["a"]  # containers are copied
