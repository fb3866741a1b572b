"""The training trunk of a Qwen2 / Llama policy without the Hugging Face per-call plumbing.

`layout.run_trunk` runs one packed layout (a few rows, a block-diagonal bool mask) through
the model's decoder stack, with gradients. The Hugging Face forward spends a noticeable part
of a small model's step on plumbing around the arithmetic: keyword routing through every
layer, the mask builder, the rotary module per call, RMSNorm as five separate ops.
`trunk_states` computes the same forward from the model's own modules, op for op:

- the embedding and every projection are the model's own modules, called as modules (so a
  wrapped or replaced projection still runs);
- RMSNorm is `F.rms_norm`: the Hugging Face formula (statistics in FP32,
  `weight * x * rsqrt(mean(x^2) + eps)`) as one kernel;
- attention is the SDPA call the Hugging Face `sdpa` implementation makes, with K/V repeated
  for grouped-query heads the way it repeats them (`expand` + `reshape`).

On the CPU the result and every gradient are bit-identical to the Hugging Face forward in
FP32 (tests/engine/model/test_trunk.py holds them to it), so the choice changes no step, replay or
recorded number there. On other devices the fused RMSNorm kernel may round differently from
the five-op formula: equal up to FP32 rounding, and as deterministic as the Hugging Face
path (replay runs this same code). `unsupported` says when a model must run through
Hugging Face instead: anything `engine.model.fused.unsupported` rejects, another attention
implementation, BF16, attention dropout while training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpod.engine.model.fused import rms_norm, rotate, signed
from grpod.engine.model.fused import unsupported as decoder_unsupported


def unsupported(model: torch.nn.Module, dtype: str) -> str | None:
    """Why `model` must run its training trunk through Hugging Face, or None."""
    reason = decoder_unsupported(model)
    if reason is not None:
        return reason
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa":
        return f"attention implementation {implementation!r} is not sdpa"
    if dtype != "float32" or model.get_output_embeddings().weight.dtype != torch.float32:
        return f"dtype {dtype}: only the FP32 forward is bit-identical"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout while training"
    return None


def trunk_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """The final-norm hidden states `[rows, width, H]` of `input_ids: [rows, width]`.

    `attention_mask: [rows, 1, width, width]` bool (True = attend), as the Hugging Face
    forward takes it. Only for a model `unsupported(model, "float32")` accepts.
    """
    base = model.base_model
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows, width = input_ids.shape
    x = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(x, position_ids)  # [rows, width, head_dim], as Hugging Face
    cos, sin = cos[:, None], signed(sin[:, None])
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(x, layer.input_layernorm)
        q = attn.q_proj(h).view(rows, width, heads, head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(rows, width, kv_heads, head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(rows, width, kv_heads, head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = _repeat_kv(k, heads // kv_heads), _repeat_kv(v, heads // kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=attn.scaling)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(rows, width, -1))
        h = _rms_norm(x, layer.post_attention_layernorm)
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    return _rms_norm(x, base.norm)


def trunk_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    dtype: str,
) -> torch.Tensor:
    """The final-norm hidden states of an unsharded model: Qwen2 / Llama in FP32 through
    `engine.model.trunk.trunk_states` (bit-identical to the Hugging Face forward, without its
    plumbing), anything else through the Hugging Face forward."""
    if unsupported(model, dtype) is None:
        return trunk_states(model, input_ids, position_ids, mask)
    return hf_states(model, input_ids, position_ids, mask)


def hf_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The final-norm hidden states through the Hugging Face forward (no cache)."""
    return model.base_model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
    ).last_hidden_state


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return rms_norm(x, (norm.weight, norm.variance_epsilon))


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """`[n, kv, s, hd]` -> `[n, kv * rep, s, hd]`, head h reading K/V head h // rep."""
    if rep == 1:
        return x
    n, kv, s, hd = x.shape
    return x[:, :, None].expand(n, kv, rep, s, hd).reshape(n, kv * rep, s, hd)
