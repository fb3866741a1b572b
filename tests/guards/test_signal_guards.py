"""advantage, sampler_mismatch and clip."""

import math

import pytest

from grpod.guards import Action, GuardsError
from grpod.guards.advantage import AdvantageGuard, binomial_tail
from grpod.guards.clip import ClipGuard
from grpod.guards.config import AdvantageConfig, ClipConfig, SamplerMismatchConfig
from grpod.guards.mismatch import SamplerMismatchGuard
from tests.guards.helpers import batch, report


def test_advantage_zero_std_fraction_boundary() -> None:
    w1 = batch(groups=16)
    assert AdvantageGuard(AdvantageConfig()).after(w1, report(zero_std_group_fraction=0.9)) == []
    # at the fraction's limit: passes. Above it after a low history: warns
    guard = AdvantageGuard(AdvantageConfig())
    assert guard.after(w1, report(zero_std_group_fraction=0.3)) == []
    (finding,) = guard.after(w1, report(zero_std_group_fraction=0.9375))
    assert finding.action is Action.WARN and finding.evidence["zero_std_group_fraction"] == 0.9375
    assert finding.evidence["history_mean"] == 0.3 and finding.evidence["groups"] == 16
    assert finding.evidence["chance"] < 1e-6
    assert "15 of 16 groups (94%, > 90%) have equal rewards after 30%" in finding.message


def test_advantage_a_healthy_runs_noise_is_no_alarm() -> None:
    """W1 healthy (2026-12-04, step 358): 15 of 16 groups alike after a mean of 0.64, within
    the history's limit, is a chance of 0.0080; the equal-rewards drill's 16 of 16 after a
    mean of 0.54 is 5.2e-5."""
    w1 = batch(groups=16)
    history = (0.625, 0.625, 0.5, 0.688, 0.875, 0.625, 0.688, 0.5)  # steps 350-357: 0.64075
    noisy, drilled = AdvantageGuard(AdvantageConfig()), AdvantageGuard(AdvantageConfig())
    for fraction in history:
        assert noisy.after(w1, report(zero_std_group_fraction=fraction)) == []
    assert noisy.after(w1, report(zero_std_group_fraction=0.9375)) == []
    assert binomial_tail(16, 15, 0.64075) == pytest.approx(0.0080, abs=5e-5)
    signal = (0.5, 0.562, 0.5, 0.625, 0.5, 0.562, 0.5, 0.562)  # mean 0.539
    for fraction in signal:
        assert drilled.after(w1, report(zero_std_group_fraction=fraction)) == []
    (finding,) = drilled.after(w1, report(zero_std_group_fraction=1.0))
    assert finding.evidence["chance"] == pytest.approx((sum(signal) / 8) ** 16, rel=1e-9)
    # with fewer groups the same drop is likelier by chance: W4's 8, all alike after 0.54
    few = AdvantageGuard(AdvantageConfig())
    for fraction in (0.5, 0.625, 0.5, 0.5, 0.625, 0.5, 0.5, 0.625):
        few.after(batch(groups=8), report(zero_std_group_fraction=fraction))
    assert few.after(batch(groups=8), report(zero_std_group_fraction=1.0)) == []
    assert binomial_tail(8, 8, 0.546875) == pytest.approx(0.546875**8)


def test_advantage_sudden_loss_warns_a_solved_campaign_does_not() -> None:
    """W4's shape: a campaign solving its prompts reaches batches where every group is alike
    after steps that were mostly alike already; the equal-rewards drill's after steps with
    signal."""
    w1 = batch(groups=16)
    learning = AdvantageGuard(AdvantageConfig())
    for fraction in (0.25, 0.5, 0.38, 0.62, 0.25, 0.5, 0.62, 0.5):  # mean 0.45
        assert learning.after(w1, report(zero_std_group_fraction=fraction)) == []
    (finding,) = learning.after(w1, report(zero_std_group_fraction=1.0))
    assert finding.kind == "zero_std_groups" and finding.evidence["history_mean"] == 0.4525
    assert "lost its signal" in finding.message

    solved = AdvantageGuard(AdvantageConfig())
    for fraction in (0.75, 0.88, 0.88, 1.0, 0.75, 0.88, 0.75, 0.88) * 3:  # W4 steps 46-53
        assert solved.after(w1, report(zero_std_group_fraction=fraction)) == []
    assert solved.after(batch(advantages=0.0), report(zero_std_group_fraction=1.0)) == []

    # the threshold sits between the two (config: W4 >= 0.80, the drill <= 0.54)
    edge = AdvantageGuard(AdvantageConfig(history_fraction_max=0.45))
    for fraction in (0.25, 0.5, 0.38, 0.62, 0.25, 0.5, 0.62, 0.5):
        edge.after(w1, report(zero_std_group_fraction=fraction))
    assert edge.after(w1, report(zero_std_group_fraction=1.0)) == []


def test_advantage_history_survives_a_checkpoint_and_an_older_one_starts_afresh() -> None:
    guard = AdvantageGuard(AdvantageConfig())
    for fraction in (0.9, 0.9, 0.9):
        guard.after(batch(), report(zero_std_group_fraction=fraction))
    again = AdvantageGuard(AdvantageConfig())
    again.load_state_dict(guard.state_dict())
    assert again.after(batch(), report(zero_std_group_fraction=1.0)) == []
    older = AdvantageGuard(AdvantageConfig())
    older.load_state_dict({})  # a checkpoint from before the history was kept
    assert len(older.after(batch(), report(zero_std_group_fraction=1.0))) == 1
    with pytest.raises(GuardsError, match=r"advantage.*zero_std"):
        older.load_state_dict({"zero_std": ["x"]})


def test_advantage_all_zero_warns_only_when_rewards_varied() -> None:
    guard = AdvantageGuard(AdvantageConfig())
    (finding,) = guard.after(batch(advantages=0.0), report())
    assert "advantages were lost" in finding.message and finding.kind == "all_zero"
    b = batch(advantages=0.0)
    b.advantages[0, 0, 1] = 1e-6  # one trainable token with signal
    assert guard.after(b, report()) == []
    # every group alike: all-zero advantages are what the rewards say, one finding, not two
    (only,) = guard.after(batch(advantages=0.0, groups=16), report(zero_std_group_fraction=1.0))
    assert only.kind == "zero_std_groups"


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


def test_mismatch_on_a_stale_rollout_is_drift_with_its_own_bounds() -> None:
    """W4, vllm-server at max_staleness 1: 29% of tokens above 0.1 nats, p99 0.90 nats."""
    guard = SamplerMismatchGuard(SamplerMismatchConfig())
    stale_one = report(mismatch_p99=0.9, mismatch_frac_above_0_1=0.29, staleness=1)
    assert guard.after(batch(), stale_one) == []
    assert guard.after(batch(), report(mismatch_p99=0.9, mismatch_frac_above_0_1=0.29)) != []
    assert guard.after(batch(), report(mismatch_p99=7.9, staleness=2)) == []  # 4 nats a version
    (p99,) = guard.after(batch(), report(mismatch_p99=8.1, staleness=2))
    assert p99.evidence["threshold"] == 8.0 and "drift over 2 versions" in p99.message
    (fraction,) = guard.after(batch(), report(mismatch_frac_above_0_1=0.81, staleness=1))
    assert fraction.action is Action.WARN and fraction.evidence["staleness"] == 1.0
    on_policy = report(mismatch_p99=1.01, mismatch_frac_above_0_1=0.1, staleness=0)
    assert "sampler/trainer" in guard.after(batch(), on_policy)[0].message


def clip_guard_past_baseline(baseline: float = 5.0, **config: object) -> ClipGuard:
    """A clip guard whose baseline (the median of its first 16 grad norms) is `baseline`."""
    guard = ClipGuard(ClipConfig(**config))
    for _ in range(guard.config.baseline_steps):
        assert guard.after(batch(), report(grad_norm=baseline, clip_coef=1.0 / baseline)) == []
    assert guard.baseline == baseline and len(guard.history) == 0
    return guard


def test_clip_at_the_runs_own_level_never_counts() -> None:
    """W4: a pretrained model clips every healthy step (pre-clip norms 3-11, coef 0.09-0.32)."""
    guard = clip_guard_past_baseline(5.0)
    for i in range(64):
        norm = 3.0 + (i % 9)  # 3..11: at most 2.2x the baseline
        assert guard.after(batch(), report(grad_norm=norm, clip_coef=1.0 / norm)) == []
    assert sum(guard.history) == 0


def test_clip_far_above_the_baseline_on_more_than_half_of_the_window() -> None:
    guard = clip_guard_past_baseline(5.0)
    suppressed = report(grad_norm=25.0, clip_coef=0.04)  # 5x the baseline
    assert guard.after(batch(), suppressed) == []  # single step: 1 of 32
    for _ in range(15):
        guard.after(batch(), suppressed)
    assert sum(guard.history) == 16  # exactly half: passes
    assert guard.after(batch(), report(grad_norm=20.0, clip_coef=0.05)) == []  # 4x is not above
    assert guard.after(batch(), report(grad_norm=25.0, clip_coef=0.2)) == []  # 0.2: not below
    (finding,) = guard.after(batch(), suppressed)
    assert finding.action is Action.WARN and finding.evidence["clipped_steps"] == 17
    assert finding.evidence["grad_norm_ratio"] == 5.0
    assert finding.evidence["baseline_grad_norm"] == 5.0


def test_clip_window_is_bounded_and_skips_non_finite_grad_norms() -> None:
    guard = clip_guard_past_baseline(1.0)
    for _ in range(40):
        guard.after(batch(), report(grad_norm=10.0, clip_coef=0.1))
    assert len(guard.history) == 32
    for _ in range(16):
        guard.after(batch(), report(grad_norm=1.0, clip_coef=1.0))
    assert guard.after(batch(), report(grad_norm=10.0, clip_coef=0.1)) == []  # 16 of the last 32
    guard.after(batch(), report(clip_coef=0.0, grad_norm=math.inf))
    assert len(guard.history) == 32 and guard.history[-1] is True


def test_clip_baseline_skips_zero_grad_steps_and_survives_a_checkpoint() -> None:
    guard = ClipGuard(ClipConfig(baseline_steps=3))
    for norm in (0.0, 2.0, 0.0, 4.0, 3.0):  # zero: every advantage 0, no level
        guard.after(batch(), report(grad_norm=norm, clip_coef=1.0))
    assert guard.baseline == 3.0
    again = ClipGuard(ClipConfig(baseline_steps=3))
    again.load_state_dict(guard.state_dict())
    assert again.baseline == 3.0
    older = ClipGuard(ClipConfig(baseline_steps=3))  # an older grpod's state: no baseline
    older.load_state_dict({"clipped": [True] * 32})
    assert older.baseline is None and len(older.history) == 0


def test_advantage_all_zero_action_is_configurable() -> None:
    guard = AdvantageGuard(AdvantageConfig(all_zero_action="FLUSH"))
    (finding,) = guard.after(batch(advantages=0.0), report())
    assert finding.action is Action.FLUSH
