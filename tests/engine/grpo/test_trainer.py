"""accumulate / apply / flush, state digests, checkpoints, and learning on `copy`."""

from pathlib import Path

import pytest
import torch

from grpod.engine import Engine, EngineConfig, EngineError
from tests.engine.helpers import config, rollouts_with_signal


def test_flush_after_accumulate_leaves_the_state_digest_unchanged() -> None:
    engine = Engine(config())
    for _ in range(2):  # give AdamW non-trivial moments first
        engine.accumulate(engine.rollout())
        engine.apply()
    before = engine.state_digest()
    lr = engine.optimizer.param_groups[0]["lr"]
    flushed_nonzero = 0
    for _ in range(4):
        report = engine.accumulate(engine.rollout())
        flushed_nonzero += report.grad_norm > 0
        engine.flush()
        assert engine.state_digest() == before
    assert flushed_nonzero > 0
    assert engine.optimizer.param_groups[0]["lr"] == lr
    assert all(p.grad is None for p in engine.params)
    assert engine.step == 6  # the data cursor moves on; the policy does not


def test_apply_changes_the_state_and_reports_pre_clip_norm() -> None:
    engine = Engine(config(max_grad_norm=1e-3))
    (batch,) = rollouts_with_signal(engine)
    before = engine.state_digest()
    report = engine.accumulate(batch)
    assert report.grad_norm > 1e-3 and report.clip_coef < 1.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in engine.params])
    assert float(norm) == report.grad_norm  # known after accumulate, before apply
    engine.apply()
    assert engine.state_digest() != before


def test_accumulate_twice_is_an_error() -> None:
    engine = Engine(config())
    batch = engine.rollout()
    engine.accumulate(batch)
    with pytest.raises(EngineError, match="accumulate before apply or flush"):
        engine.accumulate(batch)
    engine.flush()
    with pytest.raises(EngineError, match="without a pending"):
        engine.apply()


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    cfg = config(lr_schedule="cosine", warmup_steps=2, total_steps=10)
    straight = Engine(cfg)
    for _ in range(6):
        straight.accumulate(straight.rollout())
        straight.apply()
    first = Engine(cfg)
    for _ in range(3):
        first.accumulate(first.rollout())
        first.apply()
    first.save_checkpoint(tmp_path / "ck", extra={"guards": {"n": 3}})
    resumed = Engine(cfg)
    assert resumed.load_checkpoint(tmp_path / "ck") == {"guards": {"n": 3}}
    assert resumed.state_digest() == first.state_digest()
    for _ in range(3):
        resumed.accumulate(resumed.rollout())
        resumed.apply()
    assert resumed.state_digest() == straight.state_digest()


def test_bad_checkpoints_are_rejected(tmp_path: Path) -> None:
    engine = Engine(config())
    engine.accumulate(engine.rollout())
    engine.apply()  # a fresh AdamW holds no tensors: optimizer.safetensors is written after a step
    engine.save_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "optimizer.safetensors").unlink()
    with pytest.raises(EngineError, match=r"missing optimizer\.safetensors"):
        Engine(config()).load_checkpoint(tmp_path / "ck")
    other = Engine(config(task="kv-retrieval", seq_len=256))
    other.save_checkpoint(tmp_path / "kv")
    with pytest.raises(EngineError, match="shape"):
        Engine(config()).load_checkpoint(tmp_path / "kv")


def test_nan_and_inf_faults_surface_in_the_report() -> None:
    engine = Engine(config(faults={"nan_loss_steps": [0], "inf_grad_steps": [1]}))
    nan = engine.accumulate(engine.rollout())
    assert nan.loss != nan.loss and nan.micro_losses[0] != nan.micro_losses[0]
    assert nan.grad_norm != nan.grad_norm  # a NaN loss poisons the gradients as well
    engine.flush()
    inf = engine.accumulate(engine.rollout())
    assert inf.grad_norm == float("inf")
    engine.flush()
    clean = engine.accumulate(engine.rollout())
    assert torch.isfinite(torch.tensor([clean.loss, clean.grad_norm])).all()
    engine.flush()


def test_sampler_mismatch_is_small_when_sampler_and_trainer_agree() -> None:
    engine = Engine(config())
    report = engine.accumulate(engine.rollout())
    assert report.mismatch_p99 is not None and report.mismatch_p99 < 1e-4
    assert report.mismatch_frac_above_0_1 == 0.0
    engine.flush()


@pytest.mark.slow  # the fast tier stays under ~2 minutes
def test_learning_on_copy_rises_from_chance_to_0_8() -> None:
    # one thread, as every test: the gate runs two tests at once on two cores
    engine = Engine(EngineConfig(task="copy"))
    rewards = []
    for _ in range(300):
        report = engine.accumulate(engine.rollout())
        engine.apply()
        rewards.append(report.reward_mean)
        if len(rewards) >= 5 and sum(rewards[-5:]) / 5 >= 0.8:
            break
    assert sum(rewards[:5]) / 5 < 0.3  # chance is 1/15 of the vocabulary
    assert sum(rewards[-5:]) / 5 >= 0.8, f"5-step mean {sum(rewards[-5:]) / 5:.2f} after 300 steps"


def test_the_engine_docstring_example_runs() -> None:
    import doctest

    from grpod.engine.grpo import trainer

    (test,) = doctest.DocTestFinder(recurse=False).find(trainer.Engine, "Engine", globs={})
    result = doctest.DocTestRunner().run(test)
    assert result.attempted == 7 and result.failed == 0
