"""Drill fault hooks: identity by default, each fault only on the steps it names."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.config import FaultsConfig
from grpod.engine.errors import EngineError
from grpod.engine.faults import (
    LOSS_SPIKE_SCALE,
    POISON_LOGPROB_SHIFT,
    POISON_LOSS_SCALE,
    SENTINEL_LOGPROB,
    Faults,
)
from tests.batches import make_batch


def hooks(**config: object) -> Faults:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Faults(FaultsConfig.model_validate(config))


def test_default_hooks_return_their_input_untouched() -> None:
    faults = hooks()
    rewards, grads = torch.tensor([1.0, 0.0, 0.5, 0.25]), [torch.ones(3)]
    logprobs = [[], [-0.5, -1.0]]
    assert faults.rewards(0, rewards, 2) is rewards
    assert faults.advantages(0, rewards) is rewards
    assert faults.sampler_logprobs(0, logprobs) == [[], [-0.5, -1.0]]
    loss = rewards.sum()
    assert faults.micro_loss(0, 0, loss) is loss
    faults.grads(0, grads)
    assert grads[0].tolist() == [1.0, 1.0, 1.0]
    assert not faults.per_micro_accounting and faults.injected(0) == ()


def test_each_fault_hits_only_its_steps() -> None:
    faults = hooks(
        nan_loss_steps=[1],
        inf_grad_steps=[1],
        sentinel_logprob_steps=[1],
        equal_reward_steps=[1],
        loss_spike_steps=[2],
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    assert faults.rewards(1, rewards, 2).tolist() == [1.0, 1.0, 0.5, 0.5]
    assert faults.rewards(2, rewards, 2) is rewards
    assert torch.equal(faults.advantages(2, rewards), rewards * LOSS_SPIKE_SCALE)
    assert faults.sampler_logprobs(1, [[], [-0.5, -1.0]]) == [[], [SENTINEL_LOGPROB, -1.0]]
    assert math.isnan(faults.micro_loss(1, 0, torch.tensor(2.0)))
    assert faults.micro_loss(1, 1, torch.tensor(2.0)) == 2.0  # micro 0 only
    grads = [torch.ones(2)]
    faults.grads(1, grads)
    assert grads[0].tolist() == [math.inf, 1.0]
    assert faults.injected(1) == ("equal-rewards", "inf-grad", "nan-loss", "sentinel-logprob")
    assert faults.injected(2) == ("loss-spike",) and faults.injected(3) == ()


def test_faults_on_warn_and_the_accounting_fault_is_per_micro() -> None:
    with pytest.warns(UserWarning, match="FAULT INJECTION IS ON"):
        faults = Faults(FaultsConfig(accounting="last_micro_first_chunk"))
    assert faults.per_micro_accounting


def test_faults_fire_only_on_the_ranks_they_name() -> None:
    config = FaultsConfig(nan_loss_steps=[1], accounting="last_micro_first_chunk", ranks=[1])
    loss = torch.tensor(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rank0, rank1 = Faults(config, rank=0), Faults(config, rank=1)
    assert rank0.micro_loss(1, 0, loss) is loss and rank0.injected(1) == ()
    assert not rank0.per_micro_accounting
    assert math.isnan(float(rank1.micro_loss(1, 0, loss))) and rank1.injected(1) == ("nan-loss",)
    assert rank1.per_micro_accounting


def _batch(step: int) -> TransportBatch:
    """One micro, one row: sample 0 at positions 0-3 (trained 2-3), sample 1 at 4-7 (6-7)."""
    shape = (1, 1, 8)
    return make_batch(
        loss_mask=torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool).reshape(shape),
        input_ids=torch.arange(8).reshape(shape),
        position_ids=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]).reshape(shape),
        advantages=torch.ones(shape),
        sample_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32).reshape(shape),
        rewards=torch.tensor([1.0, 0.0]),
        completion_lengths=torch.tensor([2, 2], dtype=torch.int32),
        step=step,
    )


def test_poison_sample_hits_one_sample_of_its_steps_only() -> None:
    poison = dict(poison_sample_steps=[1], poison_sample_index=1)
    shift = hooks(**poison, poison_sample_kind="logprob-shift")
    assert shift.sampler_logprobs(0, [[-1.0], [-1.0]]) == [[-1.0], [-1.0]]
    assert shift.sampler_logprobs(1, [[-1.0], [-1.0]]) == [[-1.0], [-1.0 + POISON_LOGPROB_SHIFT]]
    assert shift.injected(1) == ("poison-sample",)
    scale = hooks(**poison, poison_sample_kind="loss-scale")
    loss, index = torch.ones(4), torch.tensor([2, 3, 6, 7])
    assert scale.token_loss(_batch(0), 0, index, loss) is loss
    assert scale.token_loss(_batch(1), 0, index, loss).tolist() == [1, 1, 100, 100]
    assert POISON_LOSS_SCALE == 100


def test_nan_logits_poisons_the_sample_states_from_its_layer() -> None:
    block = torch.nn.Module()
    block.mlp = torch.nn.Module()
    block.mlp.down_proj = torch.nn.Identity()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module(), block])
    faults = hooks(poison_sample_steps=[1], poison_sample_index=1, poison_sample_layer=1)
    source = torch.arange(8)  # a plain layout: position p is trunk row p of [1, 8]
    states = torch.zeros(1, 8, 3)
    with faults.trunk(model, _batch(0), [0], source, (1, 8)):
        assert torch.isfinite(block.mlp.down_proj(states)).all()
    with faults.trunk(model, _batch(1), [0], source, (1, 8)):
        out = block.mlp.down_proj(states)
    assert (~torch.isfinite(out)).any(-1)[0].tolist() == [False] * 6 + [True] * 2
    assert torch.isfinite(block.mlp.down_proj(states)).all()  # the hook is gone
    wrong = hooks(poison_sample_steps=[1], poison_sample_layer=5)
    with (
        pytest.raises(EngineError, match="poison_sample_layer 5"),
        wrong.trunk(model, _batch(1), [0], source, (1, 8)),
    ):
        pass
