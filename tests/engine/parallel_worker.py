"""One rank of the 2-process FSDP2 and DDP test, run as
`torchrun --nproc-per-node 2 -m tests.engine.parallel_worker OUT`.

For each of `parallel = "fsdp2"` and `"ddp"` (in one process group, one after the other):
step 0 is applied and its batch, report and the updated full weights are written to
OUT/MODE/ for the one-process comparison; step 1 has a NaN loss and step 2 an infinite
gradient, each on rank 1 only: both ranks must flush with their weights (shards or replica)
and AdamW state bit-identical; step 3 applies; then a DCP checkpoint (loaded back: the same
state), the final weights, and under FSDP2 the rollout copy checked against the shards.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import grpod.engine.model.parallel as parallel
from grpod.engine import Engine, EngineConfig
from grpod.engine.grpo.step import decide_step
from grpod.guards import GuardPolicy
from tests.engine.helpers import TINY

CONFIG = dict(
    TINY,
    sequence_chunks=2,
    micro_batch_rows=1,
    faults={"nan_loss_steps": [1], "inf_grad_steps": [2], "ranks": [1]},
    threads=1,
)
MODES = ("fsdp2", "ddp")


def main(out: Path) -> None:
    modes = {}
    for mode in MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = Engine(EngineConfig.model_validate({**CONFIG, "parallel": mode}))
        modes[mode] = run_steps(engine, out / mode)
    # a file per rank: two ranks printing to one pipe can interleave their lines
    rank = engine.parallel.rank
    (out / f"result-{rank}.json").write_text(json.dumps({"rank": rank, "modes": modes}))
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()


def run_steps(engine: Engine, out: Path) -> list[dict]:
    rank = engine.parallel.rank
    out.mkdir(exist_ok=True)
    policy = GuardPolicy()
    steps = []
    for step in range(4):
        batch = engine.rollout()
        before = engine.state_digest()
        result = decide_step(engine, policy, batch)
        report = result.report
        steps.append(
            {
                "outcome": result.outcome,
                "guards": sorted({f.guard for f in result.verdict.findings}),
                "untouched": engine.state_digest() == before,
            }
        )
        if step == 0:
            batch.save(out / f"batch-{rank}.safetensors")
            (out / f"report-{rank}.json").write_text(json.dumps(report.to_dict()))
            full = {n: _full(p) for n, p in engine.model.named_parameters()}
            save_file(full, str(out / f"weights-{rank}.safetensors"))
    engine.save_checkpoint(out / "checkpoint")  # collective: DCP
    digest = engine.state_digest()
    engine.load_checkpoint(out / "checkpoint")  # the same world size: everything back
    assert engine.state_digest() == digest, "a DCP round trip changed the state"
    full = {n: _full(p) for n, p in engine.model.named_parameters()}  # collective: FSDP2
    if engine.parallel.sharded:  # the rollout copy's bucketed all-gather: the same weights
        copy = dict(engine.rollout_model.named_parameters())
        for bucket_bytes in (parallel.SYNC_BUCKET_BYTES, 64 * 1024):  # one bucket, then ~20
            parallel.SYNC_BUCKET_BYTES = bucket_bytes
            with torch.no_grad():
                engine.flat_weights.zero_()
            engine.parallel.sync_rollout_copy(engine.model, engine.rollout_model)
            assert all(torch.equal(copy[n], t) for n, t in full.items()), bucket_bytes
    if rank == 0:
        save_file(full, str(out / "final.safetensors"))
    return steps


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter: an FSDP2 shard gathered, a DDP replica as it is."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach().clone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # the gloo teardown abort (tests/guards/dist_worker.py)
