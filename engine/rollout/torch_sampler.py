"""The torch sampler: batched, KV-cached generation with temperature and top-p.

Runs under `torch.no_grad` (not `inference_mode`: its tensors feed the gradient pass).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from grpod.engine.config import EngineConfig
from grpod.engine.errors import EngineError
from grpod.engine.kvcache import KVCacheSpec
from grpod.engine.model.fused import StaticDecoder, unsupported
from grpod.engine.model.kvdecoder import BoundedDecoder
from grpod.engine.model.policy import compute_context
from grpod.engine.rollout.sampler import Rollout, SamplingSettings
from grpod.engine.weight_sync import ProbeScores, PushFaults


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask logits outside the smallest set whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    dtype: str = "float32",
    decoder: Literal["auto", "hf"] = "auto",
    kv_cache: KVCacheSpec | None = None,
) -> Rollout:
    """Sample one completion per prompt (repeat prompts for a group).

    A completion ends with any of the `eos_token_id`s. `temperature = 0` is greedy (the
    logprobs are then the untempered distribution's). Each distinct prompt is prefilled
    once; its KV cache and first-token logits are then fanned out to every completion that
    shares it (a group's siblings). `decoder="auto"` decodes with
    `engine.model.fused.StaticDecoder` where it covers the model, `"hf"` always through the
    Hugging Face forward. `kv_cache` bounds the decode cache
    (`engine.model.kvdecoder.BoundedDecoder`); only the fused decoder evicts.
    """
    n = len(prompts)
    device = next(model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    inverse = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    shared = len(distinct) < n
    ids, attn = _left_pad([list(p) for p in distinct] if shared else prompts, pad_token_id)
    ragged = bool((attn == 0).any())
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    fan_out = torch.tensor(inverse, device=device) if shared else None
    out_ids = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    alive = torch.ones(n, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    static = decoder == "auto" and unsupported(model) is None
    if kv_cache is not None and not static:
        reason = "rollout_decoder is 'hf'" if decoder == "hf" else unsupported(model)
        raise EngineError(
            f"rollout_kv_cache {kv_cache.policy!r}: the Hugging Face decoder cannot evict "
            f"and the fused decoder does not cover this model ({reason})"
        )
    bounded = None
    stops = torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device
    )

    with compute_context(dtype, device):
        if kv_cache is not None:
            bounded = BoundedDecoder(model, n, ids.shape[1] + max_new_tokens, kv_cache)
            logits = bounded.prefill(ids, positions, attn.bool() if ragged else None, fan_out)
            step = bounded.step
        elif static:
            fast = StaticDecoder(model, n, ids.shape[1] + max_new_tokens)
            logits = fast.prefill(ids, positions, attn.bool() if ragged else None, fan_out)
            step = fast.step
        else:
            logits, step = _hf_decoder(model, ids, positions, attn if ragged else None, fan_out)
        step_pos = positions[:, -1] if fan_out is None else positions[fan_out, -1]
        for t in range(max_new_tokens):
            logits = logits.float()
            if temperature == 0.0:
                logprobs = logits.log_softmax(-1)
                token = logits.argmax(-1)
            else:
                if temperature != 1.0:
                    logits = logits / temperature
                logprobs = filter_top_p(logits, top_p).log_softmax(-1)
                token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
            out_ids[:, t] = torch.where(alive, token, pad_token_id)
            out_lp[:, t] = torch.where(alive, logprobs.gather(-1, token[:, None]).squeeze(-1), 0.0)
            lengths += alive.long()
            alive &= ~torch.isin(token, stops)
            if t == max_new_tokens - 1 or not bool(alive.any()):
                break
            step_pos = step_pos + 1
            logits = step(token, step_pos)
    mask = torch.arange(max_new_tokens, device=device)[None, :] < lengths[:, None]
    stats = None if bounded is None else bounded.stats
    return Rollout(out_ids.cpu(), out_lp.cpu(), mask.cpu(), stats)


def _hf_decoder(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    attn: torch.Tensor | None,
    fan_out: torch.Tensor | None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Prefill through the Hugging Face forward; the first logits and a per-token step."""
    cache_arg = _cache_argument(model)

    def forward(step_ids, step_pos, attn, cache):
        out = model(
            input_ids=step_ids,
            position_ids=step_pos,
            attention_mask=attn,
            use_cache=True,
            **{cache_arg: cache},
            logits_to_keep=1,
        )
        return out.logits[:, -1], getattr(out, "cache", None) or out.past_key_values

    logits, cache = forward(ids, positions, attn, None)
    if fan_out is not None:
        ids, positions = ids[fan_out], positions[fan_out]
        attn = None if attn is None else attn[fan_out]
        if hasattr(cache, "batch_select_indices"):
            cache.batch_select_indices(fan_out)
            logits = logits[fan_out]
        else:  # a cache that cannot be fanned out: prefill every row instead
            logits, cache = forward(ids, positions, attn, None)
    state = {"cache": cache, "attn": attn}

    def step(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        if state["attn"] is not None:
            state["attn"] = torch.cat([state["attn"], state["attn"].new_ones((len(token), 1))], 1)
        logits, state["cache"] = forward(
            token[:, None], position[:, None], state["attn"], state["cache"]
        )
        return logits

    return logits, step


def _left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids, attention: [n, width]` on the host, left padded so every prompt ends together."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    return ids, attn


def _cache_argument(model: torch.nn.Module) -> str:
    """`cache` on newer transformers, `past_key_values` before it was renamed."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TorchSampler:
    """The torch sampler as a `Sampler` (engine/rollout/sampler.py): it samples the trainer's
    own rollout copy, so a push has nothing to do and there is no copy for a probe to check."""

    probe_tokens = 0

    def __init__(self, model: torch.nn.Module, config: EngineConfig, probe_tokens: int = 0) -> None:
        self.model, self.config = model, config

    def push(self, model: torch.nn.Module, faults: PushFaults | None = None) -> tuple[str, ...]:
        """Nothing to take: `model` is the module this sampler samples."""
        return ()

    def sample(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        probe: list[int] | None = None,
        beside: Callable[[], None] | None = None,
    ) -> tuple[Rollout, ProbeScores | None]:
        """`sample` on the model, with a generator seeded `settings.seed` on the model's device."""
        cfg = self.config
        device = next(self.model.parameters()).device
        rollout = sample(
            self.model,
            prompts,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            eos_token_id=settings.eos_token_id,
            pad_token_id=settings.pad_token_id,
            generator=torch.Generator(device).manual_seed(settings.seed),
            dtype=cfg.dtype,
            decoder=cfg.rollout_decoder,
            kv_cache=cfg.kv_cache_spec,
        )
        return rollout, None

    def close(self) -> None:
        """Nothing held beyond the trainer's model."""
