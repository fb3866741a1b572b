"""The fused static-cache decoder against the Hugging Face forward it replaces."""

from __future__ import annotations

import pytest
import torch

import grpod.engine.model.fused as fused
from grpod.engine import Engine
from grpod.engine.model.fused import StaticDecoder, unsupported
from grpod.engine.model.policy import build_tiny_qwen2
from grpod.engine.rollout.torch_sampler import sample
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
            generator=torch.Generator(engine.device).manual_seed(5),
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


def test_equal_length_prompts_decode_without_a_mask_and_match_hugging_face() -> None:
    model = build_tiny_qwen2(15)
    ids = torch.tensor([[1, 4, 13, 5, 14], [1, 9, 13, 3, 14]])
    positions = torch.arange(5).expand(2, 5)
    fan_out = torch.tensor([0, 0, 1, 1])
    tokens = torch.tensor([[3, 4, 5, 6], [7, 2, 8, 9]])
    with torch.no_grad():
        decoder = StaticDecoder(model, 4, 7)
        got = [decoder.prefill(ids, positions, None, fan_out)]
        assert not decoder.ragged  # no left padding: decode steps attend to every key
        for t in range(2):
            got.append(decoder.step(tokens[t], torch.full((4,), 5 + t)))
        full = torch.cat([ids[fan_out], tokens.T], 1)
        logits = model(input_ids=full, position_ids=torch.arange(7).expand(4, 7)).logits
    for t, step_logits in enumerate(got):
        assert (step_logits - logits[:, 4 + t]).abs().max() < 2e-5, t


def test_fused_weights_are_views_of_the_flat_buffer_and_copies_otherwise() -> None:
    engine = Engine(config(task="arith"))
    layer = engine.model.base_model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        decoder = StaticDecoder(engine.model, 4, 8)
        fused_layer = decoder.fused.layers[0]
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        assert torch.equal(fused_layer.qkv_weight, qkv)
        assert torch.equal(fused_layer.gate_up_weight, gate_up)
        flat = engine.flat_weights.untyped_storage().data_ptr()
        for fused_weight, first in (
            (fused_layer.qkv_weight, attn.q_proj.weight),
            (fused_layer.gate_up_weight, mlp.gate_proj.weight),
        ):  # no copy per rollout: the matrices lie back to back in the buffer
            assert fused_weight.untyped_storage().data_ptr() == flat
            assert fused_weight.data_ptr() == first.data_ptr()
    # a step of the optimizer is seen through the view
    engine.accumulate(engine.rollout())
    engine.apply()
    with torch.no_grad():
        assert not torch.equal(fused_layer.gate_up_weight, gate_up)
        assert torch.equal(
            fused_layer.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        )
        # weights that do not lie back to back are concatenated
        apart = [attn.q_proj.weight.clone(), attn.k_proj.weight.clone()]
        joined = fused.joined(apart)
        assert torch.equal(joined, torch.cat(apart))
        assert joined.data_ptr() not in (apart[0].data_ptr(), apart[1].data_ptr())
        assert torch.equal(
            fused.joined([mlp.up_proj.weight, mlp.gate_proj.weight]),
            torch.cat([mlp.up_proj.weight, mlp.gate_proj.weight]),
        )
