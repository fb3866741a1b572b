"""The weight_sync guard: a batch whose sampler disagreed with the trainer is never trained on."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from grpod.engine.weight_sync import WeightSyncCheck
from grpod.guards.config import GuardsConfig
from grpod.guards.policy import GuardPolicy
from grpod.guards.verdict import Action
from tests.guards.helpers import batch, report

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


def test_a_sampler_that_kept_a_parameter_halts_whatever_the_probe_reads() -> None:
    # the bf16 partial-push drill at W1: 0.0105 nats, under the 0.03 limit
    kept = replace(
        CHECK,
        max_abs_diff=0.0105,
        dtype="bfloat16",
        unloaded=("model.layers.3.mlp.down_proj.weight",),
    )
    _, findings, skip = before(kept)
    (finding,) = findings
    assert skip and finding.action == Action.HALT
    assert finding.message.startswith(
        "weight sync: the sampler did not load 1 of its parameters "
        "(model.layers.3.mlp.down_proj.weight; max |Δ| 0.0105 nats at token 9 of the probe"
    )
    assert finding.evidence["unloaded_parameters"] == 1.0
    many = replace(kept, unloaded=tuple(f"p{i}" for i in range(5)))
    assert "did not load 5 of its parameters (p0, p1, p2, ...; " in before(many)[1][0].message


def test_the_unloaded_parameters_travel_with_the_check() -> None:
    kept = replace(CHECK, unloaded=("a.weight", "b.weight"))
    assert WeightSyncCheck.from_json(kept.to_json()) == kept
    recorded_before = '{"version": 4, "max_abs_diff": 5e-07, "position": 9, "tokens": 23, '
    old = recorded_before + '"cached_tokens": 0, "dtype": "float32"}'
    assert WeightSyncCheck.from_json(old) == CHECK  # a batch recorded before the field


def after(check: WeightSyncCheck | None, mismatch_max: float | None, **section: object):
    policy = GuardPolicy(GuardsConfig.model_validate({"weight_sync": section}))
    run = replace(batch(), weight_sync=check)
    return [
        f
        for f in policy.after(run, report(mismatch_max=mismatch_max, valid_tokens=960))
        if f.guard == "weight_sync"
    ]


ON_ROLLOUT = replace(CHECK, weights="rollout", tokens=8, position=41)


def test_a_rollout_compared_check_is_decided_after_the_forward() -> None:
    # before the compute: only its cache half is read (the weights are not compared yet)
    assert before(ON_ROLLOUT)[1] == [] and before(ON_ROLLOUT)[2] is False
    # W4's healthy steps read 7.0e-5 at most over up to 768 tokens; the limit is the probe's
    assert after(ON_ROLLOUT, 1.2e-4) == [] and after(ON_ROLLOUT, 1e-3) == []
    assert after(CHECK, 5.0) == []  # a probe check is decided before the compute alone
    assert after(None, 5.0) == []
    (finding,) = after(ON_ROLLOUT, 0.064)  # W4's skipped push, one update behind
    assert finding.action == Action.HALT and finding.kind == "rollout"
    assert finding.message == (
        "weight sync: the sampler's rollout disagrees with the trainer (max |Δ| 0.064 nats "
        "over the step's 960 tokens, weight version 4; limit 0.001)"
    )
    assert finding.evidence["max_abs_logprob_diff"] == 0.064
    assert finding.evidence["tokens"] == 960.0
    # no token compared, or not finite: never a pass
    evidence = [after(ON_ROLLOUT, v)[0].evidence for v in (None, math.nan, math.inf)]
    assert [math.isnan(e["max_abs_logprob_diff"]) for e in evidence] == [True, True, False]
    assert evidence[2]["max_abs_logprob_diff"] == math.inf
    assert after(ON_ROLLOUT, 0.064, action="WARN")[0].action == Action.WARN
    assert after(ON_ROLLOUT, 0.064, enabled=False) == []
    bf16 = replace(ON_ROLLOUT, dtype="bfloat16")  # not routed so by the engine; its own limit
    assert after(bf16, 0.02) == [] and after(bf16, 0.04) != []
