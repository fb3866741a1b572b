"""Audit rewards (scored, recorded, never trained on) and the completions' degeneration stats."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from grpod.engine import Engine, EngineConfig, TransportBatch
from grpod.engine.data.audit import completion_stats
from grpod.engine.data.packing import group_samples, pack
from grpod.engine.data.tasks import answer_anywhere_reward, exact_match_reward
from grpod.engine.grpo.eval import Evaluator
from grpod.guards.hack_drill import AUDIT_EXACT, HACK

W1C_AUDITED = {**HACK, "prompts_per_step": 2, "group_size": 4}  # the drill's, smaller


def _batch(completions: list[list[int]], group_size: int) -> TransportBatch:
    prompts = [[1, 5]] * (len(completions) // group_size)
    logprobs = [[-1.0] * len(c) for c in completions]
    samples = group_samples(prompts, completions, [0.0] * len(completions), logprobs, group_size, 0)
    return pack(
        samples,
        seq_len=16,
        micro_batch_rows=2,
        pack_rows=True,
        pad_token_id=0,
        rewards=torch.zeros(len(completions)),
        step=0,
        config_digest="test",
    )


def test_completion_stats_repeats_and_identical_groups() -> None:
    batch = _batch([[3, 4, 5, 3, 4, 5], [3, 4, 5, 3, 4, 5], [7, 8], [9]], group_size=2)
    stats = completion_stats(batch)
    # 4 3-grams per 6-token completion, 1 of them (3 4 5) repeated: 2 of 8 overall
    assert stats["repeated_ngram_fraction"] == pytest.approx(2 / 8)
    # group 0: identical pair (1.0); group 1: distinct (0.0)
    assert stats["identical_completion_fraction"] == pytest.approx(0.5)


def test_the_loophole_and_its_audit() -> None:
    assert answer_anywhere_reward("2+9=", "299", "2") == 1.0
    assert exact_match_reward("2+9=", "299", "2") == 0.0
    assert exact_match_reward("2+9=", "2", "2") == 1.0


def test_audit_rewards_ride_the_batch_but_not_the_advantages(tmp_path) -> None:
    engine = Engine(EngineConfig.model_validate(W1C_AUDITED))
    batch = engine.rollout()
    assert list(batch.audit_rewards) == [AUDIT_EXACT] and len(batch.audit_rewards[AUDIT_EXACT]) == 8
    # the trained rewards are the loophole's, untouched by the audit
    plain = Engine(EngineConfig.model_validate({**W1C_AUDITED, "audit_rewards": []})).rollout()
    assert torch.equal(plain.rewards, batch.rewards)
    assert torch.equal(plain.advantages, batch.advantages)
    path = tmp_path / "b.safetensors"
    batch.save(path)
    assert TransportBatch.load(path).audit_rewards == batch.audit_rewards
    plain.save(tmp_path / "p.safetensors")  # no audit: no metadata key, digest unchanged
    assert "audit_rewards" not in plain.metadata()
    report = engine.accumulate(batch)
    engine.flush()
    assert set(report.audit_rewards) == {AUDIT_EXACT}
    assert set(report.completion_stats) == {
        "repeated_ngram_fraction",
        "identical_completion_fraction",
    }
    concat = TransportBatch.concat([batch, replace(batch)])
    assert len(concat.audit_rewards[AUDIT_EXACT]) == 16


def test_audit_every_and_the_eval() -> None:
    cfg = {**W1C_AUDITED, "audit_every": 2, "eval_task": "copy-loophole", "eval_samples": 4}
    engine = Engine(EngineConfig.model_validate(cfg))
    assert engine.rollout().audit_rewards
    engine.step = 1
    assert engine.rollout().audit_rewards == {}
    result = Evaluator(engine).run()
    assert set(result.rewards) == {"total", f"audit:{AUDIT_EXACT}"}


def test_audit_rewards_listed_twice_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="audit_rewards lists a function twice"):
        EngineConfig(audit_rewards=[AUDIT_EXACT, AUDIT_EXACT])
