"""`BoundedDecoder`: the fused decoder over a KV cache of a fixed number of slots per layer.

The torch sampler's long-context path (`[engine] rollout_kv_cache = "lastrec" | "h2o"`,
engine/kvcache.py says what each policy keeps). It computes each layer with the fused
weights of `engine.model.fused` and keeps, per layer, `[rows, kv, length, hd]` keys and values,
the position of the token in each slot (-1: empty) and, for H2O, the attention each slot
has received. Keys are stored rotated at their own positions, so attention over the kept
slots is attention over those positions of the full sequence: what the trainer's masked
forward computes (tests/engine/model/test_kvdecoder.py holds both to a dense reference).

Distinct prompts are prefilled in the chunks of `engine.kvcache.prefill_chunks` (chunk
boundaries depend on the prompt's length: prompts of one length run together), then fanned
out to their rows; decode steps
run every row together, each row evicting in its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpod.engine.kvcache import CacheStats, KVCacheSpec, prefill_chunks
from grpod.engine.model.fused import FusedModel, rms_norm


@dataclass
class _LayerCache:
    """One layer's slots: `keys, values: [n, kv, L, hd]`, `positions: [n, kv, L]` int64 (-1
    empty), `scores: [n, kv, L]` FP32 accumulated attention (h2o only)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor | None

    def select(self, index: torch.Tensor) -> _LayerCache:
        scores = None if self.scores is None else self.scores[index]
        return _LayerCache(self.keys[index], self.values[index], self.positions[index], scores)


_FIELDS = ("keys", "values", "positions", "scores")


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


class BoundedDecoder:
    """Prefill + per-token decode for `rows` sequences through `spec.length` slots per layer.

    The same interface as `engine.model.fused.StaticDecoder` (`rows` is the decode batch, as there);
    `max_len` bounds the positions (the rotary table), not the cache. Build under
    `torch.no_grad`, one per rollout.
    """

    def __init__(self, model: torch.nn.Module, rows: int, max_len: int, spec: KVCacheSpec) -> None:
        self.fused = FusedModel(model)
        self.head = model.get_output_embeddings().weight
        self.spec = spec
        self.cos, self.sin = self.fused.rotary_table(max_len)
        self.cache: list[_LayerCache] = []
        self.stats: CacheStats | None = None

    def prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        fan_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the left padded prompts `ids: [d, s]` (`valid` marks real tokens; `fan_out:
        [rows]` maps rows to prompts); logits `[rows, V]` after each row's last prompt token."""
        d, width = ids.shape
        lengths = valid.sum(-1).tolist() if valid is not None else [width] * d
        # prompts of one length share their chunk boundaries: prefilled together
        by_length: dict[int, list[int]] = {}
        for j, n in enumerate(lengths):
            by_length.setdefault(n, []).append(j)
        order, caches, last, held = [], [], [], []
        for n, members in by_length.items():
            tokens = ids[members, width - n :]  # left padded: the real tokens come last
            self.cache = self._empty(len(members), ids.device)
            for start, size in prefill_chunks(n, self.spec):
                span = torch.arange(start, start + size, device=ids.device)
                x = self._advance(tokens[:, start : start + size], span.expand(len(members), -1))
            order += members
            caches.append(self.cache)
            last.append(x[:, -1])
            # slots in use per layer and K/V head, averaged (all hold prompt tokens now)
            in_use = sum((c.positions >= 0).sum((1, 2)) for c in self.cache)
            held += (in_use / (len(self.cache) * self.fused.kv_heads)).tolist()
        where = torch.empty(d, dtype=torch.long, device=ids.device)
        where[order] = torch.arange(d, device=ids.device)  # prompt j's row in the groups
        index = where if fan_out is None else where[fan_out]
        self.cache = [
            _LayerCache(*(_cat([getattr(c[i], f) for c in caches]) for f in _FIELDS)).select(index)
            for i in range(len(self.fused.layers))
        ]
        rows = index.tolist()
        self.stats = CacheStats(
            prompt_tokens_evicted=sum(lengths[order[r]] - held[r] for r in rows),
            fill=sum(held[r] for r in rows) / (len(rows) * self.spec.length),
        )
        hidden = torch.cat(last)[index]
        return F.linear(rms_norm(hidden, self.fused.norm), self.head)

    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Append one token per row (`token, position: [rows]`); logits `[rows, V]` after it."""
        x = self._advance(token[:, None], position[:, None])
        return F.linear(rms_norm(x[:, -1], self.fused.norm), self.head)

    def _empty(self, n: int, device: torch.device) -> list[_LayerCache]:
        fused, length = self.fused, self.spec.length
        shape = (n, fused.kv_heads, length, fused.head_dim)
        # the dtype the layers compute in: bf16 under autocast, as the dense cache holds it
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else fused.embed.dtype
        return [
            _LayerCache(
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                torch.full(shape[:3], -1, dtype=torch.long, device=device),
                torch.zeros(shape[:3], device=device) if self.spec.policy == "h2o" else None,
            )
            for _ in fused.layers
        ]

    def _advance(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run a chunk `ids, positions: [n, c]` (consecutive positions per row) through every
        layer, each first making room for it; the hidden states `[n, c, H]`."""
        fused = self.fused
        c = ids.shape[1]
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        x = F.embedding(ids, fused.embed, fused.padding_idx)
        for cache, layer in zip(self.cache, fused.layers):
            q, k, v = fused.qkv(layer, x, cos, sin)  # q [n, c, heads, hd], k, v [n, c, kv, hd]
            slots = self._room(cache, c, positions[:, 0])  # [n, kv, c]
            index = slots[..., None].expand(*slots.shape, fused.head_dim)
            cache.keys.scatter_(2, index, k.transpose(1, 2).to(cache.keys.dtype))
            cache.values.scatter_(2, index, v.transpose(1, 2).to(cache.values.dtype))
            cache.positions.scatter_(2, slots, positions[:, None, :].expand_as(slots))
            # a query sees the kept slots up to its own position (causal within the chunk)
            held = cache.positions[:, :, None, :]
            mask = (held >= 0) & (held <= positions[:, None, :, None])  # [n, kv, c, L]
            out, weights = _attention(fused, q, cache.keys, cache.values, mask)
            if cache.scores is not None:
                cache.scores.scatter_(2, slots, 0.0)
                cache.scores += weights.sum(2)  # each key's attention from every query head
            x = fused.finish(layer, x, out)
        return x

    def _room(self, cache: _LayerCache, c: int, start: torch.Tensor) -> torch.Tensor:
        """The `c` slots `[n, kv, c]` the chunk starting at `start: [n]` is written to: empty
        slots first, then the policy's evictions; protected slots are never chosen."""
        spec, held = self.spec, cache.positions
        if spec.policy == "lastrec":
            key = held.to(torch.float64)  # the oldest first
        else:
            key = cache.scores.to(torch.float64)  # the least attended first (ties: lower slot)
        protected = held < spec.sinks
        if spec.grace:
            protected |= held >= (start - spec.grace)[:, None, None]
        key = key.masked_fill(protected, float("inf")).masked_fill(held < 0, float("-inf"))
        return key.sort(dim=-1, stable=True).indices[..., :c]


def _attention(
    fused: FusedModel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q: [n, c, heads, hd]` over `keys, values: [n, kv, L, hd]` with `mask: [n, kv, c, L]`;
    the output `[n, c, heads * hd]` and the attention weights `[n, kv, rep * c, L]`."""
    n, c = q.shape[:2]
    kv, rep, hd = fused.kv_heads, fused.rep, fused.head_dim
    # head h reads K/V head h // rep: [n, c, kv, rep, hd] -> [n, kv, rep * c, hd]
    q = q.reshape(n, c, kv, rep, hd).permute(0, 2, 3, 1, 4).reshape(n, kv, rep * c, hd)
    scores = torch.matmul(q, keys.transpose(-1, -2).to(q.dtype)) * fused.scale
    # the rep query heads of a K/V head share its mask: broadcast, not repeated
    scores = scores.view(n, kv, rep, c, -1).masked_fill(~mask[:, :, None], float("-inf"))
    weights = scores.view(n, kv, rep * c, -1).float().softmax(-1)
    out = torch.matmul(weights.to(values.dtype), values)  # [n, kv, rep * c, hd]
    out = out.view(n, kv, rep, c, hd).permute(0, 3, 1, 2, 4).reshape(n, c, -1)
    return out.to(q.dtype), weights
