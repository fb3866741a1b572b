"""Group-relative advantages: (r - group mean) / population std, equal-reward groups -> 0."""

from __future__ import annotations

import torch

STD_FLOOR = 1e-6  # a group whose std is below this has no learning signal


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group"
) -> tuple[torch.Tensor, float]:
    """Advantages `[samples]` and the fraction of zero-std groups.

    `rewards: [groups * group_size]` float32, grouped contiguously. `scale`: `group` divides by
    each group's population std (divide by n), `batch` by the batch's, `none` not at all. A group
    whose rewards are all equal gets advantages of exactly 0 whatever the scale.
    """
    grouped = rewards.reshape(-1, group_size).double()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    group_std = grouped.std(dim=1, keepdim=True, correction=0)
    flat = group_std < STD_FLOOR
    if scale == "group":
        adv = centered / torch.where(flat, torch.ones_like(group_std), group_std)
    elif scale == "batch":
        batch_std = grouped.std(correction=0)
        adv = centered / batch_std if batch_std >= STD_FLOOR else centered
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"scale_rewards {scale!r}: expected group | batch | none")
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).float(), float(flat.double().mean())
