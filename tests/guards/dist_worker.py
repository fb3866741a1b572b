"""One rank of the two-process gloo test (run as `python -m tests.guards.dist_worker`).

Only rank 1's engine injects a NaN loss at step 1; the verdicts must agree. Then only rank 1
sees an all-long-prompt batch in the reorder hook; both ranks must skip. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from grpod.engine import Engine, EngineConfig
from grpod.engine.grpo.step import decide_step
from grpod.guards import GuardPolicy
from tests.guards.helpers import batch


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    # independent replicas (no FSDP): only the guards' verdicts cross ranks here
    cfg = dict(task="arith", prompts_per_step=2, group_size=4, seq_len=32, seed=rank)
    cfg["parallel"] = "none"
    if rank == 1:
        cfg["faults"] = {"nan_loss_steps": [1]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(EngineConfig.model_validate(cfg))
    policy = GuardPolicy()
    steps = []
    for _ in range(3):
        before = engine.state_digest()
        result = decide_step(engine, policy, engine.rollout())
        steps.append(
            {
                "step": result.step,
                "outcome": result.outcome,
                "guards": [f.guard for f in result.verdict.findings if f.action >= 2],
                "untouched": engine.state_digest() == before,
            }
        )
    # the skip decision: only rank 1's batch has no trainable token in chunk 0
    mask = [[0, 0, 0, 0, 1, 1, 0, 0]] if rank == 1 else [[0, 1, 0, 0, 1, 1, 0, 0]]
    _, findings, skip = policy.before(batch(mask, chunks=2), per_micro_accounting=True)
    print(
        json.dumps(
            {"rank": rank, "steps": steps, "skip": skip, "skip_guards": [f.guard for f in findings]}
        ),
        flush=True,
    )
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter finalization: gloo's worker threads can still hold tensors there, and
    # destroying them then aborts the process now and again ("terminate called without an
    # active exception", pytorch/pytorch#190489) after the result line is out.
    sys.stdout.flush()
    os._exit(0)
