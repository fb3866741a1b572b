"""The guards' rolling statistics: `Window` and `PairedWindow` keep exact sums as values come
and go, so a mean, std or correlation read every step equals the one computed from the window's
values afresh, at the same cost for any window size."""

from __future__ import annotations

import math
import random

import pytest

from grpod.guards.base import PairedWindow, Window
from grpod.guards.trend import trend


def fresh_mean_std(values: list[float]) -> tuple[float, float]:
    """Two passes over the values, each sum exact (fsum): the reference."""
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def test_a_sliding_window_matches_its_values_computed_afresh() -> None:
    rng = random.Random(7)
    window = Window(50)
    for step in range(2000):  # scales from 1e-6 to 1e6: the sums refine their unit as they go
        window.append(rng.lognormvariate(0.0, 1.0) * 10.0 ** rng.randint(-6, 6))
        if step % 97 == 96 or step > 1990:
            mean, std = fresh_mean_std(list(window.values))
            assert window.mean() == pytest.approx(mean, rel=1e-15)
            assert window.mean_std() == pytest.approx((mean, std), rel=1e-12)
    assert len(window) == 50


def test_the_mean_is_the_exact_mean_rounded_once() -> None:
    window = Window(3, [0.1, 0.2, 0.3])
    assert window.mean() == 0.2  # 0.1 + 0.2 + 0.3 in floats is 0.6000000000000001
    assert Window(4, [1e16, 1.0, -1e16, 1.0]).mean() == 0.5  # naive sums lose the 1.0s
    assert Window(8, [7.25] * 8).mean_std() == (7.25, 0.0)  # a flat window: exactly no spread


def test_a_non_finite_value_reads_nan_until_it_leaves() -> None:
    window = Window(2, [1.0, math.inf])
    assert all(math.isnan(x) for x in window.mean_std())
    window.append(2.0)  # the 1.0 leaves; the inf is still in
    assert math.isnan(window.mean())
    window.append(4.0)
    assert window.mean_std() == (3.0, 1.0)
    assert math.isnan(Window(3).mean())
    empty = Window(0, [1.0, 2.0])
    empty.append(3.0)
    assert len(empty) == 0 and math.isnan(empty.mean())


def test_resize_and_keep_restart_the_sums_from_the_kept_values() -> None:
    window = Window(4, [-1.0, 2.0, -3.0, 4.0])
    window.keep(lambda v: v > 0)
    assert list(window.values) == [2.0, 4.0] and window.mean_std() == (3.0, 1.0)
    window.resize(1)
    assert list(window.values) == [4.0] and window.mean_std() == (4.0, 0.0)


def test_a_spread_beyond_the_largest_float_reads_infinite() -> None:
    assert Window(2, [-1e300, 1e300]).mean_std() == (0.0, math.inf)


def reference_pearson(xs: list[float], ys: list[float]) -> float:
    """Two-pass Pearson in floats, each sum exact (fsum): the reference."""
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = math.fsum((x - mx) ** 2 for x in xs), math.fsum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy)


def test_paired_window_correlation_matches_pearson_over_its_values() -> None:
    rng = random.Random(3)
    pairs = PairedWindow(64)
    for step in range(600):
        x = rng.lognormvariate(0.0, 2.0)
        pairs.append(x, 0.3 * x + rng.gauss(0.0, 1.0) * 10.0 ** rng.randint(-3, 3))
        if step % 53 == 52 or step > 595:
            expected = reference_pearson(list(pairs.x.values), list(pairs.y.values))
            assert pairs.pearson() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(pairs) == 64


def test_paired_window_edge_cases() -> None:
    assert PairedWindow(4, [1.0], [2.0]).pearson() is None  # one pair
    assert PairedWindow(4, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).pearson() is None  # no variance
    assert PairedWindow(4, [1e8 + 1, 1e8 + 2, 1e8 + 3], [3.0, 2.0, 1.0]).pearson() == -1.0
    assert PairedWindow(4, [1.0, math.nan, 3.0], [1.0, 2.0, 3.0]).pearson() is None
    grown = PairedWindow(2, [5.0, 1.0], [1.0, 2.0])
    grown.resize(3)
    grown.append(3.0, 3.0)
    assert grown.pearson() == pytest.approx(reference_pearson([5.0, 1.0, 3.0], [1.0, 2.0, 3.0]))


def reference_trend(values: list[float]) -> tuple[float, float]:
    """(slope, t) by the textbook formulas, one generator pass each."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, math.fsum(values) / n
    sxx = math.fsum((i - mean_x) ** 2 for i in range(n))
    slope = math.fsum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sxx
    ssr = math.fsum((v - mean_y - slope * (i - mean_x)) ** 2 for i, v in enumerate(values))
    return slope, slope / math.sqrt(ssr / (n - 2) / sxx)


def test_trend_matches_the_textbook_formulas() -> None:
    rng = random.Random(11)
    for n in (3, 4, 17, 32, 200):
        values = [0.01 * i + rng.gauss(0.0, 0.5) for i in range(n)]
        fit = trend(values)
        assert (fit.slope, fit.t) == pytest.approx(reference_trend(values), rel=1e-9)
        quarter = max(1, n // 4)
        assert fit.first == pytest.approx(math.fsum(values[:quarter]) / quarter)
        assert fit.last == pytest.approx(math.fsum(values[-quarter:]) / quarter)
    assert trend([1.0, 3.0, 5.0, 7.0]).t == math.inf  # an exact line
