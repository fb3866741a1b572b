"""The fused static-cache decoder against the Hugging Face forward it replaces."""

from __future__ import annotations

import pytest
import torch

import engine.fused as fused
from engine import Engine
from engine.fused import StaticDecoder, unsupported
from engine.model import build_tiny_qwen2
from engine.rollout import sample
from tests.engine.helpers import config, tiny_llama


@pytest.mark.parametrize("model_name", ["qwen2", "llama"])
@pytest.mark.parametrize("math_max_keys", [256, 0])  # prefill by batched matmuls, or SDPA
@pytest.mark.parametrize("groups", [[0, 0, 1, 2, 2, 2], [0, 0, 1, 1, 2, 2]])  # gather, broadcast
@pytest.mark.parametrize(
    ("prompts", "packed"),
    [
        ([[1, 4, 13, 5, 14], [1, 7, 14], [1, 9, 9, 13, 3, 14]], False),  # ragged, left padded
        ([[1, 4, 13, 5, 14, 3, 4, 5, 6], [1, 7, 14], [1, 9, 9, 13]], True),  # 2 rows, not 3
    ],
)
def test_decoder_logits_match_hugging_face_step_by_step(
    model_name: str,
    math_max_keys: int,
    groups: list[int],
    prompts: list[list[int]],
    packed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused, "MATH_ATTENTION_MAX_KEYS", math_max_keys)
    packings = []
    real_pack = fused._pack_prompts
    monkeypatch.setattr(
        fused, "_pack_prompts", lambda v: packings.append(real_pack(v)) or packings[-1]
    )
    model = build_tiny_qwen2(15) if model_name == "qwen2" else tiny_llama()
    fan_out = torch.tensor(groups)
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 2, 3, 10, 4, 5], [6, 6, 7, 7, 8, 8]])
    with torch.no_grad():
        decoder = StaticDecoder(model, 6, width + 3)
        got = [decoder.prefill(ids, positions, valid, fan_out)]
        full_ids, full_valid = ids[fan_out], valid[fan_out]
        position = positions[fan_out, -1]
        for t in range(3):
            position = position + 1
            got.append(decoder.step(tokens[t], position))
            full_ids = torch.cat([full_ids, tokens[t][:, None]], 1)
            full_valid = torch.cat([full_valid, torch.ones(6, 1, dtype=torch.bool)], 1)
        full_pos = (full_valid.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=full_ids, position_ids=full_pos, attention_mask=full_valid.long()
        ).logits
    for t, step_logits in enumerate(got):
        expected = logits[:, width - 1 + t]
        assert (step_logits - expected).abs().max() < 2e-5, t
    assert (packings[0] is not None) == packed


def test_sampler_uses_the_decoder_and_agrees_with_the_hugging_face_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[int] = []
    real_step = StaticDecoder.step
    monkeypatch.setattr(
        StaticDecoder, "step", lambda self, *a: steps.append(self.length) or real_step(self, *a)
    )
    engine = Engine(config(task="arith"))
    prompts = [[1, 4, 13, 5, 14], [1, 7, 14]] * 8
    settings = dict(max_new_tokens=5, temperature=0.8, top_p=1.0, eos_token_id=2, pad_token_id=0)
    runs = {
        name: sample(
            engine.model,
            prompts,
            generator=torch.Generator().manual_seed(5),
            decoder=name,
            **settings,
        )
        for name in ("auto", "hf")
    }
    assert steps == [5, 6, 7, 8]  # auto decoded with it (prompts padded to 5), hf did not
    assert torch.equal(runs["auto"].completion_ids, runs["hf"].completion_ids)
    assert torch.equal(runs["auto"].mask, runs["hf"].mask)
    assert (runs["auto"].logprobs - runs["hf"].logprobs).abs().max() < 1e-5


def test_models_it_does_not_cover_fall_back_to_hugging_face() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=15, n_embd=32, n_layer=1, n_head=2))
    assert "architecture 'gpt2'" in unsupported(gpt2)
    engine = Engine(config(task="arith"))
    handle = engine.model.register_forward_hook(lambda module, args, output: output)
    assert unsupported(engine.model) == "the model has forward hooks"
    handle.remove()
    assert unsupported(engine.model) is None
    # rollout_decoder = "hf" takes the Hugging Face path: the same completions
    plain = Engine(config(task="arith", rollout_decoder="hf"))
    a, b = engine.rollout(), plain.rollout()
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5


def test_bf16_decoder_stays_within_bf16_rounding_of_hugging_face() -> None:
    model = build_tiny_qwen2(15)
    ids = torch.tensor([[1, 4, 13, 5, 14], [1, 9, 13, 3, 14]])
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        fp32 = model(input_ids=ids, position_ids=positions).logits[:, -1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = StaticDecoder(model, 2, 8).prefill(ids, positions, None).float()
            theirs = model(input_ids=ids, position_ids=positions).logits[:, -1].float()
    rounding = (theirs - fp32).abs().max()
    assert rounding > 1e-3  # bf16 really ran
    assert (ours - theirs).abs().max() <= 2 * rounding
