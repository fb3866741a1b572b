import json
import math
import warnings

import pytest
import torch

from grpod.engine import Engine, EngineConfig
from grpod.engine.grpo.step import decide_step
from grpod.engine.state.checkpoint import load_checkpoint, save_checkpoint
from grpod.engine.verdict import Outcome
from grpod.guards import Action, GuardPolicy, GuardsConfig, GuardsError
from grpod.guards.policy import GUARD_CLASSES
from grpod.guards.workloads import W2_GEOMETRY
from tests.guards.helpers import batch, report

TINY = dict(task="arith", prompts_per_step=2, group_size=4, seq_len=32)


def engine(**overrides: object) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(EngineConfig.model_validate({**TINY, **overrides}))


def judge(policy: GuardPolicy, **fields: object):
    b = batch()
    return policy.decide(policy.after(b, report(**fields)))


def test_fixed_order_and_one_verdict() -> None:
    assert [c.name for c in GUARD_CLASSES] == [
        "weight_sync",
        "reorder",
        "accounting",
        "finite",
        "gradnorm_vtc_correlation",
        "spike",
        "advantage",
        "sampler_mismatch",
        "clip",
        "dead_campaign",
        "reward_trend",
        "entropy",
        "reward_hacking",
    ]
    verdict = judge(GuardPolicy(), valid_tokens=0, loss=math.nan, zero_std_group_fraction=1.0)
    assert verdict.action is Action.FLUSH
    assert [f.guard for f in verdict.findings] == ["accounting", "finite", "advantage"]


def test_disabled_guards_say_nothing() -> None:
    policy = GuardPolicy({"accounting": {"enabled": False}, "finite": {"enabled": False}})
    assert judge(policy, valid_tokens=0, loss=math.nan).action is Action.PASS


def test_escalation_after_consecutive_flushes_and_reset() -> None:
    policy = GuardPolicy()
    actions = [judge(policy, valid_tokens=0).action for _ in range(5)]
    assert actions == [Action.FLUSH] * 4 + [Action.HALT]
    assert policy.consecutive_flushes == 5
    assert judge(policy).action is Action.PASS and policy.consecutive_flushes == 0
    assert judge(policy, valid_tokens=0).action is Action.FLUSH


def test_escalation_can_be_turned_off() -> None:
    policy = GuardPolicy({"halt_after_consecutive_flushes": 0})
    assert {judge(policy, valid_tokens=0).action for _ in range(8)} == {Action.FLUSH}


def test_state_round_trips_through_json_and_judges_the_same() -> None:
    first = GuardPolicy()
    for i in range(40):
        judge(first, grad_norm=1.0 / (10 + i % 7), valid_tokens=10 + i % 7, loss=0.01 * (i % 3))
    judge(first, valid_tokens=0)
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    second = GuardPolicy()
    second.load_state_dict(state)
    assert second.state_dict() == first.state_dict()
    assert second.gradnorm_vtc_correlation == first.gradnorm_vtc_correlation > 0.8
    for fields in ({"loss": 5.0}, {"valid_tokens": 0}, {}):
        assert judge(first, **fields).to_dict() == judge(second, **fields).to_dict()


def test_bad_state_and_bad_config_are_guards_errors() -> None:
    with pytest.raises(GuardsError, match="format"):
        GuardPolicy().load_state_dict({"guards": {}})
    state = GuardPolicy().state_dict()
    state["guards"]["spike"]["windows"]["loss"] = ["x"]
    with pytest.raises(GuardsError, match="spike"):
        GuardPolicy().load_state_dict(state)
    with pytest.raises(GuardsError, match=r"clip\.window"):
        GuardPolicy({"clip": {"window": 0}})
    with pytest.raises(GuardsError, match="nonsense"):
        GuardPolicy({"nonsense": 1})


def test_reload_changes_thresholds_and_keeps_history() -> None:
    policy = GuardPolicy()
    for i in range(20):
        judge(policy, grad_norm=1.0 / (10 + i % 5), valid_tokens=10 + i % 5)
    before = policy.gradnorm_vtc_correlation
    assert before is not None and before > 0.8
    policy.reload(GuardsConfig.model_validate({"gradnorm_vtc_correlation": {"threshold": 1.0}}))
    assert policy.gradnorm_vtc_correlation == before
    assert judge(policy, grad_norm=0.0).by("gradnorm_vtc_correlation") == []
    policy.reload({"accounting": {"mode": "nonzero"}})
    assert judge(policy, valid_tokens=9).action is Action.PASS


def test_decide_step_applies_flushes_and_keeps_a_flushed_policy_bit_identical() -> None:
    eng = engine(faults={"nan_loss_steps": [1]})
    policy = GuardPolicy()
    digest = eng.state_digest()
    first = decide_step(eng, policy, eng.rollout())
    assert first.outcome is Outcome.APPLIED and first.verdict.action < Action.FLUSH
    assert eng.state_digest() != digest and "guards" in first.phase_seconds
    digest = eng.state_digest()
    second = decide_step(eng, policy, eng.rollout())
    assert second.outcome is Outcome.FLUSHED and second.verdict.by("finite")
    assert eng.state_digest() == digest and eng.step == 2
    assert math.isnan(second.report.loss)


def test_non_finite_weights_after_an_apply_halt() -> None:
    # the finite guard told to let a step with an inf gradient through: the apply poisons
    # the weights, and the weights check halts
    eng = engine(faults={"inf_grad_steps": [0]})
    policy = GuardPolicy({"finite": {"action": "PASS"}})
    result = decide_step(eng, policy, eng.rollout())
    verdict = result.verdict
    assert result.outcome is Outcome.APPLIED and verdict.action is Action.HALT
    assert (
        verdict.findings[-1].guard == "finite" and "weight tensors" in verdict.findings[-1].message
    )


def test_the_weights_cover_follows_the_engines_parameters() -> None:
    eng = engine()
    policy = GuardPolicy()
    weights = policy.weights_of(eng.model)
    cover = policy.weights_cover
    flat = eng.flat_weights.untyped_storage().data_ptr()
    assert cover is not None and cover.untyped_storage().data_ptr() == flat
    for p in eng.model.parameters():  # moved out of the buffer: the cover must not go stale
        p.data = p.data.clone()
    again = policy.weights_of(eng.model)  # walked again: the same Parameter objects
    assert all(a is b for a, b in zip(again, weights, strict=True))
    assert policy.weights_cover is None
    with torch.no_grad():
        eng.model.lm_head.weight[0, 0] = math.inf
    (finding,) = policy.check_weights(policy.weights_of(eng.model), None)
    assert finding.action is Action.HALT and finding.evidence["nonfinite_tensors"] == 1


def test_skip_fast_skips_the_compute_and_advances_the_cursor() -> None:
    eng = engine(
        **W2_GEOMETRY,
        prompts_per_step=1,
        group_size=2,
        micro_batch_rows=1,
        max_new_tokens=1,
        long_prompt_batch_fraction=1.0,
        faults={"accounting": "last_micro_first_chunk"},
    )
    policy = GuardPolicy()
    digest = eng.state_digest()
    result = decide_step(eng, policy, eng.rollout())
    report, verdict = result.report, result.verdict
    assert result.outcome is Outcome.SKIPPED and report.skipped_compute
    assert verdict.action is Action.FLUSH and verdict.by("reorder")
    assert policy.skip_fast_total == 1 and eng.step == 1 and eng.state_digest() == digest


def test_policy_state_travels_in_an_engine_checkpoint(tmp_path) -> None:
    eng = engine()
    policy = GuardPolicy()
    for _ in range(2):
        decide_step(eng, policy, eng.rollout())
    judge(policy, valid_tokens=0)
    path = save_checkpoint(tmp_path / "step-2", {"engine": eng, "guards": policy})
    resumed = GuardPolicy()
    load_checkpoint(path, {"engine": engine(), "guards": resumed})
    assert resumed.state_dict() == policy.state_dict()
    assert resumed.consecutive_flushes == 1
