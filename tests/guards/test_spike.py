import math
import statistics

import pytest

from grpod.guards import Action
from grpod.guards.config import SpikeConfig
from grpod.guards.spike import SpikeGuard
from tests.guards.helpers import batch, report


def warm(guard: SpikeGuard, n: int) -> None:
    for i in range(n):  # loss alternates 0.5 / 1.5: mean 1.0, std 0.5, exactly
        assert guard.after(batch(), report(loss=0.5 if i % 2 else 1.5, grad_norm=0.5)) == []


def test_no_judgement_before_min_steps() -> None:
    guard = SpikeGuard(SpikeConfig())
    warm(guard, 31)
    assert guard.zscore("loss", 100.0) is None
    assert guard.after(batch(), report(loss=100.0)) == []


def test_empty_window_reads_none() -> None:
    assert SpikeGuard(SpikeConfig()).zscore("loss", 1.0) is None


def test_exactly_at_threshold_passes_above_warns() -> None:
    guard = SpikeGuard(SpikeConfig())
    warm(guard, 32)
    assert guard.zscore("loss", 4.0) == 6.0
    warmed = guard.state_dict()
    assert guard.after(batch(), report(loss=4.0, grad_norm=0.5)) == []  # z == 6: not above
    guard.load_state_dict(warmed)
    (finding,) = guard.after(batch(), report(loss=4.0001, grad_norm=0.5))
    assert finding.action is Action.WARN and finding.evidence["zscore"] > 6.0
    guard.load_state_dict(warmed)
    assert guard.after(batch(), report(loss=-2.0001, grad_norm=0.5))[0].evidence["zscore"] > 6


def test_spike_on_grad_norm_and_kl_low_side_too() -> None:
    guard = SpikeGuard(SpikeConfig())
    for i in range(40):
        guard.after(batch(), report(loss=1.0, grad_norm=1.0 + 0.01 * (i % 3), kl=0.01))
    found = guard.after(batch(), report(loss=1.0, grad_norm=500.0, kl=-5.0))
    assert sorted(f.message.split()[0] for f in found) == ["grad_norm", "kl"]


def test_a_flagged_value_stays_out_of_the_baseline_until_a_level_shift() -> None:
    guard = SpikeGuard(SpikeConfig(level_shift_after=3))
    warm(guard, 32)
    before = list(guard.windows["loss"].values)
    assert len(guard.after(batch(), report(loss=50.0, grad_norm=0.5))) == 1
    assert list(guard.windows["loss"].values) == before
    assert len(guard.after(batch(), report(loss=50.0, grad_norm=0.5))) == 1
    assert len(guard.after(batch(), report(loss=50.0, grad_norm=0.5))) == 1  # 3rd: accepted
    assert guard.windows["loss"].values[-1] == 50.0


def test_non_finite_and_missing_values_are_skipped() -> None:
    guard = SpikeGuard(SpikeConfig())
    warm(guard, 32)
    assert guard.after(batch(), report(loss=math.nan, grad_norm=math.inf, kl=None)) == []
    assert len(guard.windows["loss"]) == 32 and len(guard.windows["kl"]) == 0


def test_zero_variance_window_is_no_evidence() -> None:
    """The soak's case: loss exactly 0 for the whole window, then -0.0156 (15593.8 sigma of
    the old 1e-6 floor) is 1.56 spreads of the 0.01 absolute floor: no spike."""
    guard = SpikeGuard(SpikeConfig(metrics=("loss",)))
    for _ in range(128):
        guard.after(batch(), report(loss=0.0))
    assert guard.center_spread("loss") == (0.0, 0.01)
    assert guard.zscore("loss", -0.01559) == pytest.approx(1.559)
    assert guard.after(batch(), report(loss=-0.01559)) == []
    (finding,) = guard.after(batch(), report(loss=0.0601))  # 6.01 spreads of the floor
    assert finding.kind == "loss" and finding.evidence["spread"] == 0.01


def test_relative_floor_scales_with_the_center() -> None:
    guard = SpikeGuard(SpikeConfig(metrics=("grad_norm",), log_metrics=()))  # the linear scale
    for _ in range(32):
        guard.after(batch(), report(grad_norm=2.0))  # flat at 2.0: spread floor 0.05 x 2 = 0.1
    assert guard.center_spread("grad_norm") == (2.0, pytest.approx(0.1))
    assert guard.zscore("grad_norm", 2.59) == pytest.approx(5.9)
    assert len(guard.after(batch(), report(grad_norm=2.61))) == 1  # 6.1 spreads


def test_mad_spread_ignores_the_windows_outliers() -> None:
    """Two earlier outliers inflate the std (hiding a third) but not the MAD."""
    values = [1.0 + 0.1 * (i % 2) for i in range(30)] + [40.0, 40.0]
    std, mad = (SpikeGuard(SpikeConfig(metrics=("loss",), spread=s)) for s in ("std", "mad"))
    for guard in (std, mad):
        for value in values:
            guard.windows["loss"].append(value)
    assert std.after(batch(), report(loss=30.0)) == []
    (finding,) = mad.after(batch(), report(loss=30.0))
    assert finding.evidence["center"] == pytest.approx(1.1)  # 15 x 1.0, 15 x 1.1, 2 x 40


def test_window_is_bounded_and_action_configurable() -> None:
    guard = SpikeGuard(SpikeConfig(window=40, min_steps=32, action="FLUSH"))
    warm(guard, 100)
    assert len(guard.windows["loss"]) == 40
    assert guard.after(batch(), report(loss=10.0, grad_norm=0.5))[0].action is Action.FLUSH


# W1's window before its step 229 (arith, lr 1e-3, seed 0: geometric mean 0.249, log spread
# 0.486, values 0.07-1.17), as a sine in log space of that center and spread
W1_GRAD_NORMS = [0.249 * math.exp(0.486 * math.sqrt(2) * math.sin(i)) for i in range(128)]


def test_the_grad_norm_is_judged_on_a_log_scale() -> None:
    """The healthy W1 step the std scale WARNed on (2.67 against a center of 0.26: 20.5
    spreads) is 10.7x its geometric mean, 4.9 log spreads: no spike; 260 (1000x) is one."""
    linear, log = SpikeGuard(SpikeConfig(log_metrics=())), SpikeGuard(SpikeConfig())
    for guard in (linear, log):
        for value in W1_GRAD_NORMS:
            guard.after(batch(), report(loss=0.0, grad_norm=value))
    assert linear.after(batch(), report(loss=0.0, grad_norm=2.67))[0].kind == "grad_norm"
    warmed = log.state_dict()
    center, spread = log.center_spread("grad_norm")
    geometric = math.exp(statistics.fmean(math.log(v) for v in W1_GRAD_NORMS))
    assert center == pytest.approx(math.log(geometric)) and spread > math.log1p(0.05)
    assert log.zscore("grad_norm", 2.67) == pytest.approx(abs(math.log(2.67) - center) / spread)
    assert log.after(batch(), report(loss=0.0, grad_norm=2.67)) == []
    log.load_state_dict(warmed)  # 2.67 joined the window: back to the one without it
    (finding,) = log.after(batch(), report(loss=0.0, grad_norm=260.0))
    assert finding.evidence["center"] == pytest.approx(geometric)  # reported as a value
    assert f"{260.0 / geometric:.3g}x its geometric mean" in finding.message


def test_a_log_metric_skips_zero_and_floors_its_spread_in_log_units() -> None:
    guard = SpikeGuard(SpikeConfig(metrics=("grad_norm",)))
    for _ in range(32):
        guard.after(batch(), report(grad_norm=2.0))
    assert guard.after(batch(), report(grad_norm=0.0)) == []  # no gradient: not judged, not kept
    assert len(guard.windows["grad_norm"]) == 32
    assert guard.center_spread("grad_norm") == (pytest.approx(math.log(2.0)), math.log1p(0.05))
    warmed = guard.state_dict()
    assert guard.after(batch(), report(grad_norm=2.0 * 1.05**5.9)) == []  # 5.9 spreads
    guard.load_state_dict(warmed)
    assert len(guard.after(batch(), report(grad_norm=2.0 * 1.05**6.1))) == 1
