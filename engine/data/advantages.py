"""Group-relative advantages: (r - group mean) / group std, equal-reward groups -> 0."""

from __future__ import annotations

import torch

STD_FLOOR = 1e-6  # a group whose std is below this has no learning signal


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "population"
) -> tuple[torch.Tensor, float]:
    """Advantages `[samples]` and the fraction of zero-std groups.

    `rewards: [groups * group_size]` float32, grouped contiguously. `scale`: `group` divides by
    each group's std, `batch` by the batch's, `none` not at all. `std`: `population` divides
    the squared deviations by n, `sample` by n - 1 (Bessel's correction, as TRL does; for
    binary rewards in groups of 8 it makes advantages 1/1.069 of the population ones). A group
    whose rewards are all equal gets advantages of exactly 0 whatever the scale.
    """
    if std not in ("population", "sample"):
        raise ValueError(f"advantage_std {std!r}: expected population | sample")
    grouped = rewards.reshape(-1, group_size).double()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    population = grouped.std(dim=1, keepdim=True, correction=0)
    flat = population < STD_FLOOR  # the same groups count as flat whichever std scales
    group_std = population
    if std == "sample" and group_size > 1:  # one sample per group: flat, never 0 / 0
        group_std = grouped.std(dim=1, keepdim=True, correction=1)
    if scale == "group":
        adv = centered / torch.where(flat, torch.ones_like(group_std), group_std)
    elif scale == "batch":
        sample = std == "sample" and grouped.numel() > 1
        batch_std = grouped.std(correction=1 if sample else 0)
        adv = centered / batch_std if batch_std >= STD_FLOOR else centered
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"scale_rewards {scale!r}: expected group | batch | none")
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).float(), float(flat.double().mean())
