"""The training trunk against the Hugging Face forward it stands in for: bit for bit."""

from __future__ import annotations

import pytest
import torch

import grpod.engine.model.trunk as trunk_module
import grpod.engine.train.layout as layout_module
from grpod.engine import Engine
from grpod.engine.model.policy import build_tiny_qwen2
from grpod.engine.model.trunk import trunk_states, unsupported
from tests.engine.helpers import config, tiny_llama


def _packed_layout() -> layout_module.TrunkLayout:
    """A real step's joint trunk layout: shared prompts, several units per row, padding."""
    engine = Engine(config(prompts_per_step=4, group_size=4, micro_batch_rows=2))
    batch = engine.rollout()
    layout = layout_module.micro_layout(batch, list(range(batch.num_micros)))
    assert layout.input_ids.shape[0] >= 2 and not layout.attention_mask.all()
    return layout


def _hugging_face(model: torch.nn.Module, layout: layout_module.TrunkLayout) -> torch.Tensor:
    return model.base_model(
        input_ids=layout.input_ids,
        position_ids=layout.position_ids,
        attention_mask=layout.attention_mask,
        use_cache=False,
    ).last_hidden_state


def _states_and_grads(model: torch.nn.Module, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden = run()
    weights = torch.linspace(-1.0, 1.0, hidden.shape[-1])  # every feature, unequal weights
    (hidden * weights).pow(2).sum().backward()
    return hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_name", ["qwen2", "llama"])  # Qwen2: q/k/v biases; GQA 2 and 4
def test_trunk_states_and_gradients_are_bit_identical_to_hugging_face(model_name: str) -> None:
    model = build_tiny_qwen2(15) if model_name == "qwen2" else tiny_llama()
    assert unsupported(model, "float32") is None
    layout = _packed_layout()

    def ours() -> torch.Tensor:
        return trunk_states(model, layout.input_ids, layout.position_ids, layout.attention_mask)

    theirs_hidden, theirs_grads = _states_and_grads(model, lambda: _hugging_face(model, layout))
    ours_hidden, ours_grads = _states_and_grads(model, ours)
    assert torch.equal(ours_hidden, theirs_hidden)
    assert len(ours_grads) == len(theirs_grads) == len(list(model.base_model.parameters()))
    for ours_grad, theirs_grad in zip(ours_grads, theirs_grads):
        assert torch.equal(ours_grad, theirs_grad)


def test_engine_step_is_bit_identical_with_either_trunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole accumulate (loss, counter, grad norm, every gradient) does not depend on which
    trunk ran."""
    engine = Engine(config())
    batch = engine.rollout()

    def accumulate() -> tuple[float, float, list[torch.Tensor]]:
        report = engine.accumulate(batch)
        grads = [p.grad.clone() for p in engine.params]
        engine.flush()
        return report.loss, report.grad_norm, grads

    ours = accumulate()
    monkeypatch.setattr(trunk_module, "unsupported", lambda model, dtype: "forced")
    theirs = accumulate()
    assert ours[:2] == theirs[:2]
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2]))


def test_unsupported_names_the_reason() -> None:
    model = build_tiny_qwen2(15)
    assert "bfloat16" in unsupported(model, "bfloat16")

    model.config._attn_implementation = "eager"
    assert "eager" in unsupported(model, "float32")
    model.config._attn_implementation = "sdpa"

    model.config.attention_dropout = 0.1
    assert "dropout" in unsupported(model.train(), "float32")
    assert unsupported(model.eval(), "float32") is None  # no dropout outside training
    model.config.attention_dropout = 0.0

    handle = model.base_model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert "hooks" in unsupported(model, "float32")
    handle.remove()
    assert unsupported(model, "float32") is None
