"""The bounded-cache decoder against a dense, masked-softmax reference of the same sequence."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from grpod.engine.kvcache import KVCacheSpec
from grpod.engine.model.fused import StaticDecoder
from grpod.engine.model.kvdecoder import BoundedDecoder
from grpod.engine.model.policy import build_tiny_qwen2
from grpod.engine.train.kvmask import lastrec_visible
from tests.engine.helpers import tiny_llama

PROMPTS = [
    [1, *([4, 13, 5, 14, 3, 6, 7] * 3)],
    [1, 7, 14, 9, 9, 13, 3, 8, 10, 11, 12, 4, 5],
    [1, 9],
]
FAN_OUT = [0, 0, 1, 2, 2]
STEPS = 6


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    return ids, valid, (valid.long().cumsum(-1) - 1).clamp(min=0)


def _decode(model, decoder, monkeypatch) -> tuple[list[torch.Tensor], list[dict], list]:
    """Prefill + STEPS decode steps; logits, a snapshot after every chunk, the tokens fed."""
    calls: list[dict] = []
    real = BoundedDecoder._advance

    def advance(self, ids, positions):
        out = real(self, ids, positions)
        calls.append(
            dict(
                positions=positions.clone(),
                held=[c.positions.clone() for c in self.cache],
                keys=[c.keys.clone() for c in self.cache],
                values=[c.values.clone() for c in self.cache],
            )
        )
        return out

    monkeypatch.setattr(BoundedDecoder, "_advance", advance)
    ids, valid, positions = _left_padded(PROMPTS)
    fan_out = torch.tensor(FAN_OUT)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 2, 3, 10, 4, 5], [6, 6, 7, 7, 8, 8]]).T
    tokens = tokens[:, [0, 1, 1, 2, 0]]
    with torch.no_grad():
        logits = [decoder.prefill(ids, positions, valid, fan_out)]
        position = torch.tensor([len(PROMPTS[j]) - 1 for j in FAN_OUT])
        for t in range(STEPS):
            position = position + 1
            logits.append(decoder.step(tokens[t], position))
    return logits, calls, tokens


def _reference(model, sequence: list[int], visible: list[torch.Tensor]):
    """Logits `[T, V]` and each layer's rotated keys and values `[kv, T, hd]` of `sequence`
    when the query at t of layer l sees the keys `visible[l][h, t]` (K/V head h): the dense
    forward with an explicit masked softmax, from the model's own modules."""
    base, config = model.base_model, model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = config.hidden_size // heads
    ids = torch.tensor([sequence])
    pos = torch.arange(len(sequence))[None]
    x = base.embed_tokens(ids)
    cos, sin = base.rotary_emb(x, pos)
    keys, values = [], []
    for layer, mask in zip(base.layers, visible):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, -1, heads, hd).transpose(1, 2)
        k = attn.k_proj(h).view(1, -1, kv, hd).transpose(1, 2)
        v = attn.v_proj(h).view(1, -1, kv, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k[0])
        values.append(v[0])
        rep = heads // kv
        scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * hd**-0.5
        scores = scores.masked_fill(~mask.repeat_interleave(rep, 0)[None], float("-inf"))
        out = scores.softmax(-1) @ v.repeat_interleave(rep, 1)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, len(sequence), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(base.norm(x))[0], keys, values


def _visibility(calls: list[dict], row: int, prompt: int, model) -> list[torch.Tensor]:
    """Per layer `[kv, T, T]`: which keys each query of `row` saw, read off the snapshots
    (the kept slots after each chunk, up to the query's own position)."""
    config = model.config
    length = len(PROMPTS[prompt]) + STEPS
    layers, kv = config.num_hidden_layers, config.num_key_value_heads
    visible = [torch.zeros(kv, length, length, dtype=torch.bool) for _ in range(layers)]
    own = [(c, 0) for c in _prefill_calls(calls)[prompt]]
    own += [(c, row) for c in calls if c["positions"].shape[0] == len(FAN_OUT)]
    for call, r in own:
        for layer in range(layers):
            held = call["held"][layer][r]  # [kv, L]
            for q in call["positions"][r].tolist():
                for h in range(kv):
                    visible[layer][h, q, held[h][(held[h] >= 0) & (held[h] <= q)]] = True
    return visible


def _prefill_calls(calls: list[dict]) -> list[list[dict]]:
    """The prefill chunks of each prompt: prompts are prefilled one after another, alone."""
    out: list[list[dict]] = []
    for call in calls:
        if call["positions"].shape[0] != 1:
            continue
        if int(call["positions"][0, 0]) == 0:
            out.append([])
        out[-1].append(call)
    return out


def _own_calls(calls: list[dict], row: int, prompt: int) -> list[tuple[dict, int]]:
    """`(snapshot, row within it)` of every chunk `row` ran: its prompt's, then each step."""
    own = [(c, 0) for c in _prefill_calls(calls)[prompt]]
    return own + [(c, row) for c in calls if c["positions"].shape[0] == len(FAN_OUT)]


CASES = [
    KVCacheSpec("lastrec", 8, 2),
    KVCacheSpec("lastrec", 8, 0),
    KVCacheSpec("h2o", 8, 1),
    KVCacheSpec("h2o", 10, 1, grace=3),
]


@pytest.mark.parametrize("model_name", ["qwen2", "llama"])
@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"{s.policy}-{s.length}-{s.sinks}-{s.grace}")
def test_cached_keys_values_and_logits_equal_a_dense_masked_softmax_reference(
    model_name: str, spec: KVCacheSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_qwen2(15) if model_name == "qwen2" else tiny_llama()
    decoder = BoundedDecoder(model, len(FAN_OUT), 64, spec)
    logits, calls, tokens = _decode(model, decoder, monkeypatch)
    worst_state = worst_logit = 0.0
    with torch.no_grad():
        for i, j in enumerate(FAN_OUT):
            sequence = PROMPTS[j] + tokens[:, i].tolist()
            visible = _visibility(calls, i, j, model)
            ref_logits, ref_keys, ref_values = _reference(model, sequence, visible)
            n = len(PROMPTS[j])
            for t, step_logits in enumerate(logits):
                worst_logit = max(
                    worst_logit, float((step_logits[i] - ref_logits[n - 1 + t]).abs().max())
                )
            for call, r in _own_calls(calls, i, j):
                for layer, (keys, values) in enumerate(zip(ref_keys, ref_values)):
                    held = call["held"][layer][r]  # [kv, L]
                    for h in range(held.shape[0]):
                        slots = held[h] >= 0
                        at = held[h][slots]
                        for got, want in ((call["keys"], keys), (call["values"], values)):
                            delta = got[layer][r, h][slots] - want[h, at]
                            worst_state = max(worst_state, float(delta.abs().max()))
            if spec.policy == "lastrec":  # the trainer's mask is what the cache kept
                q, k = torch.arange(len(sequence))[:, None], torch.arange(len(sequence))[None]
                formula = lastrec_visible(q, k, torch.tensor(n), spec) & (k <= q)
                assert all(torch.equal(v, formula.expand_as(v)) for v in visible), (i, j)
    assert worst_state < 1e-6
    assert worst_logit < 1e-5
    # the decode cache holds `length` slots per layer, whatever the prompt's length
    assert all(c.keys.shape[2] == spec.length for c in decoder.cache)
    assert len(PROMPTS[0]) > 2 * spec.length  # the long prompt really was evicted from
    assert decoder.stats.prompt_tokens_evicted > 0


@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"{s.policy}-{s.length}-{s.sinks}-{s.grace}")
def test_sinks_and_the_grace_period_are_never_evicted_and_chunks_respect_the_cap(
    spec: KVCacheSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_qwen2(15)
    _, calls, _ = _decode(model, BoundedDecoder(model, len(FAN_OUT), 64, spec), monkeypatch)
    for j, chunks in enumerate(_prefill_calls(calls)):
        sizes = [c["positions"].shape[1] for c in chunks]
        assert sum(sizes) == len(PROMPTS[j])
        if len(PROMPTS[j]) > spec.length:
            assert max(sizes) <= spec.chunk_cap == spec.length - spec.protected, sizes
        else:
            assert len(sizes) == 1
    for call in calls:
        start = call["positions"][:, :1, None]  # [n, 1, 1]: the chunk's first position
        grace = torch.arange(-spec.grace, 0) + start  # [n, 1, grace]: the grace window
        wanted = torch.cat([torch.arange(spec.sinks).expand(len(start), 1, -1), grace], -1)
        for held in call["held"]:  # [n, kv, L]
            present = (held[:, :, None, :] == wanted[..., None]).any(-1)  # [n, kv, wanted]
            assert bool((present | (wanted < 0)).all())
    if spec.sinks == 0:  # an explicit 0 is respected: position 0 is evicted like any other
        assert not bool((calls[-1]["held"][0][0] == 0).any())


def test_a_cache_that_holds_everything_decodes_as_the_dense_decoder() -> None:
    model = build_tiny_qwen2(15)
    ids, valid, positions = _left_padded(PROMPTS)
    fan_out = torch.tensor(FAN_OUT)
    tokens = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 3, 4]])
    decoders = [StaticDecoder(model, 5, ids.shape[1] + 2)]
    decoders += [BoundedDecoder(model, 5, 64, KVCacheSpec(p, 32, 4)) for p in ("lastrec", "h2o")]
    runs = []
    with torch.no_grad():
        for decoder in decoders:
            run = [decoder.prefill(ids, positions, valid, fan_out)]
            position = positions[fan_out, -1]
            for step_tokens in tokens:
                position = position + 1
                run.append(decoder.step(step_tokens, position))
            runs.append(torch.stack(run))
    for decoder in decoders[1:]:
        assert decoder.stats.prompt_tokens_evicted == 0
        assert decoder.stats.fill == sum(len(PROMPTS[j]) for j in FAN_OUT) / (5 * 32)
    assert (runs[1] - runs[0]).abs().max() < 2e-5
    assert (runs[2] - runs[0]).abs().max() < 2e-5


@pytest.mark.parametrize("policy", ["lastrec", "h2o"])
def test_prompts_of_one_length_prefill_together_as_each_would_alone(policy: str) -> None:
    model = build_tiny_qwen2(15)
    spec = KVCacheSpec(policy, 8, 1)
    prompts = [PROMPTS[0], [1, *([9, 4, 13, 5, 8, 6, 7] * 3)], PROMPTS[1]]  # two of 22 tokens
    ids, valid, positions = _left_padded(prompts)
    with torch.no_grad():
        together = BoundedDecoder(model, 3, 64, spec)
        both = together.prefill(ids, positions, valid)
        for j in range(3):
            alone = BoundedDecoder(model, 1, 64, spec)
            one_ids, one_valid, one_positions = _left_padded([prompts[j]])
            assert (
                alone.prefill(one_ids, one_positions, one_valid)[0] - both[j]
            ).abs().max() < 1e-6
            for mine, theirs in zip(alone.cache, together.cache):
                assert torch.equal(mine.positions[0], theirs.positions[j])
                assert (mine.keys[0] - theirs.keys[j]).abs().max() < 1e-6
