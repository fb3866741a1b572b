"""A `StepReport` built by hand, shared by the tests of every package that reads reports."""

from __future__ import annotations

from grpod.engine import StepReport

HEALTHY = dict(
    step=0,
    valid_tokens=10,
    expected_valid_tokens=10,
    loss=0.01,
    micro_losses=[0.005, 0.005],
    grad_norm=0.5,
    clip_coef=1.0,
    lr=1e-3,
    reward_mean=0.5,
    reward_std=0.5,
    zero_std_group_fraction=0.25,
    advantage_abs_max=1.0,
    kl=None,
    clip_fraction_low=0.0,
    clip_fraction_high=0.0,
    mismatch_mean=1e-6,
    mismatch_p90=1e-6,
    mismatch_p99=1e-6,
    mismatch_max=1e-6,
    mismatch_frac_above_0_1=0.0,
    completion_length_mean=2.0,
    completion_length_max=4,
    num_micros=2,
    num_samples=2,
)


def make_report(**overrides: object) -> StepReport:
    """A healthy step's report; `overrides` change any field."""
    return StepReport(**{**HEALTHY, **overrides})
