import math
from dataclasses import replace
from pathlib import Path

import torch

from grpod.engine import Engine
from grpod.engine.grpo.step import Outcome, decide_step
from grpod.engine.model.flat import storage_cover
from grpod.guards import Action, GuardPolicy
from grpod.guards.config import FiniteConfig
from grpod.guards.finite import FiniteGuard
from tests.engine.helpers import config
from tests.guards.helpers import batch, report

GUARD = FiniteGuard(FiniteConfig())


def messages(findings) -> list[str]:
    assert all(f.action is Action.FLUSH for f in findings)
    return [f.message for f in findings]


def test_a_healthy_step_passes() -> None:
    assert GUARD.after(batch(), report()) == []


def test_non_finite_loss_micro_loss_and_grad_norm_flush() -> None:
    assert messages(GUARD.after(batch(), report(loss=math.nan))) == ["loss is nan"]
    found = GUARD.after(batch(), report(micro_losses=[0.1, math.inf]))
    assert messages(found) == ["1 micro losses are non-finite (first: micro 1)"]
    assert messages(GUARD.after(batch(), report(grad_norm=math.inf))) == ["grad norm is inf"]


def test_non_finite_reward_flushes() -> None:
    found = GUARD.after(batch(rewards=[1.0, math.nan]), report())
    assert messages(found) == ["1 rewards are non-finite (first: sample 1, nan)"]
    assert found[0].evidence["first_sample"] == 1.0


def test_a_nan_reward_is_named_before_the_nan_loss_it_causes() -> None:
    found = GUARD.after(batch(rewards=[math.inf, math.nan]), report(loss=math.nan))
    assert messages(found) == ["2 rewards are non-finite (first: sample 0, inf)", "loss is nan"]


def test_non_finite_values_count_only_on_trainable_tokens() -> None:
    b = batch([[0, 1, 1, 0]])
    b.advantages[0, 0, 0] = math.nan  # a prompt token: not trained, not a fault
    b.sampler_logprobs[0, 0, 3] = -math.inf
    assert GUARD.after(b, report()) == []
    b.advantages[0, 0, 1] = math.nan
    b.sampler_logprobs[0, 0, 2] = math.nan
    found = messages(GUARD.after(b, report()))
    assert found == [
        "1 trainable tokens have a non-finite advantage",
        "1 trainable tokens have a non-finite sampler_logprob",
    ]


def test_sentinel_logprobs_flush_at_and_below_the_limit() -> None:
    for value in (-9999.0, -1e4, -1000.0):  # the engine's sentinel, the classic one, the limit
        found = GUARD.after(batch(sampler=value), report())
        assert len(found) == 1 and "sentinel" in found[0].message
        assert found[0].evidence["sentinel_tokens"] == 2
    assert GUARD.after(batch(sampler=-999.0), report()) == []  # just above: a real logprob
    assert GUARD.after(batch(sampler=None), report()) == []  # no sampler logprobs at all


def test_weights_check_halts_on_non_finite_weights() -> None:
    good = [torch.zeros(3), torch.ones(2, 2)]
    assert GUARD.check_weights(good) == []
    (finding,) = GUARD.check_weights([*good, torch.tensor([1.0, math.nan])])
    assert finding.action is Action.HALT and finding.evidence["nonfinite_tensors"] == 1


def test_the_fast_check_agrees_with_the_full_one_on_every_fault() -> None:
    """`after` skips the per-token look only when `_clean` proves it would find nothing."""
    cases = []
    for where in ((0, 0, 0), (0, 0, 1)):  # a prompt token, a trainable token
        for name in ("advantages", "sampler_logprobs", "old_logprobs"):
            for value in (math.nan, math.inf, -math.inf, -9999.0, -1000.0, -999.0):
                b = batch([[0, 1, 1, 0]])
                if name == "old_logprobs":
                    b = replace(b, old_logprobs=torch.full_like(b.advantages, -0.5))
                getattr(b, name)[where] = value
                cases.append(b)
    for rewards in ([math.nan, 0.0], [math.inf, 1.0], [1.0, -math.inf]):
        cases.append(batch(rewards=rewards))
    cases.append(batch(sampler=None))
    lenient = FiniteGuard(FiniteConfig(sentinel_logprob_max=0.5))  # the fill value 0 is below
    for guard in (GUARD, lenient):
        for b in cases:
            full = [f.message for f in guard._findings(b, report())]
            assert [f.message for f in guard.after(b, report())] == full
            if guard._clean(b, report()):
                assert full == []
    assert GUARD._clean(batch(), report())  # the healthy step takes the fast path


def test_weights_whose_norms_overflow_in_sum_are_still_finite() -> None:
    big = [torch.tensor([3e38]), torch.tensor([3e38])]  # each norm finite, their sum is not
    assert GUARD.check_weights(big) == []


def test_weights_check_over_one_shared_buffer() -> None:
    buffer = torch.zeros(16)
    weights = [buffer[0:3], buffer[8:12].view(2, 2)]  # padding between them, as the engine
    cover = storage_cover(weights)
    assert cover is not None and cover.numel() == 16
    assert storage_cover([torch.zeros(3), torch.zeros(4)]) is None  # two allocations
    assert GUARD.check_weights(weights, cover) == []
    buffer[9] = math.nan
    (finding,) = GUARD.check_weights(weights, cover)
    assert finding.action is Action.HALT and finding.evidence["nonfinite_tensors"] == 1
    buffer[9] = 0.0
    buffer[0] = buffer[1] = 3e38  # every value finite, their sum is not
    assert GUARD.check_weights(weights, cover) == []
    buffer[0] = buffer[1] = 0.0
    buffer[5] = math.inf  # in the storage, but in no weight: not a finding
    assert GUARD.check_weights(weights, cover) == []


def test_a_nan_reward_in_the_run_flushes_the_step(tmp_path: Path, monkeypatch) -> None:
    """A reward function's NaN is a step fault (engine/data/rewardcall.py `NonFinite.PASS`): the
    rollout returns it, the finite guard flushes the step and the weights stay as they were."""
    (tmp_path / "nanreward.py").write_text("def nan(p, c, a):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(config(rewards=["nanreward:nan"], max_new_tokens=2))
    before = engine.state_digest()
    result = decide_step(engine, GuardPolicy(), engine.rollout())
    assert result.outcome is Outcome.FLUSHED and result.verdict.action is Action.FLUSH
    assert engine.state_digest() == before
    finite = [f.message for f in result.verdict.findings if f.guard == "finite"]
    assert finite[0] == "16 rewards are non-finite (first: sample 0, nan)", finite
