"""One rank of the 2-process FSDP2 test, run as
`torchrun --nproc-per-node 2 -m tests.engine.parallel_worker OUT`.

Step 0 is applied and its batch, report and the updated full weights are written for the
one-process comparison; step 1 has a NaN loss and step 2 an infinite gradient, each on rank 1
only: both ranks must flush with their shards and AdamW state bit-identical; step 3 applies.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from grpod.engine import Engine, EngineConfig
from grpod.engine.step import decide_step
from grpod.guards import GuardPolicy
from tests.engine.helpers import TINY

CONFIG = dict(
    TINY,
    sequence_chunks=2,
    micro_batch_rows=1,
    faults={"nan_loss_steps": [1], "inf_grad_steps": [2], "ranks": [1]},
    threads=1,
)


def main(out: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(EngineConfig.model_validate(CONFIG))
    rank = engine.parallel.rank
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
            full = {n: p.full_tensor() for n, p in engine.model.named_parameters()}
            if rank == 0:
                save_file(full, str(out / "weights.safetensors"))
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # the gloo teardown abort (tests/guards/dist_worker.py)
