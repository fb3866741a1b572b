"""advantage, sampler_mismatch and clip."""

import math

from grpod.guards import Action
from grpod.guards.advantage import AdvantageGuard
from grpod.guards.clip import ClipGuard
from grpod.guards.config import AdvantageConfig, ClipConfig, SamplerMismatchConfig
from grpod.guards.mismatch import SamplerMismatchGuard
from tests.guards.helpers import batch, report


def test_advantage_zero_std_fraction_boundary() -> None:
    guard = AdvantageGuard(AdvantageConfig())
    assert guard.after(batch(), report(zero_std_group_fraction=0.9)) == []  # at: passes
    (finding,) = guard.after(batch(), report(zero_std_group_fraction=0.9375))
    assert finding.action is Action.WARN and finding.evidence["zero_std_group_fraction"] == 0.9375


def test_advantage_all_zero_warns_and_padding_does_not_count() -> None:
    guard = AdvantageGuard(AdvantageConfig())
    (finding,) = guard.after(batch(advantages=0.0), report())
    assert "no learning signal" in finding.message
    b = batch(advantages=0.0)
    b.advantages[0, 0, 1] = 1e-6  # one trainable token with signal
    assert guard.after(b, report()) == []
    both = guard.after(batch(advantages=0.0), report(zero_std_group_fraction=1.0))
    assert len(both) == 2


def test_advantage_signal_counts_only_on_trainable_tokens() -> None:
    guard = AdvantageGuard(AdvantageConfig())
    b = batch([[0, 1, 1, 0]], advantages=0.0)
    b.advantages[0, 0, 0] = 2.0  # a prompt token's advantage is no learning signal
    (finding,) = guard.after(b, report())
    assert finding.evidence["trainable_tokens"] == 2
    b.advantages[0, 0, 2] = math.nan  # not 0: the finite guard's business, not this one's
    assert guard.after(b, report()) == []
    assert guard.after(batch([[0, 0, 0, 0]], advantages=0.0), report()) == []  # nothing trained


def test_mismatch_thresholds_and_missing_sampler_logprobs() -> None:
    guard = SamplerMismatchGuard(SamplerMismatchConfig())
    assert guard.after(batch(), report(mismatch_p99=1.0, mismatch_frac_above_0_1=0.2)) == []
    found = guard.after(batch(), report(mismatch_p99=1.01, mismatch_frac_above_0_1=0.21))
    assert [f.action for f in found] == [Action.WARN, Action.WARN]
    assert guard.after(batch(), report(mismatch_p99=None, mismatch_frac_above_0_1=None)) == []


def test_clip_more_than_half_of_the_window() -> None:
    guard = ClipGuard(ClipConfig())
    assert guard.after(batch(), report(clip_coef=0.1)) == []  # single step: 1 of 32
    for _ in range(15):
        guard.after(batch(), report(clip_coef=0.1))
    assert sum(guard.history) == 16  # exactly half: passes
    assert guard.after(batch(), report(clip_coef=0.2)) == []  # 0.2 is not below 0.2
    (finding,) = guard.after(batch(), report(clip_coef=0.19))
    assert finding.action is Action.WARN and finding.evidence["clipped_steps"] == 17


def test_clip_window_is_bounded_and_skips_non_finite_grad_norms() -> None:
    guard = ClipGuard(ClipConfig())
    for _ in range(40):
        guard.after(batch(), report(clip_coef=0.1))
    assert len(guard.history) == 32
    for _ in range(16):
        guard.after(batch(), report(clip_coef=1.0))
    assert guard.after(batch(), report(clip_coef=0.1)) == []  # 16 of the last 32
    guard.after(batch(), report(clip_coef=0.0, grad_norm=math.inf))
    assert len(guard.history) == 32 and guard.history[-1] is True


def test_advantage_all_zero_action_is_configurable() -> None:
    guard = AdvantageGuard(AdvantageConfig(all_zero_action="FLUSH"))
    (finding,) = guard.after(batch(advantages=0.0), report())
    assert finding.action is Action.FLUSH
