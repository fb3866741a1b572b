"""`grpod.base.jsonsafe`: non-finite numbers survive JSON as strings, and come back as floats."""

from __future__ import annotations

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
