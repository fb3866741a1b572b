"""The report's shared arithmetic (engine/train/stats.py): one clip-coefficient rule and one set of
sampler/trainer mismatch statistics, for the engine and the TRL adapter alike."""

from __future__ import annotations

import math

import pytest
import torch

from grpod.engine.train.stats import CLIP_EPS, clip_coefficient, mismatch_stats


@pytest.mark.parametrize("norm", [math.nan, math.inf, -math.inf])
def test_a_non_finite_norm_has_clip_coefficient_zero(norm: float) -> None:
    assert clip_coefficient(norm, 1.0) == 0.0
    assert clip_coefficient(norm, 0.0) == 0.0  # clipping off: still not "unclipped"


def test_the_coefficient_is_clip_grad_norms() -> None:
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + CLIP_EPS)
    assert clip_coefficient(4.0, 0.0) == 1.0  # TRL's max_grad_norm=0: clipping off


def test_mismatch_stats_over_the_same_tokens() -> None:
    sampler = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    trainer = torch.tensor([-1.0, -2.5, -3.0, -4.05])
    stats = mismatch_stats(sampler, trainer)
    assert stats["mismatch_max"] == pytest.approx(0.5)
    assert stats["mismatch_mean"] == pytest.approx(0.55 / 4)
    assert stats["mismatch_frac_above_0_1"] == 0.25
    none = {k: None for k in stats}
    assert mismatch_stats(None, trainer) == none == mismatch_stats(sampler[:0], trainer[:0])
