"""`StepResult` and `decide_step`: one decided step, for the daemon, replay and the drills.

`decide_step(engine, policy, batch)` runs the policy's before-hooks, `accumulate`, the
after-hooks and the verdict, then `apply()` (PASS/WARN) or `flush()` (FLUSH/HALT), or
`skip(batch)` without compute when a before-hook asks. After an apply the policy checks the
weights (HALT if they are not finite). The policy is any `StepPolicy`: the guards'
`GuardPolicy`, or replay's, which repeats what the record says was decided.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from grpod.engine.batch import TransportBatch
from grpod.engine.context import ExecutionContext
from grpod.engine.grpo.trainer import Engine
from grpod.engine.report import StepReport
from grpod.engine.rollout.ahead import AheadStats
from grpod.engine.verdict import Action, Finding, Outcome, Verdict


class StepPolicy(Protocol):
    """What decides a step: hooks before and after the compute, and the verdict."""

    def before(
        self, batch: TransportBatch, *, per_micro_accounting: bool
    ) -> tuple[TransportBatch, list[Finding], bool]:
        """`(batch to run, findings, skip the compute?)`."""
        ...

    def after(self, batch: TransportBatch, report: StepReport) -> list[Finding]: ...

    def decide(self, findings: list[Finding]) -> Verdict: ...

    def after_apply(self, model: torch.nn.Module) -> list[Finding]:
        """Findings about the weights once the update is applied."""
        ...


@dataclass(frozen=True)
class StepResult:
    """A decided step: the batch as run (reordered if a before-hook did), the engine's report,
    the verdict, what became of the update, the wall-clock seconds of each phase
    (the engine's rollout, score, grad, optim, and the policy's guards), with async
    steps what the rollout window did (engine/rollout/ahead.py; the daemon adds it), and the
    execution context it was computed under (engine/context.py; None: not known)."""

    batch: TransportBatch
    report: StepReport
    verdict: Verdict
    outcome: Outcome
    phase_seconds: Mapping[str, float]
    ahead: AheadStats | None = None
    context: ExecutionContext | None = None

    @property
    def step(self) -> int:
        return self.report.step


def decide_step(
    engine: Engine,
    policy: StepPolicy,
    batch: TransportBatch,
    *,
    global_valid_tokens: int | None = None,
) -> StepResult:
    """Run and decide step `batch.step` on `engine` under `policy` (see the module doc);
    `global_valid_tokens`: the loss divisor of a recorded distributed step, for the replay of
    one rank's part in one process (`Engine.accumulate`)."""
    started = time.perf_counter()
    run, findings, skip = policy.before(batch, per_micro_accounting=engine.per_micro_accounting)
    guards = time.perf_counter() - started
    if skip:
        report, outcome = engine.skip(batch), Outcome.SKIPPED
        started = time.perf_counter()
        verdict = policy.decide(findings)
        guards += time.perf_counter() - started
        return StepResult(
            batch, report, verdict, outcome, _phases(engine, guards), context=engine.context
        )
    report = engine.accumulate(run, global_valid_tokens=global_valid_tokens)
    started = time.perf_counter()
    verdict = policy.decide(findings + policy.after(run, report))
    guards += time.perf_counter() - started
    if verdict.action >= Action.FLUSH:
        engine.flush()
        outcome = Outcome.FLUSHED
    else:
        engine.apply()
        outcome = Outcome.APPLIED
        started = time.perf_counter()
        found = policy.after_apply(engine.model)
        if found:  # a new verdict with the weights' findings: the decided one stays as built
            action = max(verdict.action, *(f.action for f in found))
            verdict = Verdict(action, [*verdict.findings, *found])
        guards += time.perf_counter() - started
    return StepResult(
        run, report, verdict, outcome, _phases(engine, guards), context=engine.context
    )


def _phases(engine: Engine, guards: float) -> dict[str, float]:
    return {**engine.take_phase_seconds(), "guards": guards}
