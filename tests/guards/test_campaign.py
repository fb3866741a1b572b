"""dead_campaign, reward_trend and entropy: a campaign that cannot learn or is collapsing."""

from __future__ import annotations

import pytest

from grpod.guards import Action, GuardPolicy, GuardsError
from grpod.guards.campaign import DeadCampaignGuard, RewardTrendGuard
from grpod.guards.config import DeadCampaignConfig, EntropyConfig, RewardTrendConfig
from grpod.guards.entropy import EntropyGuard
from tests.guards.helpers import batch, report


def test_dead_campaign_halts_after_a_window_without_signal() -> None:
    guard = DeadCampaignGuard(DeadCampaignConfig(steps=10))
    for _ in range(9):  # a collapsed policy; one odd varied group (15/16) does not reset it
        assert guard.after(batch(), report(zero_std_group_fraction=1.0, grad_norm=0.0)) == []
    (finding,) = guard.after(batch(), report(zero_std_group_fraction=0.9375, grad_norm=0.0))
    assert finding.action is Action.HALT
    assert finding.message.startswith("no learning signal for 10 steps: 99.4% of groups")
    assert finding.evidence["zero_std_group_fraction"] == pytest.approx(0.99375)


def test_dead_campaign_on_a_vanished_gradient_and_not_on_a_learning_one() -> None:
    guard = DeadCampaignGuard(DeadCampaignConfig(steps=4))
    for _ in range(3):
        assert guard.after(batch(), report(zero_std_group_fraction=0.5, grad_norm=1e-5)) == []
    (finding,) = guard.after(batch(), report(zero_std_group_fraction=0.5, grad_norm=1e-5))
    assert "grad norm stayed <= 1e-05" in finding.message
    assert guard.after(batch(), report(zero_std_group_fraction=0.5, grad_norm=0.3)) == []
    state = guard.state_dict()
    again = DeadCampaignGuard(DeadCampaignConfig(steps=4, action="WARN"))
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(GuardsError, match="dead_campaign"):
        again.load_state_dict({"zero_std": ["x"]})


def test_reward_trend_warns_on_a_fall_from_the_best() -> None:
    guard = RewardTrendGuard(RewardTrendConfig(window=4, max_drop=0.25))
    for reward in (0.8, 0.8, 0.8, 0.8, 0.7, 0.6):  # mean 0.8 -> 0.725: 9% down
        assert guard.after(batch(), report(reward_mean=reward)) == []
    (finding,) = guard.after(batch(), report(reward_mean=0.2))  # mean 0.575: 28% down
    assert finding.action is Action.WARN and finding.evidence["best"] == pytest.approx(0.8)
    assert finding.evidence["severity"] == pytest.approx(0.28125)


def test_entropy_floor_and_drop() -> None:
    guard = EntropyGuard(EntropyConfig(window=2, floor=0.05, max_drop=0.9))
    assert guard.after(batch(), report(entropy=2.0)) == []  # window not full
    assert guard.after(batch(), report(entropy=2.0)) == []  # best 2.0
    assert guard.after(batch(), report(entropy=None)) == []  # not reported: not counted
    assert guard.after(batch(), report(entropy=0.1)) == []  # mean 1.05: 47.5% down
    (drop,) = guard.after(batch(), report(entropy=0.1))  # mean 0.1: 95% down
    assert drop.kind == "drop" and drop.evidence["drop"] == pytest.approx(0.95)
    guard.after(batch(), report(entropy=0.01))
    (floor,) = guard.after(batch(), report(entropy=0.01))  # mean 0.01 < 0.05
    assert floor.kind == "floor" and floor.action is Action.WARN


def test_policy_halts_a_dead_campaign_by_default() -> None:
    policy = GuardPolicy({"dead_campaign": {"steps": 3}})
    actions = [
        policy.decide(
            policy.after(batch(), report(zero_std_group_fraction=1.0, grad_norm=0.0))
        ).action
        for _ in range(3)
    ]
    # `advantage` warns of the sudden loss; held, the loss is `dead_campaign`'s to halt
    assert actions == [Action.WARN, Action.PASS, Action.HALT]
