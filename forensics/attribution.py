"""Per-sample attribution of a recorded step (`grpod replay --step N --by-sample`).

Offline, exactness before speed: the step is rebuilt as replay rebuilds it (its checkpoint,
the recorded steps before it as decided, its recorded execution context), run once whole
(its gradient G, compared with the recorded grad norm), then once per sample through the
same `Engine.accumulate`, on a copy of the batch in which only that sample trains
(`only_sample`) and with the step's divisor, the valid tokens of the whole step. The
per-sample gradients g_i then sum to G up to FP32 rounding; the residual |sum g_i - G| / |G|
is reported.

For each sample: its gradient norm |g_i|, its `share` |g_i| / sum_j |g_j| (what the ranking
uses: never negative, sums to 1), its `projection` <g_i, G> / |G|^2 (signed, sums to 1), its
loss contribution (its loss sum / the step's valid tokens), its largest |log-ratio| (policy vs
old logprobs) and largest sampler/trainer mismatch, and the share the data predicts,
|A_i| n_i / sum_j |A_j| n_j (advantage times trainable tokens). A sample *stands out* when its
`excess`, its gradient per unit of data |g_i| / (|A_i| n_i) over the step's median of the
same, is above STANDS_OUT: the gradient it carries is not explained by its advantage and
length (a share cannot show it: a sample whose data predicts half the step is capped at 2x).

A non-finite step also gets where its first non-finite value was born (forensics/nonfinite.py):
module, sample and token. Samples are ranked: that sample, the other non-finite ones, then by
share, descending.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from grpod.base.jsonsafe import to_json
from grpod.engine import Engine, StepReport, TransportBatch
from grpod.engine.context import ExecutionContext
from grpod.engine.grpo.samples import decode_samples
from grpod.engine.verdict import Outcome
from grpod.forensics.compare import bit_equal
from grpod.forensics.context import ContextRestore
from grpod.forensics.errors import ForensicsError
from grpod.forensics.nonfinite import FirstNonFinite, birth_token
from grpod.forensics.step_replay import as_run, opened_plan, rerun_step, restore_engine

PROMPT_ID = (
    "the prompt's position in the run's data stream: generation x prompts_per_step + its group "
    "(the batch records the group, not the task's row)"
)
STANDS_OUT = 4.0  # share / predicted share above which a sample is not explained by its data


@dataclass
class StepAttribution:
    step: int
    checkpoint_step: int
    steps_replayed: int
    outcome: str
    verdict_action: str
    injected_faults: list[str]
    valid_tokens: int  # the step's divisor
    recorded_grad_norm: Any
    replayed_grad_norm: Any  # the whole step, re-run: equal to the record on the same machine
    sum_grad_norm: Any  # |sum of the per-sample gradients|
    residual: Any  # |sum g_i - G| / |G| (None: G is not finite)
    samples: list[dict[str, Any]]  # ranked (see the module docstring)
    nonfinite: dict[str, Any] | None  # {sample, token, part, module, text}
    stands_out: list[int]  # sample indices whose share exceeds STANDS_OUT x the prediction
    rule: str
    seconds: float
    reproduced: bool = False  # the whole step's grad norm bit-equal to the record
    note: str = ""
    prompt_id_is: str = PROMPT_ID

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def attribute(
    run_dir: str | os.PathLike,
    step: int | None = None,
    incident_id: int | None = None,
    *,
    store_url: str = "",
    threads: int | None = None,
    device: str = "",
) -> StepAttribution:
    """Attribute recorded step `step` (or the step of `incident_id`) of the run in `run_dir`
    to its samples. `threads`: torch threads instead of each step's recorded count (beside a
    training daemon: forensics/incident_attribution.py); the numbers then differ from the
    record by rounding, which the note says. `device`: run there instead of the run's device
    ('': the run's; "cpu" keeps it off the GPU a training daemon uses)."""
    started = time.perf_counter()
    with opened_plan(run_dir, store_url, step, incident_id, "replay --by-sample") as opened:
        store, (config, _versions, checkpoint, plan) = opened
        recorded_device = config.get("engine", {}).get("device", "cpu")
        if device and device != recorded_device:
            config = {**config, "engine": {**config.get("engine", {}), "device": device}}
        process = ExecutionContext.capture()
        engine = restore_engine(store, config, checkpoint)
    if engine.parallel.world_size > 1:
        raise ForensicsError("replay --by-sample runs in one process, not under torchrun")
    target = plan[-1]
    contexts = ContextRestore(engine)
    try:
        for item in plan[:-1]:
            _before(contexts, item.context, threads)
            rerun_step(engine, item, compute_skipped=False, part=None, alone=False)
        _before(contexts, target.context, threads)
        batch = as_run(target.batch, target.report.micro_order)
        result = _attribute(engine, batch, target.report)
    finally:
        engine.context = contexts.shell
        process.apply()
    notes = [n for n in contexts.notes() if n]
    if device and device != recorded_device:
        notes.append(f"run on {device}, not the run's {recorded_device}")
    recorded_threads = None if target.context is None else target.context.threads
    if threads is not None and threads != recorded_threads:
        notes.append(f"run at {threads} torch thread(s), not the recorded {recorded_threads}")
    if target.row.outcome == Outcome.SKIPPED:
        notes.append("the step was skipped without compute when recorded: computed now")
    return replace(
        result,
        checkpoint_step=checkpoint.step,
        steps_replayed=len(plan),
        outcome=target.row.outcome,
        verdict_action=target.row.verdict_action,
        seconds=time.perf_counter() - started,
        note="; ".join(notes),
    )


def _before(
    contexts: ContextRestore, recorded: ExecutionContext | None, threads: int | None
) -> None:
    """Set a step's recorded context on the engine; `threads` overrides its thread count."""
    contexts.before(recorded)
    if threads is not None:
        contexts.engine.context = replace(contexts.engine.context, threads=threads)


def only_sample(batch: TransportBatch, sample: int) -> TransportBatch:
    """`batch` with every other sample turned to padding: only `sample` is run and trained
    (micros keep their places, so a micro's drill faults still find it)."""
    mine = batch.sample_ids == sample
    kept = {
        "loss_mask": batch.loss_mask & mine,
        "sample_ids": torch.where(mine, batch.sample_ids, -1),
        "group_ids": torch.where(mine, batch.group_ids, -1),
        "advantages": torch.where(mine, batch.advantages, 0.0),
    }
    for name in ("sampler_logprobs", "old_logprobs"):
        values = getattr(batch, name)
        if values is not None:
            kept[name] = torch.where(mine, values, 0.0)
    return replace(batch, **kept)


def _attribute(engine: Engine, batch: TransportBatch, recorded: StepReport) -> StepAttribution:
    params = _param_names(engine)
    whole = engine.accumulate(batch)
    grad = _flat_grad(engine)
    engine.flush()
    divisor = whole.global_valid_tokens or whole.valid_tokens
    old, current = _logprobs(engine, batch)
    total = torch.zeros_like(grad)
    joint = engine.config.dtype == "float32"
    rows: list[dict[str, Any]] = []
    births: list[tuple[int, Any]] = []
    for sample in range(batch.num_samples):
        alone = only_sample(batch, sample)
        with FirstNonFinite(engine.model) as watch:
            report = engine.accumulate(alone, global_valid_tokens=divisor)
        g = _flat_grad(engine)
        engine.flush()
        finite = bool(torch.isfinite(g).all()) and math.isfinite(report.loss)
        if finite:
            total += g
        else:
            births.append((sample, _origin(alone, sample, watch, report, engine, params, joint)))
        row = _row(batch, sample, report, g, grad, finite, old, current)
        row["prompt_id"] = batch.generation * engine.config.prompts_per_step + row["group"]
        rows.append(row)
    _shares(rows)
    nonfinite = min(births, key=lambda b: b[1]["order"])[1] if births else None
    stands_out = [r["index"] for r in rows if r["stands_out"]]
    first = None if nonfinite is None else nonfinite["sample"]
    rows.sort(key=lambda r: (r["index"] != first, r["finite"], -(r["share"] or 0.0), r["index"]))
    texts = decode_samples(batch, engine.tokenizer, engine.config.stop)
    for row in rows:
        row.update(
            prompt=texts[row["index"]]["prompt"], completion=texts[row["index"]]["completion"]
        )
    finite_grad = bool(torch.isfinite(grad).all())
    residual = (
        float((total - grad).norm() / grad.norm()) if finite_grad and grad.norm() > 0 else None
    )
    return StepAttribution(
        step=batch.step,
        checkpoint_step=-1,
        steps_replayed=0,
        outcome="",
        verdict_action="",
        injected_faults=list(batch.injected_faults),
        valid_tokens=divisor,
        recorded_grad_norm=to_json(recorded.grad_norm),
        replayed_grad_norm=to_json(whole.grad_norm),
        sum_grad_norm=to_json(float(total.norm())),
        residual=residual,
        samples=[
            {k: to_json(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows
        ],
        nonfinite=None
        if nonfinite is None
        else {k: v for k, v in nonfinite.items() if k != "order"},
        stands_out=stands_out,
        rule=(
            f"a sample stands out when its gradient per unit of data, |g| / (|advantage| x "
            f"trainable tokens), is above {STANDS_OUT:g}x the step's median of the same"
        ),
        seconds=0.0,
        reproduced=bit_equal(whole.grad_norm, recorded.grad_norm),
    )


def _row(
    batch: TransportBatch,
    sample: int,
    report: StepReport,
    g: torch.Tensor,
    grad: torch.Tensor,
    finite: bool,
    old: torch.Tensor,
    current: torch.Tensor,
) -> dict[str, Any]:
    """One sample's numbers (shares are filled in by `_shares`)."""
    mine = (batch.sample_ids == sample) & batch.loss_mask
    advantage = float(batch.advantages[mine][0]) if mine.any() else 0.0
    sampler = batch.sampler_logprobs
    mismatch = None
    if sampler is not None and mine.any():
        mismatch = float((old[mine] - sampler[mine]).abs().max())
    ratio = float((current[mine] - old[mine]).abs().max()) if mine.any() else 0.0
    dot = float(g @ grad / (grad @ grad)) if finite and bool(torch.isfinite(grad).all()) else None
    return {
        "index": sample,
        "prompt_id": None,
        "group": int(batch.sample_group_ids[sample]),
        "reward": float(batch.rewards[sample]),
        "advantage": advantage,
        "completion_length": int(batch.completion_lengths[sample]),
        "valid_tokens": int(mine.sum()),
        "grad_norm": float(g.norm()),
        "share": None,
        "projection": dot,
        "predicted_share": None,
        "excess": None,
        "stands_out": False,
        "loss": report.loss,
        "max_abs_log_ratio": ratio,
        "max_mismatch": mismatch,
        "finite": finite,
    }


def _shares(rows: list[dict[str, Any]]) -> None:
    """Fill in each finite row's share, predicted share, excess and whether it stands out.

    `excess`: the sample's gradient per unit of data, |g_i| / (|A_i| n_i), over the median of
    the same across the step's finite samples with A != 0 (inf for a gradient without data).
    """
    finite = [r for r in rows if r["finite"]]
    norms = sum(r["grad_norm"] for r in finite)
    weights = sum(abs(r["advantage"]) * r["valid_tokens"] for r in finite)
    per_unit = sorted(
        r["grad_norm"] / (abs(r["advantage"]) * r["valid_tokens"])
        for r in finite
        if r["advantage"] != 0 and r["valid_tokens"] > 0
    )
    typical = per_unit[len(per_unit) // 2] if per_unit else 0.0
    for r in finite:
        r["share"] = r["grad_norm"] / norms if norms > 0 else 0.0
        data = abs(r["advantage"]) * r["valid_tokens"]
        r["predicted_share"] = data / weights if weights > 0 else 0.0
        if data > 0 and typical > 0:
            r["excess"] = r["grad_norm"] / data / typical
        elif r["grad_norm"] > 0:
            r["excess"] = math.inf
        r["stands_out"] = (r["excess"] or 0.0) > STANDS_OUT


def _origin(
    batch: TransportBatch,
    sample: int,
    watch: FirstNonFinite,
    report: StepReport,
    engine: Engine,
    params: dict[int, str],
    joint: bool,
) -> dict[str, Any]:
    """Where sample `sample`'s first non-finite value was born (`order`: how early)."""
    birth = watch.birth
    if birth is not None:
        token, part = birth_token(batch, sample, birth, joint)
        module = f"{birth.module} {birth.where}"
        at = "" if token is None else f", {part} token {token}"
        return {
            "sample": sample,
            "token": token,
            "part": part,
            "module": birth.module,
            "text": f"{module}, sample {sample}{at}",
            "order": birth.order,
        }
    if not math.isfinite(report.loss):
        what = "the loss (every module's output finite: the FP32 head, the loss or a loss hook)"
    else:
        bad = [params.get(id(p), "?") for p in engine.params if _bad(p.grad)]
        what = f"the gradient of {bad[0] if bad else '?'} (forward and loss finite)"
    return {
        "sample": sample,
        "token": None,
        "part": "",
        "module": what,
        "text": f"{what}, sample {sample}",
        "order": math.inf,
    }


def _bad(grad: torch.Tensor | None) -> bool:
    return grad is not None and not bool(torch.isfinite(grad).all())


def _flat_grad(engine: Engine) -> torch.Tensor:
    """Every trained parameter's gradient as one FP64 vector (zeros where none)."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
            for p in engine.params
        ]
    )


def _param_names(engine: Engine) -> dict[int, str]:
    return {id(p): name for name, p in engine.model.named_parameters()}


def _logprobs(engine: Engine, batch: TransportBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`(old, current)` logprobs `[micros, rows, seq]`: the trainer's at the step's weights,
    and the old ones its ratio used (the batch's, else the same)."""
    current = engine.score(batch, engine.model)
    old = batch.old_logprobs if batch.old_logprobs is not None else current
    return old, current
