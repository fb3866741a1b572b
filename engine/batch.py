"""`TransportBatch`: the exact, self-contained input of one optimizer step.

Token tensors are `[micros, rows, seq]`; per-sample tensors are `[samples]`. Token fields are
target-aligned: `loss_mask[m, r, p]` says whether token p is trained on (scored by the logits
at p-1), and `advantages` / `sampler_logprobs` at p belong to that token.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpod.base.fileio import atomic_file
from grpod.engine.errors import EngineError
from grpod.engine.kvcache import CacheStats, KVCacheSpec
from grpod.engine.weight_sync import WeightSyncCheck

TOKEN_FIELDS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "position_ids": torch.int64,
    "loss_mask": torch.bool,
    "advantages": torch.float32,
    "sampler_logprobs": torch.float32,
    "old_logprobs": torch.float32,
    "sample_ids": torch.int32,
    "group_ids": torch.int32,
}
SAMPLE_FIELDS: dict[str, torch.dtype] = {
    "rewards": torch.float32,
    "sample_group_ids": torch.int32,
    "completion_lengths": torch.int32,
}
OPTIONAL_FIELDS = frozenset({"sampler_logprobs", "old_logprobs"})
FORMAT = "grpod.transport_batch/1"


@dataclass(frozen=True)
class TransportBatch:
    input_ids: torch.Tensor  # [micros, rows, seq] int64
    position_ids: torch.Tensor  # [micros, rows, seq] int64, restarting per sample
    loss_mask: torch.Tensor  # [micros, rows, seq] bool, target-aligned
    advantages: torch.Tensor  # [micros, rows, seq] float32, per token
    sampler_logprobs: torch.Tensor | None  # [micros, rows, seq] float32 or None
    sample_ids: torch.Tensor  # [micros, rows, seq] int32, -1 = padding
    group_ids: torch.Tensor  # [micros, rows, seq] int32, -1 = padding
    rewards: torch.Tensor  # [samples] float32
    sample_group_ids: torch.Tensor  # [samples] int32
    completion_lengths: torch.Tensor  # [samples] int32
    step: int
    config_digest: str
    sequence_chunks: int = 1
    old_logprobs: torch.Tensor | None = None  # [micros, rows, seq] float32: epochs > 1 only
    # provenance, part of the content (and the blob digest): nothing wall-clock here
    generation: int = 0  # step // epochs: the rollout whose samples these are
    injected_faults: tuple[str, ...] = ()  # drill faults injected into this step (faults.py)
    micro_order: list[int] | None = None  # micros reordered from the batch as rolled out
    kv_cache: KVCacheSpec | None = None  # the rollout's bounded KV cache (None: dense)
    kv_cache_stats: CacheStats | None = None  # that cache after the prefill
    # `[engine] rewards`: each function's value per sample (the rewards are their weighted sum)
    function_rewards: dict[str, list[float]] = field(default_factory=dict)
    # `[engine] audit_rewards` (engine/data/audit.py): scored, never trained on; {} when not audited
    audit_rewards: dict[str, list[float]] = field(default_factory=dict)
    # under torchrun (engine/model/parallel.py): whose batch, or the step's global batch (`concat`)
    rank: int = 0
    world_size: int = 1
    rank_micros: tuple[int, ...] = ()  # a global batch: each rank's micros, in rank order
    rank_samples: tuple[int, ...] = ()  # a global batch: each rank's samples
    # the policy's weight version the rollout sampled with (its applied updates; None: a
    # batch recorded before versions), and the weight-sync check of a separate sampler (vLLM)
    weight_version: int | None = None
    weight_sync: WeightSyncCheck | None = None
    # max_staleness > 0 (engine/rollout/ahead.py): the policy's version when this batch trains minus
    # `weight_version`; None for an on-policy step (0 by construction)
    staleness: int | None = None
    # a trainer whose rows are [left-padded prompt | right-padded completion] (TRL): each
    # micro's (prompt columns, completion columns), so its own inputs can be rebuilt exactly;
    # () for grpod's packed rows
    segments: tuple[tuple[int, int], ...] = ()

    @property
    def num_micros(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[2])

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_groups(self) -> int:
        """The prompts (groups) its samples answer."""
        return int(self.sample_group_ids.unique().numel())

    def expected_valid_tokens(self) -> int:
        """Host-side sum of the loss mask: what the engine's counter must equal."""
        return int(self.loss_mask.sum())

    def chunk_valid_counts(self) -> torch.Tensor:
        """`[micros, sequence_chunks]` trainable tokens per chunk of each flattened micro."""
        flat = self.loss_mask.reshape(self.num_micros, -1)
        return torch.stack([c.sum(-1) for c in flat.tensor_split(self.sequence_chunks, -1)], -1)

    def sample_tokens(self) -> list[tuple[list[int], list[int]]]:
        """Each sample's `(prompt ids, completion ids)`, by sample index, unpacked from rows."""
        ids = self.input_ids.reshape(-1).tolist()
        owner = self.sample_ids.reshape(-1).tolist()
        trained = self.loss_mask.reshape(-1).tolist()
        out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(self.num_samples)]
        for token, sample, completion in zip(ids, owner, trained):
            if sample >= 0:
                out[sample][1 if completion else 0].append(token)
        return out

    def reorder(self, order: list[int]) -> TransportBatch:
        """The same batch with its micros run in `order` (a permutation of micro indices).

        `micro_order` keeps the composed order relative to the batch as rolled out, so
        `original.reorder(report.micro_order)` rebuilds the batch as run.
        """
        if sorted(order) != list(range(self.num_micros)):
            raise EngineError(f"batch step {self.step}: {order} is not a permutation of micros")
        index = torch.tensor(order, dtype=torch.long)
        moved = {
            name: getattr(self, name)[index]
            for name in TOKEN_FIELDS
            if getattr(self, name) is not None
        }
        previous = self.micro_order or list(range(self.num_micros))
        return replace(self, **moved, micro_order=[previous[i] for i in order])

    @classmethod
    def concat(cls, batches: list[TransportBatch]) -> TransportBatch:
        """One batch of every micro of `batches` in order (e.g. each rank's batch of a step:
        the global batch one process would run). Sample ids are renumbered to stay distinct;
        the first batch's step, digest and chunks are kept, the injected faults of any."""
        first, offset, shifted = batches[0], 0, []
        for b in batches:
            if (b.seq_len, b.input_ids.shape[1]) != (first.seq_len, first.input_ids.shape[1]):
                raise EngineError(f"batch step {b.step}: micro shape differs from the first's")
            shifted.append(torch.where(b.sample_ids >= 0, b.sample_ids + offset, b.sample_ids))
            offset += b.num_samples
        joined = {
            name: torch.cat([getattr(b, name) for b in batches])
            for name in (*TOKEN_FIELDS, *SAMPLE_FIELDS)
            if getattr(first, name) is not None
        }
        joined["sample_ids"] = torch.cat(shifted)
        return replace(
            first,
            **joined,
            micro_order=_joined_order(batches),
            injected_faults=tuple(sorted({f for b in batches for f in b.injected_faults})),
            rank_micros=tuple(b.num_micros for b in batches),
            rank_samples=tuple(b.num_samples for b in batches),
            kv_cache_stats=_joined_cache_stats(batches),
            weight_sync=_worst_check(batches),
            function_rewards={
                name: [v for b in batches for v in b.function_rewards[name]]
                for name in first.function_rewards
            },
            audit_rewards={
                name: [v for b in batches for v in b.audit_rewards[name]]
                for name in first.audit_rewards
            },
            segments=tuple(s for b in batches for s in b.segments),
        )

    def part(self, rank: int) -> TransportBatch:
        """Rank `rank`'s own batch of a recorded global batch (`concat` of every rank's, with
        `rank_micros` and `rank_samples`)."""
        micros, samples = self.rank_micros, self.rank_samples
        if not micros or not samples or not 0 <= rank < len(micros):
            raise EngineError(f"batch step {self.step}: holds no rank {rank} (not distributed)")
        m0, s0 = sum(micros[:rank]), sum(samples[:rank])
        m, n = slice(m0, m0 + micros[rank]), slice(s0, s0 + samples[rank])
        token = {
            name: getattr(self, name)[m] for name in TOKEN_FIELDS if getattr(self, name) is not None
        }
        ids = token["sample_ids"]
        token["sample_ids"] = torch.where(ids >= 0, ids - s0, ids)
        per_sample = {name: getattr(self, name)[n] for name in SAMPLE_FIELDS}
        order = None if self.micro_order is None else [i - m0 for i in self.micro_order[m]]
        return replace(
            self,
            **token,
            **per_sample,
            # the cache stats stay the global batch's: a rank's own are not recorded apart
            function_rewards={k: v[n] for k, v in self.function_rewards.items()},
            audit_rewards={k: v[n] for k, v in self.audit_rewards.items()},
            rank=rank,
            micro_order=order,
            rank_micros=(),
            rank_samples=(),
            segments=self.segments[m] if self.segments else (),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        names = [*TOKEN_FIELDS, *SAMPLE_FIELDS]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def metadata(self) -> dict[str, str]:
        metadata = {
            "format": FORMAT,
            "step": str(self.step),
            "config_digest": self.config_digest,
            "sequence_chunks": str(self.sequence_chunks),
            "generation": str(self.generation),
            "injected_faults": ",".join(self.injected_faults),
            "micro_order": "" if self.micro_order is None else json.dumps(self.micro_order),
            # only with several rewards: the metadata of every other batch stays as it was
            **(
                {"function_rewards": json.dumps(self.function_rewards, sort_keys=True)}
                if self.function_rewards
                else {}
            ),
            **self._rank_metadata(),
        }
        if self.audit_rewards:  # absent without audit rewards: those digests are unchanged
            metadata["audit_rewards"] = json.dumps(self.audit_rewards, sort_keys=True)
        if self.kv_cache is not None:  # absent for a dense rollout: its digest is unchanged
            metadata["kv_cache"] = self.kv_cache.to_json()
        if self.kv_cache_stats is not None:
            metadata["kv_cache_stats"] = self.kv_cache_stats.to_json()
        if self.weight_version is not None:
            metadata["weight_version"] = str(self.weight_version)
        if self.weight_sync is not None:
            metadata["weight_sync"] = self.weight_sync.to_json()
        if self.staleness is not None:  # absent on-policy: those digests are unchanged
            metadata["staleness"] = str(self.staleness)
        if self.segments:  # absent for packed rows: their digest is unchanged
            metadata["segments"] = json.dumps([list(s) for s in self.segments])
        return metadata

    def _rank_metadata(self) -> dict[str, str]:
        """Distributed provenance; a one-process batch writes none (its digest is unchanged)."""
        if self.world_size == 1 and not self.rank_micros:
            return {}
        return {
            "rank": str(self.rank),
            "world_size": str(self.world_size),
            "rank_micros": json.dumps(list(self.rank_micros)),
            "rank_samples": json.dumps(list(self.rank_samples)),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write to safetensors atomically (temp file, fsync, rename)."""
        tensors = {n: t.contiguous() for n, t in self.tensors().items()}
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata=self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike) -> TransportBatch:
        """Read and validate a saved batch; a malformed file is an EngineError naming it."""
        path = Path(path)
        try:
            tensors = load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                metadata = fh.metadata() or {}
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"batch {path}: cannot read: {exc}") from None
        except Exception as exc:  # safetensors raises bare errors on truncated headers
            raise EngineError(f"batch {path}: not a safetensors file: {exc}") from None
        return cls.from_tensors(tensors, metadata, source=str(path))

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str = "batch"
    ) -> TransportBatch:
        """Validate names, dtypes, shapes and metadata, then build the batch."""
        if metadata.get("format") != FORMAT:
            raise EngineError(f"batch {source}: format is {metadata.get('format')!r}, not {FORMAT}")
        for name, dtype in {**TOKEN_FIELDS, **SAMPLE_FIELDS}.items():
            if name not in tensors:
                if name in OPTIONAL_FIELDS:
                    continue
                raise EngineError(f"batch {source}: missing tensor {name!r}")
            if tensors[name].dtype != dtype:
                raise EngineError(
                    f"batch {source}: tensor {name!r} has dtype {tensors[name].dtype}, not {dtype}"
                )
        token_shape = tensors["input_ids"].shape
        if len(token_shape) != 3:
            raise EngineError(f"batch {source}: input_ids must be [micros, rows, seq]")
        for name in TOKEN_FIELDS:
            if name in tensors and tensors[name].shape != token_shape:
                raise EngineError(
                    f"batch {source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                    f"input_ids has {tuple(token_shape)}"
                )
        samples = tensors["rewards"].shape
        for name in SAMPLE_FIELDS:
            if tensors[name].shape != samples or len(samples) != 1:
                raise EngineError(f"batch {source}: tensor {name!r} must be [samples]")
        unknown = set(tensors) - set(TOKEN_FIELDS) - set(SAMPLE_FIELDS)
        if unknown:
            raise EngineError(f"batch {source}: unknown tensors {sorted(unknown)}")
        try:
            step = int(metadata["step"])
            chunks = int(metadata["sequence_chunks"])
            digest = metadata["config_digest"]
            provenance = _provenance(metadata)
        except EngineError as exc:  # a kv cache setting: its message names the field
            raise EngineError(f"batch {source}: bad metadata: {exc}") from None
        except (KeyError, ValueError, TypeError) as exc:
            raise EngineError(f"batch {source}: bad metadata: {exc!r}") from None
        order = provenance["micro_order"]
        if order is not None and sorted(order) != list(range(token_shape[0])):
            raise EngineError(f"batch {source}: micro_order {order} is not a permutation")
        names = {f.name for f in fields(cls)}
        kwargs = {n: tensors.get(n) for n in names if n in TOKEN_FIELDS or n in SAMPLE_FIELDS}
        return cls(**kwargs, step=step, config_digest=digest, sequence_chunks=chunks, **provenance)


def _provenance(metadata: dict[str, str]) -> dict[str, Any]:
    """The typed provenance fields; a blob written before them carries a JSON "meta" dict."""
    if "meta" in metadata:
        meta = json.loads(metadata["meta"])
        order = meta.get("micro_order")
        return {
            "generation": int(meta.get("generation", 0)),
            "injected_faults": tuple(meta.get("injected", ())),
            "micro_order": None if order is None else [int(i) for i in order],
            "function_rewards": dict(meta.get("rewards", {})),
            **_ranks(meta),
        }
    faults, order = metadata.get("injected_faults", ""), metadata.get("micro_order", "")
    kv_cache, kv_stats = metadata.get("kv_cache"), metadata.get("kv_cache_stats")
    version, check = metadata.get("weight_version"), metadata.get("weight_sync")
    staleness = metadata.get("staleness")
    return {
        "generation": int(metadata.get("generation", "0")),
        "injected_faults": tuple(faults.split(",")) if faults else (),
        "micro_order": [int(i) for i in json.loads(order)] if order else None,
        "kv_cache": KVCacheSpec.from_json(kv_cache) if kv_cache else None,
        "kv_cache_stats": CacheStats.from_json(kv_stats) if kv_stats else None,
        "function_rewards": json.loads(metadata.get("function_rewards", "{}")),
        "audit_rewards": json.loads(metadata.get("audit_rewards", "{}")),
        "weight_version": None if version is None else int(version),
        "weight_sync": WeightSyncCheck.from_json(check) if check else None,
        "staleness": None if staleness is None else int(staleness),
        "segments": tuple((int(p), int(c)) for p, c in json.loads(metadata.get("segments", "[]"))),
        **_ranks({k: json.loads(v) for k, v in metadata.items() if k in RANK_KEYS}),
    }


def _joined_order(batches: list[TransportBatch]) -> list[int] | None:
    """The micro order of `concat(batches)`: each rank's, offset by the micros before it."""
    if all(b.micro_order is None for b in batches):
        return None
    order, offset = [], 0
    for b in batches:
        order += [offset + i for i in (b.micro_order or range(b.num_micros))]
        offset += b.num_micros
    return order


def _joined_cache_stats(batches: list[TransportBatch]) -> CacheStats | None:
    """Every rank's cache stats as one: evictions summed, fill averaged over samples."""
    stats = [(b.kv_cache_stats, b.num_samples) for b in batches if b.kv_cache_stats is not None]
    if not stats:
        return None
    samples = sum(n for _, n in stats)
    return CacheStats(
        prompt_tokens_evicted=sum(s.prompt_tokens_evicted for s, _ in stats),
        fill=sum(s.fill * n for s, n in stats) / samples,
    )


def _worst_check(batches: list[TransportBatch]) -> WeightSyncCheck | None:
    """The weight-sync check of the rank whose sampler disagreed most (NaN is the worst)."""
    checks = [b.weight_sync for b in batches if b.weight_sync is not None]
    if not checks:
        return None
    return max(checks, key=lambda c: math.inf if math.isnan(c.max_abs_diff) else c.max_abs_diff)


RANK_KEYS = ("rank", "world_size", "rank_micros", "rank_samples")


def _ranks(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "rank": int(meta.get("rank", 0)),
        "world_size": int(meta.get("world_size", 1)),
        "rank_micros": tuple(int(i) for i in meta.get("rank_micros", ())),
        "rank_samples": tuple(int(i) for i in meta.get("rank_samples", ())),
    }
