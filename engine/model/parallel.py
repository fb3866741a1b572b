"""Data parallelism under torchrun: the process group, FSDP2 sharding and a step's collectives.

One process per device (`torchrun --nproc-per-node N grpod run ...`): NCCL on CUDA, gloo on
the CPU. `[engine] parallel = "fsdp2"` (the default when `WORLD_SIZE > 1`) shards the policy
with `torch.distributed.fsdp.fully_shard` per decoder layer and the root; FP32 master weights,
and under `dtype = "bfloat16"` `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.
`parallel = "ddp"` keeps a full replica per rank and wraps the training trunk in
`DistributedDataParallel` (one gradient all-reduce per step, at the rank's last trunk pass).
FSDP's and DDP's gradient averaging is neutralised (divide factor 1 and plain SUM reductions;
a SUM comm hook) because the engine divides by the step's *global* valid-token count itself,
so an N-rank step equals the one-process step on the same global batch.

What the engine keeps per rank under FSDP2:
- the trained model is sharded (its parameters are DTensors); it runs only through the
  Hugging Face forward, entered by `trunk` so that FSDP's hooks gather and reduce;
- an unsharded *rollout copy* of the policy in one flat buffer (engine/model/flat.py): the fused
  decoder, scoring and the reference pass run on it with no collective, so ranks whose
  rollouts differ in length never wait on each other; `sync_rollout_copy` refreshes it
  from the shards (packed into buckets, one all-gather each) before every rollout;
- the weights guard checks each rank's local shards; the policy max-reduces its verdict.

Under DDP the replica is the rollout model itself (every rank applies the same update), so
there is no copy to refresh; the DCP checkpoint path is the same as FSDP2's.
"""

from __future__ import annotations

import datetime
import inspect
import math
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from grpod.base import collectives, torchrun
from grpod.engine.config import check_parallel
from grpod.engine.model.trunk import hf_states, trunk_hidden

if TYPE_CHECKING:
    from grpod.engine.config import EngineConfig

TRUNK_METHOD = "grpod_trunk"  # the FSDP-registered method the training forward enters by
TIMEOUT = datetime.timedelta(minutes=10)  # a collective a peer never joins fails, never hangs
# the rollout copy's refresh gathers at most this much per all-gather (world x it in flight),
# so a model near the memory limit never needs a second full copy at once
SYNC_BUCKET_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Parallel:
    """This process's place in the job: `mode`, `rank` of `world_size`, `local_rank`."""

    mode: str  # "fsdp2" | "ddp" | "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def sharded(self) -> bool:
        """FSDP2: the trained model's parameters are this rank's shards."""
        return self.mode == "fsdp2"

    @property
    def replicated(self) -> bool:
        """DDP: a full replica of the policy on every rank."""
        return self.mode == "ddp"

    @property
    def distributed(self) -> bool:
        """A data-parallel job: one global count, collective checkpoints (fsdp2 or ddp)."""
        return self.mode != "none"

    @classmethod
    def start(cls, config: EngineConfig) -> Parallel:
        """Read the torchrun environment, check the config against it, join the group."""
        world, rank, local = torchrun.world_size(), torchrun.rank(), torchrun.local_rank()
        mode = check_parallel(config, world)
        if mode == "none":  # under torchrun too: each rank its own replica, no engine collective
            return cls("none")
        join()
        return cls(mode, rank, world, local)

    def device(self, name: str) -> str:
        """One device per rank: `cuda` under torchrun is `cuda:LOCAL_RANK`; `auto` is that
        when CUDA is there, else the CPU (gloo), as in one process."""
        if name == "auto" and self.distributed:
            name = "cuda" if torch.cuda.is_available() else "cpu"
        return f"cuda:{self.local_rank}" if self.distributed and name == "cuda" else name

    # ----------------------------------------------------------------- data
    def local_groups(self, prompts: list) -> tuple[list, int]:
        """This rank's whole groups of the step's prompts, and the global index of its first."""
        per_rank = len(prompts) // self.world_size
        first = self.rank * per_rank
        return prompts[first : first + per_rank], first

    # ----------------------------------------------------------------- the model
    def shard(self, model: torch.nn.Module, dtype: str) -> torch.nn.Module:
        """`fully_shard` per decoder layer and the root; gradient SUM, never an average."""
        from torch.distributed.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        policy = MixedPrecisionPolicy()
        if dtype == "bfloat16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.base_model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                # gloo has no PREMUL_SUM; SUM then a division by 1 is the same bits
                module.set_force_sum_reduction_for_comms(True)
        model.grpod_trunk = types.MethodType(_hf_trunk, model)
        register_fsdp_forward_method(model, TRUNK_METHOD)
        return model

    def replicate(self, model: torch.nn.Module, dtype: str) -> torch.nn.Module:
        """The training trunk of `model` under `DistributedDataParallel`, gradients SUMmed.

        `model` stays the engine's model (optimizer, head, checkpoints); the wrapper only
        owns the trunk forward so DDP's reducer sees every backward. Buffers are not
        broadcast per forward: they are the same constants on every rank."""
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.local_rank] if next(model.parameters()).is_cuda else None
        # torch 2.13 renamed the flag (the old name warns on every rank); either way the
        # buffers are synced at init at most, never per forward
        known = inspect.signature(DistributedDataParallel).parameters
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers"
        wrapped = DistributedDataParallel(
            _Trunk(model, dtype), device_ids=device_ids, **{no_sync: False}
        )
        wrapped.register_comm_hook(None, _sum_hook)
        return wrapped

    @torch.no_grad()
    def sync_rollout_copy(self, sharded: torch.nn.Module, copy: torch.nn.Module) -> None:
        """Copy the full weights of `sharded` into the unsharded `copy` (every rank, in order):
        the parameters' shards packed into buckets of up to SYNC_BUCKET_BYTES, each padded to
        FSDP2's dim-0 chunk, one all-gather per bucket (one for a small model)."""
        params = dict(copy.named_parameters())
        pairs = [(params[name], param) for name, param in sharded.named_parameters()]
        one_dtype = len({full.dtype for full, _ in pairs}) <= 1
        if not one_dtype or not all(_row_sharded(param) for _, param in pairs):
            # not FSDP2's default layout: each parameter gathered on its own
            for full, param in pairs:
                full.copy_(param.full_tensor() if hasattr(param, "full_tensor") else param)
            return
        bucket: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
        total = 0
        for full, param in pairs:
            chunk = -(-full.shape[0] // self.world_size)  # rows per rank; the last may be fewer
            row = full[0].numel() if full.shape[0] else 0
            if bucket and (total + chunk * row) * full.element_size() > SYNC_BUCKET_BYTES:
                self._gather_bucket(bucket, total)
                bucket, total = [], 0
            bucket.append((full, param.to_local(), total, chunk, row))
            total += chunk * row
        if bucket:
            self._gather_bucket(bucket, total)

    def _gather_bucket(
        self, bucket: list[tuple[torch.Tensor, torch.Tensor, int, int, int]], total: int
    ) -> None:
        """One all-gather of `bucket`'s shards (`(full, shard, offset, chunk rows, row size)`)
        and each rank's rows copied into the full parameters."""
        mine = torch.zeros(total, dtype=bucket[0][0].dtype, device=bucket[0][1].device)
        for _, shard, offset, _, _ in bucket:
            mine[offset : offset + shard.numel()].copy_(shard.reshape(-1))
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        for full, _, offset, chunk, row in bucket:
            flat, rows = full.view(-1), full.shape[0]
            for rank, theirs in enumerate(every):
                n = max(0, min(chunk, rows - rank * chunk)) * row
                start = rank * chunk * row
                flat[start : start + n].copy_(theirs[offset : offset + n])

    # ----------------------------------------------------------------- collectives
    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (float64: integer counts stay exact below 2**53)."""
        if not self.distributed:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64, device=collectives.comm_device())
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def worst(self, norm: float) -> float:
        """DDP: the largest of every replica's `norm` (NaN if any is NaN), so a rank whose
        gradients went bad after the all-reduce decides for all; else `norm` itself. Gathered,
        not `collectives.all_reduce_max`: a MAX all-reduce need not propagate a NaN."""
        if not self.replicated:
            return norm
        norms = [value for (value,) in self.gather([norm])]
        return math.nan if any(math.isnan(n) for n in norms) else max(norms)

    @property
    def node_leader(self) -> bool:
        """Local rank 0: the rank that starts and feeds its node's rollout server."""
        return self.local_rank == 0

    def barrier(self) -> None:
        """Every rank has reached this point (a MAX all-reduce of nothing)."""
        if self.distributed:
            collectives.all_reduce_max(0)

    def from_node_leader(self, value: object) -> object:
        """Every rank gets its node leader's `value` (a picklable object; one object
        all-gather over the job: torchrun numbers a node's ranks contiguously)."""
        if not self.distributed:
            return value
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values[self.rank - self.local_rank]

    def max_int(self, value: int) -> int:
        """The max of `value` over every rank of a data-parallel job; `value` itself under
        `parallel = "none"`, where each rank is its own replica (a group may still be up for
        the guards)."""
        return collectives.all_reduce_max(value) if self.distributed else value


def join() -> None:
    """Join the torchrun job's process group (once): gloo for CPU tensors, NCCL for CUDA ones."""
    if dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(torchrun.local_rank())
        backend = "cpu:gloo,cuda:nccl"  # the daemon's small host-side collectives stay on gloo
    dist.init_process_group(backend, timeout=TIMEOUT)


def total_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of `grads` before clipping (over every rank's shards)."""
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # a DTensor: the partial norms reduced over ranks
        norm = norm.full_tensor()
    return float(norm)


def is_sharded(model: torch.nn.Module) -> bool:
    return hasattr(model, TRUNK_METHOD)


def _row_sharded(param: torch.Tensor) -> bool:
    """A DTensor sharded by rows over one mesh dimension (FSDP2's default placement)."""
    from torch.distributed.tensor import Shard

    placements = getattr(param, "placements", None)
    return placements is not None and tuple(placements) == (Shard(0),)


def is_replicated(model: torch.nn.Module) -> bool:
    """The DDP-wrapped training trunk of `Parallel.replicate`."""
    return isinstance(getattr(model, "module", None), _Trunk)


class _Trunk(torch.nn.Module):
    """The trunk forward of a causal LM as a module of its own, for DDP to wrap."""

    def __init__(self, model: torch.nn.Module, dtype: str) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        return trunk_hidden(self.model, input_ids, position_ids, attention_mask, self.dtype)


def _sum_hook(_state, bucket):  # no annotations: DDP checks them as objects, not strings
    """DDP's all-reduce of a `dist.GradBucket` without its division by the world size."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def _hf_trunk(
    self: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """The final-norm hidden states through the Hugging Face forward (FSDP hooks around it)."""
    return hf_states(self, input_ids, position_ids, attention_mask)
