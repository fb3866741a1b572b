import pytest
import torch

from grpod.engine.data.advantages import group_advantages


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


def test_sample_std_is_bessel_corrected_and_keeps_flat_groups_at_zero() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    population, frac_population = group_advantages(rewards, group_size=4)
    sample, frac_sample = group_advantages(rewards, group_size=4, std="sample")
    # [0, 1, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.577 -> advantages +-0.866
    assert torch.allclose(sample[:4], torch.tensor([-0.8660254, 0.8660254, -0.8660254, 0.8660254]))
    assert torch.allclose(sample, population * (3 / 4) ** 0.5)
    assert torch.equal(sample[4:8], torch.zeros(4)) and frac_sample == frac_population == 1 / 3
    batch, _ = group_advantages(rewards, group_size=4, scale="batch", std="sample")
    centered = (rewards.reshape(-1, 4) - rewards.reshape(-1, 4).mean(1, keepdim=True)).reshape(-1)
    assert torch.allclose(batch, centered / rewards.reshape(-1, 4).double().std().float())


def test_sample_std_with_one_sample_per_group_is_zero_not_nan() -> None:
    rewards = torch.tensor([1.0, 0.0])
    for scale in ("group", "batch", "none"):
        adv, frac = group_advantages(rewards, group_size=1, scale=scale, std="sample")
        assert torch.equal(adv, torch.zeros(2)) and frac == 1.0
    with pytest.raises(ValueError, match="advantage_std"):
        group_advantages(torch.tensor([1.0, 0.0]), group_size=2, std="unbiased")


def test_engine_config_selects_the_std() -> None:
    from grpod.engine import Engine
    from tests.engine.helpers import config, rollouts_with_signal

    # TINY: groups of 4, same seed, same completions
    population, sample = rollouts_with_signal(
        Engine(config()), Engine(config(advantage_std="sample"))
    )
    assert torch.equal(population.input_ids, sample.input_ids)
    assert population.advantages.abs().max() > 0
    assert torch.allclose(sample.advantages, population.advantages * (3 / 4) ** 0.5)
