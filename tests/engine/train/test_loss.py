"""Scoring alignment, masking, clamping and TIS, through the engine's own step."""

import pytest
import torch

from grpod.engine import Engine, EngineError
from grpod.engine.train.loss import LossSettings, policy_token_loss
from tests.engine.helpers import config, hand_batch

SEQUENCE = [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 2]  # <bos> 0 1 ... 9 <eos>


def _memorise(engine: Engine, tokens: list[int], steps: int = 200) -> None:
    """Teach the tiny model the sequence with plain next-token SFT (p -> p+1)."""
    opt = torch.optim.Adam(engine.model.parameters(), lr=1e-2)
    ids = torch.tensor([tokens])
    for _ in range(steps):
        opt.zero_grad()
        engine.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    engine.model.zero_grad(set_to_none=True)


def test_completion_token_p_is_scored_by_the_logits_at_p_minus_1() -> None:
    engine = Engine(config(seq_len=16))
    _memorise(engine, SEQUENCE)
    batch = hand_batch([(SEQUENCE, 4, 1.0)])
    logprobs = engine.score(batch).cpu()[batch.loss_mask]
    assert logprobs.numel() == len(SEQUENCE) - 4
    assert logprobs.mean() > -0.3  # the memorised next tokens are near-certain
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE], device=engine.device)
        logits = engine.model(input_ids=ids).logits[0].log_softmax(-1).cpu()
    targets = torch.tensor(SEQUENCE[4:])[:, None]
    right = logits[3:-1].gather(-1, targets).squeeze(-1)
    assert torch.allclose(logprobs, right, atol=1e-5)
    # the off-by-one reading (logits at p scoring token p) is far from certain
    wrong = logits[4:].gather(-1, targets).squeeze(-1)
    assert wrong.mean() < -2.0


def test_padding_after_eos_contributes_nothing() -> None:
    engine = Engine(config(seq_len=16))
    stopped = hand_batch([([1, 3, 13, 4, 2], 3, 1.0), ([1, 5, 13, 2], 3, -1.0)])
    padded = hand_batch([([1, 3, 13, 4, 2, 0, 0], 3, 1.0), ([1, 5, 13, 2, 0, 0, 0], 3, -1.0)])
    # the padded form keeps the pad tokens in the row but out of the loss mask
    mask = padded.loss_mask.clone()
    mask[padded.input_ids == 0] = False
    from dataclasses import replace

    padded = replace(padded, loss_mask=mask)
    a = engine.accumulate(stopped)
    grads_a = [p.grad.clone() for p in engine.params]
    engine.flush()
    b = engine.accumulate(padded)
    grads_b = [p.grad.clone() for p in engine.params]
    engine.flush()
    assert a.valid_tokens == b.valid_tokens == a.expected_valid_tokens == 2 + 1
    assert a.loss == pytest.approx(b.loss, abs=1e-6)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(grads_a, grads_b))


@pytest.mark.parametrize("old", [float("-inf"), -9999.0])
@pytest.mark.parametrize("kind", ["ppo", "cispo"])
def test_extreme_old_logprobs_give_a_finite_loss_and_grad(old: float, kind: str) -> None:
    engine = Engine(config(loss=kind, tis_cap=2.0))
    batch = engine.rollout()
    from dataclasses import replace

    olds = torch.where(batch.loss_mask, torch.full_like(batch.advantages, old), 0.0)
    sampler = torch.where(batch.loss_mask, torch.full_like(batch.advantages, old), 0.0)
    report = engine.accumulate(replace(batch, old_logprobs=olds, sampler_logprobs=sampler))
    assert torch.isfinite(torch.tensor(report.loss))
    assert torch.isfinite(torch.tensor(report.grad_norm))
    engine.flush()


def test_unclamped_ratio_would_overflow() -> None:
    lp = torch.tensor([-0.1], requires_grad=True)
    settings = LossSettings(logratio_clamp=20.0)
    out = policy_token_loss(lp, torch.tensor([-9999.0]), torch.tensor([1.0]), settings)
    assert torch.isfinite(out.loss).all()
    assert not torch.isfinite(torch.exp(lp - torch.tensor([-9999.0]))).all()


def test_tis_without_sampler_logprobs_raises() -> None:
    from dataclasses import replace

    engine = Engine(config(tis_cap=2.0))
    batch = replace(engine.rollout(), sampler_logprobs=None)
    with pytest.raises(EngineError, match="no sampler logprobs"):
        engine.accumulate(batch)


def test_single_epoch_ratio_is_exactly_one_and_ppo_clips() -> None:
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    s = LossSettings(eps_low=0.2, eps_high=0.28)
    same = policy_token_loss(lp, lp.detach(), adv, s)
    assert torch.equal(same.loss, -adv) and not same.clipped_high.any()
    moved = policy_token_loss(lp, torch.tensor([-1.5, -0.5, -1.0, -1.0]), adv, s)
    assert moved.clipped_high.tolist() == [True, False, False, False]
    assert moved.clipped_low.tolist() == [False, True, False, False]
    assert moved.loss[0] == pytest.approx(-1.28)


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    lp = torch.tensor([-1.0, -2.0])
    s = LossSettings(kl_beta=0.1)
    at_ref = policy_token_loss(lp, lp, torch.zeros(2), s, ref_logprobs=lp.clone())
    assert torch.equal(at_ref.kl, torch.zeros(2))
    off = policy_token_loss(lp, lp, torch.zeros(2), s, ref_logprobs=torch.tensor([-1.5, -1.0]))
    assert (off.kl > 0).all()
    engine = Engine(config(kl_beta=0.05))
    report = engine.accumulate(engine.rollout())
    assert report.kl == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    engine.apply()
    report = engine.accumulate(engine.rollout())
    assert report.kl > 0
    engine.flush()


def test_epochs_two_scores_once_and_reuses_it() -> None:
    engine = Engine(config(epochs=2))
    first = engine.rollout()
    assert first.old_logprobs is not None
    report = engine.accumulate(first)
    assert report.clip_fraction_high == 0.0
    engine.apply()
    second = engine.rollout()
    assert second.step == 1 and torch.equal(second.old_logprobs, first.old_logprobs)
    assert torch.equal(second.input_ids, first.input_ids)
    engine.accumulate(second)
    engine.apply()
    assert engine.rollout().generation == 1
