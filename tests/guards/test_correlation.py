import math

import pytest

from grpod.guards import Action
from grpod.guards.config import CorrelationConfig
from grpod.guards.correlation import GradNormVTCCorrelationGuard, pearson
from tests.guards.helpers import batch, report


def feed(guard, pairs):
    out = []
    for grad_norm, valid in pairs:
        out = guard.after(batch(), report(grad_norm=grad_norm, valid_tokens=valid))
    return out


def test_empty_and_short_windows_read_none() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    assert guard.value is None
    assert feed(guard, [(1.0 / v, v) for v in range(1, 16)]) == []  # 15 < min 16
    assert guard.value is None
    (finding,) = feed(guard, [(1.0 / 16, 16)])  # the 16th step: perfectly 1/valid
    assert guard.value == pytest.approx(1.0) and finding.action is Action.WARN


def test_single_step_history_reads_none() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig(min_steps=2, window=2))
    feed(guard, [(1.0, 4)])
    assert guard.value is None


def test_a_scale_independent_grad_norm_does_not_warn() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    pairs = [(0.5 + 0.1 * ((7 * i) % 5), 100 + (i % 7)) for i in range(64)]
    assert feed(guard, pairs) == []
    assert guard.value is not None and abs(guard.value) < 0.5


def test_exactly_at_the_threshold_does_not_warn_and_just_above_does() -> None:
    # two points per level: corr of x with y = x + noise is set by construction
    xs = [0.0, 1.0] * 8
    ys = [0.0, 1.0] * 8
    ys[0] = 0.5  # lower the correlation a little
    guard = GradNormVTCCorrelationGuard(CorrelationConfig(min_steps=16, window=16))
    feed(guard, [(1.0 + y, round(1.0 / (0.1 + x * 0.4) * 1000)) for x, y in zip(xs, ys)])
    value = guard.value
    assert value is not None and 0.0 < value < 1.0
    at = GradNormVTCCorrelationGuard(CorrelationConfig(threshold=value, min_steps=16, window=16))
    above = GradNormVTCCorrelationGuard(
        CorrelationConfig(threshold=math.nextafter(value, -1.0), min_steps=16, window=16)
    )
    at.load_state_dict(guard.state_dict())
    above.load_state_dict(guard.state_dict())
    assert at.after(batch(), report(grad_norm=0.0)) == []  # a zero-grad step adds no point
    assert len(above.after(batch(), report(grad_norm=0.0))) == 1


def test_uninformative_steps_are_not_recorded() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    feed(guard, [(0.0, 10), (math.nan, 10), (math.inf, 10), (1.0, 0)])
    assert len(guard.grad_norms) == 0


def test_window_is_bounded_and_survives_a_reload() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    feed(guard, [(1.0 / v, v) for v in range(1, 101)])
    assert len(guard.grad_norms) == 64
    guard.configure(CorrelationConfig(window=32, min_steps=16))
    assert len(guard.grad_norms) == 32 and guard.value == pytest.approx(1.0)


def test_pearson() -> None:
    """The one Pearson correlation (the guard's; `grpod plot` uses it through the guard)."""
    assert pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert pearson([1], [1]) is None  # too few points
    assert pearson([1, 2, 3], [1, 2]) is None  # unequal lengths
    assert pearson([1, 1, 1], [1, 2, 3]) is None  # no variance
    assert pearson([1e8 + 1, 1e8 + 2, 1e8 + 3], [3, 2, 1]) == -1.0  # FP64, clamped to [-1, 1]


def test_an_exact_counter_never_correlates_however_the_lengths_move() -> None:
    """The converged toy run: completions lengthen, a token-mean loss's grad norm falls as
    1 / valid tokens (corr 1.0 with 1 / vtc), and the counter equals the loss mask on every
    step. expected / valid is 1 throughout: no reading, no finding."""
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    for step in range(64):
        valid = 100 + 4 * step
        found = guard.after(
            batch(), report(grad_norm=50.0 / valid, valid_tokens=valid, expected_valid_tokens=valid)
        )
        assert found == []
    assert guard.value is None and len(guard.grad_norms) == 64


def test_a_counter_that_reads_part_of_the_mask_correlates() -> None:
    """The seed's failure: the loss divided by one chunk's count, the grad norm scaled by
    expected / valid (with the step's own noise), the mask's total nearly steady."""
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    found: list = []
    for step in range(16):
        expected = 400 + step % 3
        valid = 40 + 37 * (step % 5)
        noise = 1.0 + 0.05 * ((7 * step) % 3)
        found = guard.after(
            batch(),
            report(grad_norm=0.2 * noise * expected / valid, valid_tokens=valid,
                   expected_valid_tokens=expected),
        )  # fmt: skip
    assert guard.value is not None and guard.value > 0.95
    (finding,) = found
    assert "expected/valid" in finding.message


def test_an_older_window_of_inverse_counts_starts_again() -> None:
    guard = GradNormVTCCorrelationGuard(CorrelationConfig())
    guard.load_state_dict({"grad_norms": [1.0, 2.0], "inverse_valid_tokens": [0.1, 0.2]})
    assert len(guard.grad_norms) == 0 and guard.value is None
