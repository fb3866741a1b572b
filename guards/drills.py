"""Fault drills: the real engine on the tiny model with one injected fault, under the guards.

`run_drill(name)` reports how many injected steps the guards intercepted, how many clean steps
they flagged wrongly, and whether every flushed or skipped step left the policy (weights,
AdamW state, schedule) bit-identical.

- A FLUSH drill (`nan-loss`, `inf-grad`, `sentinel-logprob`, `vtc-last-chunk`) intercepts a
  step when its update is not applied (flushed or skipped) on a finding of its target guard;
  in `vtc-last-chunk` with accounting mode `nonzero` and the reorder, an applied step whose
  counter read non-zero counts as repaired.
- `reward-hacking` injects no fault: the tiny model learns a reward's loophole, and the
  drill checks that `reward_hacking` WARNs within a stated number of steps of the onset and
  stays silent on the honest twin (guards/hack_drill.py).
- A WARN drill (`equal-rewards`, `loss-spike`) intercepts a step when its target guard raises
  a finding at WARN or above (the default actions of those guards are WARN).
- A false positive is a clean step that was flushed or skipped, or on which the target guard
  raised a finding at WARN or above. Other guards' warnings on clean steps are counted in
  `clean_warnings`, for information.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpod.engine.config import EngineConfig
from grpod.engine.verdict import Action, Outcome
from grpod.guards.config import GuardsConfig, as_config
from grpod.guards.errors import GuardsError
from grpod.guards.workloads import W1_SMALL, W1C, W2_SMALL

if TYPE_CHECKING:
    from grpod.engine.grpo.step import StepResult


@dataclass(frozen=True)
class Drill:
    engine: dict[str, Any]
    fault: str  # the [engine.faults] knob; "accounting" = every step of the faulty phase
    target: frozenset[str]  # guards whose findings intercept
    action: Action  # the least action that counts as intercepted
    first: int = 5  # first injected step
    every: int = 12  # then one every this many steps
    default_steps: int = 60


DRILLS: dict[str, Drill] = {
    "vtc-last-chunk": Drill(
        W2_SMALL,
        "accounting",
        frozenset({"accounting", "reorder"}),
        Action.FLUSH,
        default_steps=24,
    ),
    "nan-loss": Drill(W1_SMALL, "nan_loss_steps", frozenset({"finite"}), Action.FLUSH),
    "inf-grad": Drill(W1_SMALL, "inf_grad_steps", frozenset({"finite"}), Action.FLUSH),
    "sentinel-logprob": Drill(
        W1_SMALL, "sentinel_logprob_steps", frozenset({"finite"}), Action.FLUSH
    ),
    "equal-rewards": Drill(W1C, "equal_reward_steps", frozenset({"advantage"}), Action.WARN),
    "loss-spike": Drill(  # the spike window needs min_steps clean values first
        W1C, "loss_spike_steps", frozenset({"spike"}), Action.WARN, first=34, every=8
    ),
    # no fault: the policy learns a reward's loophole by itself (guards/hack_drill.py)
    "reward-hacking": Drill(
        W1C, "loophole", frozenset({"reward_hacking"}), Action.WARN, default_steps=40
    ),
}


def run_drill(
    name: str,
    steps: int | None = None,
    seed: int = 0,
    *,
    guards: GuardsConfig | dict | None = None,
    clean_steps: int = 50,
    engine_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run drill `name` and return its result (JSON-able).

    `steps`: steps of the run (default per drill); in `vtc-last-chunk` every one of them is
    faulty and `clean_steps` healthy steps of the same workload run first. `guards`: the guards
    config (default `GuardsConfig()`). `engine_overrides`: EngineConfig keys to change.
    Result keys: drill, seed, injected, intercepted, false_positives, clean_steps,
    policy_untouched, ok, outcomes, clean_warnings, skip_fast_total, repaired,
    gradnorm_vtc_correlation, seconds, findings (per-step records of steps with findings).
    """
    if name not in DRILLS:
        raise GuardsError(f"drill {name!r}: unknown; expected one of {sorted(DRILLS)}")
    drill = DRILLS[name]
    steps = drill.default_steps if steps is None else steps
    if steps < 1:
        raise GuardsError(f"drill {name}: steps must be >= 1, not {steps}")
    config = as_config(guards)
    if drill.fault == "loophole":
        from grpod.guards.hack_drill import run_hack_drill

        return run_hack_drill(steps, seed, config, engine_overrides)
    base = {**drill.engine, "seed": seed, **(engine_overrides or {})}
    started = time.perf_counter()
    tally = _Tally(drill, config)
    if drill.fault == "accounting":
        if clean_steps:
            tally.phase("clean", EngineConfig.model_validate(base), clean_steps, set())
        faulty = {**base, "faults": {"accounting": "last_micro_first_chunk"}}
        tally.phase("faulty", EngineConfig.model_validate(faulty), steps, set(range(steps)))
    else:
        injected = set(range(drill.first, steps, drill.every))
        cfg = EngineConfig.model_validate({**base, "faults": {drill.fault: sorted(injected)}})
        tally.phase("run", cfg, steps, injected)
    result = tally.result()
    result.update(drill=name, seed=seed, seconds=round(time.perf_counter() - started, 3))
    return result


class _Tally:
    """Runs phases of guarded steps and counts what the guards did."""

    def __init__(self, drill: Drill, config: GuardsConfig) -> None:
        self.drill, self.config = drill, config
        self.injected = self.intercepted = self.false_positives = self.clean_steps = 0
        self.clean_warnings = self.repaired = self.skip_fast_total = 0
        self.policy_untouched = True
        self.outcomes = {str(outcome): 0 for outcome in Outcome}
        self.correlation: dict[str, float | None] = {}
        self.records: list[dict[str, Any]] = []

    def phase(
        self, label: str, engine_config: EngineConfig, steps: int, injected: set[int]
    ) -> None:
        from grpod.engine import Engine  # torch: not for listing DRILLS
        from grpod.engine.grpo.step import decide_step
        from grpod.guards.policy import GuardPolicy

        with warnings.catch_warnings():  # the engine warns loudly that faults are on: we know
            warnings.filterwarnings("ignore", message=".*FAULT INJECTION IS ON")
            engine = Engine(engine_config)
        policy = GuardPolicy(self.config)
        digest = engine.state_digest()
        for _ in range(steps):
            result = decide_step(engine, policy, engine.rollout())
            after = engine.state_digest()
            if result.outcome is not Outcome.APPLIED and after != digest:
                self.policy_untouched = False
            digest = after
            self.outcomes[result.outcome] += 1
            self._count(label, result, result.step in injected)
        self.correlation[label] = policy.gradnorm_vtc_correlation
        self.skip_fast_total += policy.skip_fast_total

    def _count(self, label: str, result: StepResult, injected: bool) -> None:
        report, verdict, applied = result.report, result.verdict, result.outcome is Outcome.APPLIED
        target = [
            f for f in verdict.findings if f.guard in self.drill.target and f.action >= Action.WARN
        ]
        repaired = (
            applied
            and self.config.accounting.mode == "nonzero"
            and report.valid_tokens > 0
            and self.config.reorder.enabled
            and self.drill.fault == "accounting"
        )
        if injected:
            self.injected += 1
            if self.drill.action >= Action.FLUSH:
                hit = (not applied and bool(target)) or repaired
            else:
                hit = any(f.action >= self.drill.action for f in target)
            self.intercepted += hit
            self.repaired += repaired
        else:
            self.clean_steps += 1
            self.false_positives += not applied or bool(target)
            self.clean_warnings += any(f.action >= Action.WARN for f in verdict.findings)
        if injected or verdict.findings:
            self.records.append(
                {
                    "phase": label,
                    "step": report.step,
                    "injected": injected,
                    "outcome": str(result.outcome),
                    "valid_tokens": report.valid_tokens,
                    "expected_valid_tokens": report.expected_valid_tokens,
                    **verdict.to_dict(),
                }
            )

    def result(self) -> dict[str, Any]:
        ok = (
            self.injected > 0
            and self.intercepted == self.injected
            and self.false_positives == 0
            and self.policy_untouched
        )
        return {
            "injected": self.injected,
            "intercepted": self.intercepted,
            "false_positives": self.false_positives,
            "clean_steps": self.clean_steps,
            "policy_untouched": self.policy_untouched,
            "ok": ok,
            "outcomes": self.outcomes,
            "repaired": self.repaired,
            "clean_warnings": self.clean_warnings,
            "skip_fast_total": self.skip_fast_total,
            "gradnorm_vtc_correlation": self.correlation,
            "findings": self.records,
        }
