"""A fused static-cache decoder for Qwen2 / Llama-family policies (the torch sampler's).

A decode step is a few hundred rows of one token each through a small model: there the
Hugging Face plumbing (cache objects, mask builders, one call per projection) and the fused
SDPA kernel's setup cost as much as the arithmetic. `StaticDecoder` computes the model's own
forward from its own parameters with

- the q/k/v and gate/up projections fused into one matmul each,
- a KV cache preallocated once per generation and written in place,
- attention as two batched matmuls, grouped-query attention without copying K/V: the
  query heads that share a K/V head are laid along the query axis of one attention call
  (a prefill longer than `MATH_ATTENTION_MAX_KEYS` uses SDPA: its score matrix is big),
- rotary cos/sin looked up from one table instead of recomputed per forward,
- ragged prompts prefilled back to back in fewer rows (first-fit decreasing, a mask per
  prompt) when that saves a fifth of the slots, instead of computing their left padding.

It is the model's forward up to FP32 rounding (tests/engine/model/test_fused.py holds it to the
Hugging Face logits step by step), so the sampler's logprobs still match the trainer's.
`unsupported` says when a model is not covered (another architecture, sliding windows,
length-dependent RoPE, forward hooks that a Hugging Face forward would run); those decode
through Hugging Face. The training trunk does not use this fused form: with autograd through
the fused weights it measured slower than Hugging Face at W1's sizes (bench/README.md);
it has its own unfused, bit-identical forward in engine/model/trunk.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpod.engine.data.packing import causal_and_eye, first_fit_decreasing
from grpod.engine.model.lora import has_adapters

ARCHITECTURES = frozenset({"qwen2", "llama"})
MATH_ATTENTION_MAX_KEYS = 64  # prefill: above this the s x s scores cost more than SDPA
PACK_PREFILL_MAX_FILL = 0.8  # ragged prompts are packed when that needs <= 80% of the slots


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` must run through Hugging Face, or None when these paths cover it."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"architecture {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope_type = getattr(getattr(model.base_model, "rotary_emb", None), "rope_type", None)
    if rope_type is None or rope_type in ("dynamic", "longrope"):
        return f"rope type {rope_type!r} depends on the sequence length"
    if _has_hooks(model):
        return "the model has forward hooks"
    if has_adapters(model):  # its layers add adapter deltas that these paths do not apply
        return "LoRA adapters"
    return None


def _has_hooks(model: torch.nn.Module) -> bool:
    """Any forward (pre-)hook on `model` or a submodule: a plain walk over `_modules`, a third
    of `model.modules()`'s cost (this runs on every rollout and training pass)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if module._forward_hooks or module._forward_pre_hooks:
            return True
        stack.extend(m for m in module._modules.values() if m is not None)
    return False


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's parameters with its projections fused."""

    attn_norm: tuple[torch.Tensor, float]
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: tuple[torch.Tensor, float]
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


class FusedModel:
    """The model's parameters with projections fused, and the per-layer arithmetic that the
    static decoder here and the bounded one (engine/model/kvdecoder.py) share."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        base = model.base_model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.rep = self.heads // self.kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.rotary = base.rotary_emb
        self.embed = base.embed_tokens.weight
        self.padding_idx = base.embed_tokens.padding_idx  # its row gets no gradient, as in HF
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.layers = [_fused_layer(layer) for layer in base.layers]

    def rotary_table(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sine `[max_len, hd]` of positions 0..max_len-1, as `rotate` takes
        them (looked up per forward instead of recomputed)."""
        positions = torch.arange(max_len, device=self.embed.device)[None]
        cos, sin = self.rotary(self.embed[:1], positions)
        return cos[0], signed(sin[0])

    def qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q `[n, s, heads, hd]` and k, v `[n, s, kv, hd]` of `x: [n, s, H]`."""
        n, s, _ = x.shape
        h = rms_norm(x, layer.attn_norm)
        qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(n, s, -1, self.head_dim)
        split = self.heads + self.kv_heads
        qk, v = qkv[:, :, :split], qkv[:, :, split:]
        qk = rotate(qk, cos, sin)
        return qk[:, :, : self.heads], qk[:, :, self.heads :], v

    def finish(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual (`attn: [n, s, heads * hd]`)."""
        x = x + F.linear(attn, layer.o_weight, layer.o_bias)
        gate, up = F.linear(rms_norm(x, layer.mlp_norm), layer.gate_up_weight).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_weight)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """`q: [n, s, heads, hd]`, `k, v: [n, kv, L, hd]`, `mask: [n, 1, s, L]` bool (True =
        attend; None: every key, a decode step without padding); returns `[n, s, heads * hd]`.
        Every query row must see at least one key."""
        n, s = q.shape[:2]
        if s > 1 and k.shape[2] > MATH_ATTENTION_MAX_KEYS:  # a decode step is one query
            q = q.transpose(1, 2)
            k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return out.transpose(1, 2).reshape(n, s, -1)
        # head h reads K/V head h // rep: [n, s, kv, rep, hd] -> [n, kv, rep * s, hd]
        q = q.view(n, s, self.kv_heads, self.rep, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(n, self.kv_heads, self.rep * s, self.head_dim)
        if self.rep > 1 and s > 1:
            mask = mask.repeat(1, 1, self.rep, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)  # [n, kv, rep * s, hd]
        out = out.view(n, self.kv_heads, self.rep, s, self.head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(n, s, -1)


class StaticDecoder:
    """Prefill + per-token decode for `rows` sequences of up to `max_len` positions.

    Reads the model's parameters at construction (call under `torch.no_grad`); build a new
    one after an optimizer step.
    """

    def __init__(self, model: torch.nn.Module, rows: int, max_len: int) -> None:
        self.fused = FusedModel(model)
        self.head = model.get_output_embeddings().weight
        weight = self.fused.embed
        self.cos, self.sin = self.fused.rotary_table(max_len)
        self.shape = (rows, self.fused.kv_heads, max_len, self.fused.head_dim)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # allocated by the prefill
        self.key_valid = torch.ones(rows, max_len, dtype=torch.bool, device=weight.device)
        self.ragged = False  # some key is left padding: decode steps must mask it
        self.length = 0  # positions written so far (the same for every row)

    def prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        fan_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the (left padded) prompts `ids: [d, s]`; logits `[rows, V]` of the last position.

        `valid: [d, s]` marks real prompt tokens (None: no padding). With `fan_out: [rows]`,
        prompt `fan_out[i]` seeds row i: each distinct prompt is computed once.
        """
        fused, (d, s) = self.fused, ids.shape
        packing = _pack_prompts(valid) if valid is not None else None
        if packing is None:
            # causal, padding keys hidden, a padding query sees itself (no empty softmax row)
            mask, eye = causal_and_eye(s, ids.device)
            if valid is not None:
                mask = (mask & valid[:, None, :]) | eye
            mask = mask.expand(d, s, s)[:, None]
            run_ids, run_positions = ids, positions
        else:  # ragged prompts back to back in fewer rows: no compute on left padding
            mask = packing.mask
            run_ids = ids.reshape(-1)[packing.source].view(-1, s)
            run_positions = positions.reshape(-1)[packing.source].view(-1, s)
        cos, sin = self.cos[run_positions][:, :, None], self.sin[run_positions][:, :, None]
        x = F.embedding(run_ids, fused.embed, fused.padding_idx)
        rows = self.shape[0]
        # GRPO groups: prompt j seeds rows [j * g, (j + 1) * g), written by one broadcast copy
        grouped = fan_out is not None and rows % d == 0
        grouped = grouped and torch.equal(
            fan_out, torch.arange(d, device=fan_out.device).repeat_interleave(rows // d)
        )
        self.cache = []
        for layer in fused.layers:
            q, k, v = fused.qkv(layer, x, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, kv, s, hd]
            x = fused.finish(layer, x, fused.attention(q, k, v, mask))
            if packing is not None:  # back to one left-padded row per prompt: [d, kv, s, hd]
                k, v = packing.unpack(k, d), packing.unpack(v, d)
            k_cache, v_cache = k.new_empty(self.shape), v.new_empty(self.shape)
            for cache, new in ((k_cache, k), (v_cache, v)):
                if grouped:
                    cache.view(d, rows // d, *self.shape[1:])[:, :, :, :s] = new[:, None]
                else:
                    cache[:, :, :s] = new if fan_out is None else new[fan_out]
            self.cache.append((k_cache, v_cache))
        self.ragged = valid is not None
        if valid is not None:
            self.key_valid[:, :s] = valid if fan_out is None else valid[fan_out]
        self.length = s
        last = x[:, -1] if packing is None else x.reshape(-1, x.shape[-1])[packing.last]
        logits = F.linear(rms_norm(last, fused.norm), self.head)
        return logits if fan_out is None else logits[fan_out]

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Append one token per row (`token, position: [rows]`); logits `[rows, V]` after it."""
        fused, t = self.fused, self.length
        cos, sin = self.cos[position][:, None, None], self.sin[position][:, None, None]
        mask = self.key_valid[:, None, None, : t + 1] if self.ragged else None
        x = F.embedding(token[:, None], fused.embed, fused.padding_idx)  # [rows, 1, H]
        for (k_cache, v_cache), layer in zip(self.cache, fused.layers):
            q, k, v = fused.qkv(layer, x, cos, sin)
            k_cache[:, :, t : t + 1] = k.transpose(1, 2)
            v_cache[:, :, t : t + 1] = v.transpose(1, 2)
            attn = fused.attention(q, k_cache[:, :, : t + 1], v_cache[:, :, : t + 1], mask)
            x = fused.finish(layer, x, attn)
        self.length = t + 1
        return F.linear(rms_norm(x[:, -1], fused.norm), self.head)


@dataclass(frozen=True)
class _PromptPacking:
    """Left-padded prompts `[d, s]` laid back to back into fewer rows of width `s`."""

    source: torch.Tensor  # [rows * s] flat index into the prompts (a padding cell when empty)
    mask: torch.Tensor  # [rows, 1, s, s] bool: causal within each prompt
    cells: torch.Tensor  # [d * s] flat packed slot of each prompt cell (0 for padding cells)
    last: torch.Tensor  # [d] flat packed slot of each prompt's last token

    def unpack(self, state: torch.Tensor, d: int) -> torch.Tensor:
        """`[rows, kv, s, hd]` packed keys or values -> `[d, kv, s, hd]`, one left-padded row
        per prompt (padding cells hold some prompt's state: the decode masks them)."""
        rows, kv, s, hd = state.shape
        flat = state.transpose(1, 2).reshape(rows * s, kv, hd)[self.cells]
        return flat.view(d, s, kv, hd).transpose(1, 2)


def _pack_prompts(valid: torch.Tensor) -> _PromptPacking | None:
    """The packing of ragged prompts (`valid: [d, s]`, left padded), or None when it would
    save less than a fifth of the prefill's slots."""
    d, s = valid.shape
    lengths = valid.sum(-1).tolist()
    placed = first_fit_decreasing(lengths, s)
    if len(placed) * s > PACK_PREFILL_MAX_FILL * d * s:
        return None
    pad_cell = int((~valid).reshape(-1).nonzero()[0])
    source, segment = [pad_cell] * (len(placed) * s), [-1] * (len(placed) * s)
    cells, last = [0] * (d * s), [0] * d
    for r, members in enumerate(placed):
        at = r * s
        for j in members:
            n = lengths[j]
            start = j * s + s - n  # the prompt's first real cell
            source[at : at + n] = range(start, start + n)
            segment[at : at + n] = [j] * n
            cells[start : start + n] = range(at, at + n)
            last[j] = at + n - 1
            at += n
    device = valid.device
    seg = torch.tensor(segment, device=device).view(len(placed), s)
    causal, eye = causal_and_eye(s, device)
    mask = ((seg[:, :, None] == seg[:, None, :]) & causal) | eye
    return _PromptPacking(
        source=torch.tensor(source, device=device),
        mask=mask[:, None],
        cells=torch.tensor(cells, device=device),
        last=torch.tensor(last, device=device),
    )


def _fused_layer(layer: torch.nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    qkv_bias = None
    if any(p.bias is not None for p in projections):
        qkv_bias = torch.cat(
            [
                p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                for p in projections
            ]
        )
    return _Layer(
        attn_norm=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
        qkv_weight=joined([p.weight for p in projections]),
        qkv_bias=qkv_bias,
        o_weight=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        mlp_norm=(
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
        ),
        gate_up_weight=joined([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_weight=mlp.down_proj.weight,
    )


def joined(weights: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(weights)` (along dim 0), as a view when the weights already lie back to back
    in one storage (engine/model/flat.py lays a layer's matrices out that way): a decoder built per
    rollout then copies no weights. Call under `torch.no_grad`."""
    first = weights[0]
    rows, at = 0, first.data_ptr()
    for w in weights:
        if (
            w.dtype != first.dtype
            or w.shape[1:] != first.shape[1:]
            or not w.is_contiguous()
            or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or w.data_ptr() != at
        ):
            return torch.cat(weights)
        rows += w.shape[0]
        at += w.numel() * w.element_size()
    return first.as_strided((rows, *first.shape[1:]), first.stride())  # contiguous: same strides


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it, `x * cos + rotate_half(x) * sin`, with
    `signed_sin = signed(sin)`: `rotate_half(x) = cat(-x2, x1)` times `sin` is `cat(x2, x1)`
    times `signed_sin`, bit for bit (a sign flip is exact), without a negation per call."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def signed(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half of the last dimension negated (`rotate`'s sine)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """The Hugging Face RMSNorm: statistics in FP32, scaled in the input dtype."""
    weight, eps = norm
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
