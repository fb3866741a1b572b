import torch

from engine.advantages import group_advantages


def test_equal_reward_groups_get_exactly_zero_and_are_counted() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    adv, zero_std = group_advantages(rewards, group_size=4)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert torch.equal(adv[8:], torch.zeros(4))
    assert torch.isfinite(adv).all()
    assert zero_std == 2 / 3


def test_population_std_divides_by_n() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    adv, zero_std = group_advantages(rewards, group_size=4)
    # mean 0.5, population std 0.5 (sample std would be 0.577)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    assert zero_std == 0.0


def test_scale_batch_and_none() -> None:
    rewards = torch.tensor([0.0, 2.0, 1.0, 1.0])
    none, _ = group_advantages(rewards, group_size=2, scale="none")
    assert torch.allclose(none, torch.tensor([-1.0, 1.0, 0.0, 0.0]))
    batch, frac = group_advantages(rewards, group_size=2, scale="batch")
    std = rewards.reshape(-1, 2).double().std(correction=0)
    assert torch.allclose(batch, (none / std).float())
    assert frac == 0.5  # the [1, 1] group still counts as zero-std, and stays exactly 0
    assert torch.equal(batch[2:], torch.zeros(2))


def test_nearly_equal_rewards_are_not_blown_up_to_full_scale() -> None:
    rewards = torch.tensor([1.0, 1.0 + 1e-9, 1.0, 1.0])
    adv, zero_std = group_advantages(rewards, group_size=4)
    assert torch.equal(adv, torch.zeros(4)) and zero_std == 1.0
