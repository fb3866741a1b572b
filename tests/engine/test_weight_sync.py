"""`compare`, the weight-sync check's arithmetic: the largest |sampler - trainer| difference and
where it is, over the probe's scored tokens and then the continuation (cached against fresh)."""

from __future__ import annotations

import math

import pytest
import torch

from grpod.engine.errors import EngineError
from grpod.engine.weight_sync import ProbeScores, WeightSyncCheck, compare

PROBE = [7, 3, 9, 4, 1]  # 4 prompt logprobs: tokens 1..4


def scores(**changes) -> ProbeScores:
    fields = dict(
        continuation=[2, 2, 5],
        prompt_logprobs=[-1.0, -2.0, -0.5, -3.0],
        continuation_logprobs=[-0.25, -0.5, -1.0],
        cached_tokens=4,
        fresh_continuation=[2, 2, 5],
        fresh_logprobs=[-0.25, -0.75, -1.0],
    )
    return ProbeScores(**{**fields, **changes})


def check(trainer: list[float], **changes):
    values = torch.tensor(trainer, dtype=torch.float32)
    return compare(PROBE, scores(**changes), values, version=3, dtype="float32")


def test_the_largest_difference_is_found_in_the_probe_at_its_token() -> None:
    got = check([-1.0, -2.5, -0.5])  # 3 scored tokens: 0, 0.5, 0 then the cache's 0, 0.25, 0
    assert (got.max_abs_diff, got.position, got.tokens) == (0.5, 2, 6)
    assert (got.version, got.cached_tokens, got.dtype) == (3, 4, "float32")


def test_the_largest_difference_in_the_continuation_is_placed_after_the_whole_probe() -> None:
    got = check([-1.0, -2.0])  # the probe agrees; the continuation's token 1 differs by 0.25
    assert (got.max_abs_diff, got.position, got.tokens) == (0.25, len(PROBE) + 1, 5)


def test_equal_differences_name_the_first() -> None:
    got = check([-1.5, -2.5, -1.0])  # 0.5 three times
    assert (got.max_abs_diff, got.position) == (0.5, 1)


def test_the_difference_is_float64_of_the_float32_logprob() -> None:
    got = check([-1.1])  # float32(-1.1) is not -1.1: the check sees float32's own value
    assert got.max_abs_diff == max(abs(-1.0 - float(torch.tensor(-1.1))), 0.25)


@pytest.mark.parametrize(
    ("changes", "trainer", "position"),
    [
        ({}, [-1.0, math.nan], 2),  # the trainer's NaN
        ({"prompt_logprobs": [-1.0, -math.inf, -0.5, -3.0]}, [-1.0, -2.0], 2),  # vLLM's -inf
        ({"fresh_continuation": [2, 4, 5]}, [-1.0], len(PROBE) + 1),  # another greedy token
    ],
    ids=["trainer-nan", "sampler-inf", "continuations-differ"],
)
def test_a_value_that_is_not_finite_or_another_token_is_nan_at_its_first_place(
    changes: dict, trainer: list[float], position: int
) -> None:
    got = check(trainer, **changes)
    assert math.isnan(got.max_abs_diff) and got.position == position


def test_scores_of_another_length_are_refused() -> None:
    with pytest.raises(EngineError, match="scored 3 of 5 probe tokens"):
        check([-1.0], prompt_logprobs=[-1.0, -2.0, -0.5])
    with pytest.raises(EngineError, match="continuations of 3 and 2 tokens"):
        check([-1.0], fresh_continuation=[2, 2])


def test_without_the_trainers_probe_the_check_is_the_cache_half_and_the_rollout_decides() -> None:
    got = compare(PROBE, scores(), None, version=3, dtype="float32")
    assert got.on_rollout and got.weights == "rollout"
    assert got.max_abs_diff == 0.25 and got.position == len(PROBE) + 1 and got.tokens == 3
    assert got.with_rollout(1e-4) == 0.25 and got.with_rollout(0.5) == 0.5
    assert math.isnan(got.with_rollout(None)) and math.isnan(got.with_rollout(math.inf))
    probe = check([-1.0, -2.5, -0.5])
    assert not probe.on_rollout and probe.with_rollout(9.0) == probe.max_abs_diff
    assert WeightSyncCheck.from_json(got.to_json()) == got


def test_a_recorded_check_of_another_weights_route_is_refused() -> None:
    text = check([-1.0]).to_json().replace('"probe"', '"trainer"')
    with pytest.raises(EngineError, match="weights 'trainer'"):
        WeightSyncCheck.from_json(text)
