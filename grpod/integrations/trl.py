"""`GuardedGRPOTrainer`: TRL's `GRPOTrainer` with grpod's guards, flight recorder and metrics.

    from grpod.integrations.trl import GrpodTRLConfig, GuardedGRPOTrainer  # was: from trl ...

    trainer = GuardedGRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(...), train_dataset=dataset,
        grpod=GrpodTRLConfig(run_dir="runs/r1"),  # the one new argument
    )
    try:
        trainer.train()
    except GrpodHalt as halt:  # the guards stopped the run, after TRL saved a checkpoint
        sys.exit(halt.exit_code)  # 3, as `grpod run`'s HALT

Each optimizer step's micro-batches become one `TransportBatch` and its results a
`StepReport` (trl_batch.py); `grpod.engine.grpo.step.decide_step` runs the guards on them and the
optimizer's `step()` applies or declines (trl_optim.py): a FLUSH runs neither
`optimizer.step()` nor `lr_scheduler.step()`, so weights, AdamW state and the schedule
position are bit-identical. TRL's `state.global_step` still advances on a flushed step (it
counts optimizer-step attempts: `max_steps` includes flushed steps, and the prompts of a
flushed step are not re-drawn); the schedule and AdamW's step count only applied steps.
A HALT flushes, saves a checkpoint through TRL's own `_save_checkpoint`, stops the loop
(`should_training_stop`) and raises `GrpodHalt` from `train()`. Under accelerate with several
processes the verdict is all-reduced (max): every rank applies, flushes or halts together.
The run directory is a grpod run directory (trl_sink.py); `grpod replay` re-runs a recorded
step through TRL's own loss (trl_replay.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger
from pydantic import BaseModel, ConfigDict, Field
from transformers import TrainerCallback
from trl import GRPOTrainer

from grpod.daemon.exitcodes import EXIT_HALT
from grpod.daemon.runinfo import device_name, software_versions
from grpod.engine.grpo.step import StepResult, decide_step
from grpod.engine.report import StepReport
from grpod.engine.verdict import Action, Outcome
from grpod.forensics.config import ForensicsConfig
from grpod.guards.config import GuardsConfig
from grpod.guards.policy import GuardPolicy
from grpod.integrations.trl_batch import (
    SAMPLE_INDEX,
    Generation,
    Micro,
    StepTotals,
    step_report,
    to_transport_batch,
)
from grpod.integrations.trl_checkpoint import load_guards, write_manifest
from grpod.integrations.trl_optim import DecliningOptimizer, FollowingScheduler
from grpod.integrations.trl_sink import RunSink, is_halt

_logger = get_logger("trl.grpod")  # TRL's own loggers are accelerate's, under `trl`
MICRO_METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean")
# guards that cannot apply to TRL's step: no micro reorder (TRL's divisor is the step's
# num_items_in_batch), no weight-sync probe of a separate sampler
OFF_FOR_TRL = {"reorder": {"enabled": False}, "weight_sync": {"enabled": False}}


class GrpodTRLConfig(BaseModel):
    """grpod's settings for a guarded TRL run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str = Field(description="the grpod run directory (created, or resumed)")
    guards: GuardsConfig = Field(default_factory=lambda: GuardsConfig(**OFF_FOR_TRL))
    forensics: ForensicsConfig = Field(default_factory=ForensicsConfig)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(None, description="serve /metrics here (0: any free port)")
    log_samples: int = Field(4, ge=0, description="samples `grpod incidents show` decodes")


class GrpodHalt(Exception):
    """The guards halted a TRL run; TRL saved a checkpoint first. `exit_code` is 3."""

    exit_code = EXIT_HALT

    def __init__(self, result: StepResult, checkpoint: str | None) -> None:
        worst = max(result.verdict.findings, key=lambda f: f.action, default=None)
        why = f"{worst.guard}: {worst.message}" if worst else "HALT"
        super().__init__(f"step {result.step}: HALT ({why}); checkpoint {checkpoint}")
        self.result, self.checkpoint = result, checkpoint


@dataclass
class _Pending:
    """What one optimizer step has gathered so far."""

    micros: list[Micro]
    rollout_seconds: float = 0.0
    grad_seconds: float = 0.0
    grad_norm: float = math.nan


class GuardedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` under grpod's guards; `grpod=GrpodTRLConfig(run_dir=...)`."""

    def __init__(self, *args: Any, grpod: GrpodTRLConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            raise ValueError(
                "GuardedGRPOTrainer: steps_per_generation must equal gradient_accumulation_steps "
                "(one generation per optimizer step: its num_items_in_batch is the step's)"
            )
        self.grpod = grpod
        self.grpod_policy = GuardPolicy(grpod.guards)
        self.grpod_sink = RunSink(
            grpod.run_dir,
            self.grpod_policy.config,
            grpod.forensics,
            log_samples=grpod.log_samples,
            metrics_host=grpod.metrics_host,
            metrics_port=grpod.metrics_port,
        )
        self.grpod_digest = config_digest(self.args)
        self.grpod_optimizer: DecliningOptimizer | None = None
        self.grpod_halted: StepResult | None = None
        self.grpod_last: StepResult | None = None
        self._grpod_unlogged: list[StepResult] = []  # decided since TRL's last log
        self._grpod_pending = _Pending([])
        self._grpod_micro: Micro | None = None
        self._grpod_generation: Generation | None = None
        self._grpod_checkpoint: str | None = None
        self.add_callback(_GrpodCallback(self))

    # ----------------------------------------------------------------- the run
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """TRL's `train`, recorded in the run directory; raises `GrpodHalt` after a HALT."""
        self.grpod_sink.start(
            self.processing_class,
            trl_config(self.args),
            software_versions(),
            device_name(self.accelerator.device),
        )
        if isinstance(resume_from_checkpoint, str):
            load_guards(self.grpod_policy, resume_from_checkpoint)
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except BaseException as exc:
            self.grpod_sink.close("failed", halted=False, reason=str(exc).splitlines()[0])
            raise
        halted = self.grpod_halted
        self.grpod_sink.close("halted" if halted else "finished", halted=halted is not None)
        if halted is not None:
            raise GrpodHalt(halted, self._grpod_checkpoint)
        return output

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.grpod_optimizer is None:  # the Trainer's own, before accelerate wraps it
            self.grpod_optimizer = DecliningOptimizer(optimizer, self._grpod_decide)
            self.optimizer = self.grpod_optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, FollowingScheduler):
            if self.grpod_optimizer is None:
                raise RuntimeError("GuardedGRPOTrainer: the LR schedule came before its optimizer")
            self.lr_scheduler = FollowingScheduler(scheduler, self.grpod_optimizer)
        return self.lr_scheduler

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            write_manifest(folder, self.grpod_policy, self.state.global_step)
            self.grpod_sink.note_checkpoint(self.state.global_step, folder)
        self._grpod_checkpoint = str(folder)

    # ----------------------------------------------------------------- what a step ran
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        gathered = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training:
            self._grpod_generation = Generation(
                gathered.detach().float().cpu(),
                self.reward_weights.detach().float().cpu(),
                tuple(self.reward_func_names),
                self.num_generations,
            )
        return gathered

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        started = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            rows = int(output["prompt_ids"].shape[0])
            first = self.accelerator.process_index * rows
            output[SAMPLE_INDEX] = torch.arange(
                first, first + rows, device=output["prompt_ids"].device
            )
            self._grpod_pending.rollout_seconds += time.perf_counter() - started
        return output

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training or SAMPLE_INDEX not in inputs:
            return inputs
        index = inputs[SAMPLE_INDEX]
        inputs = {k: v for k, v in inputs.items() if k != SAMPLE_INDEX}
        tensors = {k: v.detach().cpu() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        self._grpod_micro = Micro(tensors, index.cpu())
        return inputs

    def training_step(
        self, model: Any, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        started, rollout = time.perf_counter(), self._grpod_pending.rollout_seconds
        seen = {key: len(self._metrics["train"].get(key, ())) for key in MICRO_METRICS}
        loss = super().training_step(model, inputs, num_items_in_batch)
        micro, self._grpod_micro = self._grpod_micro, None
        if micro is not None:
            micro.loss = float(loss)
            for key in MICRO_METRICS:
                values = self._metrics["train"].get(key, ())
                if len(values) > seen[key]:
                    micro.metrics[key] = float(values[-1])
            self._grpod_pending.micros.append(micro)
        spent = time.perf_counter() - started
        self._grpod_pending.grad_seconds += spent - (self._grpod_pending.rollout_seconds - rollout)
        return loss

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float:
        value = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._grpod_pending.grad_norm = float(value)
        return value

    # ----------------------------------------------------------------- the decision
    def _grpod_decide(self, apply: Any) -> bool:
        """Called by the optimizer's `step()`: decide the step, record it; True = applied."""
        pending, self._grpod_pending = self._grpod_pending, _Pending([])
        if not pending.micros or self._grpod_generation is None:
            apply()  # nothing captured (not a GRPO training micro): TRL's behaviour
            return True
        batch, report = self._grpod_step(pending)
        step = _DecidedStep(self.model, report, apply, pending)
        result = decide_step(step, self.grpod_policy, batch)  # type: ignore[arg-type]
        self.grpod_sink.publish(result, self.grpod_policy.gradnorm_vtc_correlation)
        self._grpod_say(result)
        self.grpod_last = result
        self._grpod_unlogged.append(result)
        if is_halt(result):
            self.grpod_halted = result
        return result.outcome is Outcome.APPLIED

    def _grpod_say(self, result: StepResult) -> None:
        """One line per finding through TRL's logging (its `trl.*` loggers, main process):
        `grpod: step 3 FLUSH finite: <message> (incident 2)`."""
        findings = [f for f in result.verdict.findings if f.action >= Action.WARN]
        if not findings:
            return
        incidents = self.grpod_sink.incident_ids(result.step)
        for finding in findings:
            incident = incidents.get(finding.guard)
            where = f" (incident {incident})" if incident is not None else ""
            message = " ".join(finding.message.split())
            _logger.warning(
                f"grpod: step {result.step} {finding.action.name} {finding.guard}: {message}{where}"
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the verdicts of the steps since the last one: `grpod/verdict`
        the worst (0 PASS, 1 WARN, 2 FLUSH, 3 HALT), `grpod/flushed` how many were not applied."""
        if self.model.training and self._grpod_unlogged:
            results, self._grpod_unlogged = self._grpod_unlogged, []
            logs["grpod/verdict"] = float(max(int(r.verdict.action) for r in results))
            logs["grpod/flushed"] = float(sum(r.outcome is not Outcome.APPLIED for r in results))
        super().log(logs, start_time)

    def _grpod_step(self, pending: _Pending) -> tuple[Any, StepReport]:
        micros, acc = pending.micros, self.accelerator
        local = [int(m.inputs["completion_mask"].sum()) for m in micros]
        width = max(
            int(m.inputs["prompt_ids"].shape[1] + m.inputs["completion_ids"].shape[1])
            for m in micros
        )
        loss = math.fsum(m.loss for m in micros)
        ranks, world = [sum(local)], acc.num_processes
        if world > 1:  # every rank's count and width, and the mean of the ranks' losses
            shared = acc.gather(torch.tensor([[sum(local), width]], device=acc.device)).cpu()
            ranks, width = shared[:, 0].tolist(), int(shared[:, 1].max())
            losses = acc.gather(torch.tensor([loss], dtype=torch.float64, device=acc.device))
            loss = float(losses.cpu().mean())
        step = self.state.global_step
        batch = to_transport_batch(
            micros,
            self._grpod_generation,
            step=step,
            config_digest=self.grpod_digest,
            seq_len=width,
            rank=acc.process_index,
            world_size=world,
        )
        totals = StepTotals(
            step=step,
            lr=float(self._get_learning_rate()),
            grad_norm=pending.grad_norm,
            max_grad_norm=float(self.args.max_grad_norm or 0.0),
            valid_tokens=_num_items(micros),
            expected_valid_tokens=sum(ranks),
            rank_expected_valid_tokens=ranks,
            loss=loss,
            rank=acc.process_index,
            world_size=world,
        )
        return batch, step_report(batch, micros, self._grpod_generation, totals)


class _DecidedStep:
    """The engine side of `decide_step` for a TRL step already computed: `accumulate` hands
    over its report, `apply` runs the optimizer's inner step, `flush` leaves everything (the
    Trainer's `model.zero_grad()` discards the gradients)."""

    per_micro_accounting = False
    context = None  # TRL's step records no execution context (replay through TRL: as before)

    def __init__(self, model: Any, report: StepReport, apply: Any, pending: _Pending) -> None:
        self.model, self.report, self._apply = model, report, apply
        self.phases = {"rollout": pending.rollout_seconds, "grad": pending.grad_seconds}

    def accumulate(self, batch: Any, global_valid_tokens: int | None = None) -> StepReport:
        return self.report

    def skip(self, batch: Any) -> StepReport:
        return replace(self.report, skipped_compute=True)

    def apply(self) -> None:
        started = time.perf_counter()
        self._apply()
        self.phases["optim"] = time.perf_counter() - started

    def flush(self) -> None:
        self.phases["optim"] = 0.0

    def take_phase_seconds(self) -> dict[str, float]:
        return dict(self.phases)


class _GrpodCallback(TrainerCallback):
    """The initial checkpoint (replay of the first steps needs one), and a HALT's stop."""

    def __init__(self, trainer: GuardedGRPOTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.grpod_sink.checkpoint_step < 0 and state.global_step == 0:
            self.trainer._save_checkpoint(self.trainer.model, None)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.grpod_halted is not None:
            control.should_save = True  # through TRL's own _save_checkpoint
            control.should_training_stop = True


def _num_items(micros: list[Micro]) -> int:
    """TRL's num_items_in_batch of the step; a micro that disagrees with the first wins (the
    accounting guard compares it with the mask)."""
    values = [int(m.inputs["num_items_in_batch"]) for m in micros]
    return next((v for v in values if v != values[0]), values[0])


def trl_config(args: Any) -> dict[str, Any]:
    """The GRPOConfig as JSON (recorded with the run; replay rebuilds it)."""
    return {"trainer": "trl", "args": json.loads(args.to_json_string())}


def config_digest(args: Any) -> str:
    text = json.dumps(trl_config(args), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = ["GrpodHalt", "GrpodTRLConfig", "GuardedGRPOTrainer"]
