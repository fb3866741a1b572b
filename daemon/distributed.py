"""The daemon under torchrun: one plan for every rank, rank 0 owns the store, agreed stops.

`grpod run` under `torchrun --nproc-per-node N` joins the process group before it reads the
run dir; rank 0 resolves the plan (fresh or resume, run id, config) and the others take it
from rank 0, so no rank can decide differently or see a half-created directory. Each step
every rank's batch and report go to rank 0 (`gather_step`), which records the step once:
the global batch (every rank's micros in rank order, `TransportBatch.rank_micros`) as one
blob, rank 0's report with every rank's scalars and phase seconds (`rank_reports`), and a
`step_ranks` row per rank naming its slice of that blob (forensics/ranks.py). A stop signal takes
effect on all ranks at the same step boundary (`agree_stop`), so none waits in a collective
for a peer that left. Metrics: every rank writes prometheus_client's multiprocess files
into the run dir (`use_multiprocess_metrics`, daemon/metrics.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from grpod.base import torchrun
from grpod.base.torchrun import rank, world_size  # the daemon's callers read them from here
from grpod.daemon.errors import ConfigError
from grpod.engine import TransportBatch
from grpod.engine.grpo.step import StepResult
from grpod.engine.report import RankReport

T = TypeVar("T")


def use_multiprocess_metrics(run_dir: str | os.PathLike) -> Path:
    """Point prometheus_client's multiprocess mode at this node's directory in `run_dir`
    (`<run dir>/prometheus/node-<GROUP_RANK>`); before prometheus_client is imported, which
    chooses its value class once, from the environment."""
    if "prometheus_client.values" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess directory")
    path = Path(run_dir).resolve() / "prometheus" / f"node-{torchrun.group_rank()}"
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


def agree(resolve: Callable[[], T]) -> T:
    """`resolve()` on rank 0, its result (or its ConfigError) on every rank."""
    if world_size() == 1:
        return resolve()
    import torch.distributed as dist

    from grpod.engine.model.parallel import join

    join()
    box: list[Any] = [None]
    if rank() == 0:
        try:
            box[0] = resolve()
        except ConfigError as exc:
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ConfigError):
        raise box[0]
    return box[0]


def agree_refusal(mine: str | None) -> str | None:
    """Every rank's refusal of the job before its first step (bad input: a reason, or None),
    agreed: None when no rank refused, else this rank's own reason or the first refusing
    rank's, named, so every rank says one line and exits 2 together."""
    import torch.distributed as dist

    from grpod.engine.model.parallel import join

    join()
    every: list[str | None] = [None] * world_size()
    dist.all_gather_object(every, mine)
    if mine is not None:
        return mine
    return next((f"rank {r}: {why}" for r, why in enumerate(every) if why is not None), None)


def barrier() -> None:
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


def leave(code: int, together: bool) -> None:
    """Exit this rank with `code`, after its peers when they all stop `together`."""
    import torch.distributed as dist

    if together:
        dist.barrier()  # no rank tears the group down while another still uses it
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter finalization: gloo's threads can abort it (tests/guards/dist_worker.py)
    os._exit(code)


def agree_stop(requested: bool) -> bool:
    """True on every rank when a stop was asked of any (the agent signals all of them)."""
    if world_size() == 1:
        return requested
    from grpod.base import collectives

    return bool(collectives.all_reduce_max(int(requested)))


def gather_step(result: StepResult) -> StepResult | None:
    """On rank 0: the step to record (the global batch, rank 0's report with every rank's
    `RankReport`; verdict, outcome and phases as decided); None on other ranks. Under
    torchrun with `parallel = "none"` every rank trains its own replica: rank 0 records its
    own step, with nothing gathered."""
    if world_size() == 1 or result.report.world_size == 1:
        return result if rank() == 0 else None
    import torch.distributed as dist

    mine = (result.batch, result.report, dict(result.phase_seconds))
    items: list[Any] = [None] * world_size() if rank() == 0 else []
    dist.gather_object(mine, items if rank() == 0 else None, dst=0)
    if rank() != 0:
        return None
    joined = TransportBatch.concat([b for b, _, _ in items])
    order, offset = [], 0
    for b, r, _ in items:
        order += [offset + m for m in (r.micro_order or range(b.num_micros))]
        offset += b.num_micros
    recorded = replace(
        result.report,
        micro_order=order,
        rank_reports=[RankReport.of(r, phases) for _, r, phases in items],
    )
    return replace(result, batch=joined, report=recorded)
