"""reward_hacking: each rule fires at onset on a constructed history and stays silent on the
honest version of the same history; persistence HALTs; state round-trips."""

from __future__ import annotations

import json
import math
import random

import pytest

from grpod.guards import Action, GuardPolicy, GuardsError
from grpod.guards.config import RewardHackingConfig
from grpod.guards.reward_hacking import RewardHackingGuard
from grpod.guards.trend import quarter_means, trend
from tests.guards.helpers import batch, report

AUDIT = "audits:exact"


def _step(step: int, reward: float, audit: float | None = None, **fields: object):
    audits = {} if audit is None else {AUDIT: {"mean": audit, "std": 0.0}}
    return report(step=step, reward_mean=reward, audit_rewards=audits, **fields)


def _run(guard: RewardHackingGuard, reports: list) -> list[tuple[int, list]]:
    """(step, findings) of every step that had findings."""
    out = []
    for r in reports:
        found = guard.after(batch(rewards=[1.0, 0.0]), r)
        if found:
            out.append((r.step, found))
    return out


def _noise(seed: int, n: int, scale: float = 0.03) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(0.0, scale) for _ in range(n)]


def test_trend_reads_slope_t_and_quarters() -> None:
    line = trend([0.0, 1.0, 2.0, 3.0])
    assert line.slope == 1.0 and line.t == math.inf and line.rise == 3.0
    assert trend([2.0] * 8).t == 0.0
    assert quarter_means([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]) == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError):
        trend([1.0, 2.0])


def test_divergence_warns_at_onset_then_halts_on_persistence() -> None:
    cfg = RewardHackingConfig(halt_after=30)
    guard = RewardHackingGuard(cfg)
    noise = _noise(0, 60)
    reports = [_step(s, 0.25 + 0.015 * s + noise[s], 0.01 + noise[-s] / 10) for s in range(60)]
    hits = _run(guard, reports)
    first_step, (finding,) = hits[0]
    assert first_step == cfg.min_steps - 1 + cfg.warn_after - 1  # the earliest it can
    assert finding.kind == "divergence" and finding.action is Action.WARN
    assert "while audit reward audits:exact did not" in finding.message
    assert finding.evidence["trained_q4"] > finding.evidence["trained_q1"] + 0.1
    assert finding.evidence["example_sample"] == 0.0  # the batch's rewards [1, 0]: sample 0
    halts = [s for s, found in hits if any(f.action is Action.HALT for f in found)]
    assert halts and halts[0] == first_step + cfg.halt_after - cfg.warn_after


def test_divergence_silent_when_the_audit_follows() -> None:
    guard = RewardHackingGuard(RewardHackingConfig())
    noise = _noise(1, 80)
    reports = [_step(s, 0.2 + 0.01 * s + noise[s], 0.1 + 0.008 * s + noise[-s]) for s in range(80)]
    assert _run(guard, reports) == []


def test_divergence_against_a_flat_eval_below_the_trained_reward() -> None:
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    found = []
    for s in range(40):
        found += guard.after(batch(), _step(s, 0.3 + 0.01 * s))
        if s % 5 == 4:
            guard.observe_eval(s + 1, {"total": 0.3})
    assert found and found[0].kind == "divergence" and "held-out eval" in found[0].message
    # an eval at or above the trained reward (greedy beats sampling) is no evidence
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    for s in range(40):
        assert guard.after(batch(), _step(s, 0.3 + 0.01 * s)) == []
        if s % 5 == 4:
            guard.observe_eval(s + 1, {"total": 0.97})


def test_length_drift_in_step_with_reward_while_the_audit_falls() -> None:
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    reports = [_step(s, 0.3 + 0.01 * s, 0.5, completion_length_mean=8.0) for s in range(20)]
    reports += [
        _step(20 + s, 0.5 + 0.01 * s, 0.5 - 0.01 * s, completion_length_mean=8.0 + 2 * s)
        for s in range(30)
    ]
    kinds = {f.kind for _, found in _run(guard, reports) for f in found}
    assert "length" in kinds
    # the same length growth with the audit rising along: a policy learning to say more
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    honest = [
        _step(s, 0.3 + 0.01 * s, 0.3 + 0.01 * s, completion_length_mean=8.0 + s) for s in range(50)
    ]
    assert _run(guard, honest) == []


def test_degeneration_rises_while_the_second_opinion_falls_from_its_best() -> None:
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    stats = [{"identical_completion_fraction": 0.1, "repeated_ngram_fraction": 0.0}] * 20
    reports = [_step(s, 0.6, completion_stats=stats[s]) for s in range(20)]
    reports += [
        _step(
            20 + s,
            0.6 - 0.01 * s,
            completion_stats={"identical_completion_fraction": 0.1 + 0.03 * s},
        )
        for s in range(30)
    ]
    kinds = {f.kind for _, found in _run(guard, reports) for f in found}
    assert "degeneration" in kinds
    # an honest policy converging: one answer per prompt while its reward climbs to its best
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    honest = [
        _step(
            s,
            min(1.0, 0.3 + 0.02 * s),
            completion_stats={"identical_completion_fraction": min(1.0, 0.02 * s)},
        )
        for s in range(80)
    ]
    assert _run(guard, honest) == []


def test_term_dominance_one_term_rises_another_falls() -> None:
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    guard.weights = {"r:correct": 1.0, "r:format": 0.5}

    def terms(a: float, b: float) -> dict:
        return {"r:correct": {"mean": a, "std": 0.0}, "r:format": {"mean": b, "std": 0.0}}

    reports = [
        _step(
            s,
            (0.2 + 0.02 * s) + 0.5 * (0.8 - 0.005 * s),
            reward_functions=terms(0.2 + 0.02 * s, 0.8 - 0.005 * s),
        )
        for s in range(40)
    ]
    kinds = {f.kind for _, found in _run(guard, reports) for f in found}
    assert "term_dominance" in kinds
    # W4's shape: one term gains, the other stays at 0 (not crowded out: never earned)
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    guard.weights = {"r:correct": 1.0, "r:format": 0.25}
    flat = [
        _step(s, 0.2 + 0.02 * s, reward_functions=terms(0.2 + 0.02 * s, 0.0)) for s in range(40)
    ]
    assert _run(guard, flat) == []


def test_term_weights_are_solved_from_the_batch() -> None:
    guard = RewardHackingGuard(RewardHackingConfig())
    b = batch(rewards=[1.25, 0.25, 1.0, 0.0])
    from dataclasses import replace

    b = replace(b, function_rewards={"a": [1.0, 0.0, 1.0, 0.0], "b": [1.0, 1.0, 0.0, 0.0]})
    b = replace(b, sample_group_ids=b.sample_group_ids.new_zeros(4))
    guard.after(b, _step(0, 0.625))
    assert guard.weights == {"a": 1.0, "b": 0.25}


def test_kl_growing_without_gain() -> None:
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    reports = [_step(s, 0.8, kl=0.001) for s in range(20)]
    reports += [_step(20 + s, 0.8 - 0.005 * s, kl=0.001 + 0.002 * s) for s in range(30)]
    kinds = {f.kind for _, found in _run(guard, reports) for f in found}
    assert "kl_efficiency" in kinds
    # KL growing while the reward holds its best: the honest drift of a converged policy
    guard = RewardHackingGuard(RewardHackingConfig(warn_after=1))
    honest = [_step(s, 0.8, kl=0.001 + 0.002 * s) for s in range(50)]
    assert _run(guard, honest) == []


def test_single_step_blip_is_no_finding() -> None:
    guard = RewardHackingGuard(RewardHackingConfig())
    reports = [_step(s, 0.5 + (0.5 if s == 30 else 0.0), 0.4) for s in range(60)]
    assert _run(guard, reports) == []


def test_state_round_trips_and_rejects_garbage() -> None:
    guard = RewardHackingGuard(RewardHackingConfig())
    _run(guard, [_step(s, 0.3 + 0.02 * s, 0.0, kl=0.01) for s in range(20)])
    guard.observe_eval(10, {"total": 0.2})
    _run(guard, [_step(20, 0.7, 0.0)])  # a step without KL: None, strict JSON in the checkpoint
    state = json.loads(json.dumps(guard.state_dict(), allow_nan=False))
    again = RewardHackingGuard(RewardHackingConfig())
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(GuardsError, match="reward_hacking"):
        again.load_state_dict({"steps": 3})


def test_policy_runs_the_guard_and_takes_evals() -> None:
    policy = GuardPolicy()
    assert "reward_hacking" in policy.guards and policy.guards["reward_hacking"].enabled
    policy.observe_eval(10, {"total": 0.5})
    assert list(policy.guards["reward_hacking"].evals) == [(10, 0.5)]
    saved = policy.state_dict()
    GuardPolicy().load_state_dict(saved)


def test_the_windows_columns_and_audit_names_follow_the_records() -> None:
    """What the rules read beside the records (each series, the audits' names) is the window's
    own: an audit reward that left the window is no longer named, a resize or a restore keeps
    them in step, and a saved record without a series is malformed state."""
    guard = RewardHackingGuard(RewardHackingConfig(window=8, min_steps=4))
    _run(guard, [_step(s, 0.1 * s, 0.05 * s) for s in range(6)])
    _run(guard, [_step(s, 0.1 * s) for s in range(6, 14)])  # 8 steps without an audit
    assert guard._audit_names() == []
    assert guard._series("reward") == [r["reward"] for r in guard.steps]
    guard.configure(RewardHackingConfig(window=4, min_steps=4))
    assert guard._series("reward") == pytest.approx([1.0, 1.1, 1.2, 1.3])
    _run(guard, [_step(14, 2.0, 1.0)])
    assert guard._audit_names() == [AUDIT]
    again = RewardHackingGuard(RewardHackingConfig(window=4, min_steps=4))
    again.load_state_dict(guard.state_dict())
    assert again._audit_names() == [AUDIT] and again._series("kl") == guard._series("kl")
    state = guard.state_dict()
    del state["steps"][0]["length"]
    with pytest.raises(GuardsError, match="reward_hacking"):
        again.load_state_dict(state)
