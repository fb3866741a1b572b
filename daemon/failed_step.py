"""A step whose rollout failed is still a decided step: recorded as skipped under a HALT
finding that names the failure, so its incident keeps what was sampled, and the loop stops.
The data cursor stays at the step: after a fix (or a restart) it runs again."""

from __future__ import annotations

from dataclasses import dataclass

from grpod.engine import Engine
from grpod.engine.batch import TransportBatch
from grpod.engine.errors import RewardError, SamplerError
from grpod.engine.grpo.step import StepResult, decide_step
from grpod.engine.verdict import Action, Finding, Outcome, Verdict
from grpod.guards import GuardPolicy


@dataclass(frozen=True)
class DecidedStep:
    """A step's result, and why the run stops after it: `input_failure` (a reward's: exit 2,
    the input's fault, no restart into the same failure) or `system_failure` (the rollout
    server's: exit 1 after a checkpoint; systemd restarts and the step runs again)."""

    result: StepResult
    input_failure: str | None = None
    system_failure: str | None = None


def take_step(engine: Engine, policy: GuardPolicy) -> DecidedStep:
    """Roll out, train and decide the engine's next step; a rollout that failed on a batch
    is recorded as a skipped step (`unscored_step`, `unsampled_step`)."""
    try:
        return DecidedStep(decide_step(engine, policy, engine.rollout()))
    except RewardError as exc:
        if exc.batch is None:
            raise
        return DecidedStep(
            unscored_step(engine, exc), input_failure=f"step {exc.batch.step}: {exc}"
        )
    except SamplerError as exc:
        if exc.batch is None:
            raise
        return DecidedStep(
            unsampled_step(engine, exc), system_failure=f"step {exc.batch.step}: {exc}"
        )


def unscored_step(engine: Engine, exc: RewardError) -> StepResult:
    """A reward failed on the step in flight: nothing is trained on; the step is recorded as
    skipped with its samples (NaN rewards) under a HALT finding of the `reward` guard."""
    finding = Finding("reward", Action.HALT, str(exc), {"sample": float(exc.sample)}, kind="failed")
    return failed_step(engine, exc.batch, finding)


def unsampled_step(engine: Engine, exc: SamplerError) -> StepResult:
    """The rollout server failed (exited, hung, garbage) on the step in flight: nothing is
    trained on; the step is recorded as skipped with its prompts under a HALT finding of the
    `rollout` guard (its incident)."""
    finding = Finding("rollout", Action.HALT, str(exc), {}, kind="failed")
    return failed_step(engine, exc.batch, finding)


def failed_step(engine: Engine, batch: TransportBatch, finding: Finding) -> StepResult:
    """`batch`'s step recorded as skipped under `finding`; the cursor stays at it."""
    report = engine.skip(batch)
    engine.step = batch.step
    phases = {**engine.take_phase_seconds(), "guards": 0.0}
    return StepResult(
        batch, report, Verdict.of([finding]), Outcome.SKIPPED, phases, context=engine.context
    )
