"""The weight_sync guard: a batch whose sampler disagreed with the trainer is never trained on."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from grpod.engine.weight_sync import WeightSyncCheck
from grpod.guards.config import GuardsConfig
from grpod.guards.policy import GuardPolicy
from grpod.guards.verdict import Action
from tests.guards.helpers import batch

CHECK = WeightSyncCheck(
    version=4, max_abs_diff=5e-7, position=9, tokens=23, cached_tokens=0, dtype="float32"
)


def before(check: WeightSyncCheck | None, **section: object):
    policy = GuardPolicy(GuardsConfig.model_validate({"weight_sync": section}))
    return policy.before(replace(batch(), weight_sync=check))


def test_an_agreeing_sampler_and_a_batch_without_a_check_pass() -> None:
    for check in (None, CHECK, replace(CHECK, max_abs_diff=1e-3)):
        _, findings, skip = before(check)
        assert not skip and not [f for f in findings if f.guard == "weight_sync"]


@pytest.mark.parametrize("diff", [2e-3, math.nan, math.inf])
def test_a_disagreeing_sampler_skips_the_step_and_halts(diff: float) -> None:
    _, findings, skip = before(replace(CHECK, max_abs_diff=diff, position=257, cached_tokens=128))
    (finding,) = findings
    assert skip and finding.guard == "weight_sync" and finding.action == Action.HALT
    assert finding.message.startswith(
        "weight sync: the sampler disagrees with the trainer (max |Δ| "
    )
    assert "at token 257 of the probe, 23 tokens compared, weight version 4; limit 0.001" in (
        finding.message
    )
    assert finding.evidence["cached_tokens"] == 128 and finding.evidence["threshold"] == 1e-3


def test_the_limit_follows_the_trainers_dtype_and_warn_trains_on() -> None:
    bf16 = replace(CHECK, max_abs_diff=0.02, dtype="bfloat16")
    assert before(bf16)[1] == []  # under the bf16 limit
    assert before(replace(bf16, dtype="float32"))[2] is True
    assert before(replace(bf16, max_abs_diff=0.072))[2] is True  # the bf16 corrupt-push drill
    _, findings, skip = before(replace(CHECK, max_abs_diff=1.0), action="WARN")
    assert not skip and findings[0].action == Action.WARN
    assert before(replace(CHECK, max_abs_diff=1.0), enabled=False)[1] == []
